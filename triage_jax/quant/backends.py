"""Backend registry with a capability probe: who executes the quantizers and the quantized GEMM.

- `xla`: the pure jax.numpy reference, everywhere.
- `pallas`: kernels/ (quantize kernels + a fused dequantize-matmul); interpret mode on CPU, compiled on GPU.
- `cudnn`: the reference quantizers + `jax.nn.scaled_matmul` (the cuDNN block-scaled GEMM behind
  `jax.nn.scaled_dot_general`), on compute capability >= 10.0 only. The project's quantizers feed it because
  `scaled_dot_general`'s own quantizer divides and makes zero blocks NaN (numerics.md); only the GEMM differs.
- `te`: Transformer Engine JAX (`te.dense` under `te.autocast`), when it imports on a supporting GPU.

`available_backends()` reports {name: (ok, reason)}; `resolve_backend("auto")` picks the best available; asking
for an unavailable backend raises with the probe's reason (never a silent substitution).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from triage_jax.quant import formats as fmt

F32 = jnp.float32
BF16 = jnp.bfloat16
AUTO_ORDER = ("te", "cudnn", "pallas", "xla")


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but its capability probe failed."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """How one backend quantizes ([..., K] along K) and multiplies ([M, K] x [N, K]^T -> f32 [M, N])."""

    name: str
    probe: Callable[[], tuple[bool, str]]
    quantize: Callable  # (x, fmt_name, scaling, amax=None) -> NVFP4Tensor | MXFP8Tensor | FP8Tensor
    matmul: Callable  # (lhs, rhs) -> float32 [M, N]; each a quantized tensor or a raw array
    accelerated: Callable[[], bool] = lambda: True  # whether "auto" may pick it here
    # (w[..., K, N], fmt_name, scaling) -> w^T quantized along K, without materializing the transpose (optional)
    quantize_kn: Callable | None = None

    def quantize_weight(self, w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
        """w[K, N] (one matrix) quantized along K, returned in [N, K] layout."""
        if self.quantize_kn is not None:
            return self.quantize_kn(w_kn, fmt_name, scaling)
        return self.quantize(jnp.swapaxes(w_kn, -1, -2), fmt_name, scaling)


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    _REGISTRY[backend.name] = backend
    _probe.cache_clear()


@functools.lru_cache(maxsize=None)
def _probe(name: str) -> tuple[bool, str]:
    try:
        return _REGISTRY[name].probe()
    except Exception as e:  # a probe that crashes reports why
        return False, f"probe failed: {type(e).__name__}: {e}"


def available_backends() -> dict[str, tuple[bool, str]]:
    """{name: (ok, reason)} for every registered backend (probed once per process)."""
    return {name: _probe(name) for name in _REGISTRY}


def resolve_backend(name: str = "auto") -> str:
    """The backend name to use: `name` if it is available, else an error naming the reason; "auto" picks the best."""
    if name == "auto":
        for cand in AUTO_ORDER:
            if cand in _REGISTRY and _probe(cand)[0] and _REGISTRY[cand].accelerated():
                return cand
        return "xla"
    if name not in _REGISTRY:
        raise ValueError(f"unknown quantization backend {name!r}; registered: {sorted(_REGISTRY)} or 'auto'")
    ok, reason = _probe(name)
    if not ok:
        raise BackendUnavailableError(f"quantization backend {name!r} is unavailable here: {reason}")
    return name


def get_backend(name: str = "auto") -> Backend:
    return _REGISTRY[resolve_backend(name)]


# --- xla: the reference ------------------------------------------------------------------------------------------


def reference_quantize(x: jax.Array, fmt_name: str, scaling: str = "tensor", amax=None):
    """Quantize x[..., K] along its last axis in the named format with the reference quantizers."""
    if fmt_name == "nvfp4":
        return fmt.quantize_nvfp4(x, scaling=scaling, amax=amax)
    if fmt_name == "mxfp8":
        return fmt.quantize_mxfp8(x)
    if fmt_name == "fp8":
        return fmt.quantize_fp8(x)
    raise ValueError(f"unknown format {fmt_name!r}; expected 'nvfp4', 'mxfp8' or 'fp8'")


def split_scaled(q, order: str = "natural") -> tuple[jax.Array, jax.Array]:
    """(exact block-scaled values in bf16 [..., K], float32 output factor broadcastable to the rows)."""
    if isinstance(q, fmt.NVFP4Tensor):
        return q.block_values(order).astype(BF16), q.global_decode_scale()
    if order == "split":
        raise ValueError("split K order is only produced for NVFP4 left operands")
    if isinstance(q, fmt.MXFP8Tensor):
        return q.dequantize(F32).astype(BF16), jnp.float32(1.0)
    if isinstance(q, fmt.FP8Tensor):
        return q.data.astype(BF16), q.scale.astype(F32)
    return q, jnp.float32(1.0)


def _split_k_t(v_kn: jax.Array) -> jax.Array:
    """Reorder the K axis of [..., K, N] to the "split" order (per 16-block: even elements, then odd)."""
    *lead, k, n = v_kn.shape
    v = v_kn.reshape(*lead, k // fmt.NVFP4_BLOCK, fmt.NVFP4_BLOCK // 2, 2, n)
    return jnp.swapaxes(v, -2, -3).reshape(v_kn.shape)


def split_scaled_t(q, order: str = "natural") -> tuple[jax.Array, jax.Array]:
    """split_scaled of an [..., N, K] operand with the values transposed to [..., K, N] (decoded in that layout)."""
    if isinstance(q, fmt.NVFP4Tensor):
        return q.block_values_t(order).astype(BF16), q.global_decode_scale()
    if isinstance(q, fmt.MXFP8Tensor):
        v = jnp.swapaxes(q.data, -1, -2).astype(F32)
        *lead, k, n = v.shape
        s = jnp.swapaxes(q.scale, -1, -2).astype(F32)[..., None, :]
        v = (v.reshape(*lead, k // fmt.MXFP8_BLOCK, fmt.MXFP8_BLOCK, n) * s).reshape(v.shape).astype(BF16)
        f = jnp.float32(1.0)
    elif isinstance(q, fmt.FP8Tensor):
        v, f = jnp.swapaxes(q.data, -1, -2).astype(BF16), q.scale.astype(F32)
    else:
        v, f = jnp.swapaxes(q, -1, -2), jnp.float32(1.0)
    return (_split_k_t(v) if order == "split" else v), f


def gemm_operands(lhs, rhs):
    """(a [M, K], fa, b [..., K, N], fb): both operands' exact values in one shared K order.

    With an NVFP4 left operand both use the "split" K order (fast decode on CPU; the dot is unchanged).
    """
    order = "split" if isinstance(lhs, fmt.NVFP4Tensor) else "natural"
    a, fa = split_scaled(lhs, order)
    b, fb = split_scaled_t(rhs, order)
    cdt = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(cdt), fa, b.astype(cdt), fb


def reference_matmul(lhs, rhs) -> jax.Array:
    """Exact block-scaled operands, float32 accumulation, float32 output factors (the GEMM's alpha)."""
    a, fa, b, fb = gemm_operands(lhs, rhs)  # b: the weight decoded in its K-major layout
    y = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)
    return y * fa * jnp.reshape(fb, (1, -1)) if jnp.ndim(fb) else y * fa * fb


