"""NVFP4, MXFP8 and FP8 quantizers: the bit-exact jax.numpy reference (TE kernel semantics, spec numerics.md).

Every other backend is checked against these functions. All arithmetic is float32 and in the spec's order: a
different order (dividing instead of multiplying by a reciprocal, `(a/6)*S` instead of `a*(S/6)`) changes the
rounding of real inputs.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

F32 = jnp.float32
FLT_MAX = np.float32(np.finfo(np.float32).max)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
# 2688 = 448 * 6: the largest product of an E4M3 block scale and an E2M1 element.
NVFP4_RANGE = E4M3_MAX * E2M1_MAX
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

Scaling = Literal["tensor", "row", "tile2d"]
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_input(x: jax.Array, block: int, what: str, min_rank: int = 1) -> None:
    if not hasattr(x, "dtype") or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{what}: unsupported input dtype {getattr(x, 'dtype', type(x))}; expected float32, bfloat16 or float16"
        )
    if x.ndim < min_rank:
        raise ValueError(f"{what}: input of shape {x.shape} has rank {x.ndim}; need rank >= {min_rank}")
    if x.shape[-1] % block:
        raise ValueError(
            f"{what}: last (contraction) dim of shape {x.shape} is {x.shape[-1]}, not a multiple of {block}"
        )


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _nan_to_zero_abs(x: jax.Array) -> jax.Array:
    # TE's amax reductions use fmaxf, which drops NaN.
    return jnp.where(jnp.isnan(x), 0.0, jnp.abs(x))


def _amax(x: jax.Array, scaling: Scaling) -> jax.Array:
    a = _nan_to_zero_abs(x)
    if scaling == "row":
        return jnp.max(a, axis=-1, keepdims=True)
    return jnp.max(a)


def e2m1_cast(y: jax.Array) -> jax.Array:
    """Round-to-nearest-even cast of float32 values to E2M1 with TE's saturation (NaN -> +6)."""
    y = jnp.where(jnp.isnan(y), E2M1_MAX, jnp.clip(y, -E2M1_MAX, E2M1_MAX))
    return y.astype(jnp.float4_e2m1fn)


def e2m1_cast_stochastic(y: jax.Array, key: jax.Array) -> jax.Array:
    """Stochastic rounding to E2M1: up with probability (|y| - lo) / (hi - lo), unbiased on [-6, 6]."""
    y = jnp.where(jnp.isnan(y), E2M1_MAX, jnp.clip(y, -E2M1_MAX, E2M1_MAX)).astype(F32)
    grid = jnp.asarray(E2M1_GRID)
    mag = jnp.abs(y)
    hi_idx = jnp.clip(jnp.searchsorted(grid, mag, side="left"), 1, len(E2M1_GRID) - 1)
    lo, hi = grid[hi_idx - 1], grid[hi_idx]
    p_up = (mag - lo) / (hi - lo)
    u = jax.random.uniform(key, y.shape, F32)
    out = jnp.where(u < p_up, hi, lo)
    return jnp.copysign(out, y).astype(jnp.float4_e2m1fn)


def e4m3_cast(y: jax.Array) -> jax.Array:
    """Round-to-nearest-even cast to E4M3 after clipping (the cast itself is not saturating)."""
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


@struct.dataclass
class NVFP4Tensor:
    """NVFP4 tensor: E2M1 `data` (x's shape), E4M3 `scale` [..., K/16], float32 global `amax`."""

    data: jax.Array
    scale: jax.Array
    amax: jax.Array
    scaling: str = struct.field(pytree_node=False, default="tensor")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def global_decode_scale(self) -> jax.Array:
        return jnp.where(self.amax == 0, jnp.float32(1.0), self.amax.astype(F32) / NVFP4_RANGE)

    def dequantize(self, dtype=F32) -> jax.Array:
        q = _blocks(self.data.astype(F32), NVFP4_BLOCK)
        s = self.scale.astype(F32)[..., None]
        g = self.global_decode_scale()
        if self.scaling == "row":
            g = g[..., None]
        # e2m1(q) * float(s) * (amax / 2688), left to right.
        return ((q * s) * g).reshape(self.data.shape).astype(dtype)


