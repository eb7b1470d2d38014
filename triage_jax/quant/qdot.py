"""The one quantized dot every model matmul goes through (dense and grouped per-expert), with a custom VJP.

Forward: both operands in the layer's format, executed by the registered backend the name resolves to
(backends.py: `Backend.forward` / `Backend.grouped_forward`; nothing here branches on a name). The reference keeps
each operand as its exact block-scaled value `q * s` (exactly representable in bfloat16 for E2M1*E4M3, E4M3*E8M0
and E4M3), accumulates in float32 and applies the float32 per-tensor (or per-row, per-expert) factors to the
output, like the GEMM's alpha on hardware. On the xla backend an operand quantized on the fly is never packed: its
exact values come from one fused elementwise pass (formats.nvfp4_fake_quant, bit-identical to decoding the packed
tensor), and a [K, N] weight is quantized along K in its own layout (no transposed read).
Backward: straight-through (the quantizer's Jacobian taken as the identity), GEMMs on the high-precision operands
rounded to bfloat16 (or float32) with float32 accumulation. grad="nvfp4" instead quantizes the backward GEMMs'
operands to NVFP4: the output gradient with stochastic rounding, and a 16-point random Hadamard transform along
the token axis on both wgrad operands (tokens zero-padded to a multiple of 16, per expert group for the grouped
dot). The backward always runs on the reference (xla) ops.
Debug: with `LayerPrecision.debug_nonfinite` on ("raise" / "log"), the activation, the raw weight and (grad="nvfp4")
the output gradient are checked for NaN/Inf at run time (quant/debug.py); the mode is a field of the static
precision argument, so it is part of the compiled program's key.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from triage_jax.quant import backends as be
from triage_jax.quant import formats as fmt
from triage_jax.quant.debug import report_nonfinite
from triage_jax.quant.policy import LayerPrecision

F32 = jnp.float32
BF16 = jnp.bfloat16
_SR_SEED = 0x7A1A6E  # the fixed seed the derived stochastic-rounding keys fold from
_BLOCK = {"nvfp4": fmt.NVFP4_BLOCK, "mxfp8": fmt.MXFP8_BLOCK, **{f: fmt.MXFP4_BLOCK for f in fmt.MXFP4_FORMATS}}


@struct.dataclass
class QuantizedWeight:
    """A weight quantized once (the sampler reuses it every step); `q` holds it transposed as [..., N, K].

    For a 3D per-expert weight [E, K, N], each expert is quantized on its own (its own NVFP4 amax / FP8 scale).
    """

    q: fmt.NVFP4Tensor | fmt.NVFP4Int8Tensor | fmt.MXFP4Tensor | fmt.MXFP8Tensor | fmt.FP8Tensor
    fmt_name: str = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.q.shape
        return s[:-2] + (s[-1], s[-2])

    def dequantize(self, dtype=F32) -> jax.Array:
        """The dequantized weight [..., K, N]."""
        return jnp.swapaxes(self.q.dequantize(dtype), -1, -2)

    @property
    def mesh_replicated(self) -> bool:
        """Whether a mesh holds it whole on every device: a custom kernel's layout (MESH_REPLICATED: fp4_gemm) is
        not partitioned, nor split by logical names."""
        return bool(getattr(self.q, "MESH_REPLICATED", False))


def quantize_operand(x: jax.Array, fmt_name: str, scaling: str = "tensor", backend: str = "xla"):
    """Quantize x[..., K] along its last axis in the named format (x itself for "none"); 3D = per-matrix."""
    return be.quantize_operand(be.get_backend(backend), x, fmt_name, scaling)


def quantize_weight(w_kn: jax.Array, fmt_name: str, scaling: str = "tensor", backend: str = "xla"):
    """Quantize a weight w[K, N] (or per expert w[E, K, N]) along K, returned as w^T [..., N, K] quantized."""
    return be.quantize_weight(be.get_backend(backend), w_kn, fmt_name, scaling)


def prequantize(w_kn: jax.Array, prec: LayerPrecision, *, backend: str = "xla") -> jax.Array | QuantizedWeight:
    """Quantize a weight w[K, N] or per-expert w[E, K, N] once for reuse (the sampler's sync); w itself for "none"."""
    if prec.weight == "none":
        return w_kn
    if w_kn.ndim not in (2, 3):
        raise ValueError(f"prequantize: expected w[K, N] or w[E, K, N]; got shape {w_kn.shape}")
    _check_block(w_kn.shape[-2], prec.weight, "weight", f"w {w_kn.shape}")
    report_nonfinite(w_kn, "prequantize", "", prec.debug_nonfinite)
    return QuantizedWeight(
        q=quantize_weight(w_kn, prec.weight, prec.weight_scaling, backend), fmt_name=prec.weight
    )


def concat_prequantized(ws, backend: str = "xla") -> QuantizedWeight | None:
    """Weights quantized once for one input (QuantizedWeight [K, N_i], one format) as one [K, sum N_i] whose qdot
    is the parts' qdots side by side, on a backend that runs it as one GEMM (Backend.concat_weights: fp4_gemm);
    None where the backend does not merge or these weights cannot be merged."""
    b = be.get_backend(backend)
    ws = list(ws)
    if b.concat_weights is None or not all(isinstance(w, QuantizedWeight) for w in ws):
        return None
    if len({w.fmt_name for w in ws}) != 1:
        return None
    q = b.concat_weights([w.q for w in ws])
    return None if q is None else QuantizedWeight(q=q, fmt_name=ws[0].fmt_name)


def _check_block(k: int, fmt_name: str, role: str, shapes: str) -> None:
    block = _BLOCK.get(fmt_name)
    if block and k % block:
        raise ValueError(f"{role} format {fmt_name} needs the contraction dim K={k} ({shapes}) to be a multiple of {block}")


def _check_common(x, w, prec: LayerPrecision, w_rank: int, what: str) -> None:
    if getattr(x, "dtype", None) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"{what}: unsupported activation dtype {getattr(x, 'dtype', None)} (shape {x.shape})")
    w_shape = tuple(w.shape)
    shapes = f"x {tuple(x.shape)}, w {w_shape}"
    if len(w_shape) != w_rank or x.ndim < 1:
        want = "w[K, N]" if w_rank == 2 else "w[E, K, N]"
        raise ValueError(f"{what}: expected x[..., K] and {want}; got {shapes}")
    if isinstance(w, QuantizedWeight):
        if w.fmt_name != prec.weight:
            raise ValueError(f"{what}: weight pre-quantized as {w.fmt_name} but the layer asks for {prec.weight}")
    elif getattr(w, "dtype", None) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise TypeError(f"{what}: unsupported weight dtype {getattr(w, 'dtype', None)} (shape {w_shape})")
    k = x.shape[-1]
    if w_shape[-2] != k:
        raise ValueError(f"{what}: contraction mismatch, {shapes}")
    for role, f in (("act", prec.act), ("weight", prec.weight)):
        _check_block(k, f, f"{what}: {role}", shapes)
    if prec.grad == "nvfp4":
        _check_block(w_shape[-1], "nvfp4", f"{what}: grad", shapes + "; N is dgrad's contraction dim")