def fake_quant(x: jax.Array, fmt_name: str, scaling: str = "tensor") -> tuple[jax.Array, jax.Array]:
    """(exact quantized values in bf16 [..., K], float32 output factor) of x quantized along K, computed
    elementwise without packing: the reference's on-the-fly GEMM operand (bit-identical to split_scaled of the
    quantized tensor; XLA fuses it into one pass)."""
    if fmt_name == "none":
        return x, jnp.float32(1.0)
    if fmt_name == "nvfp4":
        v, g = fmt.nvfp4_fake_quant(x, scaling=scaling)
        return v.astype(BF16), g
    return split_scaled(reference_quantize(x, fmt_name, scaling))


def fake_quant_kn(w_kn: jax.Array, fmt_name: str, scaling: str = "tensor") -> tuple[jax.Array, jax.Array]:
    """fake_quant of w^T (quantized along K) for a weight w[..., K, N], in w's own [..., K, N] layout."""
    if fmt_name == "none":
        return w_kn, jnp.float32(1.0)
    if fmt_name == "nvfp4":
        if w_kn.ndim == 3:
            v, g = jax.vmap(lambda m: fmt.nvfp4_fake_quant_kn(m, scaling=scaling))(w_kn)
        else:
            v, g = fmt.nvfp4_fake_quant_kn(w_kn, scaling=scaling)
        return v.astype(BF16), g
    quant = functools.partial(reference_quantize_kn, fmt_name=fmt_name, scaling=scaling)
    q = jax.vmap(quant)(w_kn) if w_kn.ndim == 3 else quant(w_kn)
    return split_scaled_t(q)