@struct.dataclass
class MXFP8Tensor:
    """MXFP8 tensor: E4M3 `data` (x's shape), E8M0 power-of-two `scale` [..., K/32]."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def dequantize(self, dtype=F32) -> jax.Array:
        q = _blocks(self.data.astype(F32), MXFP8_BLOCK)
        s = self.scale.astype(F32)[..., None]
        return (q * s).reshape(self.data.shape).astype(dtype)


@struct.dataclass
class FP8Tensor:
    """Per-tensor FP8: E4M3 `data` and a float32 `scale` (x = data * scale)."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def dequantize(self, dtype=F32) -> jax.Array:
        return (self.data.astype(F32) * self.scale.astype(F32)).astype(dtype)


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
    """Encode scale S = min(2688 / amax, FLT_MAX), with S = 1 where amax == 0 or S == 0."""
    amax = amax.astype(F32)
    s = jnp.minimum(jnp.float32(NVFP4_RANGE) / amax, FLT_MAX)
    return jnp.where((amax == 0) | (s == 0), jnp.float32(1.0), s)


def _nvfp4_block_amax(x: jax.Array, scaling: Scaling) -> jax.Array:
    """Per-16-block amax [..., K/16]; for 2D tiles the amax of each 16x16 tile, repeated over its 16 rows."""
    a = _nan_to_zero_abs(x)
    ba = jnp.max(_blocks(a, NVFP4_BLOCK), axis=-1)
    if scaling != "tile2d":
        return ba
    m = x.shape[-2]
    tiles = ba.reshape(*ba.shape[:-2], m // NVFP4_BLOCK, NVFP4_BLOCK, ba.shape[-1])
    return jnp.broadcast_to(jnp.max(tiles, axis=-2, keepdims=True), tiles.shape).reshape(ba.shape)


def quantize_nvfp4(
    x: jax.Array,
    *,
    scaling: Scaling = "tensor",
    amax: jax.Array | float | None = None,
    sr_key: jax.Array | None = None,
) -> NVFP4Tensor:
    """NVFP4-quantize x[..., K] along its last axis (blocks of 16), TE semantics.

    scaling: "tensor" (one global amax), "row" (one amax per row: token-wise) or "tile2d" (16x16 weight tiles
    share a block scale, so W and W^T quantize alike). `amax` reuses a given global amax (scalar, or [..., 1] for
    "row"). `sr_key` switches the E2M1 cast to stochastic rounding (the gradient path).
    """
    if scaling not in ("tensor", "row", "tile2d"):
        raise ValueError(f"quantize_nvfp4: unknown scaling {scaling!r}; expected 'tensor', 'row' or 'tile2d'")
    _check_input(x, NVFP4_BLOCK, "quantize_nvfp4", min_rank=2 if scaling == "tile2d" else 1)
    if scaling == "tile2d" and x.shape[-2] % NVFP4_BLOCK:
        raise ValueError(
            f"quantize_nvfp4(scaling='tile2d'): second-to-last dim of shape {x.shape} is {x.shape[-2]}, "
            f"not a multiple of {NVFP4_BLOCK}"
        )
    x = x.astype(F32)
    if amax is None:
        amax = _amax(x, scaling)
    else:
        amax = jnp.asarray(amax, F32)
        want = x.shape[:-1] + (1,) if scaling == "row" else ()
        if scaling == "row" and amax.ndim == 0:
            amax = jnp.broadcast_to(amax, want)
        if amax.shape != want:
            raise ValueError(f"quantize_nvfp4: amax of shape {amax.shape} for input {x.shape}; expected {want}")
    s_enc = nvfp4_global_scale(amax)
    s_dec = jnp.float32(1.0) / s_enc  # "row": [..., 1], broadcasts over the row's blocks
    ba = _nvfp4_block_amax(x, scaling)
    # TE folds 1/6 into S first: ba * (S * (1/6)).
    scale = e4m3_cast(jnp.minimum(ba * (s_enc * jnp.float32(1.0 / 6.0)), E4M3_MAX))
    inv = jnp.minimum(jnp.float32(1.0) / (scale.astype(F32) * s_dec), FLT_MAX)
    y = _blocks(x, NVFP4_BLOCK) * inv[..., None]
    q = e2m1_cast(y) if sr_key is None else e2m1_cast_stochastic(y, sr_key)
    return NVFP4Tensor(data=q.reshape(x.shape), scale=scale, amax=amax, scaling=scaling)


def _e8m0_rceil(v: jax.Array) -> jax.Array:
    """Biased E8M0 exponent that rounds v up to a power of two (TE/cuBLAS RCEIL), as uint32 in [0, 255]."""
    bits = jax.lax.bitcast_convert_type(v.astype(F32), jnp.uint32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    round_up = (man != 0) & (exp != 254) & ~((exp == 0) & (man <= 0x400000))
    e = exp + round_up.astype(jnp.uint32)
    return jnp.where(exp == 255, jnp.uint32(255), e)


def _pow2_neg_biased(e: jax.Array) -> jax.Array:
    """Exactly 2^(127 - e) in float32 for a biased exponent e (2^-127 is a float32 subnormal; e = 255 -> NaN)."""
    b = jnp.uint32(254) - jnp.minimum(e, jnp.uint32(254))
    bits = jnp.where(b == 0, jnp.uint32(0x400000), b << 23)
    out = jax.lax.bitcast_convert_type(bits, F32)
    return jnp.where(e == 255, jnp.float32(jnp.nan), out)


def quantize_mxfp8(x: jax.Array) -> MXFP8Tensor:
    """MXFP8-quantize x[..., K] along its last axis (blocks of 32, E8M0 scales, RCEIL rounding)."""
    _check_input(x, MXFP8_BLOCK, "quantize_mxfp8")
    x = x.astype(F32)
    xb = _blocks(x, MXFP8_BLOCK)
    v = jnp.max(_nan_to_zero_abs(xb), axis=-1) * jnp.float32(1.0 / E4M3_MAX)
    e = _e8m0_rceil(v)
    q = e4m3_cast(xb * _pow2_neg_biased(e)[..., None])
    scale = jax.lax.bitcast_convert_type(e.astype(jnp.uint8), jnp.float8_e8m0fnu)
    return MXFP8Tensor(data=q.reshape(x.shape), scale=scale)


def quantize_fp8(x: jax.Array, scale: jax.Array | float | None = None) -> FP8Tensor:
    """Per-tensor E4M3 with scale = amax / 448 (or a fixed calibrated scale); used for the KV cache."""
    if not hasattr(x, "dtype") or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize_fp8: unsupported input dtype {getattr(x, 'dtype', type(x))}")
    x = x.astype(F32)
    if scale is None:
        amax = jnp.max(_nan_to_zero_abs(x))
        scale = jnp.where(amax == 0, jnp.float32(1.0), amax / jnp.float32(E4M3_MAX))
    scale = jnp.asarray(scale, F32)
    return FP8Tensor(data=e4m3_cast(x / scale), scale=scale)


def pack_fp4(data: jax.Array) -> jax.Array:
    """Pack E2M1 codes two per byte: element 2i in bits 0-3, element 2i+1 in bits 4-7 -> uint8 [..., K/2]."""
    if data.dtype != jnp.float4_e2m1fn:
        raise TypeError(f"pack_fp4: expected float4_e2m1fn data, got {data.dtype}")
    if data.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim of shape {data.shape} is odd")
    codes = _e2m1_codes(data)
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Inverse of pack_fp4: uint8 [..., K/2] -> float4_e2m1fn [..., K]."""
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_fp4: expected uint8, got {packed.dtype}")
    lo, hi = packed & 0xF, packed >> 4
    codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    mag = jnp.asarray(E2M1_GRID)[(codes & 0x7).astype(jnp.int32)]
    return jnp.where((codes & 0x8) != 0, -mag, mag).astype(jnp.float4_e2m1fn)


def _e2m1_codes(data: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (sign << 3 | magnitude index) as uint8."""
    f = data.astype(F32)
    idx = jnp.searchsorted(jnp.asarray(E2M1_GRID), jnp.abs(f)).astype(jnp.uint8)
    sign = jnp.signbit(f).astype(jnp.uint8)
    return (sign << 3) | idx


def e2m1_codes(data: jax.Array) -> jax.Array:
    """Public view of the E2M1 codes of float4 data (for tests and checkpoints)."""
    return _e2m1_codes(data)


def hadamard16(sign_seed: int = 0) -> jax.Array:
    """The 16-point random Hadamard transform H = diag(s) * H16 / 4 (orthogonal), s a fixed +-1 vector."""
    h = np.array([[1.0]], np.float32)
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    s = np.where(np.random.default_rng(sign_seed).random(16) < 0.5, -1.0, 1.0).astype(np.float32)
    return jnp.asarray(s[:, None] * h / 4.0)


def rht16(x: jax.Array, axis: int = -1, sign_seed: int = 0) -> jax.Array:
    """Apply H to each 16-block along `axis`: (H x_blk). Applied to both wgrad operands it cancels (H^T H = I)."""
    _check_input(jnp.moveaxis(x, axis, -1), NVFP4_BLOCK, "rht16")
    h = hadamard16(sign_seed)
    xm = jnp.moveaxis(x, axis, -1)
    y = jnp.einsum("...bi,ji->...bj", _blocks(xm.astype(F32), NVFP4_BLOCK), h)
    return jnp.moveaxis(y.reshape(xm.shape), -1, axis).astype(x.dtype)