# --- dense -------------------------------------------------------------------------------------------------------


def _weight_operand(w):
    """What a backend receives as the weight: the raw [.., K, N] array, or a pre-quantized one's tensor [.., N, K]."""
    return w.q if isinstance(w, QuantizedWeight) else w


def _forward(x2: jax.Array, w, prec: LayerPrecision, backend: str) -> jax.Array:
    """y[M, N] in float32 on the backend (its own forward, or its quantizers + matmul).

    Traced once per distinct (shapes, precision, backend, the backend's trace_key) by a jit of its own: a 36-layer
    model's 144 quantized dots are 4 traces, not 144 (the 4B W4A4 decode round: ~70% of its trace time), lowered
    as calls of one function each, which XLA inlines before it optimizes (the same program, the same bits).
    """
    b = be.get_backend(backend)
    return _forward_once(x2, w, prec, b, b.trace_key())


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _forward_once(x2, w, prec: LayerPrecision, b: be.Backend, trace_key) -> jax.Array:
    del trace_key  # a key of the jit's trace cache only
    return b.forward(x2, _weight_operand(w), prec)


def _report_grad(g, prec: LayerPrecision, op: str, name: str) -> None:
    if prec.grad == "nvfp4":  # the output gradient is quantized (and NaN saturated) in the backward
        report_nonfinite(g, f"{op} backward (output gradient)", name, prec.debug_nonfinite)


