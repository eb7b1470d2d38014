"""Backend registry with a capability probe: who executes the quantizers and the quantized dots.

Every backend is a registry entry, and `qdot` / `qragged_dot` dispatch through it only (`Backend.forward`,
`Backend.grouped_forward`); nothing outside this registry branches on a backend's name.

- `xla`: the pure jax.numpy reference, everywhere (its own fused dense and grouped forwards).
- `pallas`: kernels/pallas_quant.py (quantize kernels + a fused dequantize-matmul); interpret mode on CPU; on a
  GPU the quantizers compile with Mosaic GPU and the GEMM is xla's (the fused one does not lower). The kernel module registers itself on import; the registry imports the modules named in
  `KERNEL_BACKENDS` on its first query, and a module that does not import is registered as unavailable with why.
- `fp4_gemm`: kernels/fp4_gemm.py, a Mosaic GPU 4-bit weight GEMM for Hopper (NVFP4 / MXFP4 weights prequantized
  into its layout, dense and grouped, bf16 or quantized activations); xla's quantizers, and xla's dots for float32
  activations and every other format. Mosaic GPU's CPU interpreter off a GPU.
- `cudnn`: the reference quantizers + `jax.nn.scaled_matmul` (the cuDNN block-scaled GEMM behind
  `jax.nn.scaled_dot_general`), on compute capability >= 10.0 only. The project's quantizers feed it because
  `scaled_dot_general`'s own quantizer divides and makes zero blocks NaN (numerics.md); only the GEMM differs.
  Its grouped dot is the composed one (its quantizers, the reference grouped GEMM).
- `te`: Transformer Engine JAX (`te.dense` under `te.autocast`, TE quantizing inside its GEMM), when
  `transformer_engine.jax` imports on a supporting GPU. It provides the dense dot only: its quantizers, a bare
  matmul over our tensors and the grouped dot are declared unsupported with the reason.

`available_backends()` reports {name: (ok, reason)}; `resolve_backend("auto")` picks the best available; asking
for an unavailable backend raises BackendUnavailableError with the probe's reason, and asking an available backend
for an operation it does not provide raises BackendUnsupportedError with its reason (never a silent substitution).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib
from typing import Callable, Hashable, Mapping

import jax
import jax.numpy as jnp

from triage_jax.quant import formats as fmt

F32 = jnp.float32
BF16 = jnp.bfloat16
AUTO_ORDER = ("te", "cudnn", "pallas", "xla")
# Backends whose implementation lives in a kernel module that registers it on import (imported on first use).
KERNEL_BACKENDS = {"pallas": "triage_jax.kernels.pallas_quant", "fp4_gemm": "triage_jax.kernels.fp4_gemm"}
OPS = ("quantize", "matmul", "dot", "grouped_dot")
QUANTIZED_TYPES = (fmt.NVFP4Tensor, fmt.NVFP4Int8Tensor, fmt.MXFP4Tensor, fmt.MXFP8Tensor, fmt.FP8Tensor)


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but its capability probe failed."""


class BackendUnsupportedError(NotImplementedError):
    """An available backend was asked for an operation it does not provide (the message says why)."""


def is_quantized(a) -> bool:
    """Whether `a` is a quantized tensor (one of QUANTIZED_TYPES), not a raw array."""
    return isinstance(a, QUANTIZED_TYPES)


