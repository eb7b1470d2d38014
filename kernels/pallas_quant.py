"""Pallas kernels: NVFP4 and MXFP8 quantize, and a fused dequantize-matmul over block-scaled operands.

Importing this module registers the `pallas` quantization backend (`register()`; the registry in
triage_jax/quant/backends.py imports it on its first query). Interpret mode on CPU (the bit-exactness checks),
Mosaic GPU on a GPU.

Lowering: Mosaic GPU, the maintained Pallas GPU lowering (Triton's is deprecated in JAX 0.11 and does not lower
`round`), with its Lane semantics named (kernels/mosaic.py: they do not lower under Warpgroup, jax 0.11's default).
The quantize kernels are written for what it lowers: its reductions run over a whole register tile, its TMA copies
move at most 256 elements per dimension with 16-byte GMEM strides, and it has no 8-bit arithmetic. So the kernels
quantize *down the columns* of a [K, N] matrix: a tile is [16 g, n] (MXFP8: [32 g, n]), row j of each group of 16
holding element j of n blocks, so a block's amax is an elementwise max of 16 row vectors and the packed byte of rows
2i and 2i+1 is an elementwise or; every op is elementwise on [n] vectors, in 32-bit integers where it is integer.
That is a weight's own K-major layout (`quantize_nvfp4_kn`, no transpose); an activation x[M, K] quantized along K
is transposed first (an XLA pass). The uint8 outputs leave transposed back to the [N, K] layout of the reference. N
is padded to a multiple of 128 (COL_MULTIPLE).

The per-block math is the reference's own (`formats.nvfp4_block_scales`, `formats.e2m1_rne_codes`,
`formats.mxfp8_block_exponent`), so the kernels differ from it only in tiling and layout, which the tests check
bit for bit. The global amax is a separate reduction pass before the quantize kernel (as in TE), and so are the
16x16 tile amaxes of tile2d scaling (a max across 16 adjacent columns is not elementwise here).
`tests/test_quant_backends.py::test_pallas_quantizers_lower_for_cuda` exports the quantizers for CUDA on the CPU,
so a change that breaks their Mosaic GPU lowering fails without a GPU.

The fused dequantize-matmul does not lower to Mosaic GPU (it decodes 8-bit operands in registers and multiplies
with jnp.dot; Mosaic GPU needs wgmma on shared-memory operands): on a GPU the backend's GEMM is the xla one on the
kernels' quantized operands, and test_pallas_dequant_matmul_lowers_for_cuda (a strict xfail) records the error.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from triage_jax.kernels import mosaic
from triage_jax.quant import backends as be
from triage_jax.quant import formats as fmt
from triage_jax.quant import ieee

F32 = jnp.float32
U32 = jnp.uint32
TMA_MAX = 256  # elements per dimension of one TMA copy
# N is padded to this: a warpgroup's 128 threads share each [n] row vector (Mosaic GPU's strided register layout
# needs n % 128 == 0), which also makes the uint8 outputs' rows (n bytes) the 16-byte multiples TMA needs.
COL_MULTIPLE = 128


def _call_params(interpret: bool | None) -> dict:
    """pallas_call's interpret / compiler_params: interpret mode, or Mosaic GPU with its lowering semantics chosen
    explicitly (kernels/mosaic.py: JAX versions changed both defaults)."""
    interpret = mosaic.default_interpret() if interpret is None else interpret
    return {"interpret": True} if interpret else {"compiler_params": mosaic.compiler_params()}


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


def _abs_no_nan(v):
    return jnp.where(jnp.isnan(v), 0.0, jnp.abs(v))  # TE's amax uses fmaxf, which drops NaN


def _nvfp4_kernel(*refs, ba_given: bool):
    """One [16 g, n] tile of x^T: rows 16b..16b+15 are the 16 elements of n blocks (see the module docstring)."""
    if ba_given:
        x_ref, se_ref, sd_ref, ba_ref, packed_ref, scale_ref = refs
    else:
        (x_ref, se_ref, sd_ref, packed_ref, scale_ref), ba_ref = refs, None
    s_enc, s_dec = se_ref[...], sd_ref[...]
    for b in range(scale_ref.shape[0]):
        rows = [ieee.flush_subnormals(x_ref[fmt.NVFP4_BLOCK * b + j]) for j in range(fmt.NVFP4_BLOCK)]
        ba = ba_ref[b] if ba_given else functools.reduce(jnp.maximum, [_abs_no_nan(r) for r in rows])
        _, code, inv = fmt.nvfp4_block_scales(ba, s_enc, s_dec, recip=_recip)
        scale_ref[b] = code
        for i in range(fmt.NVFP4_BLOCK // 2):
            lo = fmt.e2m1_rne_codes(rows[2 * i] * inv).astype(U32)
            hi = fmt.e2m1_rne_codes(rows[2 * i + 1] * inv).astype(U32)
            packed_ref[fmt.NVFP4_BLOCK // 2 * b + i] = (lo | (hi << 4)).astype(jnp.uint8)


def _pad_cols(a: jax.Array, n: int) -> jax.Array:
    return a if a.shape[-1] == n else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - a.shape[-1])])


def _tiles(k_rows: int, n: int, block: int, block_g: int, block_n: int) -> tuple[int, int]:
    g = _block(k_rows // block, min(block_g, TMA_MAX // block), 1)
    return g, _block(n, min(block_n, TMA_MAX), COL_MULTIPLE)


def _nvfp4_cols(xt: jax.Array, s_enc_n: jax.Array, s_dec_n: jax.Array, ba_t: jax.Array | None, *,
                interpret, block_g: int, block_n: int) -> tuple[jax.Array, jax.Array]:
    """xt [K, N] (float32, blocks of 16 down the columns), per-column global scales [N] and optionally the block
    amaxes [K/16, N] -> (packed [N, K/2] uint8, E4M3 scales [N, K/16] float8), the reference's layout."""
    k, n = xt.shape
    npad = -(-n // COL_MULTIPLE) * COL_MULTIPLE
    g, bn = _tiles(k, npad, fmt.NVFP4_BLOCK, block_g, block_n)
    args = [_pad_cols(xt, npad), _pad_cols(s_enc_n, npad), _pad_cols(s_dec_n, npad)]
    in_specs = [pl.BlockSpec((fmt.NVFP4_BLOCK * g, bn), lambda j, i: (i, j)),
                pl.BlockSpec((bn,), lambda j, i: (j,)), pl.BlockSpec((bn,), lambda j, i: (j,))]
    if ba_t is not None:
        args.append(_pad_cols(ba_t, npad))
        in_specs.append(pl.BlockSpec((g, bn), lambda j, i: (i, j)))
    packed_t, code_t = pl.pallas_call(
        functools.partial(_nvfp4_kernel, ba_given=ba_t is not None),
        out_shape=(jax.ShapeDtypeStruct((k // 2, npad), jnp.uint8),
                   jax.ShapeDtypeStruct((k // fmt.NVFP4_BLOCK, npad), jnp.uint8)),
        grid=(npad // bn, k // (fmt.NVFP4_BLOCK * g)),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((fmt.NVFP4_BLOCK // 2 * g, bn), lambda j, i: (i, j)),
                   pl.BlockSpec((g, bn), lambda j, i: (i, j))),
        name="nvfp4_quantize_cols",
        **_call_params(interpret),
    )(*args)
    return packed_t[:, :n].T, jax.lax.bitcast_convert_type(code_t[:, :n].T, jnp.float8_e4m3fn)


def quantize_nvfp4(
    x: jax.Array, *, scaling: str = "tensor", amax=None, interpret: bool | None = None, block_g: int = 2,
    block_n: int = 256,
) -> fmt.NVFP4Tensor:
    """NVFP4 quantize along the last axis with a Pallas kernel; bit-identical to `formats.quantize_nvfp4` (no
    stochastic rounding). The kernel reads x^T (an XLA transpose; see the module docstring)."""
    x, amax = fmt.nvfp4_prepare(x, scaling, amax, what="pallas quantize_nvfp4")
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    ba = fmt.nvfp4_block_amax(x, scaling) if scaling == "tile2d" or amax is None else None
    if amax is None:
        amax = fmt.amax_from_blocks(ba, scaling)  # the separate amax pass
    s_enc, s_dec = (jnp.broadcast_to(v, lead + (1,)).reshape(m) if scaling == "row" else jnp.full((m,), v)
                    for v in fmt.nvfp4_global_scales(amax))
    ba_t = ba.reshape(m, k // fmt.NVFP4_BLOCK).T if scaling == "tile2d" else None
    packed, scale = _nvfp4_cols(x.reshape(m, k).T, s_enc, s_dec, ba_t, interpret=interpret, block_g=block_g,
                                block_n=block_n)
    return fmt.NVFP4Tensor(packed=packed.reshape(*lead, k // 2), scale=scale.reshape(*lead, k // fmt.NVFP4_BLOCK),
                           amax=amax, scaling=scaling)


def quantize_nvfp4_kn(
    w: jax.Array, *, scaling: str = "tensor", interpret: bool | None = None, block_g: int = 2, block_n: int = 256
) -> fmt.NVFP4Tensor:
    """NVFP4 of w^T for a weight w[K, N] read in its own layout (no transpose of the float input); bit-identical to
    `formats.quantize_nvfp4_kn`."""
    if w.ndim != 2:
        raise ValueError(f"pallas quantize_nvfp4_kn: expected one matrix w[K, N], got shape {w.shape}")
    if scaling not in ("tensor", "tile2d"):
        raise ValueError(f"pallas quantize_nvfp4_kn: scaling {scaling!r}; weights use 'tensor' or 'tile2d'")
    fmt.nvfp4_prepare(w.T, scaling, None, what="pallas quantize_nvfp4_kn (w^T)")  # validation only (w^T unused)
    w = ieee.ftz(w.astype(F32))
    k, n = w.shape
    ba = fmt.nvfp4_block_amax(w.T, scaling).T if scaling == "tile2d" else jnp.max(
        _abs_no_nan(w).reshape(k // fmt.NVFP4_BLOCK, fmt.NVFP4_BLOCK, n), axis=1)  # [K/16, N]
    amax = fmt.amax_from_blocks(ba, "tensor")
    s_enc, s_dec = (jnp.full((n,), v) for v in fmt.nvfp4_global_scales(amax))
    packed, scale = _nvfp4_cols(w, s_enc, s_dec, ba if scaling == "tile2d" else None, interpret=interpret,
                                block_g=block_g, block_n=block_n)
    return fmt.NVFP4Tensor(packed=packed, scale=scale, amax=amax, scaling=scaling)


def _mxfp8_kernel(x_ref, data_ref, scale_ref):
    """One [32 g, n] tile of x^T: rows 32b..32b+31 are the 32 elements of n blocks."""
    for b in range(scale_ref.shape[0]):
        rows = [ieee.flush_subnormals(x_ref[fmt.MXFP8_BLOCK * b + j]) for j in range(fmt.MXFP8_BLOCK)]
        amax = functools.reduce(jnp.maximum, [_abs_no_nan(r) for r in rows])
        e, factor = fmt.mxfp8_block_exponent(amax, ftz=ieee.flush_subnormals)
        scale_ref[b] = e.astype(jnp.uint8)
        for j, r in enumerate(rows):
            data_ref[fmt.MXFP8_BLOCK * b + j] = jax.lax.bitcast_convert_type(fmt.e4m3_convert(r * factor), jnp.uint8)


def _mxfp8_cols(xt: jax.Array, *, interpret, block_g: int, block_n: int) -> fmt.MXFP8Tensor:
    """xt [K, N] float32, blocks of 32 down the columns -> MXFP8 of xt^T ([N, K] layout)."""
    k, n = xt.shape
    npad = -(-n // COL_MULTIPLE) * COL_MULTIPLE
    g, bn = _tiles(k, npad, fmt.MXFP8_BLOCK, block_g, block_n)
    data_t, e_t = pl.pallas_call(
        _mxfp8_kernel,
        out_shape=(jax.ShapeDtypeStruct((k, npad), jnp.uint8),
                   jax.ShapeDtypeStruct((k // fmt.MXFP8_BLOCK, npad), jnp.uint8)),
        grid=(npad // bn, k // (fmt.MXFP8_BLOCK * g)),
        in_specs=[pl.BlockSpec((fmt.MXFP8_BLOCK * g, bn), lambda j, i: (i, j))],
        out_specs=(pl.BlockSpec((fmt.MXFP8_BLOCK * g, bn), lambda j, i: (i, j)),
                   pl.BlockSpec((g, bn), lambda j, i: (i, j))),
        name="mxfp8_quantize_cols",
        **_call_params(interpret),
    )(_pad_cols(xt, npad))
    return fmt.MXFP8Tensor(data=jax.lax.bitcast_convert_type(data_t[:, :n].T, jnp.float8_e4m3fn),
                           scale=jax.lax.bitcast_convert_type(e_t[:, :n].T, jnp.float8_e8m0fnu))


def quantize_mxfp8(
    x: jax.Array, *, interpret: bool | None = None, block_g: int = 1, block_n: int = 256
) -> fmt.MXFP8Tensor:
    """MXFP8 (RCEIL) quantize along the last axis with a Pallas kernel; bit-identical to `formats.quantize_mxfp8`."""
    fmt._check_input(x, fmt.MXFP8_BLOCK, "pallas quantize_mxfp8")
    lead, k = x.shape[:-1], x.shape[-1]
    q = _mxfp8_cols(ieee.ftz(x.astype(F32)).reshape(math.prod(lead), k).T, interpret=interpret,
                    block_g=block_g, block_n=block_n)
    return fmt.MXFP8Tensor(data=q.data.reshape(x.shape), scale=q.scale.reshape(*lead, k // fmt.MXFP8_BLOCK))


def quantize_mxfp8_kn(w: jax.Array, *, interpret: bool | None = None, block_g: int = 1, block_n: int = 256
                      ) -> fmt.MXFP8Tensor:
    """MXFP8 of w^T for a weight w[K, N] read in its own layout; bit-identical to `formats.quantize_mxfp8_kn`."""
    if w.ndim != 2:
        raise ValueError(f"pallas quantize_mxfp8_kn: expected one matrix w[K, N], got shape {w.shape}")
    fmt._check_input(w.T, fmt.MXFP8_BLOCK, "pallas quantize_mxfp8_kn (w^T)")
    return _mxfp8_cols(ieee.ftz(w.astype(F32)), interpret=interpret, block_g=block_g, block_n=block_n)


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
        interpret=mosaic.default_interpret() if interpret is None else interpret,
        name="dequant_matmul",
    )(*la, *ra)
    return y * lf * (jnp.reshape(rf, (1, -1)) if jnp.ndim(rf) else rf)  # per-row lhs factor [M, 1], scalars


# --- the backend -------------------------------------------------------------------------------------------------


def _probe() -> tuple[bool, str]:
    x = jnp.linspace(-3.0, 3.0, 32 * 64, dtype=F32).reshape(32, 64)
    if not (bool(jnp.array_equal(fmt.quantize_nvfp4(x).packed, quantize_nvfp4(x).packed))
            and bool(jnp.array_equal(fmt.quantize_nvfp4_kn(x).packed, quantize_nvfp4_kn(x).packed))):
        return False, "the Pallas NVFP4 kernel disagrees with the reference on the probe tensor"
    if mosaic.default_interpret():
        return True, f"Pallas on {jax.default_backend()}, interpret mode (slow; for checks)"
    return True, f"Pallas on {jax.default_backend()}, compiled (Mosaic GPU quantizers; the GEMM is xla's)"


def _quantize(x, fmt_name, scaling="tensor", amax=None):
    if fmt_name == "nvfp4":
        return quantize_nvfp4(x, scaling=scaling, amax=amax)
    if fmt_name == "mxfp8":
        return quantize_mxfp8(x)
    return be.reference_quantize(x, fmt_name, scaling, amax)  # FP8 per-tensor is one multiply: no kernel


def _quantize_kn(w_kn, fmt_name, scaling="tensor"):
    if fmt_name == "nvfp4":
        return quantize_nvfp4_kn(w_kn, scaling=scaling)
    if fmt_name == "mxfp8":
        return quantize_mxfp8_kn(w_kn)
    return be.reference_quantize_kn(w_kn, fmt_name, scaling)


def _matmul(lhs, rhs):
    """The fused dequantize-matmul in interpret mode; on a GPU, where it does not lower (module docstring), the
    xla backend's GEMM."""
    return dequant_matmul(lhs, rhs) if mosaic.default_interpret() else be.reference_matmul(lhs, rhs)


# `auto` never picks this backend: no GPU measurement has shown these kernels faster than the xla backend's fused
# quantizers and GEMM (the rule: auto only where measured faster); name it to use it.
BACKEND = be.Backend(
    "pallas", _probe, _quantize, _matmul, accelerated=lambda: False, quantize_kn=_quantize_kn,
    trace_key=mosaic.default_interpret,
)  # dense forward composed from these; grouped: these quantizers + the reference grouped GEMM


def register() -> None:
    """Register (or re-register) the `pallas` backend."""
    be.register_backend(BACKEND)


register()