def _derive_key(g: jax.Array, key) -> jax.Array:
    """The explicit key, or one folded deterministically from a fixed seed, g's shape and g's content."""
    if key is not None:
        return key
    content = jax.lax.bitcast_convert_type(jnp.sum(g.astype(F32)), jnp.uint32)
    k = jax.random.fold_in(jax.random.key(_SR_SEED), g.shape[0] * 65537 + g.shape[-1])
    return jax.random.fold_in(k, content)


def _pad_rows(a: jax.Array, multiple: int = fmt.NVFP4_BLOCK) -> jax.Array:
    pad = -a.shape[0] % multiple
    return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _nvfp4_dgrad_operands(g2, w_kn, key, prec: LayerPrecision):
    """dgrad dx = g . w^T contracts N: g quantized along N with stochastic rounding, w along N (RNE)."""
    gq = fmt.quantize_nvfp4(g2, sr_key=key)
    tile = prec.weight_scaling == "tile2d" and w_kn.shape[-2] % fmt.NVFP4_BLOCK == 0
    wq = quantize_operand(w_kn.astype(F32), "nvfp4", "tile2d" if tile else "tensor")  # [(E,) K, N]
    return gq, wq


def _nvfp4_wgrad_operands(x_pk, g_pn, key):
    """wgrad contracts tokens: RHT along tokens on both operands (amax after it), quantized along tokens."""
    xt = fmt.rht16(x_pk.astype(F32), axis=0).T  # [K, P]
    gt = fmt.rht16(g_pn.astype(F32), axis=0).T  # [N, P]
    return fmt.quantize_nvfp4(xt), fmt.quantize_nvfp4(gt, sr_key=key)


def _nvfp4_grads(x2, w, g2, key, prec: LayerPrecision):
    k_d, k_w = jax.random.split(_derive_key(g2, key))
    gq, wq = _nvfp4_dgrad_operands(g2, w, k_d, prec)
    dx = be.reference_matmul(gq, wq)
    xq, gtq = _nvfp4_wgrad_operands(_pad_rows(x2), _pad_rows(g2), k_w)
    dw = be.reference_matmul(xq, gtq)
    return dx, dw


def _st_grads(x2, w, g2, prec: LayerPrecision):
    gdt = F32 if prec.grad == "f32" else BF16
    g = g2.astype(gdt)
    dx = jnp.dot(g, w.T.astype(gdt), preferred_element_type=F32)
    dw = jnp.dot(x2.T.astype(gdt), g, preferred_element_type=F32)
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _qdot_q(x2, w, key, prec, backend, name):
    return _forward(x2, w, prec, backend)


def _qdot_q_fwd(x2, w, key, prec, backend, name):
    return _forward(x2, w, prec, backend), (x2, w, key)


def _qdot_q_bwd(prec, backend, name, res, g2):
    x2, w, key = res
    _report_grad(g2, prec, "qdot", name)
    if prec.grad == "nvfp4":
        dx, dw = _nvfp4_grads(x2, w, g2, key, prec)
    else:
        dx, dw = _st_grads(x2, w, g2, prec)
    return dx.astype(x2.dtype), dw.astype(w.dtype), None