@dataclasses.dataclass(frozen=True, eq=False)  # equal and hashed by identity: a jit key (qdot traces per backend)
class Backend:
    """One backend: a capability probe and the operations it provides.

    quantize: (x[..., K], fmt_name, scaling, amax=None) -> NVFP4Tensor | MXFP8Tensor | FP8Tensor, along K.
    matmul: (lhs [M, K], rhs [N, K]) -> float32 [M, N]; each a quantized tensor or a raw array.
    quantize_kn: optional (w[K, N], fmt_name, scaling) -> w^T quantized along K, without materializing w^T.
    dot: optional dense forward (x [M, K], w, prec) -> float32 [M, N]; w is the raw weight [K, N] or a quantized
        tensor [N, K] (a pre-quantized weight). Without it the forward is composed: `quantize` both operands,
        then `matmul` (composed_dot).
    grouped_dot: optional grouped forward (x [M, K], w, group_sizes [E], prec) -> float32 [M, N]; w raw [E, K, N]
        or quantized [E, N, K]. Without it: `quantize` both operands, then the reference grouped GEMM
        (composed_grouped_dot).
    concat_weights: optional (weights quantized once by this backend, [N_i, K] each) -> one weight [sum N_i, K]
        whose dot is the parts' dots side by side, or None where these cannot merge: a layer's projections of one
        input then run as one (models.layers.MergedLinear), one launch of a custom kernel (fp4_gemm) or one 4-bit
        decode (xla) instead of one per part.
    unsupported: {op: reason} for the operations in OPS this backend does not provide; asking for one raises
        BackendUnsupportedError with the reason (and a composed forward that needs it does too).
    accelerated: whether "auto" may pick it here.
    trace_key: what its operations' traces depend on besides their arguments (a hashable; e.g. whether its kernels
        lower for the device or its CPU interpreter, kernels/mosaic.py): with the backend itself, part of the key
        under which qdot traces a forward once per shape, so that a trace made in one such context, or by a backend
        since replaced in the registry, is never reused.
    """

    name: str
    probe: Callable[[], tuple[bool, str]]
    quantize: Callable | None = None
    matmul: Callable | None = None
    accelerated: Callable[[], bool] = lambda: True
    quantize_kn: Callable | None = None
    dot: Callable | None = None
    grouped_dot: Callable | None = None
    concat_weights: Callable | None = None
    unsupported: Mapping[str, str] = dataclasses.field(default_factory=dict)
    trace_key: Callable[[], Hashable] = lambda: None

    def __post_init__(self):
        for op in self.unsupported:
            if op not in OPS:
                raise ValueError(f"Backend {self.name!r}: unsupported op {op!r}; expected one of {OPS}")
            if getattr(self, op) is not None:
                raise ValueError(f"Backend {self.name!r}: {op} is both provided and declared unsupported")

    def supports(self, op: str) -> bool:
        return op not in self.unsupported and (getattr(self, op) is not None or op in ("dot", "grouped_dot"))

    def op(self, name: str) -> Callable:
        """The operation `name` ("quantize" or "matmul"), or BackendUnsupportedError saying why it is missing."""
        fn = getattr(self, name)
        if fn is None or name in self.unsupported:
            why = self.unsupported.get(name, "not provided")
            raise BackendUnsupportedError(f"backend {self.name!r} does not provide {name}: {why}")
        return fn

    def quantize_weight(self, w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
        """w[K, N] (one matrix) quantized along K, returned in [N, K] layout."""
        if self.quantize_kn is not None:
            return self.quantize_kn(w_kn, fmt_name, scaling)
        return self.op("quantize")(jnp.swapaxes(w_kn, -1, -2), fmt_name, scaling)

    def forward(self, x_mk: jax.Array, w, prec) -> jax.Array:
        """The dense quantized dot's forward, float32 [M, N] (w raw [K, N] or quantized [N, K])."""
        if self.dot is not None:
            return self.dot(x_mk, w, prec)
        if "dot" in self.unsupported:
            self.op("dot")
        return composed_dot(self, x_mk, w, prec)

    def grouped_forward(self, x_mk: jax.Array, w, group_sizes_e: jax.Array, prec) -> jax.Array:
        """The grouped quantized dot's forward, float32 [M, N] (w raw [E, K, N] or quantized [E, N, K])."""
        if self.grouped_dot is not None:
            return self.grouped_dot(x_mk, w, group_sizes_e, prec)
        if "grouped_dot" in self.unsupported:
            self.op("grouped_dot")
        return composed_grouped_dot(self, x_mk, w, group_sizes_e, prec)


_REGISTRY: dict[str, Backend] = {}
_KERNELS_LOADED: set[str] = set()


def register_backend(backend: Backend) -> None:
    """Add or replace a backend (kernel modules call this on import)."""
    _REGISTRY[backend.name] = backend
    _probe.cache_clear()


def _unimportable(name: str, module: str, err: Exception) -> Backend:
    reason = f"kernel module {module} does not import ({type(err).__name__}: {err})"
    return Backend(name, lambda: (False, reason), unsupported={op: reason for op in OPS})


def backend_names() -> tuple[str, ...]:
    """Every name a policy or config may give as its backend (registered, kernel modules not yet imported, "auto"),
    without importing a kernel module: what config validation reads."""
    return tuple(sorted({*_REGISTRY, *KERNEL_BACKENDS, "auto"}))


def load_kernel_backends() -> None:
    """Import the kernel modules of KERNEL_BACKENDS once each; each registers its backend on import."""
    for name, module in KERNEL_BACKENDS.items():
        if module in _KERNELS_LOADED:
            continue
        _KERNELS_LOADED.add(module)
        try:
            importlib.import_module(module)
        except Exception as e:  # an honest entry saying why, instead of a missing one
            register_backend(_unimportable(name, module, e))
        if name not in _REGISTRY:
            register_backend(_unimportable(name, module, RuntimeError("it registered no backend")))


@functools.lru_cache(maxsize=None)
def _probe(name: str) -> tuple[bool, str]:
    try:
        # The first ask may come from inside a trace (a sampler's copy prepared under jax.eval_shape, a qdot under
        # jit), where a probe's checks on its own arrays would see tracers and fail, and the failure be cached for
        # the process. JAX's trace state is per thread, so the probe runs on a thread of its own, outside any trace
        # (ensure_compile_time_eval is not enough: it folds a kernel's own constants, which Pallas refuses).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(_REGISTRY[name].probe).result()
    except Exception as e:  # a probe that crashes reports why
        return False, f"probe failed: {type(e).__name__}: {e}"


def available_backends() -> dict[str, tuple[bool, str]]:
    """{name: (ok, reason)} for every registered backend (probed once per process)."""
    load_kernel_backends()
    return {name: _probe(name) for name in _REGISTRY}


def resolve_backend(name: str = "auto") -> str:
    """The backend name to use: `name` if it is available, else an error naming the reason; "auto" picks the best."""
    load_kernel_backends()
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


# --- the composed forwards (any backend's quantizers and matmul) -------------------------------------------------


def quantize_operand(backend: Backend, x: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """x[..., K] quantized along K on `backend` (x itself for "none"); a 3D x is quantized per matrix (experts)."""
    if fmt_name == "none":
        return x
    quant = backend.op("quantize")
    if x.ndim == 3 and scaling != "row":  # per-expert weights: one amax / scale per matrix
        return jax.vmap(lambda m: quant(m, fmt_name, scaling))(x)
    return quant(x, fmt_name, scaling)


def quantize_weight(backend: Backend, w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """A weight w[K, N] (or per expert w[E, K, N]) quantized along K on `backend`, as w^T [..., N, K]."""
    if w_kn.ndim == 3:  # per-expert weights: one amax / scale per matrix
        return jax.vmap(lambda m: backend.quantize_weight(m, fmt_name, scaling))(w_kn)
    return backend.quantize_weight(w_kn, fmt_name, scaling)


def _weight_nk(backend: Backend, w, prec):
    """The weight operand in [..., N, K] layout: as given when quantized, else quantized (or transposed) here."""
    if is_quantized(w):
        return w
    if prec.weight == "none":
        return jnp.swapaxes(w, -1, -2)
    return quantize_weight(backend, w, prec.weight, prec.weight_scaling)


def _kernel_operand(q):
    """What a backend's matmul receives: MXFP4 tensors (no kernel here reads them) as their exact bf16 values."""
    return q.block_values().astype(BF16) if isinstance(q, fmt.MXFP4Tensor) else q


def composed_dot(backend: Backend, x_mk: jax.Array, w, prec) -> jax.Array:
    """Dense forward from the backend's own quantizers and matmul (MXFP4 operands handed over as exact values)."""
    qx = quantize_operand(backend, x_mk, prec.act, prec.act_scaling)
    return backend.op("matmul")(_kernel_operand(qx), _kernel_operand(_weight_nk(backend, w, prec)))


def composed_grouped_dot(backend: Backend, x_mk: jax.Array, w, group_sizes_e: jax.Array, prec) -> jax.Array:
    """Grouped forward from the backend's own quantizers and the reference grouped GEMM (jax.lax.ragged_dot)."""
    qx = quantize_operand(backend, x_mk, prec.act, prec.act_scaling)
    return reference_grouped_matmul(qx, _weight_nk(backend, w, prec), group_sizes_e)


_FORMAT_NAMES = ("nvfp4", "mxfp8", *fmt.MXFP4_FORMATS, "fp8")

# --- xla: the reference ------------------------------------------------------------------------------------------


def reference_quantize(x: jax.Array, fmt_name: str, scaling: str = "tensor", amax=None):
    """Quantize x[..., K] along its last axis in the named format with the reference quantizers."""
    if fmt_name == "nvfp4":
        return fmt.quantize_nvfp4(x, scaling=scaling, amax=amax)
    if fmt_name == "mxfp8":
        return fmt.quantize_mxfp8(x)
    if fmt_name in fmt.MXFP4_FORMATS:
        return fmt.quantize_mxfp4(x, fmt.MXFP4_FORMATS[fmt_name])
    if fmt_name == "fp8":
        return fmt.quantize_fp8(x)
    raise ValueError(f"unknown format {fmt_name!r}; expected one of {_FORMAT_NAMES}")


def split_scaled(q, order: str = "natural") -> tuple[jax.Array, jax.Array]:
    """(exact block-scaled values in bf16 [..., K], float32 output factor broadcastable to the rows)."""
    if isinstance(q, fmt.NVFP4Tensor):
        return q.block_values(order).astype(BF16), q.global_decode_scale()
    if order == "split":
        raise ValueError("split K order is only produced for NVFP4 left operands")
    if isinstance(q, fmt.NVFP4Int8Tensor):
        return q.block_values().astype(BF16), q.global_decode_scale()
    if isinstance(q, fmt.MXFP4Tensor):
        return q.block_values().astype(BF16), jnp.float32(1.0)
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
    if isinstance(q, fmt.NVFP4Int8Tensor):
        v, f = q.block_values_t().astype(BF16), q.global_decode_scale()
    elif isinstance(q, fmt.MXFP4Tensor):
        v, f = q.block_values_t().astype(BF16), jnp.float32(1.0)
    elif isinstance(q, fmt.MXFP8Tensor):
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
    """Exact block-scaled operands, float32 accumulation, float32 output factors (the GEMM's alpha).

    The two NVFP4 factors amax/2688 are applied one after the other to the float32 sum; TE's cuBLAS epilogue
    folds one alpha amax_a * amax_b * f32(1/2688^2) instead (see NVFP4Tensor.global_decode_scale).
    """
    a, fa, b, fb = gemm_operands(lhs, rhs)  # b: the weight decoded in its K-major layout
    y = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)
    return y * fa * jnp.reshape(fb, (1, -1)) if jnp.ndim(fb) else y * fa * fb


def row_groups(group_sizes_e: jax.Array, m: int) -> jax.Array:
    """The group (expert) index of each of the m rows of a grouped dot, int [M].

    Rows past sum(group_sizes) get the last group; ragged_dot gives them 0, so any factor of theirs is harmless.
    """
    e = group_sizes_e.shape[0]
    return jnp.repeat(jnp.arange(e), group_sizes_e, total_repeat_length=m)


def per_row_factor(factor: jax.Array, rows_e: jax.Array) -> jax.Array:
    """A per-group output factor [E] (or a scalar, returned as is) as a per-row factor [M, 1], rows_e from row_groups."""
    return factor[rows_e][:, None] if jnp.ndim(factor) else factor


def reference_grouped_matmul(lhs, rhs, group_sizes_e: jax.Array) -> jax.Array:
    """The grouped reference GEMM: lhs [M, K] (rows sorted by group), rhs [E, N, K] per group (quantized or raw)
    -> float32 [M, N]; exact block-scaled operands, jax.lax.ragged_dot with float32 accumulation, then the
    per-row lhs factor and each row's group factor."""
    a, fa, b, fb = gemm_operands(lhs, rhs)  # b [E, K, N], fb [E] or scalar
    y = jax.lax.ragged_dot(a, b, group_sizes_e, preferred_element_type=F32)
    return y * fa * per_row_factor(fb, row_groups(group_sizes_e, lhs.shape[0]))


def fake_quant(x: jax.Array, fmt_name: str, scaling: str = "tensor") -> tuple[jax.Array, jax.Array]:
    """(exact quantized values in bf16 [..., K], float32 output factor) of x quantized along K, computed
    elementwise without packing: the reference's on-the-fly GEMM operand (bit-identical to split_scaled of the
    quantized tensor; XLA fuses it into one pass)."""
    if fmt_name == "none":
        return x, jnp.float32(1.0)
    if fmt_name == "nvfp4":
        v, g = fmt.nvfp4_fake_quant(x, scaling=scaling)
        return v.astype(BF16), g
    if fmt_name in fmt.MXFP4_FORMATS:  # block-local scales: "tensor" / "row" scaling mean the same here
        return fmt.mxfp4_fake_quant(x, fmt.MXFP4_FORMATS[fmt_name]).astype(BF16), jnp.float32(1.0)
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
    if fmt_name in fmt.MXFP4_FORMATS:
        return fmt.mxfp4_fake_quant_kn(w_kn, fmt.MXFP4_FORMATS[fmt_name]).astype(BF16), jnp.float32(1.0)
    quant = functools.partial(reference_quantize_kn, fmt_name=fmt_name, scaling=scaling)
    q = jax.vmap(quant)(w_kn) if w_kn.ndim == 3 else quant(w_kn)
    return split_scaled_t(q)


def reference_quantize_kn(w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """w^T quantized along K, read in w's own K-major layout (bit-identical to quantizing the transpose)."""
    if fmt_name == "nvfp4":
        return fmt.quantize_nvfp4_kn(w_kn, scaling=scaling)
    if fmt_name == "mxfp8":
        return fmt.quantize_mxfp8_kn(w_kn)
    if fmt_name in fmt.MXFP4_FORMATS:
        return fmt.quantize_mxfp4_kn(w_kn, fmt.MXFP4_FORMATS[fmt_name])
    if fmt_name == "fp8":
        q = fmt.quantize_fp8(w_kn)
        return fmt.FP8Tensor(data=jnp.swapaxes(q.data, -1, -2), scale=q.scale)
    raise ValueError(f"unknown format {fmt_name!r}; expected one of {_FORMAT_NAMES}")


def _reference_forward(x_mk: jax.Array, w, prec, gs: jax.Array | None = None) -> jax.Array:
    """The xla backend's forward, dense or grouped: operands quantized on the fly as exact values (one fused pass
    each, nothing packed), or a pre-quantized weight decoded; float32 accumulation; float32 output factors."""
    xv, fx = fake_quant(x_mk, prec.act, prec.act_scaling)
    if is_quantized(w):
        wv, fw = split_scaled(w)  # [(E,) N, K]: contract its last axis (a transposed copy costs ~2x the dot)
        k_axis = wv.ndim - 1
    else:
        wv, fw = fake_quant_kn(w, prec.weight, prec.weight_scaling)  # [(E,) K, N]
        k_axis = wv.ndim - 2
    cdt = jnp.promote_types(xv.dtype, wv.dtype)
    xv, wv = xv.astype(cdt), wv.astype(cdt)
    if gs is None:
        y = jax.lax.dot_general(xv, wv, (((1,), (k_axis,)), ((), ())), preferred_element_type=F32)
        if jnp.ndim(fw):  # a merged weight's per-row amax [N, 1] (reference_concat_weights): one factor per column
            fw = jnp.reshape(fw, (1, -1))
        return y * fx * fw
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (k_axis,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,)
    )
    y = jax.lax.ragged_dot_general(xv, wv, gs, dims, preferred_element_type=F32)
    return y * fx * per_row_factor(fw, row_groups(gs, x_mk.shape[0]))


def reference_concat_weights(qs) -> fmt.NVFP4Tensor | fmt.NVFP4Int8Tensor | fmt.MXFP4Tensor | None:
    """Weights quantized once [N_i, K] as one [sum N_i, K] for the xla forward: codes and block scales side by side
    along N. NVFP4 parts keep their own tensor amax, repeated over their rows (a "row"-scaled tensor, amax [N, 1]),
    so every element's decode factor is its part's. The forward decodes one weight instead of one per part: on
    XLA:GPU each 4-bit decode is a kernel of its own, while XLA merges the parts' GEMMs anyway (its DotMerger).
    None where they cannot merge: not all 2D NVFP4 with one scalar amax each (tensor or tile2d scaling), or all
    MXFP4 of one rounding, of one K. NVFP4 parts stored as int8 codes (xla_int8) merge alike."""
    qs = list(qs)
    if len(qs) < 2 or any(len(q.shape) != 2 for q in qs) or len({q.shape[-1] for q in qs}) != 1:
        return None
    for cls, codes in ((fmt.NVFP4Tensor, "packed"), (fmt.NVFP4Int8Tensor, "codes")):
        if all(isinstance(q, cls) and q.scaling != "row" and jnp.ndim(q.amax) == 0 for q in qs):
            amax = jnp.concatenate([jnp.broadcast_to(jnp.asarray(q.amax, F32), (q.shape[0], 1)) for q in qs])
            return cls(jnp.concatenate([getattr(q, codes) for q in qs]), jnp.concatenate([q.scale for q in qs]),
                       amax, "row")
    if all(isinstance(q, fmt.MXFP4Tensor) for q in qs) and len({q.rounding for q in qs}) == 1:
        return fmt.MXFP4Tensor(jnp.concatenate([q.packed for q in qs]), jnp.concatenate([q.scale for q in qs]),
                               qs[0].rounding)
    return None


def reference_dot(x_mk: jax.Array, w, prec) -> jax.Array:
    """The xla backend's dense forward (see _reference_forward)."""
    return _reference_forward(x_mk, w, prec)


def reference_grouped_dot(x_mk: jax.Array, w, group_sizes_e: jax.Array, prec) -> jax.Array:
    """The xla backend's grouped forward (see _reference_forward)."""
    return _reference_forward(x_mk, w, prec, group_sizes_e)


register_backend(
    Backend("xla", lambda: (True, "pure jax.numpy reference"), reference_quantize, reference_matmul,
            quantize_kn=reference_quantize_kn, dot=reference_dot, grouped_dot=reference_grouped_dot,
            concat_weights=reference_concat_weights)
)


def int8_quantize_kn(w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """reference_quantize_kn, an NVFP4 result stored as int8 codes (fmt.NVFP4Int8Tensor); other formats as is."""
    q = reference_quantize_kn(w_kn, fmt_name, scaling)
    return fmt.NVFP4Int8Tensor.from_nvfp4(q) if isinstance(q, fmt.NVFP4Tensor) else q


# The xla backend with quantized-once NVFP4 weights stored as int8 2*e2m1 codes: the same results bit for bit (the
# GEMM operand is the same exact bf16 values), a layout XLA:GPU's GEMM fusion can read as an s8 operand. `auto`
# never picks it: which layout is faster on a GPU is for experiments/bench_gpu.py to measure.
register_backend(
    Backend("xla_int8", lambda: (True, "the xla reference; quantized-once NVFP4 weights as int8 2*e2m1 codes"),
            reference_quantize, reference_matmul, accelerated=lambda: False, quantize_kn=int8_quantize_kn,
            dot=reference_dot, grouped_dot=reference_grouped_dot, concat_weights=reference_concat_weights)
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
        raise BackendUnsupportedError(
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

    if weight_fmt in fmt.MXFP4_FORMATS or act_fmt in fmt.MXFP4_FORMATS:
        raise BackendUnsupportedError("te backend: no TE recipe for MXFP4 here; use the 'xla' backend")
    if weight_fmt != act_fmt:
        raise NotImplementedError(f"te backend: TE recipes use one format for both operands; got {weight_fmt}/{act_fmt}")
    rec = {
        "nvfp4": lambda: te_recipe.NVFP4BlockScaling(use_2d_weight_quantization=weight_scaling == "tile2d"),
        "mxfp8": lambda: te_recipe.MXFP8BlockScaling(),
        "fp8": lambda: te_recipe.Float8CurrentScaling(),
    }[weight_fmt]()
    with te.autocast(enabled=True, recipe=rec):
        return dense(x_mk, w_kn, contracting_dims=((1,), (0,))).astype(F32)


def _te_dot(x_mk: jax.Array, w, prec) -> jax.Array:
    if is_quantized(w):
        raise BackendUnsupportedError(
            "backend 'te' quantizes inside its GEMM: pass the raw weight, not a QuantizedWeight"
        )
    return te_dense(x_mk, w, prec.weight, prec.act, prec.weight_scaling)


_TE_INSIDE = "TE quantizes inside te.dense; its quantizers and GEMM are not exposed over this project's tensors"
register_backend(
    Backend("te", _te_probe, dot=_te_dot, unsupported={
        "quantize": _TE_INSIDE, "matmul": _TE_INSIDE,
        "grouped_dot": "the te backend has no grouped (per-expert) GEMM here; use 'xla' or 'pallas'",
    })
)
