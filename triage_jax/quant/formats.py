"""NVFP4, MXFP4, MXFP8 and FP8 quantizers: the bit-exact jax.numpy reference (TE kernel semantics, spec numerics.md).

Every other backend is checked against these functions. All arithmetic is float32 and in the spec's order: a
different order (dividing instead of multiplying by a reciprocal, `(a/6)*S` instead of `a*(S/6)`) changes the
rounding of real inputs. `NVFP4Tensor.dequantize` follows TE's dequantize kernel in the same way: per block
`final = (float(s) * amax) * f32(1/2688)`, then `e2m1 * final`.

Speed note: XLA:CPU writes 4-bit arrays (float4_e2m1fn, uint4) about 10x slower than a memory copy, so the E2M1
rounding is done in float32 arithmetic (power-of-two steps and a round-half-even, bit-identical to the cast) and
NVFP4 tensors are stored packed, two codes per byte, as on the hardware; `.data` unpacks to float4 on demand.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from triage_jax.quant.debug import report_nonfinite
from triage_jax.quant import ieee

F32 = jnp.float32
FLT_MAX = np.float32(np.finfo(np.float32).max)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
MXFP4_BLOCK = 32
# The quantized dot's MXFP4 format names and their shared-exponent rounding (numerics.md, "MXFP4").
MXFP4_FORMATS = {"mxfp4": "floor", "mxfp4_rceil": "rceil"}
# 2688 = 448 * 6: the largest product of an E4M3 block scale and an E2M1 element.
NVFP4_RANGE = E4M3_MAX * E2M1_MAX
# TE's dequantize constant `factor_inv = 1.0 / (6.0 * 448.0)`: 1/2688 rounded to float32 once.
NVFP4_DECODE_FACTOR = np.float32(1.0 / NVFP4_RANGE)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

Scaling = Literal["tensor", "row", "tile2d"]
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _compiled(*static: str):
    """jax.jit for a public quantizer: one program per (shapes, dtypes, static settings). Called eagerly (notebooks,
    tools, tests), op-by-op dispatch would compile each of its ~40 primitives on its own (~50 ms each on XLA:CPU);
    inside a jitted model the call is inlined as before."""
    return functools.partial(jax.jit, static_argnames=static)


def _check_input(x, block: int, what: str, min_rank: int = 1) -> None:
    dtype = getattr(x, "dtype", None)
    if dtype is None or dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{what}: unsupported input dtype {dtype or type(x).__name__} (shape {getattr(x, 'shape', None)}); "
            "expected float32, bfloat16 or float16"
        )
    if x.ndim < min_rank:
        raise ValueError(f"{what}: input of shape {x.shape} has rank {x.ndim}; need rank >= {min_rank}")
    if x.shape[-1] % block:
        raise ValueError(
            f"{what}: last (contraction) dim of shape {x.shape} is {x.shape[-1]}, not a multiple of {block}"
        )


def _as_input(x: jax.Array) -> jax.Array:
    """A quantizer's input as float32, its float32 subnormals counting as zeros of their sign (XLA:CPU's DAZ;
    ieee.ftz_int makes the other backends do the same: docs/numerics.md, "GPU")."""
    return ieee.ftz_int(x.astype(F32))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _nan_to_zero_abs(x: jax.Array) -> jax.Array:
    # TE's amax reductions use fmaxf, which drops NaN.
    return jnp.where(jnp.isnan(x), 0.0, jnp.abs(x))


# ---------------------------------------------------------------------------------------------------------------
# E2M1 in float32 arithmetic. On [0, 2) the grid step is 0.5, on [2, 4) 1, on [4, 6] 2; within a binade rounding
# to a multiple of the step with ties to an even multiple is exactly the cast's round-to-nearest-even, and the
# even multiple is the even code (grid index = multiple + 0, 2 or 4).


def _e2m1_saturate(y: jax.Array) -> jax.Array:
    """TE's saturating cast input: NaN -> +6, clip to [-6, 6]."""
    y = y.astype(F32)
    return jnp.where(jnp.isnan(y), jnp.float32(E2M1_MAX), jnp.clip(y, -E2M1_MAX, E2M1_MAX))


def _e2m1_binade(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(1/step, code offset) for magnitudes a in [0, 6]."""
    inv_step = jnp.where(a >= 4.0, jnp.float32(0.5), jnp.where(a >= 2.0, jnp.float32(1.0), jnp.float32(2.0)))
    offset = jnp.where(a >= 4.0, jnp.float32(4.0), jnp.where(a >= 2.0, jnp.float32(2.0), jnp.float32(0.0)))
    return inv_step, offset


def _codes(y: jax.Array, multiple: jax.Array, offset: jax.Array) -> jax.Array:
    # In 32-bit integers, the sign from the bits: Mosaic GPU has no 8-bit arithmetic and no cast to a bool vector.
    sign = (jax.lax.bitcast_convert_type(y, jnp.uint32) >> 31) << 3
    return ((multiple + offset).astype(jnp.uint32) | sign).astype(jnp.uint8)


def e2m1_rne_codes(y: jax.Array) -> jax.Array:
    """E2M1 codes (uint8, sign << 3 | index) of the saturating round-to-nearest-even cast of y (NaN -> +6)."""
    y = _e2m1_saturate(y)
    a = jnp.abs(y)
    inv_step, offset = _e2m1_binade(a)
    return _codes(y, jnp.round(a * inv_step), offset)  # jnp.round rounds half to even


def e2m1_sr_codes(y: jax.Array, key: jax.Array) -> jax.Array:
    """Stochastic rounding to E2M1 codes: only to the two neighbours, up with probability (|y| - lo) / step."""
    y = _e2m1_saturate(ieee.ftz(y))  # a subnormal |y| has a fractional part only without FTZ
    a = jnp.abs(y)
    inv_step, offset = _e2m1_binade(a)
    scaled = ieee.rounded(a * inv_step)  # exact (a power of two); rounded: no FMA into `scaled - lo`
    lo = jnp.floor(scaled)
    return _codes(y, lo + (_uniform01(key, y.shape) < scaled - lo).astype(F32), offset)


def _uniform01(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """jax.random.uniform(key, shape) in [0, 1), bit for bit, without its affine map `u * (max - min) + min`
    (an exact multiply-add for [0, 1), but one a GPU compiler may contract: see quant/ieee.py)."""
    bits = jax.random.bits(key, shape, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), F32) - jnp.float32(1.0)


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """Float32 values of E2M1 codes (uint8, bits 0-3) assembled from their bits: exponent e and mantissa m give
    m * 0.5 for e = 0, else 2^(e-1) * (1 + m/2); bit 3 is the sign (code 8 is -0). Integer ops and one bitcast, no
    float compare chain: XLA:GPU fuses it into the kernel that interleaves a weight's nibbles, where a float chain
    was one more kernel writing both nibble planes to HBM in float32 (4B decode step: 5 kernels per layer)."""
    c = codes.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    mag = jnp.where(e == 0, m * jnp.uint32(0x3F000000), ((e + 126) << 23) | (m << 22))
    return jax.lax.bitcast_convert_type(mag | ((c & 8) << 28), F32)


def codes_to_fp4(codes: jax.Array) -> jax.Array:
    """uint8 E2M1 codes -> float4_e2m1fn (same bits)."""
    return jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)


def fp4_to_codes(data: jax.Array) -> jax.Array:
    """float4_e2m1fn -> uint8 E2M1 codes (same bits)."""
    return jax.lax.bitcast_convert_type(data, jnp.uint4).astype(jnp.uint8)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., K] -> uint8 [..., K/2]: element 2i in bits 0-3, element 2i+1 in bits 4-7."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> uint8 codes [..., K] (inverse of pack_codes)."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e4m3_convert(y: jax.Array) -> jax.Array:
    """Round-to-nearest-even cast to E4M3 after clipping (the cast itself is not saturating); the bare convert,
    for kernel bodies (no platform branch). Elsewhere use e4m3_cast."""
    return jnp.clip(y, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def e4m3_cast(y: jax.Array) -> jax.Array:
    """e4m3_convert's E4M3 data, on every backend. Off the CPU the value is rounded first (e4m3_value, integer
    arithmetic) and then converted, exactly: XLA:GPU's simplify-fp-conversions pass (on under its default
    xla_allow_excess_precision) collapses a chain of float converts such as f32 -> f8 -> f32 or f32 -> f8 -> bf16
    within one program into one convert, which drops the E4M3 rounding wherever the data is dequantized or fed to a
    GEMM in the program that quantized it (an MXFP8 / FP8 operand of the xla backend was not quantized at all on an
    H200, deviceless compile). Of a rounded value the collapsed chain is that value (docs/numerics.md, "GPU")."""
    return jax.lax.platform_dependent(y, cpu=e4m3_convert, default=lambda v: e4m3_convert(e4m3_value(v)))


def e4m3_value(y: jax.Array) -> jax.Array:
    """The float32 value of e4m3_convert(y): y clipped to +-448 and rounded to nearest even in integer arithmetic
    (e4m3_round_nonneg of |y|, y's sign put back: -0 stays -0), NaN kept."""
    y = jnp.clip(y.astype(F32), -E4M3_MAX, E4M3_MAX)
    value, _ = e4m3_round_nonneg(jnp.abs(y))
    sign = jax.lax.bitcast_convert_type(y, jnp.uint32) & jnp.uint32(0x80000000)
    signed = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(value, jnp.uint32) | sign, F32)
    return jnp.where(jnp.isnan(y), y, signed)


