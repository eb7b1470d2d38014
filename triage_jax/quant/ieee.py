"""Correctly rounded float32 division in integer arithmetic: the same bits on every XLA backend.

XLA:GPU compiles a float32 division to PTX `div.full.f32` (up to 2 ulp off; 14-29% of random quotients differ
from IEEE), TPUs divide through a reciprocal, and every backend's algebraic simplifier turns a division by a
constant into a multiplication by its rounded reciprocal. The quantizers' scale arithmetic divides (TE's kernels
use IEEE division), so `div_rn` computes the IEEE 754 round-to-nearest-even quotient from the operands' bits with
integer operations only, which every backend executes exactly (docs/numerics.md, "GPU"). Subnormal operands and
results are kept (no flush to zero), overflow rounds to infinity, and the special cases are IEEE's; a NaN result is
the canonical quiet NaN (payloads are not propagated). On CUDA `div` divides in float64 instead (`div_wide`): PTX's
`div.rn.f64` is IEEE's, and XLA:GPU compiles it ~3x faster than the integer long division.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

U32 = jnp.uint32
I32 = jnp.int32
_EXP_MASK = 0xFF
_FRAC_MASK = 0x7FFFFF
_HIDDEN = 0x800000
_QNAN = 0x7FC00000
_INF = 0x7F800000


def _unpack(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(bits, biased exponent field, significand normalized to [2^23, 2^24), unbiased exponent of that significand).

    A subnormal's significand is shifted up to the normal range and its exponent lowered to match (zero gives
    garbage here; callers treat it as a special case).
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), U32)
    ef = (bits >> 23) & _EXP_MASK
    frac = bits & _FRAC_MASK
    sub_shift = jax.lax.clz(frac) - U32(8)  # a subnormal's leading one moves to bit 23
    normal = ef != 0
    sig = jnp.where(normal, frac | _HIDDEN, frac << jnp.where(normal, U32(0), sub_shift))
    exp = jnp.where(normal, ef.astype(I32) - 127, -126 - sub_shift.astype(I32))
    return bits, ef, sig, exp


def div_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b in float32, rounded to nearest even exactly as IEEE 754 divides (broadcasting like `a / b`)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    ua, ea, ma, xa = _unpack(a)
    ub, eb, mb, xb = _unpack(b)
    sign = (ua ^ ub) & U32(0x80000000)
    a_nan = (ea == _EXP_MASK) & ((ua & _FRAC_MASK) != 0)
    b_nan = (eb == _EXP_MASK) & ((ub & _FRAC_MASK) != 0)
    a_inf = (ea == _EXP_MASK) & ~a_nan
    b_inf = (eb == _EXP_MASK) & ~b_nan
    a_zero = (ua & U32(0x7FFFFFFF)) == 0
    b_zero = (ub & U32(0x7FFFFFFF)) == 0

    # Significand quotient ma2 / mb in [1, 2): shift ma up once when it is the smaller one.
    lt = ma < mb
    ma2 = jnp.where(lt, ma << 1, ma)  # < 2^25
    exp = xa - xb - lt.astype(I32)  # unbiased exponent of the quotient
    # Q = floor(ma2 * 2^25 / mb) in [2^25, 2^26) by long division, 8 quotient bits per step (the partial
    # remainder stays below mb < 2^24, so r << 8 fits in 32 bits), plus a sticky bit for a non-zero remainder.
    q, r = U32(1), ma2 - mb
    for width in (8, 8, 8, 1):
        r = r << width
        d = r // mb
        q, r = (q << width) | d, r - d * mb
    sticky = r != 0

    # Q's unit is 2^(exp - 25). The result's last place is 2^(exp - 23) when it is normal (shift 2) and 2^-149
    # when it is subnormal (shift -exp - 124 > 2); shifts past 29 leave only rounding bits that cannot round up.
    shift = jnp.clip(-exp - 124, 2, 29).astype(U32)
    mant = q >> shift
    rem = q & ((U32(1) << shift) - 1)
    half = U32(1) << (shift - 1)
    up = (rem > half) | ((rem == half) & (sticky | ((mant & 1) == 1)))
    mant = mant + up.astype(U32)
    # A normal result carries its hidden bit in mant, so the biased exponent field gets exp + 127 - 1 and the
    # hidden bit adds the 1 back (a rounding carry to 2^24 moves it up once more); a subnormal gets field 0, and a
    # carry to 2^23 makes it the smallest normal.
    biased = exp + 127
    field = jnp.maximum(biased - 1, 0)
    overflow = biased >= 255
    body = jnp.where(overflow, U32(_INF), (field.astype(U32) << 23) + mant)
    body = jnp.minimum(body, U32(_INF))  # a carry out of the largest binade rounds to infinity

    nan = a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf)
    inf = (a_inf | b_zero) & ~nan
    zero = (a_zero | b_inf) & ~nan
    out = jnp.where(inf, U32(_INF), jnp.where(zero, U32(0), body)) | sign
    out = jnp.where(nan, U32(_QNAN), out)
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def flush_subnormals(x: jax.Array) -> jax.Array:
    """x with float32 subnormals replaced by zeros of their sign, in integer operations (exact everywhere).

    XLA:CPU runs its programs with denormals flushed (FTZ and DAZ: a subnormal operand counts as zero, a subnormal
    result becomes zero), as TPUs do; XLA:GPU keeps them (IEEE, like Transformer Engine's kernels). The quantizers
    flush explicitly where a subnormal can arise (docs/numerics.md, "GPU"), so all backends agree.
    """
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, U32)
    sub = (bits & U32(0x7F800000)) == 0
    return jax.lax.bitcast_convert_type(jnp.where(sub, bits & U32(0x80000000), bits), jnp.float32)


def flush_small(x: jax.Array) -> jax.Array:
    """flush_subnormals in float operations: |x| < 2^-126 becomes x * 0, the zero of x's sign (IEEE), NaN and
    everything else kept. The same bits (also under a CPU's FTZ / DAZ, which keeps a flushed zero's sign), but no
    bitcasts: XLA:GPU's Triton fusions (a GEMM's or a norm's) take it in, where the integer form stays a kernel of
    its own (the 4B decode step on an H200, deviceless: W4A16 2 launches per layer fewer, W4A4 3)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(jnp.abs(x) < jnp.float32(2.0**-126), x * jnp.float32(0.0), x)


def ftz(x: jax.Array) -> jax.Array:
    """flush_small where the backend keeps subnormals; on XLA:CPU, which flushes every float operation's
    operands and results itself, x unchanged (no extra pass). Use it on the result of a float operation."""
    x = jnp.asarray(x, jnp.float32)
    return jax.lax.platform_dependent(x, cpu=lambda v: v, default=flush_small)


def ftz_int(x: jax.Array) -> jax.Array:
    """ftz with the integer form (flush_subnormals) off the CPU: the same bits, but XLA:GPU keeps it out of its
    Triton fusions. For a quantizer's input: in float form, an RMSNorm -> flush -> |x| -> max chain goes into Triton
    normalization fusions and a W4A4 decode step launches more kernels (0.6B, fp4_gemm: 1,024 against 968)."""
    x = jnp.asarray(x, jnp.float32)
    return jax.lax.platform_dependent(x, cpu=lambda v: v, default=flush_subnormals)


def div_flushed(a: jax.Array, b: jax.Array) -> jax.Array:
    """XLA:CPU's division on any backend: IEEE division of the operands with subnormals flushed, result flushed."""
    return flush_subnormals(div_rn(flush_subnormals(a), flush_subnormals(b)))


# 2^-896: scales every float32 into float64's normal range (the smallest normal float32 2^-126 lands on float64's
# smallest normal 2^-1022) and is no float32, so no compiler can fold it into a float32 operation.
_WIDE_SCALE = 2.0**-896


def _widen(x: jax.Array) -> jax.Array:
    """A flushed float32 (no subnormals) as a float64 times 2^-896: exact (a float64 has more significand and range
    than the product needs), Inf / NaN / zero kept.

    Not plain `astype(float64)`: LLVM rewrites fptrunc(fpext(a) / fpext(b)) to a float32 division (the same value
    when that division is IEEE's), which NVPTX then compiles to `div.full.f32`. It cannot after the scaling: a
    float64 multiply by a constant that has no float32 form is no fpext. Scaling both operands alike leaves the
    quotient, and so its rounding, as it was."""
    with jax.enable_x64(True):
        return x.astype(jnp.float64) * jnp.float64(_WIDE_SCALE)


def div_wide(a: jax.Array, b: jax.Array, *, flushed: bool = False, normal: bool = False) -> jax.Array:
    """div_flushed's bits from one float64 division: the operands flushed and widened (exactly), divided (PTX
    `div.rn.f64`, IEEE on every NVIDIA GPU), the quotient rounded to float32 and flushed.

    Rounding twice, to float64's 53 bits and then to float32's 24, gives the correctly rounded float32 quotient:
    double rounding cannot change a quotient of p-bit operands when the wider format has >= 2p + 2 bits
    (53 >= 50; Figueroa, "When is double rounding innocuous?", 1995), subnormal float32 results included. The
    widened operands are normal float64s (or zero, Inf, NaN), and their quotient is the operands' own, a normal
    float64 where it is finite and not zero, so a backend's FTZ / DAZ for float64 changes nothing. A NaN result is
    the canonical quiet NaN, as div_rn's.

    What the caller knows drops work (see `div`): `flushed`, no operand is a subnormal (no operand flushes);
    `normal`, the quotient is never a float32 subnormal nor NaN (no result flush, no NaN canonicalization)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    if not flushed:
        a, b = flush_subnormals(a), flush_subnormals(b)
    wa, wb = _widen(a), _widen(b)
    with jax.enable_x64(True):
        q = (wa / wb).astype(jnp.float32)
    if normal:
        return q
    q = flush_subnormals(q)
    return jnp.where(jnp.isnan(q), jax.lax.bitcast_convert_type(U32(_QNAN), jnp.float32), q)


def div(a: jax.Array, b: jax.Array, *, flushed: bool = False, normal: bool = False) -> jax.Array:
    """a / b as XLA:CPU divides, on every backend: correctly rounded (IEEE), subnormal operands and results
    flushed to zero. On a CPU that is its own float32 division (LLVM `fdiv` under FTZ/DAZ, ~1.5x faster there than
    div_rn's integer long division); on CUDA div_wide (a float64 division: XLA:GPU spends ~0.1 s of compile on
    each of div_rn's integer long divisions, ~12 per layer of a W4A4 sampler); elsewhere div_rn between flushes.
    One program picks its branch by the platform it is lowered for. Divisors here are data: XLA rewrites only a
    division by a compile-time constant as a multiplication by its reciprocal.

    `flushed` (no operand is a float32 subnormal) and `normal` (the quotient is never a subnormal nor NaN) are the
    caller's promises, which spare CUDA's branch its flushes (each is ops that XLA:GPU's fusion passes cost-model:
    the NVFP4 scale divisions' promises cut a 4B W4A4 decode round's compile by ~15%). A broken promise changes bits
    off the CPU only: tests/test_quant_ieee.py evaluates the GPU branch with IEEE subnormals to hold them."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return jax.lax.platform_dependent(a, b, cpu=jnp.divide, default=div_flushed,
                                      cuda=functools.partial(div_wide, flushed=flushed, normal=normal))


def recip(b: jax.Array, *, flushed: bool = False, normal: bool = False) -> jax.Array:
    """1 / b, as `div` (with its promises)."""
    return div(jnp.float32(1.0), b, flushed=flushed, normal=normal)


def rounded(x: jax.Array) -> jax.Array:
    """x rounded to its dtype where it stands, so that no later add can absorb its last operation as an FMA.

    XLA's CPU and GPU backends contract a multiply feeding an add into a fused multiply-add wherever both land in
    one fusion (one rounding instead of two), and fusions depend on the whole program. copysign(|x|, x) is x for
    every x (NaN, signed zeros), elementwise, and no contraction looks through it (tests/test_exact.py).
    """
    return jnp.copysign(jnp.abs(x), x) if jnp.issubdtype(x.dtype, jnp.floating) else x
