"""The one quantized dot every model matmul goes through, with a custom VJP.

Forward: both operands in the layer's format. The reference (`xla` backend) keeps each operand as its exact
block-scaled value `q * s` (exactly representable in bfloat16 for E2M1*E4M3, E4M3*E8M0 and E4M3), accumulates in
float32 and applies the float32 per-tensor (or per-row) factors to the output, like the GEMM's alpha on hardware.
Backward: straight-through, in bfloat16 (or float32) by default; NVFP4 gradients with stochastic rounding and a
16-point random Hadamard transform on the wgrad operands as an option.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from triage_jax.quant import formats as fmt
from triage_jax.quant.policy import LayerPrecision

F32 = jnp.float32
BF16 = jnp.bfloat16


@struct.dataclass
class ScaledOperand:
    """An operand split as (block-scaled values [..., K] in bf16, float32 output factor broadcastable to rows)."""

    values: jax.Array
    factor: jax.Array


@struct.dataclass
class QuantizedWeight:
    """A weight quantized once (the sampler reuses it every step); `q` holds it transposed as [..., N, K]."""

    q: fmt.NVFP4Tensor | fmt.MXFP8Tensor | fmt.FP8Tensor
    fmt_name: str = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.q.shape
        return s[:-2] + (s[-1], s[-2])


def quantize_operand(x: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """Quantize x[..., K] along its last axis in the named format (None for "none")."""
    if fmt_name == "none":
        return None
    if fmt_name == "nvfp4":
        return fmt.quantize_nvfp4(x, scaling=scaling)
    if fmt_name == "mxfp8":
        return fmt.quantize_mxfp8(x)
    if fmt_name == "fp8":
        return fmt.quantize_fp8(x)
    raise ValueError(f"unknown format {fmt_name!r}")


def split_scaled(q) -> ScaledOperand:
    """Exact block-scaled values (bf16) and the float32 factor the GEMM applies to its output."""
    if isinstance(q, fmt.NVFP4Tensor):
        blocks = fmt._blocks(q.data.astype(F32), fmt.NVFP4_BLOCK) * q.scale.astype(F32)[..., None]
        g = q.global_decode_scale()
        return ScaledOperand(blocks.reshape(q.shape).astype(BF16), g if q.scaling == "row" else g)
    if isinstance(q, fmt.MXFP8Tensor):
        return ScaledOperand(q.dequantize(F32).astype(BF16), jnp.float32(1.0))
    if isinstance(q, fmt.FP8Tensor):
        return ScaledOperand(q.data.astype(BF16), q.scale.astype(F32))
    raise TypeError(f"cannot split {type(q).__name__}")


def prequantize(w_kn: jax.Array, prec: LayerPrecision) -> jax.Array | QuantizedWeight:
    """Quantize a weight w[..., K, N] once for reuse (the sampler's sync); returns w itself for "none"."""
    if prec.weight == "none":
        return w_kn
    q = quantize_operand(jnp.swapaxes(w_kn, -1, -2), prec.weight, prec.weight_scaling)
    return QuantizedWeight(q=q, fmt_name=prec.weight)


def _check(x: jax.Array, w_shape: tuple[int, ...], prec: LayerPrecision) -> None:
    k = x.shape[-1]
    if x.ndim < 1 or len(w_shape) != 2:
        raise ValueError(f"qdot: expected x[..., K] and w[K, N]; got x {x.shape}, w {w_shape}")
    if w_shape[0] != k:
        raise ValueError(f"qdot: contraction mismatch, x {x.shape} vs w {w_shape}")
    for name, f in (("act", prec.act), ("weight", prec.weight)):
        block = {"nvfp4": fmt.NVFP4_BLOCK, "mxfp8": fmt.MXFP8_BLOCK}.get(f)
        if block and k % block:
            raise ValueError(
                f"qdot: {name} format {f} needs the contraction dim K={k} (x {x.shape}, w {w_shape}) "
                f"to be a multiple of {block}"
            )


def _forward_xla(x: jax.Array, w, prec: LayerPrecision) -> jax.Array:
    """Reference forward: exact block-scaled operands, f32 accumulation, f32 output factors."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    qx = quantize_operand(x2, prec.act, prec.act_scaling)
    if isinstance(w, QuantizedWeight):
        qw = w.q
    else:
        qw = quantize_operand(jnp.swapaxes(w, 0, 1), prec.weight, prec.weight_scaling)
    xs = split_scaled(qx) if qx is not None else ScaledOperand(x2, jnp.float32(1.0))
    ws = split_scaled(qw) if qw is not None else ScaledOperand(jnp.swapaxes(w, 0, 1), jnp.float32(1.0))
    cdt = jnp.promote_types(xs.values.dtype, ws.values.dtype)
    y = jax.lax.dot_general(
        xs.values.astype(cdt), ws.values.astype(cdt), (((1,), (1,)), ((), ())), preferred_element_type=F32
    )
    y = y * xs.factor * ws.factor  # row factor [M, 1] (token-wise) or scalars
    return y.astype(x.dtype).reshape(*lead, y.shape[-1])


def _grad_dtype(prec: LayerPrecision, like: jax.Array):
    return F32 if prec.grad == "f32" else BF16


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _qdot_q(x, w, prec):
    return _forward_xla(x, w, prec)


def _qdot_q_fwd(x, w, prec):
    return _forward_xla(x, w, prec), (x, w)


def _qdot_q_bwd(prec, res, g):
    x, w = res
    gdt = _grad_dtype(prec, x)
    g2 = g.reshape(-1, g.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    # Straight-through: the quantizer's Jacobian is the identity; backward GEMMs use the high-precision operands.
    dx = jnp.dot(g2.astype(gdt), w.T.astype(gdt), preferred_element_type=F32)
    dw = jnp.dot(x2.T.astype(gdt), g2.astype(gdt), preferred_element_type=F32)
    return dx.astype(x.dtype).reshape(x.shape), dw.astype(w.dtype)


_qdot_q.defvjp(_qdot_q_fwd, _qdot_q_bwd)


def qdot(x: jax.Array, w, prec: LayerPrecision, *, backend: str = "xla") -> jax.Array:
    """y[..., N] = x[..., K] @ w[K, N] in the layer's precision; w may be a pre-quantized QuantizedWeight."""
    w_shape = w.shape
    _check(x, w_shape, prec)
    if backend != "xla":
        raise ValueError(f"qdot: backend {backend!r} is not available yet")
    if not prec.quantized:
        return jnp.dot(x, w, preferred_element_type=F32).astype(x.dtype)
    if isinstance(w, QuantizedWeight):
        return _forward_xla(x, w, prec)  # pre-quantized weights are for inference: no gradient
    return _qdot_q(x, w, prec)


def qragged_dot(x_mk: jax.Array, w_ekn, group_sizes_e: jax.Array, prec: LayerPrecision, *, backend: str = "xla"):
    """Grouped (per-expert) quantized dot: rows of x_mk sorted by expert, group_sizes_e rows each -> y_mn."""
    if not prec.quantized:
        return jax.lax.ragged_dot(x_mk, w_ekn, group_sizes_e, preferred_element_type=F32).astype(x_mk.dtype)
    raise NotImplementedError("quantized ragged dot: see issue 2")