def reference_quantize_kn(w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """w^T quantized along K, read in w's own K-major layout (bit-identical to quantizing the transpose)."""
    if fmt_name == "nvfp4":
        return fmt.quantize_nvfp4_kn(w_kn, scaling=scaling)
    if fmt_name == "mxfp8":
        return fmt.quantize_mxfp8_kn(w_kn)
    if fmt_name == "fp8":
        q = fmt.quantize_fp8(w_kn)
        return fmt.FP8Tensor(data=jnp.swapaxes(q.data, -1, -2), scale=q.scale)
    raise ValueError(f"unknown format {fmt_name!r}; expected 'nvfp4', 'mxfp8' or 'fp8'")


register_backend(
    Backend("xla", lambda: (True, "pure jax.numpy reference"), reference_quantize, reference_matmul,
            quantize_kn=reference_quantize_kn)
)


# --- pallas ------------------------------------------------------------------------------------------------------


def _pallas_probe() -> tuple[bool, str]:
    from triage_jax.kernels import pallas_quant as pk

    x = jnp.linspace(-3.0, 3.0, 8 * 64, dtype=F32).reshape(8, 64)
    a, b = fmt.quantize_nvfp4(x), pk.quantize_nvfp4(x)
    if not bool(jnp.array_equal(a.packed, b.packed)):
        return False, "the Pallas NVFP4 kernel disagrees with the reference on the probe tensor"
    mode = "interpret mode (slow; for checks)" if pk.default_interpret() else "compiled"
    return True, f"Pallas on {jax.default_backend()}, {mode}"


def _pallas_quantize(x, fmt_name, scaling="tensor", amax=None):
    from triage_jax.kernels import pallas_quant as pk

    if fmt_name == "nvfp4":
        return pk.quantize_nvfp4(x, scaling=scaling, amax=amax)
    if fmt_name == "mxfp8":
        return pk.quantize_mxfp8(x)
    return reference_quantize(x, fmt_name, scaling, amax)  # FP8 per-tensor is one multiply: no kernel


def _pallas_matmul(lhs, rhs):
    from triage_jax.kernels import pallas_quant as pk

    return pk.dequant_matmul(lhs, rhs)


register_backend(
    Backend("pallas", _pallas_probe, _pallas_quantize, _pallas_matmul, accelerated=lambda: jax.default_backend() == "gpu")
)


# --- cudnn -------------------------------------------------------------------------------------------------------


def _gpu_capability() -> tuple[int, int] | None:
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    cc = getattr(dev, "compute_capability", None)
    if not cc:
        return None
    major, minor = str(cc).split(".")
    return int(major), int(minor)


def _cudnn_probe() -> tuple[bool, str]:
    if not hasattr(jax.nn, "scaled_matmul"):
        return False, f"jax {jax.__version__} has no jax.nn.scaled_matmul"
    cc = _gpu_capability()
    if cc is None:
        return False, f"needs an NVIDIA GPU with compute capability >= 10.0; this process has {jax.default_backend()}"
    if cc < (10, 0):
        return False, f"cuDNN block-scaled GEMMs need compute capability >= 10.0 (sm_100); found {cc[0]}.{cc[1]}"
    return True, f"cuDNN block-scaled GEMM on sm_{cc[0]}{cc[1]}"


def _cudnn_matmul(lhs, rhs):
    kinds = (type(lhs).__name__, type(rhs).__name__)
    if kinds not in (("NVFP4Tensor", "NVFP4Tensor"), ("MXFP8Tensor", "MXFP8Tensor")):
        raise NotImplementedError(
            f"cudnn backend: jax.nn.scaled_matmul multiplies two NVFP4 or two MXFP8 operands; got {kinds}"
        )
    y = jax.nn.scaled_matmul(
        lhs.data[None], rhs.data[None], lhs.scale[None], rhs.scale[None], preferred_element_type=F32
    )[0]
    if kinds[0] == "NVFP4Tensor":
        gb = rhs.global_decode_scale()
        y = y * lhs.global_decode_scale() * (jnp.reshape(gb, (1, -1)) if jnp.ndim(gb) else gb)
    return y


register_backend(Backend("cudnn", _cudnn_probe, reference_quantize, _cudnn_matmul))


# --- te ----------------------------------------------------------------------------------------------------------


def _te_probe() -> tuple[bool, str]:
    try:
        import transformer_engine.jax  # noqa: F401
    except Exception as e:
        return False, f"transformer_engine.jax does not import ({type(e).__name__}: {e}); install the 'te' extra"
    cc = _gpu_capability()
    if cc is None or cc < (9, 0):
        found = "no GPU" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
        return False, f"TE-JAX low-precision GEMMs need an NVIDIA GPU with compute capability >= 9.0; found {found}"
    return True, f"TE-JAX on sm_{cc[0]}{cc[1]} (NVFP4/MXFP8 recipes need sm_100+)"


def te_dense(x_mk: jax.Array, w_kn: jax.Array, weight_fmt: str, act_fmt: str, weight_scaling: str) -> jax.Array:
    """x @ w with TE's own quantize + GEMM under the recipe matching the precision (TE quantizes internally)."""
    import transformer_engine.jax as te
    from transformer_engine.common import recipe as te_recipe
    from transformer_engine.jax.dense import dense

    if weight_fmt != act_fmt:
        raise NotImplementedError(f"te backend: TE recipes use one format for both operands; got {weight_fmt}/{act_fmt}")
    rec = {
        "nvfp4": lambda: te_recipe.NVFP4BlockScaling(use_2d_weight_quantization=weight_scaling == "tile2d"),
        "mxfp8": lambda: te_recipe.MXFP8BlockScaling(),
        "fp8": lambda: te_recipe.Float8CurrentScaling(),
    }[weight_fmt]()
    with te.autocast(enabled=True, recipe=rec):
        return dense(x_mk, w_kn, contracting_dims=((1,), (0,))).astype(F32)


def _te_unsupported(*_a, **_k):
    raise NotImplementedError("te backend: TE quantizes inside te_dense; its quantizers are not exposed separately")


register_backend(Backend("te", _te_probe, _te_unsupported, _te_unsupported))
