"""Pallas kernels: NVFP4 and MXFP8 quantize, and a fused dequantize-matmul over block-scaled operands.

Importing this module registers the `pallas` quantization backend (`register()`; the registry in
triage_jax/quant/backends.py imports it on its first query). Interpret mode on CPU (the bit-exactness checks).

On a GPU these kernels do not lower yet, and the backend's probe says why. Mosaic GPU (the maintained Pallas GPU
lowering, the one with Hopper's wgmma and TMA; Triton's is deprecated in JAX 0.11 and, at jax 0.10.2, fails on a
bitcast of a folded constant) reduces only over a whole axis of a register tile (`No support for axes yet` for the
per-16-element block max of an [rows, K] tile), and its TMA copies need 16-byte strides (a [rows, 1] per-row scale
has 4). `tests/test_quant_backends.py::test_pallas_lowers_for_cuda` exports them for CUDA on the CPU and records
the first lowering error, so the state is checked without a GPU. A GPU version lays the blocks out for it: one
16-element block per tile row (the max over the tile's minor axis), the even and odd elements as separate
inputs, the per-row scales as a [rows] vector. The per-block math is the reference's own
(`formats.nvfp4_encode_blocks`, `formats.mxfp8_encode_blocks`), applied to one VMEM/SMEM tile at a time, so the
kernels differ from the reference only in tiling, layout and packing, which is what the tests check. The global
amax is a separate reduction pass before the quantize kernel (as in TE). Float8 outputs leave the kernels as their
uint8 bit patterns and are bitcast outside.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triage_jax.quant import backends as be
from triage_jax.quant import formats as fmt
from triage_jax.quant import ieee

F32 = jnp.float32


def default_interpret() -> bool:
    """Interpret mode everywhere but on a GPU."""
    return jax.default_backend() != "gpu"


def _block(dim: int, target: int, multiple: int) -> int:
    """The largest b <= target with dim % b == 0 and b % multiple == 0; dim itself when it is small or no b fits."""
    if dim <= target:
        return dim
    b = (target // multiple) * multiple
    while b >= multiple:
        if dim % b == 0:
            return b
        b -= multiple
    return dim


def _recip(v):
    """1 / v as the CPU divides (ieee.div's other branch, written out: a kernel body cannot branch by platform)."""
    return ieee.div_flushed(jnp.float32(1.0), v)


def _nvfp4_kernel(x_ref, s_ref, d_ref, packed_ref, scale_ref, *, tile2d: bool):
    x = ieee.flush_subnormals(x_ref[...].astype(F32))
    bm, bk = x.shape
    xb = x.reshape(bm, bk // fmt.NVFP4_BLOCK, fmt.NVFP4_BLOCK)
    ba = jnp.max(jnp.where(jnp.isnan(xb), 0.0, jnp.abs(xb)), axis=-1)
    if tile2d:
        t = ba.reshape(bm // fmt.NVFP4_BLOCK, fmt.NVFP4_BLOCK, ba.shape[-1])
        ba = jnp.broadcast_to(jnp.max(t, axis=1, keepdims=True), t.shape).reshape(ba.shape)
    s_enc, s_dec = s_ref[...], d_ref[...]  # [bm, 1]
    packed, scale = fmt.nvfp4_encode_blocks(xb, ba, s_enc, s_dec, recip=_recip)
    packed_ref[...] = packed
    scale_ref[...] = jax.lax.bitcast_convert_type(scale, jnp.uint8)


def quantize_nvfp4(
    x: jax.Array, *, scaling: str = "tensor", amax=None, interpret: bool | None = None, block_m: int = 64,
    block_k: int = 512,
) -> fmt.NVFP4Tensor:
    """NVFP4 quantize with a Pallas kernel; bit-identical to `formats.quantize_nvfp4` (no stochastic rounding)."""
    x, amax = fmt.nvfp4_prepare(x, scaling, amax, what="pallas quantize_nvfp4")
    lead, k = x.shape[:-1], x.shape[-1]
    if amax is None:
        amax = fmt.amax_from_blocks(fmt.nvfp4_block_amax(x, scaling), scaling)  # the separate amax pass
    s_enc, s_dec = fmt.nvfp4_global_scales(amax)
    x2 = x.reshape(math.prod(lead), k)
    m = x2.shape[0]

    def rows(v):
        return jnp.broadcast_to(v, lead + (1,)).reshape(m, 1) if scaling == "row" else jnp.full((m, 1), v)
    # tile2d: a row tile never splits a 16x16 tile (tiles do not cross the matrices of a batched weight either).
    bm = _block(m, block_m, fmt.NVFP4_BLOCK if scaling == "tile2d" else 8)
    bk = _block(k, block_k, 32 if k % 32 == 0 else fmt.NVFP4_BLOCK)
    packed, scale = pl.pallas_call(
        functools.partial(_nvfp4_kernel, tile2d=scaling == "tile2d"),
        out_shape=(
            jax.ShapeDtypeStruct((m, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((m, k // fmt.NVFP4_BLOCK), jnp.uint8),
        ),
        grid=(m // bm, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, j)), pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((bm, 1), lambda i, j: (i, 0))],
        out_specs=(
            pl.BlockSpec((bm, bk // 2), lambda i, j: (i, j)),
            pl.BlockSpec((bm, bk // fmt.NVFP4_BLOCK), lambda i, j: (i, j)),
        ),
        interpret=default_interpret() if interpret is None else interpret,
        name="nvfp4_quantize",
    )(x2, rows(s_enc), rows(s_dec))
    return fmt.NVFP4Tensor(
        packed=packed.reshape(*lead, k // 2),
        scale=jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn).reshape(*lead, k // fmt.NVFP4_BLOCK),
        amax=amax,
        scaling=scaling,
    )


def _mxfp8_kernel(x_ref, data_ref, scale_ref):
    x = ieee.flush_subnormals(x_ref[...].astype(F32))
    bm, bk = x.shape
    q, e = fmt.mxfp8_encode_blocks(x.reshape(bm, bk // fmt.MXFP8_BLOCK, fmt.MXFP8_BLOCK),
                                   ftz=ieee.flush_subnormals)
    data_ref[...] = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(bm, bk)
    scale_ref[...] = e


def quantize_mxfp8(
    x: jax.Array, *, interpret: bool | None = None, block_m: int = 64, block_k: int = 512
) -> fmt.MXFP8Tensor:
    """MXFP8 (RCEIL) quantize with a Pallas kernel; bit-identical to `formats.quantize_mxfp8`."""
    fmt._check_input(x, fmt.MXFP8_BLOCK, "pallas quantize_mxfp8")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.astype(F32).reshape(math.prod(lead), k)
    m = x2.shape[0]
    bm, bk = _block(m, block_m, 8), _block(k, block_k, fmt.MXFP8_BLOCK)
    data, scale = pl.pallas_call(
        _mxfp8_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, k), jnp.uint8),
            jax.ShapeDtypeStruct((m, k // fmt.MXFP8_BLOCK), jnp.uint8),
        ),
        grid=(m // bm, k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, j))],
        out_specs=(
            pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
            pl.BlockSpec((bm, bk // fmt.MXFP8_BLOCK), lambda i, j: (i, j)),
        ),
        interpret=default_interpret() if interpret is None else interpret,
        name="mxfp8_quantize",
    )(x2)
    return fmt.MXFP8Tensor(
        data=jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn).reshape(*lead, k),
        scale=jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).reshape(*lead, k // fmt.MXFP8_BLOCK),
    )


# --- fused dequantize-matmul -------------------------------------------------------------------------------------
# An operand is (kind, arrays) in [rows, K] layout: "raw" (values), "nvfp4" (packed u8 [R, K/2], E4M3 bytes
# [R, K/16]), "mxfp8" (E4M3 bytes [R, K], E8M0 bytes [R, K/32]), "fp8" (E4M3 bytes [R, K]).


def _operand(q) -> tuple[str, tuple[jax.Array, ...], jax.Array]:
    """(kind, kernel inputs, float32 output factor) of a quantized tensor or a raw [R, K] array."""
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    if isinstance(q, fmt.NVFP4Tensor):
        return "nvfp4", (q.packed, u8(q.scale)), q.global_decode_scale()
    if isinstance(q, fmt.MXFP8Tensor):
        return "mxfp8", (u8(q.data), u8(q.scale)), jnp.float32(1.0)
    if isinstance(q, fmt.FP8Tensor):
        return "fp8", (u8(q.data),), q.scale.astype(F32)
    return "raw", (q,), jnp.float32(1.0)


def _specs(kind: str, rows_block: int, bk: int, row_axis: int) -> list[pl.BlockSpec]:
    def index(i, j, k):
        return ((i, j)[row_axis], k)

    widths = {
        "raw": (bk,), "fp8": (bk,), "nvfp4": (bk // 2, bk // fmt.NVFP4_BLOCK), "mxfp8": (bk, bk // fmt.MXFP8_BLOCK)
    }[kind]
    return [pl.BlockSpec((rows_block, w), index) for w in widths]


def _decode(kind: str, refs) -> jax.Array:
    """Exact block-scaled values of one operand tile, as bfloat16 (exact for every format here)."""
    if kind == "raw":
        return refs[0][...]
    if kind == "fp8":
        return jax.lax.bitcast_convert_type(refs[0][...], jnp.float8_e4m3fn).astype(jnp.bfloat16)
    if kind == "nvfp4":
        p, s = refs[0][...], refs[1][...]
        r = p.shape[0]
        v = jnp.stack([fmt.e2m1_decode(p & 0xF), fmt.e2m1_decode(p >> 4)], axis=-1)
        v = v.reshape(r, s.shape[1], fmt.NVFP4_BLOCK)
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn).astype(F32)
        return (v * s[..., None]).reshape(r, -1).astype(jnp.bfloat16)
    d, s = refs[0][...], refs[1][...]  # mxfp8
    r = d.shape[0]
    v = jax.lax.bitcast_convert_type(d, jnp.float8_e4m3fn).astype(F32).reshape(r, s.shape[1], fmt.MXFP8_BLOCK)
    s = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu).astype(F32)
    return (v * s[..., None]).reshape(r, -1).astype(jnp.bfloat16)


def _matmul_kernel(*refs, lhs_kind: str, rhs_kind: str, n_lhs: int):
    lhs_refs, rhs_refs, out_ref = refs[:n_lhs], refs[n_lhs:-1], refs[-1]

    @pl.when(pl.program_id(2) == 0)
    def _init():
        out_ref[...] = jnp.zeros_like(out_ref)

    a = _decode(lhs_kind, lhs_refs)
    b = _decode(rhs_kind, rhs_refs)
    cdt = jnp.promote_types(a.dtype, b.dtype)
    a, b = a.astype(cdt), b.astype(cdt)
    out_ref[...] += jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def dequant_matmul(
    lhs, rhs, *, interpret: bool | None = None, block_m: int = 128, block_n: int = 128, block_k: int = 512
) -> jax.Array:
    """y[M, N] (float32) = lhs[M, K] . rhs[N, K]^T with each operand dequantized inside the kernel.

    lhs / rhs: NVFP4Tensor, MXFP8Tensor, FP8Tensor or a raw array, 2D in [rows, K] layout. The float32 output
    factors (NVFP4 global decode scales, per-row for token-wise scaling; FP8 scales) are applied to the tile sum,
    as the GEMM's alpha (NVFP4Tensor.global_decode_scale): the tiles hold the exact values e2m1 * s, and this is a
    matmul, not TE's dequantize (that is NVFP4Tensor.dequantize).
    """
    lk, la, lf = _operand(lhs)
    rk, ra, rf = _operand(rhs)
    m, k = lhs.shape
    n = rhs.shape[0]
    if rhs.shape[1] != k or len(lhs.shape) != 2 or len(rhs.shape) != 2:
        raise ValueError(f"dequant_matmul: expected lhs [M, K] and rhs [N, K]; got {lhs.shape} and {rhs.shape}")
    mult = fmt.MXFP8_BLOCK if "mxfp8" in (lk, rk) else fmt.NVFP4_BLOCK  # K tiles hold whole scale blocks
    bm, bn, bk = _block(m, block_m, 8), _block(n, block_n, 8), _block(k, block_k, mult)
    y = pl.pallas_call(
        functools.partial(_matmul_kernel, lhs_kind=lk, rhs_kind=rk, n_lhs=len(la)),
        out_shape=jax.ShapeDtypeStruct((m, n), F32),
        grid=(m // bm, n // bn, k // bk),
        in_specs=_specs(lk, bm, bk, 0) + _specs(rk, bn, bk, 1),
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        interpret=default_interpret() if interpret is None else interpret,
        name="dequant_matmul",
    )(*la, *ra)
    return y * lf * (jnp.reshape(rf, (1, -1)) if jnp.ndim(rf) else rf)  # per-row lhs factor [M, 1], scalars


# --- the backend -------------------------------------------------------------------------------------------------


def _probe() -> tuple[bool, str]:
    x = jnp.linspace(-3.0, 3.0, 8 * 64, dtype=F32).reshape(8, 64)
    a, b = fmt.quantize_nvfp4(x), quantize_nvfp4(x)
    if not bool(jnp.array_equal(a.packed, b.packed)):
        return False, "the Pallas NVFP4 kernel disagrees with the reference on the probe tensor"
    mode = "interpret mode (slow; for checks)" if default_interpret() else "compiled"
    return True, f"Pallas on {jax.default_backend()}, {mode}"


def _quantize(x, fmt_name, scaling="tensor", amax=None):
    if fmt_name == "nvfp4":
        return quantize_nvfp4(x, scaling=scaling, amax=amax)
    if fmt_name == "mxfp8":
        return quantize_mxfp8(x)
    return be.reference_quantize(x, fmt_name, scaling, amax)  # FP8 per-tensor is one multiply: no kernel


# `auto` never picks this backend: no GPU measurement has shown these kernels faster than the xla backend's fused
# quantizers and GEMM (the rule: auto only where measured faster); name it to use it.
BACKEND = be.Backend(
    "pallas", _probe, _quantize, lambda lhs, rhs: dequant_matmul(lhs, rhs), accelerated=lambda: False,
)  # dense forward composed from these; grouped: these quantizers + the reference grouped GEMM


def register() -> None:
    """Register (or re-register) the `pallas` backend."""
    be.register_backend(BACKEND)


register()