def e4m3_round_nonneg(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Round-to-nearest-even of float32 v in [0, 448] to E4M3 in integer arithmetic: (float32 value, uint8 code).

    Bit-identical to `v.astype(float8_e4m3fn)` there, but it vectorizes: XLA:CPU converts float8 element by
    element in software, and a fused consumer would redo that conversion for every element of a block.
    """
    v = v.astype(F32)
    sub = jnp.round(v * jnp.float32(2.0**9))  # subnormal step 2^-9; 8 carries into the first normal (code 0x08)
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    r = (bits + jnp.uint32(0x7FFFF) + ((bits >> 20) & 1)) & jnp.uint32(0xFFF00000)
    normal = v >= jnp.float32(2.0**-6)
    value = jnp.where(normal, jax.lax.bitcast_convert_type(r, F32), sub * jnp.float32(2.0**-9))
    code = jnp.where(normal, (((r >> 23) - 120) << 3) | ((r >> 20) & 7), sub.astype(jnp.uint32))
    return value, code.astype(jnp.uint8)


def e4m3_decode_nonneg(code: jax.Array) -> jax.Array:
    """Float32 value of a non-negative E4M3 code (uint8 < 0x7F) in integer arithmetic (see e4m3_round_nonneg)."""
    c = code.astype(jnp.uint32)
    e, m = (c >> 3) & 0xF, c & 7
    normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), F32)
    return jnp.where(e == 0, m.astype(F32) * jnp.float32(2.0**-9), normal)


def e4m3_scale_values(scale: jax.Array) -> jax.Array:
    """Float32 values of non-negative E4M3 block scales (float8_e4m3fn): on the CPU decoded in integer arithmetic
    (e4m3_decode_nonneg, which vectorizes there), elsewhere by the float8 convert (exact, the same bits). XLA:GPU
    fuses the convert into the kernel that decodes a weight's values; the integer decode stayed a kernel of its own
    per weight and step (4B decode step: 5 kernels per layer)."""
    return jax.lax.platform_dependent(
        scale, cpu=lambda s: e4m3_decode_nonneg(jax.lax.bitcast_convert_type(s, jnp.uint8)),
        default=lambda s: s.astype(F32))


def _bcast_factor(g: jax.Array, ndim: int) -> jax.Array:
    """Right-pad g's shape with ones to rank ndim (scalar, per-row [..., 1] or batched per-tensor [E])."""
    return g.reshape(g.shape + (1,) * (ndim - g.ndim))


class PackedFP4:
    """Accessors of a tensor stored as packed E2M1 pairs (`packed` [..., K/2] uint8): shape, codes, elements."""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.packed.shape[:-1] + (self.packed.shape[-1] * 2,)

    @property
    def codes(self) -> jax.Array:
        """uint8 E2M1 codes [..., K] (bits 0-3)."""
        return unpack_codes(self.packed)

    @property
    def data(self) -> jax.Array:
        """float4_e2m1fn elements [..., K]."""
        return codes_to_fp4(self.codes)


@struct.dataclass
class NVFP4Tensor(PackedFP4):
    """NVFP4 tensor: packed E2M1 codes (uint8 [..., K/2]), E4M3 `scale` [..., K/16], float32 global `amax`.

    `.data` gives the float4_e2m1fn elements in x's shape. `amax` is a scalar ("tensor", "tile2d"), [..., 1]
    ("row"), or carries leading batch dims when quantized under vmap (per-expert weights).
    """

    packed: jax.Array
    scale: jax.Array
    amax: jax.Array
    scaling: str = struct.field(pytree_node=False, default="tensor")

    @classmethod
    def from_data(cls, data: jax.Array, scale: jax.Array, amax: jax.Array, scaling: str = "tensor") -> "NVFP4Tensor":
        return cls(packed=pack_fp4(data), scale=scale, amax=amax, scaling=scaling)

    def global_decode_scale(self) -> jax.Array:
        """amax * f32(1/2688) (1 where amax == 0, see nvfp4_decode_factor): the float32 factor the GEMM paths apply
        to their output.

        This is the quantized dot's alpha, not the dequantize: the reference GEMM (backends.reference_matmul, the
        fused xla path, the Pallas and cuDNN matmuls) computes `dot(e2m1*s, e2m1*s) * (amax_a/2688) * (amax_b/2688)`
        after float32 accumulation, whereas TE's cuBLAS epilogue folds one alpha `amax_a * amax_b * f32(1/2688^2)`.
        The two differ by float32 rounding of the factor (a few ulp of the output), like any change of the
        accumulation order; `dequantize` below is TE's dequantize kernel bit for bit.
        """
        return nvfp4_decode_factor(self.amax)

    def decoded_scale(self) -> jax.Array:
        """The E4M3 block scales as float32 [..., K/16] (e4m3_scale_values)."""
        return e4m3_scale_values(self.scale)

    def block_values(self, order: str = "natural") -> jax.Array:
        """e2m1(q) * float(s) in float32 [..., K]: exact, and exactly representable in bfloat16.

        order="split" lays each 16-block out as its 8 even then its 8 odd elements (the nibble order of the packed
        bytes). A dot whose operands share that K order is unchanged, and XLA:CPU decodes it ~5x faster than the
        interleaved natural order.
        """
        *lead, half = self.packed.shape
        nb = half * 2 // NVFP4_BLOCK
        p = self.packed.reshape(*lead, nb, NVFP4_BLOCK // 2)
        s = self.decoded_scale()[..., None]
        lo, hi = e2m1_decode(p & 0xF) * s, e2m1_decode(p >> 4) * s  # [..., nb, 8]
        v = jnp.stack([lo, hi], axis=-2 if order == "split" else -1)
        return v.reshape(*lead, half * 2)

    def block_values_t(self, order: str = "natural") -> jax.Array:
        """block_values(order) transposed, [..., K, N], decoded in that layout (the GEMM's K-major weight operand).

        For a weight quantized by quantize_nvfp4_kn the two transposes cancel and the codes are read in the
        order they were written.
        """
        p = jnp.swapaxes(self.packed, -1, -2)  # [..., K/2, N]
        s = jnp.swapaxes(self.decoded_scale(), -1, -2)[..., None, :]  # [..., K/16, 1, N]
        *lead, half, n = p.shape
        nb = half * 2 // NVFP4_BLOCK
        p = p.reshape(*lead, nb, NVFP4_BLOCK // 2, n)
        lo, hi = e2m1_decode(p & 0xF) * s, e2m1_decode(p >> 4) * s  # [..., nb, 8, N]
        v = jnp.stack([lo, hi], axis=-3 if order == "split" else -2)
        return v.reshape(*lead, half * 2, n)

    def block_decode_factor(self) -> jax.Array:
        """TE's per-block dequantize factor [..., K/16]: (float(s) * amax) * f32(1/(6*448)), float32, in that order.

        As in TE's kernel (dequantize_nvfp4.cuh) there is no special case for amax == 0: the factor is then 0.
        """
        s = self.decoded_scale()  # [..., K/16]
        amax = self.amax.astype(F32)
        if self.scaling != "row":  # "row": amax [..., 1] broadcasts over the row's blocks
            amax = _bcast_factor(amax, s.ndim)  # scalar, or [E] under vmap -> [E, 1, 1]
        return ieee.ftz(ieee.ftz(s * amax) * jnp.float32(NVFP4_DECODE_FACTOR))

    @_compiled("dtype")
    def dequantize(self, dtype=F32) -> jax.Array:
        """TE's dequantize, bit for bit: e2m1(q) * block_decode_factor() in float32, then cast to dtype."""
        e = _blocks(e2m1_decode(self.codes), NVFP4_BLOCK)  # [..., K/16, 16]
        return ieee.ftz(e * self.block_decode_factor()[..., None]).reshape(self.shape).astype(dtype)


@struct.dataclass
class NVFP4Int8Tensor:
    """NVFP4 stored one code per byte as the signed integer 2 * e2m1 (-12..12), with NVFP4Tensor's E4M3 `scale`
    [..., K/16], `amax` and `scaling`: the same numbers in a layout a GPU GEMM fusion reads as an s8 operand
    (converted and scaled in its prologue) instead of unpacking nibbles, at twice the packed bytes (still half of
    bf16). codes * (s / 2) = e2m1 * s exactly in bfloat16, so every GEMM path gives NVFP4Tensor's results. An int8
    has no -0: E2M1's negative zero (code 8) is stored as 0, so a dequantized zero is +0 where NVFP4Tensor's is -0
    (the same value; no GEMM sum changes).
    """

    codes: jax.Array
    scale: jax.Array
    amax: jax.Array
    scaling: str = struct.field(pytree_node=False, default="tensor")

    @classmethod
    def from_nvfp4(cls, q: "NVFP4Tensor") -> "NVFP4Int8Tensor":
        """The same tensor with its packed codes as 2 * e2m1 int8 values (exact)."""
        two_e = (e2m1_decode(q.codes) * jnp.float32(2.0)).astype(jnp.int8)
        return cls(codes=two_e, scale=q.scale, amax=q.amax, scaling=q.scaling)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def decoded_scale(self) -> jax.Array:
        """The E4M3 block scales as float32 [..., K/16] (e4m3_scale_values)."""
        return e4m3_scale_values(self.scale)

    def global_decode_scale(self) -> jax.Array:
        """amax * f32(1/2688) (1 where amax == 0): the GEMM's output factor, as NVFP4Tensor's."""
        return nvfp4_decode_factor(self.amax)

    def block_values(self) -> jax.Array:
        """(2 e2m1) * (s / 2) = e2m1 * s [..., K] in bfloat16, exact: 2 e2m1 (-12..12) and s / 2 (an E4M3 value
        halved, >= 2^-10) are bf16 values and their product has at most 6 significant bits. In bf16 so that XLA:GPU
        can fuse the decode into its GEMM (its subchannel-dequantisation fusion takes a bf16 multiply of a converted
        s8 operand by broadcast scales, not a float32 one; experiments/bench_gpu.py's w4a16_int8sc)."""
        half = (self.decoded_scale().astype(jnp.bfloat16) * jnp.bfloat16(0.5))[..., None]
        return (_blocks(self.codes.astype(jnp.bfloat16), NVFP4_BLOCK) * half).reshape(self.shape)

    def block_values_t(self) -> jax.Array:
        """block_values() transposed, [..., K, N] (the GEMM's K-major weight operand)."""
        return jnp.swapaxes(self.block_values(), -1, -2)

    @_compiled("dtype")
    def dequantize(self, dtype=F32) -> jax.Array:
        """TE's dequantize order (NVFP4Tensor.dequantize): e2m1 * ((float(s) * amax) * f32(1/2688))."""
        e = _blocks(self.codes.astype(F32) * jnp.float32(0.5), NVFP4_BLOCK)
        s = self.decoded_scale()
        amax = self.amax.astype(F32)
        if self.scaling != "row":
            amax = _bcast_factor(amax, s.ndim)
        final = ieee.ftz(ieee.ftz(s * amax) * jnp.float32(NVFP4_DECODE_FACTOR))
        return ieee.ftz(e * final[..., None]).reshape(self.shape).astype(dtype)


@struct.dataclass
class MXFP8Tensor:
    """MXFP8 tensor: E4M3 `data` (x's shape), E8M0 power-of-two `scale` [..., K/32]."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @_compiled("dtype")
    def dequantize(self, dtype=F32) -> jax.Array:
        q = _blocks(self.data.astype(F32), MXFP8_BLOCK)
        s = ieee.ftz(self.scale.astype(F32))[..., None]  # code 0 is the subnormal 2^-127
        return ieee.ftz(q * s).reshape(self.data.shape).astype(dtype)


@struct.dataclass
class FP8Tensor:
    """Per-tensor FP8: E4M3 `data` and a float32 `scale` (x = data * scale)."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @_compiled("dtype")
    def dequantize(self, dtype=F32) -> jax.Array:
        s = _bcast_factor(ieee.ftz(self.scale.astype(F32)), self.data.ndim)
        return ieee.ftz(self.data.astype(F32) * s).astype(dtype)


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 (OCP MX v1.0): E2M1 elements, one E8M0 shared exponent per 32 elements, no tensor-level factor.


def _mxfp4_exponent(amax: jax.Array, rounding: str) -> jax.Array:
    """Biased E8M0 exponent (uint32 in [0, 255]) of blocks with float32 amax >= 0, in integer arithmetic (exact).

    "floor" (OCP): X = floor(log2 amax) - 2, the E2M1 emax. "rceil": the smallest X with 2^X >= amax / 6, i.e. with
    amax = m * 2^E (m in [1, 2)), X = E - 2 when m <= 1.5 and E - 1 otherwise (6 * 2^X is exact, so no rounded
    division decides it). Both clamp to the E8M0 range [-127, 127]; a zero block (and one whose amax is a float32
    subnormal) lands on code 0, i.e. 2^-127; an infinite amax gives code 255 (NaN scale), as for MXFP8.
    """
    bits = jax.lax.bitcast_convert_type(amax.astype(F32), jnp.uint32)
    exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
    e = exp - 2
    if rounding == "rceil":
        e = e + ((bits & 0x7FFFFF) > 0x400000).astype(jnp.int32)
    e = jnp.where(exp == 0, 0, jnp.clip(e, 0, 254))
    return jnp.where(exp == 255, 255, e).astype(jnp.uint32)


def _pow2_biased(e: jax.Array) -> jax.Array:
    """Exactly 2^(e - 127) in float32 for a biased E8M0 exponent e (code 0 is the subnormal 2^-127; 255 -> NaN)."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e == 0, jnp.uint32(0x400000), e << 23)
    return jnp.where(e == 255, jnp.float32(jnp.nan), jax.lax.bitcast_convert_type(bits, F32))


def e8m0_scale_values(scale: jax.Array) -> jax.Array:
    """2^(e - 127) in float32 for E8M0 scales (float8_e8m0fnu; code 0 the subnormal 2^-127, 255 NaN): on the CPU
    in integer arithmetic (_pow2_biased), elsewhere by the float8 convert (the same bits). XLA:GPU fuses the
    convert into the kernel that decodes a weight's values; the integer form (and a flush of its result) made
    the float32 scales a kernel of their own per weight and step (0.6B w4a16_mx decode: 5 launches a layer)."""
    return jax.lax.platform_dependent(
        scale, cpu=lambda s: _pow2_biased(jax.lax.bitcast_convert_type(s, jnp.uint8)),
        default=lambda s: s.astype(F32))


def _check_rounding(rounding: str, what: str) -> None:
    if rounding not in ("floor", "rceil"):
        raise ValueError(f"{what}: unknown rounding {rounding!r}; expected 'floor' or 'rceil'")


def mxfp4_encode_blocks(xb: jax.Array, rounding: str = "floor") -> tuple[jax.Array, jax.Array]:
    """The per-block MXFP4 core: blocks [..., nb, 32] float32 -> (uint8 E2M1 codes [..., nb, 32], exponent u8 [..., nb])."""
    e = _mxfp4_exponent(jnp.max(_nan_to_zero_abs(xb), axis=-1), rounding)
    return e2m1_rne_codes(xb * _pow2_neg_biased(e)[..., None]), e.astype(jnp.uint8)


@struct.dataclass
class MXFP4Tensor(PackedFP4):
    """MXFP4 tensor (OCP MX v1.0): packed E2M1 codes (uint8 [..., K/2], packed like NVFP4Tensor) and E8M0 `scale`
    [..., K/32] (float8_e8m0fnu; bitcast to uint8 for the biased exponents). No tensor-level factor: the value of
    element j of block b is e2m1(q_j) * 2^(scale_b - 127). `rounding` records the shared-exponent rule used."""

    packed: jax.Array
    scale: jax.Array
    rounding: str = struct.field(pytree_node=False, default="floor")

    @classmethod
    def from_data(cls, data: jax.Array, scale: jax.Array, rounding: str = "floor") -> "MXFP4Tensor":
        return cls(packed=pack_fp4(data), scale=scale, rounding=rounding)

    @property
    def exponents(self) -> jax.Array:
        """The biased E8M0 exponents as uint8 [..., K/32]."""
        return jax.lax.bitcast_convert_type(self.scale, jnp.uint8)

    def decoded_scale(self) -> jax.Array:
        """The block scales 2^(e - 127) as float32 [..., K/32] (code 0 the subnormal 2^-127; 255 -> NaN)."""
        return e8m0_scale_values(self.scale)

    def block_values(self) -> jax.Array:
        """e2m1(q) * 2^(e - 127) in float32 [..., K]: the exact values (exactly representable in bfloat16). Each
        nibble plane of the packed bytes is decoded and scaled, and the values interleaved (as NVFP4Tensor's): no
        uint8 array of unpacked codes between (on XLA:GPU a kernel of its own per weight and step)."""
        *lead, half = self.packed.shape
        p = self.packed.reshape(*lead, half * 2 // MXFP4_BLOCK, MXFP4_BLOCK // 2)
        # Code 0's scale, the subnormal 2^-127, counts as 0 (XLA:CPU flushes it). Zeroing its products instead of
        # flushing the scale keeps the scale a bare float8 convert, which XLA:GPU fuses into the GEMM's operand
        # (a flushed scale was a kernel of its own for some weights: 0.6B w4a16_mx decode, 2 launches a layer).
        s = e8m0_scale_values(self.scale)[..., None]
        zero = (self.exponents == 0)[..., None]

        def values(codes):
            v = e2m1_decode(codes) * s
            return ieee.ftz(jnp.where(zero, v * jnp.float32(0.0), v))

        lo, hi = values(p & 0xF), values(p >> 4)  # [..., nb, 16]
        return jnp.stack([lo, hi], axis=-1).reshape(*lead, half * 2)

    def block_values_t(self) -> jax.Array:
        """block_values() transposed, [..., K, N] (the GEMM's K-major weight operand)."""
        return jnp.swapaxes(self.block_values(), -1, -2)

    @_compiled("dtype")
    def dequantize(self, dtype=F32) -> jax.Array:
        return self.block_values().astype(dtype)


def _mxfp4_check(x, rounding: str, what: str) -> jax.Array:
    _check_rounding(rounding, what)
    _check_input(x, MXFP4_BLOCK, what)
    return _as_input(x)


@_compiled("rounding", "name", "debug")
def quantize_mxfp4(x: jax.Array, rounding: str = "floor", *, name: str = "", debug: bool | str = False) -> MXFP4Tensor:
    """MXFP4-quantize x[..., K] along its last axis (OCP MX v1.0; blocks of 32, E8M0 shared exponents).

    rounding="floor" (the OCP rule): shared exponent X = floor(log2 amax) - 2, so block elements above 6 * 2^X
    saturate to +-6; "rceil": X = the smallest exponent with 2^X >= amax / 6 (nothing saturates). Elements
    x * 2^-X are rounded to nearest even on the E2M1 grid (NaN -> +6, as NVFP4). A zero block gets scale code 0
    (2^-127) and zero codes. K must be a multiple of 32 (the error names the shape).
    """
    x = _mxfp4_check(x, rounding, "quantize_mxfp4")
    report_nonfinite(x, "quantize_mxfp4", name, debug)
    codes, e = mxfp4_encode_blocks(_blocks(x, MXFP4_BLOCK), rounding)
    return MXFP4Tensor(packed=pack_codes(codes.reshape(x.shape)),
                       scale=jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu), rounding=rounding)


def _mxfp4_kn_codes(w: jax.Array, rounding: str, what: str) -> tuple[jax.Array, jax.Array]:
    """Blocks of 32 down the columns of w[..., K, N]: (E2M1 codes [..., K, N], exponents uint32 [..., K/32, N])."""
    _check_rounding(rounding, what)
    _check_input(jnp.swapaxes(w, -1, -2), MXFP4_BLOCK, f"{what} (w^T)", min_rank=2)
    *lead, k, n = w.shape
    wb = _as_input(w).reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK, n)
    e = _mxfp4_exponent(jnp.max(_nan_to_zero_abs(wb), axis=-2), rounding)
    return e2m1_rne_codes(wb * _pow2_neg_biased(e)[..., None, :]).reshape(w.shape), e


@_compiled("rounding")
def quantize_mxfp4_kn(w: jax.Array, rounding: str = "floor") -> MXFP4Tensor:
    """MXFP4 of w^T for a weight w[..., K, N]: bit-identical to quantize_mxfp4(swapaxes(w, -1, -2), rounding)."""
    codes, e = _mxfp4_kn_codes(w, rounding, "quantize_mxfp4_kn")
    *lead, k, n = w.shape
    pairs = codes.reshape(*lead, k // 2, 2, n)
    packed = pairs[..., 0, :] | (pairs[..., 1, :] << 4)  # [..., K/2, N]
    scale = jax.lax.bitcast_convert_type(e.astype(jnp.uint8), jnp.float8_e8m0fnu)
    return MXFP4Tensor(packed=jnp.swapaxes(packed, -1, -2), scale=jnp.swapaxes(scale, -1, -2), rounding=rounding)


@_compiled("rounding")
def mxfp4_fake_quant(x: jax.Array, rounding: str = "floor") -> jax.Array:
    """quantize_mxfp4(x, rounding).block_values() computed elementwise, without packing (the on-the-fly operand)."""
    x = _mxfp4_check(x, rounding, "mxfp4_fake_quant")
    xb = _blocks(x, MXFP4_BLOCK)
    e = _mxfp4_exponent(jnp.max(_nan_to_zero_abs(xb), axis=-1), rounding)
    v = ieee.ftz(_e2m1_rne_values(xb * _pow2_neg_biased(e)[..., None]) * ieee.ftz(_pow2_biased(e))[..., None])
    return v.reshape(x.shape)


@_compiled("rounding")
def mxfp4_fake_quant_kn(w: jax.Array, rounding: str = "floor") -> jax.Array:
    """mxfp4_fake_quant of w^T for w[..., K, N], returned in w's [..., K, N] layout (as quantize_mxfp4_kn)."""
    _check_rounding(rounding, "mxfp4_fake_quant_kn")
    _check_input(jnp.swapaxes(w, -1, -2), MXFP4_BLOCK, "mxfp4_fake_quant_kn (w^T)", min_rank=2)
    *lead, k, n = w.shape
    wb = _as_input(w).reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK, n)
    e = _mxfp4_exponent(jnp.max(_nan_to_zero_abs(wb), axis=-2), rounding)[..., None, :]
    return ieee.ftz(_e2m1_rne_values(wb * _pow2_neg_biased(e)) * ieee.ftz(_pow2_biased(e))).reshape(w.shape)


def nvfp4_global_scale(amax: jax.Array) -> jax.Array:
    """Encode scale S = min(2688 / amax, FLT_MAX), with S = 1 where amax == 0 or S == 0 (IEEE division: ieee.div).
    amax is no subnormal (stored flushed), so the quotient is 0, Inf or >= 2688 / FLT_MAX ~ 7.9e-36: a normal, the
    division's promise (ieee.div). A NaN amax (only a given one can be) gives backend-dependent bits, as any
    float arithmetic on a NaN does (x86 keeps its payload, NVIDIA GPUs return 0x7FFFFFFF)."""
    amax = amax.astype(F32)
    s = jnp.minimum(ieee.div(jnp.float32(NVFP4_RANGE), amax, flushed=True, normal=True), FLT_MAX)
    return jnp.where((amax == 0) | (s == 0), jnp.float32(1.0), s)


def nvfp4_global_scales(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(encode scale S, S_dec = 1 / S): the tensor-level factors every NVFP4 quantizer derives from amax. S is a
    normal (or 1); S_dec is flushed to 0 where 1 / S is a subnormal (S > 2^126: amax < ~3e-35)."""
    s_enc = nvfp4_global_scale(amax)
    return s_enc, ieee.recip(s_enc, flushed=True)


def nvfp4_block_scales(ba: jax.Array, s_enc: jax.Array, s_dec: jax.Array, recip=None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(E4M3 block scale as float32, its code, element multiplier inv) from block amaxes ba, in TE's order:
    s = e4m3(min(ba * (S * (1/6)), 448)) (TE folds 1/6 into S first), inv = min(1 / (s * S_dec), FLT_MAX).
    `recip` (default ieee.recip) is the reciprocal; a kernel body passes a platform-free one (ieee.div_flushed).
    s * S_dec may underflow (flushed: inv = FLT_MAX), but never exceeds 448 / fl(2688 / FLT_MAX) ~ 5.7e37 < 2^126,
    so 1 / (s * S_dec) is Inf or a normal: the default reciprocal's promise (ieee.div)."""
    scale_f32, code = e4m3_round_nonneg(jnp.minimum(ba * (s_enc * jnp.float32(1.0 / 6.0)), E4M3_MAX))
    product = scale_f32 * s_dec
    inv = ieee.recip(product, normal=True) if recip is None else recip(product)
    return scale_f32, code, jnp.minimum(inv, FLT_MAX)


def nvfp4_decode_factor(amax: jax.Array) -> jax.Array:
    """The decode factor amax / 2688 as XLA computes it in a compiled program: amax * f32(1/2688) (a division by a
    constant is compiled as a multiplication by its float32 reciprocal, an ulp off the true quotient for ~1/4 of
    inputs); written out, eager and compiled calls agree. 1 where amax == 0."""
    amax = jnp.asarray(amax).astype(F32)
    return jnp.where(amax == 0, jnp.float32(1.0), ieee.ftz(amax * jnp.float32(NVFP4_DECODE_FACTOR)))


def nvfp4_block_amax(x: jax.Array, scaling: Scaling) -> jax.Array:
    """Per-16-block amax [..., K/16]; for 2D tiles the amax of each 16x16 tile, repeated over its 16 rows."""
    ba = jnp.max(_blocks(_nan_to_zero_abs(x), NVFP4_BLOCK), axis=-1)
    if scaling != "tile2d":
        return ba
    m = x.shape[-2]
    tiles = ba.reshape(*ba.shape[:-2], m // NVFP4_BLOCK, NVFP4_BLOCK, ba.shape[-1])
    return jnp.broadcast_to(jnp.max(tiles, axis=-2, keepdims=True), tiles.shape).reshape(ba.shape)


def amax_from_blocks(ba: jax.Array, scaling: Scaling) -> jax.Array:
    """The global amax from the block amaxes (one pass over x fewer than reducing x again)."""
    # max(ba, 0) == ba; it stops XLA from merging the two reductions into one over |x|, which would then
    # materialize |x| in float32 for its two consumers.
    ba = jnp.maximum(ba, jnp.float32(0.0))
    amax = jnp.max(ba, axis=-1, keepdims=True) if scaling == "row" else jnp.max(ba)
    # On a CPU the max of subnormals (all counting as zero) can be any of them; the stored amax is then 0.
    # Elsewhere the quantizers' inputs are flushed already (ieee.ftz_int), so their max is no subnormal.
    return jax.lax.platform_dependent(amax, cpu=ieee.flush_subnormals, default=lambda v: v)


# Below this many elements, nvfp4_fake_quant on a GPU takes its block amaxes from strided slices (see
# _fake_quant_amaxes): one fused kernel fewer per quantized activation, one more read of x. A decode step's
# activations (rows = slots) are launch-bound there; the learner's are bandwidth-bound.
SLICED_AMAX_MAX_ELEMENTS = 1 << 21


def _block_amax_by_slices(x: jax.Array) -> jax.Array:
    """nvfp4_block_amax(x, "row" or "tensor") as a tree of elementwise maxima over the 16 strided slices of x
    (slice i: element i of every block): no reduce, so XLA fuses it into the block scales' loop fusion (max is
    exact: the same bits). Slices of x itself, not of its [..., K/16, 16] blocks: no reshape per slice, and the 4B
    W4A4 decode round compiles ~4% faster for an H200 (the same kernels)."""
    a = _nan_to_zero_abs(x)
    parts = [a[..., i::NVFP4_BLOCK] for i in range(NVFP4_BLOCK)]
    while len(parts) > 1:
        parts = [jnp.maximum(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0]


def _amaxes_reduced(x: jax.Array, scaling: Scaling, amax: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(block amax, global amax): the block amaxes by a reduce, the global one from them (or the given amax)."""
    ba = nvfp4_block_amax(x, scaling)
    return ba, amax_from_blocks(ba, scaling) if amax is None else amax


def _amaxes_sliced(x: jax.Array, scaling: Scaling, amax: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """_amaxes_reduced's bits ("row" / "tensor"), the global amax reduced from |x| itself and the block amaxes by
    slices (_block_amax_by_slices)."""
    if amax is None:
        amax = amax_from_blocks(_nan_to_zero_abs(x), scaling)  # |x| as blocks of one: the same reduce and flush
    return _block_amax_by_slices(x), amax


def _fake_quant_amaxes(x: jax.Array, scaling: Scaling, amax: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(block amax, global amax) for nvfp4_fake_quant: on a CPU, and for tile2d or large x, _amaxes_reduced; on
    other platforms, for x up to SLICED_AMAX_MAX_ELEMENTS, _amaxes_sliced, which XLA:GPU computes with the block
    scales in 3 kernels per activation instead of 4 (block amax, global amax, block scales, values); on a CPU it
    takes twice the time."""
    if scaling == "tile2d" or x.size > SLICED_AMAX_MAX_ELEMENTS:
        return _amaxes_reduced(x, scaling, amax)
    return jax.lax.platform_dependent(x, cpu=lambda v: _amaxes_reduced(v, scaling, amax),
                                      default=lambda v: _amaxes_sliced(v, scaling, amax))


def nvfp4_encode_blocks(
    xb: jax.Array, ba: jax.Array, s_enc: jax.Array, s_dec: jax.Array, sr_key: jax.Array | None = None, recip=None
) -> tuple[jax.Array, jax.Array]:
    """The per-block core shared by every NVFP4 backend: blocks [..., nb, 16] -> (packed codes, E4M3 scales).

    ba: block amax [..., nb]; s_enc, s_dec: global encode / decode scales broadcastable to ba; recip: see
    nvfp4_block_scales.
    """
    _, code, inv = nvfp4_block_scales(ba, s_enc, s_dec, recip)
    scale = jax.lax.bitcast_convert_type(code, jnp.float8_e4m3fn)
    # Even and odd elements are rounded apart and or-ed into bytes: XLA:CPU vectorizes this form (the
    # reshape-to-pairs form runs ~15x slower).
    y_even, y_odd = xb[..., 0::2] * inv[..., None], xb[..., 1::2] * inv[..., None]
    if sr_key is None:
        lo, hi = e2m1_rne_codes(y_even), e2m1_rne_codes(y_odd)
    else:
        k_even, k_odd = jax.random.split(sr_key)
        lo, hi = e2m1_sr_codes(y_even, k_even), e2m1_sr_codes(y_odd, k_odd)
    return (lo | (hi << 4)).reshape(*xb.shape[:-2], xb.shape[-2] * (NVFP4_BLOCK // 2)), scale


def nvfp4_prepare(
    x: jax.Array, scaling: Scaling = "tensor", amax: jax.Array | float | None = None, what: str = "quantize_nvfp4"
) -> tuple[jax.Array, jax.Array]:
    """Validate x and scaling, and return (x as float32, the given amax checked against the scaling, or None)."""
    if scaling not in ("tensor", "row", "tile2d"):
        raise ValueError(f"{what}: unknown scaling {scaling!r}; expected 'tensor', 'row' or 'tile2d'")
    _check_input(x, NVFP4_BLOCK, what, min_rank=2 if scaling == "tile2d" else 1)
    if scaling == "tile2d" and x.shape[-2] % NVFP4_BLOCK:
        raise ValueError(
            f"{what}(scaling='tile2d'): second-to-last dim of shape {x.shape} is {x.shape[-2]}, "
            f"not a multiple of {NVFP4_BLOCK}"
        )
    x = _as_input(x)
    if amax is None:
        return x, None
    amax = ieee.flush_subnormals(jnp.asarray(amax, F32))
    want = x.shape[:-1] + (1,) if scaling == "row" else ()
    if scaling == "row" and amax.ndim == 0:
        amax = jnp.broadcast_to(amax, want)
    if amax.shape != want:
        raise ValueError(f"{what}: amax of shape {amax.shape} for input {x.shape}; expected {want}")
    return x, amax


@_compiled("scaling", "name", "debug")
def quantize_nvfp4(
    x: jax.Array,
    *,
    scaling: Scaling = "tensor",
    amax: jax.Array | float | None = None,
    sr_key: jax.Array | None = None,
    name: str = "",
    debug: bool | str = False,
) -> NVFP4Tensor:
    """NVFP4-quantize x[..., K] along its last axis (blocks of 16), TE semantics.

    scaling: "tensor" (one global amax), "row" (one amax per row: token-wise) or "tile2d" (16x16 weight tiles
    share a block scale, so W and W^T quantize alike). `amax` reuses a given global amax (scalar, or [..., 1] for
    "row"). `sr_key` switches the E2M1 cast to stochastic rounding (the gradient path). `debug` ("raise" / "log"; see
    quant/debug.py) checks x for NaN/Inf at run time; `name` labels that report.
    """
    x, amax = nvfp4_prepare(x, scaling, amax)
    report_nonfinite(x, "quantize_nvfp4", name, debug)
    ba = nvfp4_block_amax(x, scaling)
    if amax is None:
        amax = amax_from_blocks(ba, scaling)
    s_enc, s_dec = nvfp4_global_scales(amax)  # "row": [..., 1], broadcast over the row's blocks
    packed, scale = nvfp4_encode_blocks(_blocks(x, NVFP4_BLOCK), ba, s_enc, s_dec, sr_key)
    return NVFP4Tensor(packed=packed, scale=scale, amax=amax, scaling=scaling)


def _nvfp4_kn_block_scales(w: jax.Array, scaling: Scaling, what: str, name: str = "", debug: bool | str = False):
    """The scale stage shared by the K-major weight quantizers: blocks of 16 down the columns of w[..., K, N].

    Returns (w as [..., K/16, 16, N] float32, global amax, the element multiplier [..., K/16, 1, N], and the E4M3
    block scales as float32 values and as codes [..., K/16, N]), computed in TE's order (see quantize_nvfp4).
    """
    if scaling not in ("tensor", "tile2d"):
        raise ValueError(f"{what}: scaling {scaling!r}; weights use 'tensor' or 'tile2d'")
    _check_input(jnp.swapaxes(w, -1, -2), NVFP4_BLOCK, f"{what} (w^T)", min_rank=2)
    if scaling == "tile2d" and w.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"{what}(scaling='tile2d'): N of shape {w.shape} is not a multiple of 16")
    w = _as_input(w)
    report_nonfinite(w, "quantize_nvfp4", name, debug)
    *lead, k, n = w.shape
    nb = k // NVFP4_BLOCK
    wb = w.reshape(*lead, nb, NVFP4_BLOCK, n)
    ba = jnp.max(_nan_to_zero_abs(wb), axis=-2)  # [..., K/16, N]
    if scaling == "tile2d":
        t = ba.reshape(*lead, nb, n // NVFP4_BLOCK, NVFP4_BLOCK)
        ba = jnp.broadcast_to(jnp.max(t, axis=-1, keepdims=True), t.shape).reshape(ba.shape)
    amax = amax_from_blocks(ba, "tensor")
    scale_f32, code, inv = nvfp4_block_scales(ba, *nvfp4_global_scales(amax))
    return wb, amax, inv[..., None, :], scale_f32, code


@_compiled("scaling", "name", "debug")
def quantize_nvfp4_kn(
    w: jax.Array, *, scaling: Scaling = "tensor", name: str = "", debug: bool | str = False
) -> NVFP4Tensor:
    """NVFP4 of w^T for a weight w[..., K, N] stored K-major: bit-identical to quantize_nvfp4(swapaxes(w, -1, -2)).

    The blocks run down the columns of w, so the float input is read in its own layout and only the small uint8
    outputs are transposed (XLA:CPU reads a transposed float input many times slower).
    """
    wb, amax, inv, _, code = _nvfp4_kn_block_scales(w, scaling, "quantize_nvfp4_kn", name, debug)
    scale = jax.lax.bitcast_convert_type(code, jnp.float8_e4m3fn)
    lo = e2m1_rne_codes(wb[..., 0::2, :] * inv)
    hi = e2m1_rne_codes(wb[..., 1::2, :] * inv)
    *lead, k, n = w.shape
    packed = (lo | (hi << 4)).reshape(*lead, k // 2, n)
    return NVFP4Tensor(
        packed=jnp.swapaxes(packed, -1, -2), scale=jnp.swapaxes(scale, -1, -2), amax=amax, scaling=scaling
    )


@_compiled("name", "debug")
def quantize_mxfp8_kn(w: jax.Array, *, name: str = "", debug: bool | str = False) -> MXFP8Tensor:
    """MXFP8 of w^T for a weight w[..., K, N]: bit-identical to quantize_mxfp8(swapaxes(w, -1, -2))."""
    _check_input(jnp.swapaxes(w, -1, -2), MXFP8_BLOCK, "quantize_mxfp8_kn (w^T)", min_rank=2)
    w = _as_input(w)
    report_nonfinite(w, "quantize_mxfp8", name, debug)
    *lead, k, n = w.shape
    wb = w.reshape(*lead, k // MXFP8_BLOCK, MXFP8_BLOCK, n)
    amax = jnp.max(_nan_to_zero_abs(wb), axis=-2)
    e = _e8m0_rceil(ieee.ftz(amax * jnp.float32(1.0 / E4M3_MAX)))
    q = e4m3_cast(wb * _pow2_neg_biased(e)[..., None, :]).reshape(*lead, k, n)
    scale = jax.lax.bitcast_convert_type(e.astype(jnp.uint8), jnp.float8_e8m0fnu)
    return MXFP8Tensor(data=jnp.swapaxes(q, -1, -2), scale=jnp.swapaxes(scale, -1, -2))


def _e2m1_rne_values(y: jax.Array) -> jax.Array:
    """The float32 value of the saturating RNE E2M1 cast of y (the codes' values, without packing them)."""
    y = _e2m1_saturate(y)
    a = jnp.abs(y)
    inv_step, _ = _e2m1_binade(a)
    step = jnp.where(a >= 4.0, jnp.float32(2.0), jnp.where(a >= 2.0, jnp.float32(1.0), jnp.float32(0.5)))
    return jnp.copysign(jnp.round(a * inv_step) * step, y)  # powers of two: exact (no division, see ieee.py)


@_compiled("scaling")
def nvfp4_fake_quant(
    x: jax.Array, *, scaling: Scaling = "tensor", amax: jax.Array | float | None = None
) -> tuple[jax.Array, jax.Array]:
    """(e2m1(q) * s as float32 [..., K], global decode factor): quantize_nvfp4(x)'s exact block values and factor,
    computed elementwise without packing (the on-the-fly GEMM operand; packed storage is for reuse). The factor is
    the GEMM's (see NVFP4Tensor.global_decode_scale); qdot runs the debug non-finite check on its operands itself."""
    x, amax = nvfp4_prepare(x, scaling, amax, what="nvfp4_fake_quant")
    ba, amax = _fake_quant_amaxes(x, scaling, amax)
    scale_f32, _, inv = nvfp4_block_scales(ba, *nvfp4_global_scales(amax))
    v = _e2m1_rne_values(_blocks(x, NVFP4_BLOCK) * inv[..., None]) * scale_f32[..., None]
    g = nvfp4_decode_factor(amax)
    return v.reshape(x.shape), g


@_compiled("scaling")
def nvfp4_fake_quant_kn(w: jax.Array, *, scaling: Scaling = "tensor") -> tuple[jax.Array, jax.Array]:
    """nvfp4_fake_quant of w^T for w[..., K, N], returned in w's [..., K, N] layout (as quantize_nvfp4_kn)."""
    wb, amax, inv, scale_f32, _ = _nvfp4_kn_block_scales(w, scaling, "nvfp4_fake_quant_kn")
    v = _e2m1_rne_values(wb * inv) * scale_f32[..., None, :]
    g = nvfp4_decode_factor(amax)
    return v.reshape(w.shape), g


def _e8m0_rceil(v: jax.Array) -> jax.Array:
    """Biased E8M0 exponent that rounds v up to a power of two (TE/cuBLAS RCEIL), as uint32 in [0, 255]."""
    bits = jax.lax.bitcast_convert_type(v.astype(F32), jnp.uint32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    round_up = (man != 0) & (exp != 254) & ~((exp == 0) & (man <= 0x400000))
    e = exp + round_up.astype(jnp.uint32)
    return jnp.where(exp == 255, jnp.uint32(255), e)


def _e8m0_floor(amax: jax.Array) -> jax.Array:
    """OCP / torchao FLOOR rule: 2^(floor(log2 amax) - 8), for comparison only (the project uses RCEIL)."""
    exp = ((jax.lax.bitcast_convert_type(amax.astype(F32), jnp.uint32) >> 23) & 0xFF).astype(jnp.int32)
    return jnp.where(exp == 255, 255, jnp.clip(exp - 8, 0, 254)).astype(jnp.uint32)


def _pow2_neg_biased(e: jax.Array) -> jax.Array:
    """Exactly 2^(127 - e) in float32 for a biased exponent e (2^-127 is a float32 subnormal; e = 255 -> NaN)."""
    b = jnp.uint32(254) - jnp.minimum(e, jnp.uint32(254))
    bits = jnp.where(b == 0, jnp.uint32(0x400000), b << 23)
    out = jax.lax.bitcast_convert_type(bits, F32)
    return jnp.where(e == 255, jnp.float32(jnp.nan), out)


def mxfp8_encode_blocks(xb: jax.Array, rounding: str = "rceil", ftz=None) -> tuple[jax.Array, jax.Array]:
    """The per-block MXFP8 core shared by every backend: blocks [..., nb, 32] -> (E4M3 data, biased exponent u8).
    `ftz` (default ieee.ftz) flushes the scaled amax; a kernel body passes ieee.flush_subnormals (no platform branch)."""
    e, factor = mxfp8_block_exponent(jnp.max(_nan_to_zero_abs(xb), axis=-1), rounding, ftz)
    return e4m3_cast(xb * factor[..., None]), e.astype(jnp.uint8)


def mxfp8_block_exponent(amax: jax.Array, rounding: str = "rceil", ftz=None) -> tuple[jax.Array, jax.Array]:
    """(biased E8M0 exponent e as uint32, the element multiplier 2^(127 - e)) of blocks with amax `amax`."""
    ftz = ieee.ftz if ftz is None else ftz
    e = _e8m0_rceil(ftz(amax * jnp.float32(1.0 / E4M3_MAX))) if rounding == "rceil" else _e8m0_floor(amax)
    return e, _pow2_neg_biased(e)


@_compiled("rounding", "name", "debug")
def quantize_mxfp8(
    x: jax.Array, *, rounding: str = "rceil", name: str = "", debug: bool | str = False
) -> MXFP8Tensor:
    """MXFP8-quantize x[..., K] along its last axis (blocks of 32, E8M0 scales, RCEIL rounding).

    rounding="floor" gives the OCP rule, only to compare against (it differs for amax in (448*2^k, 512*2^k)).
    """
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"quantize_mxfp8: unknown rounding {rounding!r}; expected 'rceil' or 'floor'")
    _check_input(x, MXFP8_BLOCK, "quantize_mxfp8")
    x = _as_input(x)
    report_nonfinite(x, "quantize_mxfp8", name, debug)
    q, e = mxfp8_encode_blocks(_blocks(x, MXFP8_BLOCK), rounding)
    scale = jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu)
    return MXFP8Tensor(data=q.reshape(x.shape), scale=scale)


@_compiled("name", "debug")
def quantize_fp8(
    x: jax.Array, scale: jax.Array | float | None = None, *, name: str = "", debug: bool | str = False
) -> FP8Tensor:
    """Per-tensor E4M3 with scale = amax / 448 (or a fixed calibrated scale); used for the KV cache."""
    _check_input(x, 1, "quantize_fp8")
    x = _as_input(x)
    report_nonfinite(x, "quantize_fp8", name, debug)
    if scale is None:
        amax = jnp.max(_nan_to_zero_abs(x))
        scale = jnp.where(amax == 0, jnp.float32(1.0), ieee.ftz(amax * jnp.float32(1.0 / E4M3_MAX)))  # as compiled
    scale = jnp.asarray(scale, F32)
    return FP8Tensor(data=e4m3_cast(ieee.div(x, scale)), scale=scale)  # IEEE division on every backend


def pack_fp4(data: jax.Array) -> jax.Array:
    """Pack E2M1 codes two per byte: element 2i in bits 0-3, element 2i+1 in bits 4-7 -> uint8 [..., K/2]."""
    if getattr(data, "dtype", None) != jnp.float4_e2m1fn:
        raise TypeError(f"pack_fp4: expected float4_e2m1fn data, got {getattr(data, 'dtype', type(data))}")
    if data.ndim < 1 or data.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim of shape {data.shape} must be even")
    return pack_codes(fp4_to_codes(data))


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Inverse of pack_fp4: uint8 [..., K/2] -> float4_e2m1fn [..., K]."""
    if getattr(packed, "dtype", None) != jnp.uint8:
        raise TypeError(f"unpack_fp4: expected uint8, got {getattr(packed, 'dtype', type(packed))}")
    return codes_to_fp4(unpack_codes(packed))


def e2m1_codes(data: jax.Array) -> jax.Array:
    """The 4-bit E2M1 codes (sign << 3 | magnitude index) of float4 data, as uint8 (for tests and checkpoints)."""
    if getattr(data, "dtype", None) != jnp.float4_e2m1fn:
        raise TypeError(f"e2m1_codes: expected float4_e2m1fn data, got {getattr(data, 'dtype', type(data))}")
    return fp4_to_codes(data)


def _rht_signs(sign_seed: int) -> np.ndarray:
    """The fixed +-1 vector s of the random Hadamard transform (numpy's generator: the same on every backend)."""
    return np.where(np.random.default_rng(sign_seed).random(16) < 0.5, -1.0, 1.0).astype(np.float32)


def hadamard16(sign_seed: int = 0) -> jax.Array:
    """The 16-point random Hadamard transform H = diag(s) * H16 / 4 (orthogonal), s a fixed +-1 vector."""
    h = np.array([[1.0]], np.float32)
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return jnp.asarray(_rht_signs(sign_seed)[:, None] * h / 4.0)


def rht16(x: jax.Array, axis: int = -1, sign_seed: int = 0) -> jax.Array:
    """Apply H (hadamard16) to each 16-block along `axis`. Applied to both wgrad operands it cancels (H^T H = I).

    Computed as a fast Walsh-Hadamard transform, four butterfly stages (a, b) -> (a + b, a - b) at strides 8, 4,
    2, 1 (Sylvester's H16), then the exact scaling by s/4: elementwise adds in a fixed order, where a dot would
    sum 16 products in its backend's order (XLA:CPU's and cuBLAS's float32 sums round differently). The input is
    rounded first (ieee.rounded), so no producer's multiply is contracted into the first adds as an FMA, and
    float32 subnormals are flushed at every stage, as XLA:CPU does (ieee.ftz).
    """
    xm = jnp.moveaxis(x, axis, -1)
    _check_input(xm, NVFP4_BLOCK, f"rht16(axis={axis})")
    v = ieee.rounded(_blocks(_as_input(xm), NVFP4_BLOCK))
    lead = v.shape[:-1]
    for h in (8, 4, 2, 1):
        pairs = v.reshape(*lead, NVFP4_BLOCK // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = ieee.ftz(jnp.stack([a + b, a - b], axis=-2).reshape(*lead, NVFP4_BLOCK))  # a cancellation can be tiny
    y = ieee.ftz(v * jnp.asarray(_rht_signs(sign_seed) / 4.0))
    return jnp.moveaxis(y.reshape(xm.shape), -1, axis).astype(x.dtype)
