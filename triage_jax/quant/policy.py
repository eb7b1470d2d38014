"""Precision policies: which format each matmul's weights, activations and gradients use (the miniTE split).

A policy is data, selected by config strings, separate from the layer that calls the quantized dot and from the
backend that executes it. Per-layer rules match module paths (e.g. "layers.3.mlp.down_proj"); by default the
embeddings, the LM head, the MoE router and norms stay in high precision.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

from triage_jax.quant.debug import check_nonfinite_mode, nonfinite_mode_from_env

FORMATS = ("none", "nvfp4", "mxfp8", "mxfp4", "mxfp4_rceil", "fp8")  # mxfp4: OCP floor exponents; _rceil: RCEIL
GRAD_MODES = ("bf16", "f32", "nvfp4")
KV_FORMATS = ("bf16", "fp8")


ACT_SCALINGS = ("tensor", "row")  # one float32 activation scale per tensor, or per token (row)


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """Formats of one matmul. "none" keeps the operand in the compute dtype.

    debug_nonfinite: False, "raise" or "log" (True means "raise"): the quantized dot checks its operands (and the
    output gradient it quantizes) for NaN/Inf at run time (quant/debug.py). A field, so part of the jit key.
    """

    weight: str = "none"
    act: str = "none"
    weight_scaling: str = "tensor"  # NVFP4 weights: "tensor" (1D blocks) or "tile2d" (16x16 tiles)
    act_scaling: str = "tensor"  # NVFP4 activations: "tensor" or "row" (token-wise); MX formats: no effect
    grad: str = "bf16"  # backward GEMMs: "bf16" / "f32" straight-through, or "nvfp4" (SR + RHT)
    debug_nonfinite: bool | str = False

    def __post_init__(self):
        object.__setattr__(
            self, "debug_nonfinite", check_nonfinite_mode(self.debug_nonfinite, "LayerPrecision.debug_nonfinite")
        )
        for field, value, allowed in (
            ("weight", self.weight, FORMATS),
            ("act", self.act, FORMATS),
            ("weight_scaling", self.weight_scaling, ("tensor", "tile2d")),
            ("act_scaling", self.act_scaling, ACT_SCALINGS),
            ("grad", self.grad, GRAD_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"LayerPrecision.{field}={value!r}; expected one of {allowed}")

    @property
    def quantized(self) -> bool:
        return self.weight != "none" or self.act != "none"


HIGH = LayerPrecision()

PRESETS: dict[str, LayerPrecision] = {
    "bf16": HIGH,
    "fp8": LayerPrecision(weight="fp8", act="fp8"),
    "w4a16": LayerPrecision(weight="nvfp4"),
    "w4a8": LayerPrecision(weight="nvfp4", act="mxfp8"),
    "w4a4": LayerPrecision(weight="nvfp4", act="nvfp4"),
    # MXFP4 (OCP MX v1.0, numerics.md "MXFP4"): E2M1 with one E8M0 exponent per 32 elements, no tensor scale.
    "w4a16_mx": LayerPrecision(weight="mxfp4"),
    "w4a8_mx": LayerPrecision(weight="mxfp4", act="mxfp8"),
    "w4a4_mx": LayerPrecision(weight="mxfp4", act="mxfp4"),
    "w4a4_mx_rceil": LayerPrecision(weight="mxfp4_rceil", act="mxfp4_rceil"),
}

# Modules that stay in high precision unless a rule says otherwise (numerics.md, "Training-recipe pieces").
DEFAULT_HIGH_PRECISION = (r"(^|\.)embed", r"(^|\.)lm_head$", r"(^|\.)router$", r"norm")


def _as_precision(p: LayerPrecision | str) -> LayerPrecision:
    if isinstance(p, LayerPrecision):
        return p
    if p not in PRESETS:
        raise ValueError(f"unknown precision preset {p!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[p]


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """A model-wide policy: the default layer precision, ordered per-path rules, KV-cache format and backend.

    Hashable, so it can be a static argument of jitted functions. `rules` are (regex, precision) pairs; the
    first whose regex `re.search`es the module path wins, then the high-precision defaults, then `default`.
    `debug_nonfinite` (False, "raise", "log"; quant/debug.py) applies to every layer; None (the default) reads
    env TRIAGE_JAX_DEBUG_NONFINITE once, here, when the policy is built, so the mode is always a field of the
    policy and part of the compiled programs' key.
    `exact` runs the model's batch-invariant numerics (models/invariant.py): the sampler and the learner, both
    under such a policy with the same formats, compute every token's log-prob to the same bits
    (docs/numerics.md#exact-mode).
    """

    default: LayerPrecision = HIGH
    rules: tuple[tuple[str, LayerPrecision], ...] = ()
    kv_cache: str = "bf16"
    backend: str = "xla"
    keep_high_precision: tuple[str, ...] = DEFAULT_HIGH_PRECISION
    debug_nonfinite: bool | str | None = None
    exact: bool = False

    def __post_init__(self):
        mode = nonfinite_mode_from_env() if self.debug_nonfinite is None else self.debug_nonfinite
        object.__setattr__(self, "debug_nonfinite", check_nonfinite_mode(mode, "PrecisionPolicy.debug_nonfinite"))
        if self.kv_cache not in KV_FORMATS:
            raise ValueError(f"PrecisionPolicy.kv_cache={self.kv_cache!r}; expected one of {KV_FORMATS}")
        for pattern, _ in self.rules:
            re.compile(pattern)

    @classmethod
    def from_spec(
        cls,
        preset: str,
        *,
        act_scaling: str | None = None,
        weight_scaling: str | None = None,
        grad: str | None = None,
        kv_cache: str = "bf16",
        backend: str = "xla",
        rules: Iterable[tuple[str, LayerPrecision | str]] = (),
        debug_nonfinite: bool | str | None = None,
        exact: bool = False,
    ) -> "PrecisionPolicy":
        """Build from config strings, e.g. from_spec("w4a4", act_scaling="row", kv_cache="fp8")."""
        base = _as_precision(preset)
        overrides = {
            k: v
            for k, v in (("act_scaling", act_scaling), ("weight_scaling", weight_scaling), ("grad", grad))
            if v is not None
        }
        return cls(
            default=dataclasses.replace(base, **overrides),
            rules=tuple((pat, _as_precision(p)) for pat, p in rules),
            kv_cache=kv_cache,
            backend=backend,
            debug_nonfinite=debug_nonfinite,
            exact=bool(exact),
        )

    def for_layer(self, path: str) -> LayerPrecision:
        """The precision of the matmul at module `path` (carrying the policy's debug_nonfinite mode when it is on)."""
        prec = self._match(path)
        if self.debug_nonfinite and prec.debug_nonfinite != self.debug_nonfinite:
            prec = dataclasses.replace(prec, debug_nonfinite=self.debug_nonfinite)
        return prec

    def _match(self, path: str) -> LayerPrecision:
        for pattern, prec in self.rules:
            if re.search(pattern, path):
                return prec
        if any(re.search(p, path) for p in self.keep_high_precision):
            return HIGH
        return self.default


# --- per-layer rules from strings (the tools' --rules) ----------------------------------------------------------


def layers_regex(layers: Iterable[int]) -> str:
    r"""The module-path regex of decoder layers `layers` (e.g. [13, 14] -> r"^layers\.(13|14)\.")."""
    ids = sorted({int(i) for i in layers})
    if not ids:
        raise ValueError("layers_regex: no layer given")
    return r"^layers\.(" + "|".join(map(str, ids)) + r")\."


def _layer_count(spec: str, how_many: str, num_layers: int | None) -> int:
    if num_layers is None:
        raise ValueError(f"precision rule {spec!r}: a first:/last: rule needs the model's number of layers")
    try:
        v = float(how_many)
    except ValueError:
        raise ValueError(f"precision rule {spec!r}: {how_many!r} is neither a layer count nor a fraction") from None
    # a whole number counts layers; a fraction in (0, 1) is rounded up (last:0.15 of 28 layers = the last 5)
    k = int(v) if v >= 1 and v == int(v) else math.ceil(v * num_layers - 1e-9) if 0 < v < 1 else 0
    if not 1 <= k <= num_layers:
        raise ValueError(f"precision rule {spec!r}: {how_many!r} is not a layer count in 1..{num_layers} nor a "
                         f"fraction in (0, 1)")
    return k


def parse_rule(spec: str, num_layers: int | None = None) -> tuple[str, str]:
    """One precision rule from a string: (module-path regex, preset name).

    "REGEX=PRESET" (split at the last "="; REGEX is `re.search`ed on module paths such as
    "layers.3.mlp.down_proj"), or "last:K=PRESET" / "first:K=PRESET" for the last / first K decoder layers, K a
    count or a fraction of `num_layers` rounded up: "last:0.15=bf16" keeps the last 15% of the layers in BF16.
    """
    pattern, sep, preset = spec.rpartition("=")
    if not sep or not pattern or not preset:
        raise ValueError(f"precision rule {spec!r}: expected REGEX=PRESET, last:K=PRESET or first:K=PRESET")
    if preset not in PRESETS:
        raise ValueError(f"precision rule {spec!r}: unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    which, colon, how_many = pattern.partition(":")
    if colon and which in ("first", "last"):
        k = _layer_count(spec, how_many, num_layers)
        ids = range(k) if which == "first" else range(num_layers - k, num_layers)
        return layers_regex(ids), preset
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"precision rule {spec!r}: bad regex {pattern!r} ({e})") from None
    return pattern, preset


def parse_rules(specs: Iterable[str], num_layers: int | None = None) -> tuple[tuple[str, str], ...]:
    """parse_rule of each spec, in order (the first matching rule wins in PrecisionPolicy)."""
    return tuple(parse_rule(s, num_layers) for s in specs)