_qdot_q.defvjp(_qdot_q_fwd, _qdot_q_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _qdot_pre(x2, qw, prec, backend):
    return _forward(x2, qw, prec, backend)


def _qdot_pre_fwd(x2, qw, prec, backend):
    return _forward(x2, qw, prec, backend), (x2, qw)


def _qdot_pre_bwd(prec, backend, res, g2):
    x2, qw = res  # straight-through to x through the dequantized weight; none to the frozen quantized weight
    gdt = F32 if prec.grad == "f32" else BF16
    dx = jnp.dot(g2.astype(gdt), qw.dequantize(F32).T.astype(gdt), preferred_element_type=F32)
    return dx.astype(x2.dtype), None


_qdot_pre.defvjp(_qdot_pre_fwd, _qdot_pre_bwd)


def _report_operands(x, w, prec: LayerPrecision, op: str, name: str) -> None:
    report_nonfinite(x, op, name, prec.debug_nonfinite)
    if not isinstance(w, QuantizedWeight) and prec.weight != "none":
        report_nonfinite(w, f"{op} (weight)", name, prec.debug_nonfinite)


def qdot(
    x: jax.Array, w, prec: LayerPrecision, *, backend: str = "xla", sr_key: jax.Array | None = None, name: str = ""
) -> jax.Array:
    """y[..., N] = x[..., K] @ w[K, N] in the layer's precision; w may be a pre-quantized QuantizedWeight.

    backend: a registered backend name or "auto" (unavailable -> error with the reason). sr_key: the stochastic-
    rounding key of grad="nvfp4" (default: derived from a fixed seed, the shapes and the gradient's content).
    name: the layer path, used by the non-finite debug report (prec.debug_nonfinite).
    """
    _check_common(x, w, prec, 2, "qdot")
    if not prec.quantized:
        if isinstance(w, QuantizedWeight):
            raise ValueError("qdot: a QuantizedWeight needs a layer precision with a weight format")
        return jnp.dot(x, w, preferred_element_type=F32).astype(x.dtype)
    backend = be.resolve_backend(backend)
    _report_operands(x, w, prec, "qdot", name)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if isinstance(w, QuantizedWeight):
        y = _qdot_pre(x2, w, prec, backend)
    else:
        y = _qdot_q(x2, w, sr_key, prec, backend, name)
    return y.astype(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


# --- grouped (per-expert) ----------------------------------------------------------------------------------------

_RAGGED_WGRAD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=()
)


def _ragged_forward(x_mk, w, gs, prec: LayerPrecision, backend: str) -> jax.Array:
    """The grouped forward, traced once per shape as _forward is."""
    b = be.get_backend(backend)
    return _ragged_forward_once(x_mk, w, gs, prec, b, b.trace_key())


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _ragged_forward_once(x_mk, w, gs, prec: LayerPrecision, b: be.Backend, trace_key) -> jax.Array:
    del trace_key
    return b.grouped_forward(x_mk, _weight_operand(w), gs, prec)


def _ragged_st_grads(x, w, gs, g, gdt):
    g = g.astype(gdt)
    dx = jax.lax.ragged_dot(g, jnp.swapaxes(w, -1, -2).astype(gdt), gs, preferred_element_type=F32)
    dw = jax.lax.ragged_dot_general(x.astype(gdt), g, gs, _RAGGED_WGRAD, preferred_element_type=F32)
    return dx, dw


def _pad_groups(a_mk: jax.Array, gs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of each group moved to a start that is a multiple of 16, zeros between: (padded [P, K], padded sizes)."""
    m, e = a_mk.shape[0], gs.shape[0]
    p = -(-(m + (fmt.NVFP4_BLOCK - 1) * e) // fmt.NVFP4_BLOCK) * fmt.NVFP4_BLOCK
    padded_gs = -(-gs // fmt.NVFP4_BLOCK) * fmt.NVFP4_BLOCK
    starts = jnp.cumsum(gs) - gs
    padded_starts = jnp.cumsum(padded_gs) - padded_gs
    rows_e = be.row_groups(gs, m)
    r = jnp.arange(m)
    dest = jnp.where(r < jnp.sum(gs), r - starts[rows_e] + padded_starts[rows_e], p)
    return jnp.zeros((p, a_mk.shape[1]), a_mk.dtype).at[dest].set(a_mk, mode="drop"), padded_gs.astype(gs.dtype)


def _ragged_nvfp4_grads(x, w, gs, g, key, prec):
    k_d, k_w = jax.random.split(_derive_key(g, key))
    gq, wq = _nvfp4_dgrad_operands(g, w, k_d, prec)  # w [E, K, N] quantized per expert along N
    gv, fg, wv, fw = be.gemm_operands(gq, wq)  # wq holds w [E, K, N] quantized along N: wv is [E, N, K]
    dx = jax.lax.ragged_dot(gv, wv, gs, preferred_element_type=F32)
    dx = dx * fg * be.per_row_factor(fw, be.row_groups(gs, x.shape[0]))
    x_p, pgs = _pad_groups(x, gs)
    g_p, _ = _pad_groups(g, gs)
    xq, gtq = _nvfp4_wgrad_operands(x_p, g_p, k_w)
    (xv, fx), (gtv, fgt) = be.split_scaled(xq), be.split_scaled(gtq)  # [K, P], [N, P]
    dw = jax.lax.ragged_dot_general(xv.T, gtv.T, pgs, _RAGGED_WGRAD, preferred_element_type=F32)
    return dx, dw * (fx * fgt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _qragged(x, w, gs, key, prec, backend, name):
    return _ragged_forward(x, w, gs, prec, backend)


def _qragged_fwd(x, w, gs, key, prec, backend, name):
    return _ragged_forward(x, w, gs, prec, backend), (x, w, gs, key)


def _qragged_bwd(prec, backend, name, res, g):
    x, w, gs, key = res
    if not isinstance(w, QuantizedWeight):
        _report_grad(g, prec, "qragged_dot", name)
    if isinstance(w, QuantizedWeight):
        gdt = F32 if prec.grad == "f32" else BF16
        dx, _ = _ragged_st_grads(x, w.dequantize(F32), gs, g, gdt)
        return dx.astype(x.dtype), None, None, None
    if prec.grad == "nvfp4":
        dx, dw = _ragged_nvfp4_grads(x, w, gs, g, key, prec)
    else:
        dx, dw = _ragged_st_grads(x, w, gs, g, F32 if prec.grad == "f32" else BF16)
    return dx.astype(x.dtype), dw.astype(w.dtype), None, None


_qragged.defvjp(_qragged_fwd, _qragged_bwd)


def qragged_dot(
    x_mk: jax.Array,
    w_ekn,
    group_sizes_e: jax.Array,
    prec: LayerPrecision,
    *,
    backend: str = "xla",
    sr_key: jax.Array | None = None,
    name: str = "",
) -> jax.Array:
    """Grouped (per-expert) quantized dot: rows of x_mk sorted by expert, group_sizes_e rows each -> y_mn.

    Weights are quantized per expert along K (own amax / scale per expert), activations along K per row block; the
    grouped GEMMs are jax.lax.ragged_dot on the exact block-scaled values (any backend's quantizers feed it).
    """
    _check_common(x_mk, w_ekn, prec, 3, "qragged_dot")
    if x_mk.ndim != 2:
        raise ValueError(f"qragged_dot: expected x[M, K]; got shape {x_mk.shape}")
    if group_sizes_e.shape != (w_ekn.shape[0],) or not jnp.issubdtype(group_sizes_e.dtype, jnp.integer):
        raise ValueError(
            f"qragged_dot: group_sizes must be int [E={w_ekn.shape[0]}]; got {group_sizes_e.dtype} {group_sizes_e.shape}"
        )
    if not prec.quantized:
        if isinstance(w_ekn, QuantizedWeight):
            raise ValueError("qragged_dot: a QuantizedWeight needs a layer precision with a weight format")
        if jax.default_backend() == "cpu":
            # XLA's CPU runtime has no bf16 x bf16 -> f32 dot; in float32 the same products and sums are exact.
            x32, w32 = x_mk.astype(F32), jnp.asarray(w_ekn).astype(F32)
            return jax.lax.ragged_dot(x32, w32, group_sizes_e).astype(x_mk.dtype)
        return jax.lax.ragged_dot(x_mk, w_ekn, group_sizes_e, preferred_element_type=F32).astype(x_mk.dtype)
    backend = be.resolve_backend(backend)
    _report_operands(x_mk, w_ekn, prec, "qragged_dot", name)
    return _qragged(x_mk, w_ekn, group_sizes_e, sr_key, prec, backend, name).astype(x_mk.dtype)
