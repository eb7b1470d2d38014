"""A 4-bit weight GEMM for Hopper in Mosaic GPU: y[M, N] = x[M, K] . W^T with W NVFP4 or MXFP4, bf16 activations.

Hopper has no FP4 tensor cores, so the gain is bandwidth: the weights cross HBM as 4-bit codes and 8-bit scales
and are decoded next to the tensor cores. Its reference is the xla backend's quantized dot (quant/backends.py:
the exact block values e2m1 * s, float32 accumulation, the tensor factor after the sum); results differ from it
only by the float32 summation order (`accumulation_bound`).

Weight layout (`FP4GemmWeight`, made once by `prepare_weight`, at the sampler's sync, never per step):
  codes  [K/32, N, 16] uint8: row n of chunk c holds the codes of W[n, 32c + j] (low nibble) and W[n, 32c + 16 + j]
         (high nibble), j < 16: each nibble plane is one whole 16-element block, so the kernel never interleaves
         nibbles (Mosaic GPU cannot reshape a register tile) and one scale per row covers a decoded [64, 16] tile.
  scales [K/16, N] uint8 (NVFP4: E4M3 codes) or [K/32, N] (MXFP4: E8M0 exponents), K-major so that a block's
         scales for 64 rows are one contiguous vector.
  amax   float32: NVFP4's tensor amax; its decode scale amax / 2688 (`factor`, 1 for MXFP4) scales the output.

Kernel: swap-AB, the weights in wgmma's M slot (y^T[N, M] = W . x^T), since decode has M = 1..64 rows and wgmma's
M is 64; x and y stay in XLA's row-major [M, K] / [M, N] (x's tiles are wgmma's K-major B through transposed views
of shared memory, and each output tile is written back transposed), so no transpose runs around the call and the
norms / RoPE / cache writes next to it fuse as they do around XLA's own GEMMs: one warpgroup per 64 weight rows, a
TMA pipeline over K streaming codes, scales and x tiles into shared
memory, and per 16-element block: decode in registers with integer bit tricks (no lookup table and no float4
convert, which Mosaic GPU refuses below sm_100): each E2M1 code's bits moved into a float32 that is 2^-126 times its
value (code 1 a subnormal, which a kernel without .FTZ keeps) and multiplied by 2^126, each E4M3 scale alike (2^120;
E8M0: 2^(c - 127) from the exponent field), one bf16x2 multiply by the block scale (the product e2m1 * s is exact
in bfloat16), a store to shared memory and a wgmma (bf16 x bf16 -> float32) against x^T. The interpreter (XLA:CPU
flushes subnormals) decodes field by field: the same values. By default the decoded tile goes through shared
memory rather than straight from registers as wgmma's A operand: Mosaic GPU's CPU interpreter (the tests' only
way to run this kernel without a GPU) takes wgmma operands from shared memory only, and the default is the
tested path; `a_operand="registers"` (compiled only) skips the round trip, for the GPU to race. The interpreter
has no transposed views either: there x's blocks are copied transposed and the output tile transposed as an
array (the same values); the compiled views are checked on the CPU where Mosaic GPU lowers them (jax.export for
CUDA), assembled there for sm_90a by Mosaic GPU and ptxas (tests/test_gpu_kernels.py: wgmma in the SASS, no
spilled register, no .FTZ; tools/gpu_kernels.py shows every sampler shape), and run on a GPU by the -m gpu tests.
Split-K over a second grid axis fills the SMs at decode shapes (N / 64 CTAs alone are 40 at N = 2560); the partial
sums are added in XLA in a fixed order. M is padded to a multiple of 16 and tiled by up to 256 (wgmma's N).

W4A4 / W4A8 on Hopper (the `fp4_gemm` backend's dot with quantized activations): the activations are quantized
by the reference quantizer (token-wise NVFP4, MXFP8, FP8; an XLA pass, not fused into the kernel), their exact
values go in as bf16 (every NVFP4 / MXFP8 / FP8 value is a bf16) and their factors scale the output.
Per-expert (grouped) weights, `fp4_grouped_matmul` (jax.lax.ragged_dot's contract): each group's rows are moved
to row tiles of their own, a table gives each tile its expert (read by the kernel as a scalar from global memory,
then a dynamic slice of the stacked codes and scales) and its valid rows (an empty tile is skipped: nothing read,
nothing written). An expert's weight crosses HBM once per row tile of its group. A scanned model's layer reads
its own weights out of the stacked ones the same way (`FP4GemmWeight.layer_view`: every tile's index is the
layer's; per-expert stacks [L, E, ...] are L x E weights, a tile's index L_i E + its expert), where a dynamic slice
of the stacks would be a copy of the layer's codes and scales before the call.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from triage_jax.kernels import mosaic
from triage_jax.quant import backends as be
from triage_jax.quant import formats as fmt
from triage_jax.quant import ieee

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
TILE_N = 64  # weight rows per warpgroup: wgmma's M
CHUNK = 32  # K per codes row: two 16-element nibble planes
# Split-K aims at this many CTAs: ~4 one-warpgroup CTAs per SM of a 132-SM Hopper, so that while one waits on its
# TMA loads or its wgmma others decode (a bandwidth-bound kernel hides latency by occupancy). A fixed number, not
# the device's SM count, so the summation order (and the result) never depends on the device.
TARGET_CTAS = 512


@struct.dataclass
class FP4GemmWeight:
    """A 4-bit weight W[N, K] in the kernel's layout (module docstring): `fmt_name` "nvfp4" (with its tensor `amax`)
    or "mxfp4" (amax unused, `rounding` its exponent rule)."""

    # Replicated on a mesh (sharding.sampler_state_shardings): a custom kernel is not partitioned, and this layout
    # is not the [..., N, K'] one that logical names split (scales are [K/16, N]).
    MESH_REPLICATED = True

    codes: jax.Array
    scales: jax.Array
    amax: jax.Array
    n: int = struct.field(pytree_node=False, default=0)  # the weight's own N and K (the layout pads them)
    k: int = struct.field(pytree_node=False, default=0)
    fmt_name: str = struct.field(pytree_node=False, default="nvfp4")
    rounding: str = struct.field(pytree_node=False, default="floor")
    splits: tuple[int, ...] = struct.field(pytree_node=False, default=())  # merged: its parts' N (concat_weights)
    # A layer of stacked weights (codes [L, ...]): the traced index the kernel reads them at (`layer_view`).
    layer: jax.Array | None = None

    # A scanned model's layer takes its view of the stacked weights (layer_view) rather than a slice of them, which
    # XLA copies out of the stack before a custom kernel (models.qwen3._scan_layers).
    LAYER_INDEXED = True

    @property
    def shape(self) -> tuple[int, ...]:
        """(..., N, K) of the weight (a leading E for per-expert weights, prepare_weight under vmap; a layer view's
        is its layer's)."""
        lead = tuple(self.codes.shape[:-3])
        return (lead[1:] if self.layer is not None else lead) + (self.n, self.k)

    def layer_view(self, i: jax.Array, amax: jax.Array) -> FP4GemmWeight:
        """Layer i of stacked weights (codes [L, K/32, N, 16], amax [L]; per expert [L, E, ...], amax [L, E]) with
        that layer's amax row `amax`, for the kernel to read in place (fp4_matmul, fp4_grouped_matmul): no copy
        of the layer's codes and scales."""
        if self.codes.ndim not in (4, 5) or self.splits or self.layer is not None:
            raise ValueError(f"FP4GemmWeight.layer_view: stacked weights expected, got codes {self.codes.shape}"
                             f"{' (merged)' if self.splits else ''}{' (a view)' if self.layer is not None else ''}")
        return self.replace(amax=amax, layer=jnp.asarray(i, I32))

    def sliced(self) -> FP4GemmWeight:
        """A layer view as the layer's own weight (a dynamic slice of the stacks: a copy); any other as it is."""
        if self.layer is None:
            return self
        take = lambda a: lax.dynamic_index_in_dim(a, self.layer, keepdims=False)  # noqa: E731
        return self.replace(codes=take(self.codes), scales=take(self.scales), layer=None)

    @property
    def factor(self) -> jax.Array:
        """The output factor: NVFP4's tensor decode scale (NVFP4Tensor.global_decode_scale), 1 for MXFP4; a merged
        weight's per output column [N] (each part's own)."""
        if self.fmt_name != "nvfp4":
            return jnp.float32(1.0)
        f = fmt.nvfp4_decode_factor(self.amax)
        if not self.splits:
            return f
        # Each part's factor broadcast over its columns. Not jnp.repeat: its index is a cumsum over N, which XLA
        # constant-folds as a reduce-window of window N (O(N^2): ~6% of a 4B W4A4 decode round's compile).
        return jnp.concatenate([jnp.broadcast_to(f[..., i:i + 1], (*f.shape[:-1], n)) for i, n in enumerate(self.splits)],
                               axis=-1)

    def unmerged(self) -> list[FP4GemmWeight]:
        """The parts of a merged weight (concat_weights), [self] for one weight (a layer view: its layer's):
        slices, nothing re-laid out."""
        if not self.splits:
            return [self.sliced()]
        parts, n0 = [], 0
        for i, n in enumerate(self.splits):
            amax = self.amax[i] if self.fmt_name == "nvfp4" else jnp.float32(0.0)
            parts.append(FP4GemmWeight(self.codes[:, n0:n0 + n], self.scales[:, n0:n0 + n], amax, n, self.k,
                                       self.fmt_name, self.rounding))
            n0 += n
        return parts

    def to_tensor(self) -> fmt.NVFP4Tensor | fmt.MXFP4Tensor:
        """The quantized tensor [N, K] this layout was made from (the exact inverse of prepare_weight; per expert
        under vmap). A merged weight has one per part (`unmerged`)."""
        if self.splits:
            raise ValueError(f"FP4GemmWeight.to_tensor: a merged weight (parts of N {self.splits}) has no single "
                             "tensor; take each part's (unmerged())")
        if self.layer is not None:
            return self.sliced().to_tensor()
        (k_chunks, n_pad, _), (n, k) = self.codes.shape, self.shape
        c = self.codes.astype(jnp.uint32)
        codes = jnp.stack([c & 0xF, c >> 4], axis=2).transpose(1, 0, 2, 3).reshape(n_pad, k_chunks * 16, 2)
        packed = (codes[:n, :k // 2, 0] | (codes[:n, :k // 2, 1] << 4)).astype(jnp.uint8)
        block = fmt.MXFP4_BLOCK if self.fmt_name == "mxfp4" else fmt.NVFP4_BLOCK
        scales = self.scales.T[:n, :k // block]
        if self.fmt_name == "mxfp4":
            return fmt.MXFP4Tensor(packed, lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu), self.rounding)
        return fmt.NVFP4Tensor(packed, lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), self.amax)

    def dequantize(self, dtype=F32) -> jax.Array:
        """The weight's values [N, K], as the quantized tensor's dequantize (the straight-through backward's)."""
        if self.splits:
            return jnp.concatenate([p.to_tensor().dequantize(dtype) for p in self.unmerged()], axis=-2)
        return self.to_tensor().dequantize(dtype)


def concat_weights(ws: Sequence[FP4GemmWeight]) -> FP4GemmWeight | None:
    """Weights [N_i, K] that multiply one input as one weight [sum N_i, K]: codes and scales side by side along N,
    each part's tensor amax kept (its factor scales its own columns), so one kernel launch computes every part
    (a layer's q / k / v, its gate / up). Its product equals the parts' within the float32 summation order
    (`accumulation_bound`: the split-K schedule follows the merged N). None where they cannot merge: not all one
    dense weight of one K and format, a part already merged, or an N that is not a multiple of 64 (its layout's
    zero padding would sit between two parts' columns)."""
    ws = list(ws)
    w0 = ws[0] if ws else None
    if (len(ws) < 2 or not all(isinstance(w, FP4GemmWeight) for w in ws)
            or any(w.codes.ndim != 3 or w.splits or w.n % TILE_N for w in ws)
            or len({(w.k, w.codes.shape[0], w.fmt_name, w.rounding) for w in ws}) != 1):
        return None
    amax = jnp.stack([jnp.asarray(w.amax, F32) for w in ws])
    return FP4GemmWeight(jnp.concatenate([w.codes for w in ws], axis=1), jnp.concatenate([w.scales for w in ws], axis=1),
                         amax, sum(w.n for w in ws), w0.k, w0.fmt_name, w0.rounding, tuple(w.n for w in ws))


def prepare_weight(q: fmt.NVFP4Tensor | fmt.MXFP4Tensor) -> FP4GemmWeight:
    """The kernel's layout of a quantized weight q [N, K] (NVFP4 with tensor scaling, or MXFP4). N is padded to a
    multiple of 64 and K to one of 32 with zero codes and zero scales (zero rows and blocks: the padded outputs are
    dropped, the padded K contributes +0)."""
    if q.packed.ndim != 2:
        raise ValueError(f"prepare_weight: expected one weight [N, K], got packed shape {q.packed.shape}")
    if not isinstance(q, (fmt.NVFP4Tensor, fmt.MXFP4Tensor)):
        raise TypeError(f"prepare_weight: expected an NVFP4Tensor or MXFP4Tensor, got {type(q).__name__}")
    if isinstance(q, fmt.NVFP4Tensor) and q.scaling != "tensor":
        raise ValueError(f"prepare_weight: NVFP4 weights use tensor scaling here, got {q.scaling!r}")
    n, k = q.shape
    n_pad, k_pad = -(-n // TILE_N) * TILE_N, -(-k // CHUNK) * CHUNK
    codes = jnp.pad(q.codes.astype(jnp.uint32), ((0, n_pad - n), (0, k_pad - k))).reshape(n_pad, k_pad // CHUNK, 2, 16)
    codes = (codes[:, :, 0] | (codes[:, :, 1] << 4)).astype(jnp.uint8).transpose(1, 0, 2)
    scales = jax.lax.bitcast_convert_type(q.scale, jnp.uint8)
    block = k // scales.shape[-1]
    scales = jnp.pad(scales, ((0, n_pad - n), (0, k_pad // block - scales.shape[-1]))).T
    if isinstance(q, fmt.NVFP4Tensor):
        return FP4GemmWeight(codes, scales, q.amax, n, k, "nvfp4")
    return FP4GemmWeight(codes, scales, jnp.float32(0.0), n, k, "mxfp4", q.rounding)


def _e2m1_value(c):
    """float32 values of E2M1 codes (int32 0..15) from their bits: 0 and 0.5 apart, else 2^(e-1) * (1 + m/2)."""
    e, m, s = (c >> 1) & 3, c & 1, (c >> 3) & 1
    bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22)) | (s << 31)
    return lax.bitcast_convert_type(bits, F32)


def _e2m1_bits_at(codes, shift: int):
    """The E2M1 codes in bits shift .. shift + 3 of `codes` (int32) as the float32 bits of their value times 2^-126:
    the magnitude bits (e1 e0 m) become the exponent's two low bits and the mantissa's top bit, the sign bit 31, so
    that e = 0 gives the subnormal m * 2^-127 and e > 0 2^(e - 127) (1 + m/2), both exactly 2^-126 times E2M1's
    m * 0.5 and 2^(e - 1) (1 + m/2) (code 8 is -0, as e2m1_decode). Two shifts and one three-input mask per
    element (SASS) where _e2m1_value's fields, compare and select took ~13 instructions: the K loop issued 18.9
    SASS instructions per weight element and thread with it, 11.0 with this, _e4m3_bits and the bf16x2 scale
    multiply (4B q / k / v at M = 16, tools/gpu_kernels.py). Compiled only: XLA:CPU (the interpreter) flushes
    subnormal operands, a GPU kernel without .FTZ keeps them (tests/test_gpu_kernels.py checks the SASS)."""
    return ((codes << (22 - shift)) & 0x01C00000) | ((codes << (28 - shift)) & jnp.int32(-(2**31)))


def _e4m3_bits(code):
    """Non-negative E4M3 codes (int32) as the float32 bits of their value times 2^-120: (e4 m3) at bits 20..26,
    e = 0 the subnormal m * 2^-129 (E4M3's m * 2^-9), else 2^(e - 127) (1 + m/8). One shift (compiled only, as
    _e2m1_bits_at)."""
    return code << 20


def _e8m0_value(c):
    """2^(c - 127) for E8M0 exponents (int32), flushed at c = 0 and NaN at 255, as MXFP4Tensor.block_values."""
    v = lax.bitcast_convert_type(c << 23, F32)
    return jnp.where(c == 255, jnp.float32(jnp.nan), v)


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _schedule(k_chunks: int, ctas: int, max_g: int, split_k: int | None, mp: int = 16) -> tuple[int, int]:
    """(chunks of 32 per pipeline step g, K splits s) with s dividing the K steps: the most CTAs up to TARGET_CTAS
    (ctas x s), then the fewest splits, then the longest step (fewer, larger TMA copies). The float32 partial sums
    (s x N x mp x 4 bytes) may not outweigh the weight's codes (N x K / 2 bytes): s <= K / (8 mp), so prefill-sized
    M takes no split."""
    want = max(1, min(-(-TARGET_CTAS // ctas), k_chunks * CHUNK // (8 * mp)))
    best = None
    for g in _divisors(k_chunks, max_g):
        k_steps = k_chunks // g
        if split_k is not None:
            if k_steps % split_k == 0:
                best = max(best or (0, 0, 0), (0, g, split_k))
            continue
        s = max(_divisors(k_steps, want), key=lambda d: (min(ctas * d, TARGET_CTAS), -d))
        best = max(best or (0, 0, 0), (min(ctas * s, TARGET_CTAS), g, s))
    if best is None:
        raise ValueError(f"fp4_matmul: split_k={split_k} divides none of the K step counts of {k_chunks} chunks")
    return best[1], best[2]


def _check_a_operand(a_operand: str, interpret: bool) -> None:
    if a_operand not in ("smem", "registers"):
        raise ValueError(f"fp4_matmul: a_operand {a_operand!r}; expected 'smem' or 'registers'")
    if interpret and a_operand == "registers":
        raise ValueError("fp4_matmul: a_operand='registers' needs the compiled kernel (a GPU); the interpreter "
                         "takes wgmma operands from shared memory only")


# One jit around the kernel: a program that calls it at one shape many times (a decode step: 4 calls per layer at 4
# shapes) traces it once and lowers it once (jax reuses the lowering of a jitted call whose jaxpr it has seen), not
# once per call: Mosaic GPU's lowering is ~0.3 s of Python per kernel, 50 s for a 36-layer step's 144 calls.
@functools.partial(jax.jit, static_argnames=("tile_m", "mx", "chunks_per_step", "split_k", "steps_in_flight",
                                             "interpret", "regs"))
def _kernel_call(codes, scales, x, tile_expert, tile_rows, *, tile_m: int, mx: bool, chunks_per_step: int,
                 split_k: int | None, steps_in_flight: int, interpret: bool, regs: bool) -> jax.Array:
    """The kernel over codes [E, K/32, N, 16], scales [E, K/16 or K/32, N], x [P, K] bf16 (P a multiple of
    tile_m), the expert of each row tile tile_expert [P / tile_m] and its valid rows tile_rows (a tile with none
    is skipped: nothing read, nothing written) -> float32 partial sums [s, P, N] (y per K split: the accumulator
    holds y^T's tile, and is written transposed, so that XLA reads the result in its own row-major layout and
    fuses what follows (a norm, RoPE, the cache write) instead of launching a transpose per call)."""
    _, k_chunks, n, _ = codes.shape
    mp = x.shape[0]
    # Chunks of 32 per pipeline step: at most chunks_per_step, and x's tile (64 g tile_m bytes) <= 48 KiB, so
    # that steps_in_flight of them and the [64, tile_m] float32 output tile fit in 227 KiB of shared memory.
    g, s = _schedule(k_chunks, (n // TILE_N) * (mp // tile_m), min(chunks_per_step, max(1, 768 // tile_m)),
                     split_k, mp)
    steps = k_chunks // g // s
    n_scale_rows = g if mx else 2 * g  # scale rows per step: one per 32 (MXFP4) or per 16 (NVFP4)
    # x tiles [tile_m, 32 g] bf16 in 16-column (32-byte) swizzled tiles; each 16 columns, seen transposed, are a
    # K-major [16, tile_m] B of wgmma (K = 16 per wgmma; a 128-byte swizzle needs 64). x is read as XLA holds it.
    x_transforms = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
    a_transforms = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))

    def load(ref, layout):
        # The interpreter has no register layouts; compiled, the tiles load in wgmma's accumulator layout, and the
        # scale vectors in its row-reduced form, so that they broadcast along a tile's rows.
        return ref[...] if interpret else plgpu.load(ref, (), layout=layout)

    def kernel(e_gmem, r_gmem, c_gmem, s_gmem, x_gmem, o_gmem, o_smem, a_smem, *xt_smem):
        def x_block(x_smem, j):
            """Columns 16 j .. 16 j + 15 of the x tile as wgmma's B [16, tile_m]: a transposed view (K-major B).
            The interpreter has no transposed views: there a transposed copy of the same values."""
            if interpret:
                return xt_smem[0].at[j]
            return plgpu.transpose_ref(x_smem.at[:, pl.ds(16 * j, 16)], (1, 0))

        n0 = lax.axis_index("n") * TILE_N
        t = lax.axis_index("m")
        m0 = t * tile_m
        ks = lax.axis_index("k")
        e = e_gmem[t]  # this row tile's expert (0 for a dense weight)

        def compute(acc_ref):
            def step(_, c_smem, s_smem, x_smem):
                if interpret:
                    for j in range(2 * g):
                        xt_smem[0][j] = x_smem[:, pl.ds(16 * j, 16)].T
                for c in range(g):
                    codes = load(c_smem.at[c], plgpu.Layout.WGMMA).astype(I32)
                    for h in range(2):  # the low nibbles (block 2c of the chunk), then the high ones (2c + 1)
                        row = load(s_smem.at[c if mx else 2 * c + h], plgpu.Layout.WGMMA.reduce(1))
                        if interpret:  # XLA:CPU flushes subnormals: the decodes field by field
                            scale = _e8m0_value(row.astype(I32)) if mx else fmt.e4m3_decode_nonneg(row)
                            e2m1 = _e2m1_value((codes >> (4 * h)) & 0xF)
                        else:  # the bits placed into float32, times a power of two: exact
                            scale = _e8m0_value(row.astype(I32)) if mx else (
                                lax.bitcast_convert_type(_e4m3_bits(row.astype(I32)), F32) * jnp.float32(2.0**120))
                            e2m1 = lax.bitcast_convert_type(_e2m1_bits_at(codes, 4 * h), F32) * jnp.float32(2.0**126)
                        if mx or interpret:
                            v = e2m1 * lax.broadcast_in_dim(scale, (TILE_N, 16), (0,))
                            a = (ieee.flush_subnormals(v) if mx else v).astype(BF16)
                        else:  # e2m1 * s has at most 6 significant bits and is >= 2^-10: exact in bfloat16,
                            # so two products per bf16x2 multiply give the float32 product's bits
                            a = e2m1.astype(BF16) * lax.broadcast_in_dim(scale.astype(BF16), (TILE_N, 16), (0,))
                        if regs:
                            plgpu.wgmma(acc_ref, a, x_block(x_smem, 2 * c + h))
                        else:
                            a_smem[2 * c + h] = a
                if not regs:
                    plgpu.commit_smem()  # the decoded tiles, visible to the tensor cores' async reads
                    for j in range(2 * g):
                        plgpu.wgmma(acc_ref, a_smem.at[j], x_block(x_smem, j))
                plgpu.wgmma_wait(0)  # before the pipeline reuses x_smem (and a_smem)

            plgpu.emit_pipeline(
                step, grid=(steps,), max_concurrent_steps=steps_in_flight,
                in_specs=[plgpu.BlockSpec((g, TILE_N, 16), lambda i: (i, 0, 0)),
                          plgpu.BlockSpec((n_scale_rows, TILE_N), lambda i: (i, 0)),
                          plgpu.BlockSpec((tile_m, 32 * g), lambda i: (0, i), transforms=x_transforms)],
            )(c_gmem.at[e, pl.ds(ks * steps * g, steps * g), pl.ds(n0, TILE_N)],
              s_gmem.at[e, pl.ds(ks * steps * n_scale_rows, steps * n_scale_rows), pl.ds(n0, TILE_N)],
              x_gmem.at[pl.ds(m0, tile_m), pl.ds(ks * steps * 32 * g, steps * 32 * g)])
            return acc_ref[...]

        @pl.when(r_gmem[t] > 0)
        def _tile():
            acc = pl.run_scoped(compute, plgpu.ACC((TILE_N, tile_m), F32))
            # y^T's tile [64, tile_m] into y's [tile_m, 64]. Compiled: through a transposed view of the shared-memory
            # tile, from the transposed register layout (one shuffle per register pair; Mosaic GPU stores a
            # transposed view only from it; its lowering is checked on the CPU by jax.export). The interpreter has
            # neither register layouts nor transposed views: there the same values, transposed as an array.
            if interpret:
                o_smem[...] = acc.T
            else:
                plgpu.transpose_ref(o_smem, (1, 0))[...] = plgpu.layout_cast(acc, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, pl.ds(m0, tile_m), pl.ds(n0, TILE_N)])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((s, mp, n), F32),
        grid=(n // TILE_N, mp // tile_m, s), grid_names=("n", "m", "k"),
        scratch_types=[plgpu.SMEM((tile_m, TILE_N), F32),
                       plgpu.SMEM((2 * g, TILE_N, 16), BF16, transforms=a_transforms)]
                      + ([plgpu.SMEM((2 * g, 16, tile_m), BF16)] if interpret else []),
        compiler_params=mosaic.compiler_params(),
        interpret=mosaic.interpret_params() if interpret else None,
    )(tile_expert.astype(I32), tile_rows.astype(I32), codes, scales, x)


def _sum_splits(parts: jax.Array) -> jax.Array:
    return functools.reduce(jnp.add, [parts[i] for i in range(parts.shape[0])])  # a fixed order over the splits


def _padded(x: jax.Array, k: int, rows: int) -> jax.Array:
    """x [M, K'] as bf16 [rows, K], zero-padded."""
    return jnp.pad(x.astype(BF16), ((0, rows - x.shape[0]), (0, k - x.shape[1])))


def fp4_matmul(x: jax.Array, w: FP4GemmWeight, *, split_k: int | None = None, chunks_per_step: int = 4,
               steps_in_flight: int = 3, interpret: bool | None = None, apply_factor: bool = True,
               a_operand: str = "smem") -> jax.Array:
    """y[M, N] float32 = x[M, K] (cast to bf16) . W^T * w.factor (apply_factor=False: without it), W decoded inside
    the kernel. a_operand: "smem" (the decoded tiles through shared memory, the tested path) or "registers"
    (wgmma's A straight from registers: no shared-memory round trip or barrier per step; compiled only, since the
    interpreter has no register operands; raced against "smem" by experiments/bench_gpu.py)."""
    if w.codes.ndim != 3 + (w.layer is not None):
        raise ValueError(f"fp4_matmul: one weight expected, got codes {w.codes.shape} (per expert: fp4_grouped_matmul)")
    n_true, k_true = w.shape
    if x.ndim != 2 or x.shape[1] != k_true:
        raise ValueError(f"fp4_matmul: expected x[M, {k_true}] for a weight [N={n_true}, K={k_true}], got x {x.shape}")
    interpret = mosaic.default_interpret() if interpret is None else interpret
    _check_a_operand(a_operand, interpret)
    k = w.codes.shape[-3] * CHUNK  # the padded layout's
    m = x.shape[0]
    tile_m = min(256, -(-m // 16) * 16)
    mp = -(-m // tile_m) * tile_m
    tiles = mp // tile_m
    # A layer view: the whole stacks go in, and every row tile reads layer `w.layer` of them (the kernel's per-tile
    # expert index, as for per-expert weights); the same schedule and bits as the layer's own weight.
    stacked = w.layer is not None
    parts = _kernel_call(w.codes if stacked else w.codes[None], w.scales if stacked else w.scales[None],
                         _padded(x, k, mp), jnp.full((tiles,), w.layer if stacked else 0, I32),
                         jnp.full((tiles,), tile_m, I32), tile_m=tile_m, mx=w.fmt_name == "mxfp4",
                         chunks_per_step=chunks_per_step, split_k=split_k, steps_in_flight=steps_in_flight,
                         interpret=interpret, regs=a_operand == "registers")
    y = _sum_splits(parts)[:m, :n_true]
    return y * w.factor if apply_factor else y


def grouped_tiles(group_sizes_e: jax.Array, m: int, tile_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each group's rows moved to its own row tiles: (destination row of each of the m rows [M] (P for rows past
    the groups), the expert of each tile [T], its valid rows [T]); T = ceil(m / tile_m) + E bounds the tiles any
    group sizes need (each group wastes less than one tile), P = T tile_m."""
    e = group_sizes_e.shape[0]
    t = -(-m // tile_m) + e
    gs = group_sizes_e.astype(I32)
    tiles_e = -(-gs // tile_m)
    tile_start_e = jnp.cumsum(tiles_e) - tiles_e
    row_start_e = jnp.cumsum(gs) - gs
    r = jnp.arange(m, dtype=I32)
    group = be.row_groups(gs, m)
    dest = jnp.where(r < jnp.sum(gs), tile_start_e[group] * tile_m + r - row_start_e[group], t * tile_m)
    ti = jnp.arange(t, dtype=I32)
    tile_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_e), ti, side="right"), e - 1).astype(I32)
    rows = gs[tile_expert] - (ti - tile_start_e[tile_expert]) * tile_m
    return dest, tile_expert, jnp.where(ti < jnp.sum(tiles_e), jnp.clip(rows, 0, tile_m), 0)


def fp4_grouped_matmul(x: jax.Array, w: FP4GemmWeight, group_sizes_e: jax.Array, *, tile_m: int | None = None,
                       chunks_per_step: int = 4, steps_in_flight: int = 3, interpret: bool | None = None,
                       apply_factor: bool = True, a_operand: str = "smem") -> jax.Array:
    """Per-expert y[M, N] float32: rows of x [M, K] (sorted by group, as jax.lax.ragged_dot takes them) times their
    expert's W_e^T (w: FP4GemmWeight with a leading E axis, prepare_weight under vmap) * its factor. Each group's
    rows go to row tiles of their own (tile_m: default the mean group size rounded up to 16, at most 256), and each
    tile reads its expert's codes: an expert's weight crosses HBM once per tile of its rows, and a tile with no
    rows is skipped."""
    stacked = w.layer is not None
    if w.codes.ndim != 4 + stacked:
        raise ValueError(f"fp4_grouped_matmul: per-expert weights expected, got codes {w.codes.shape}")
    e = w.codes.shape[-4]
    n_true, k_true = w.shape[-2:]
    if x.ndim != 2 or x.shape[1] != k_true or group_sizes_e.shape != (e,):
        raise ValueError(f"fp4_grouped_matmul: expected x[M, {k_true}] and group sizes [{e}], got x {x.shape} and "
                         f"{group_sizes_e.shape}")
    interpret = mosaic.default_interpret() if interpret is None else interpret
    _check_a_operand(a_operand, interpret)
    m, k = x.shape[0], w.codes.shape[-3] * CHUNK
    tile_m = tile_m or min(256, max(16, -(-(-(-m // e)) // 16) * 16))
    dest, tile_expert, tile_rows = grouped_tiles(group_sizes_e, m, tile_m)
    p = tile_expert.shape[0] * tile_m
    x_p = jnp.zeros((p, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    codes, scales = w.codes, w.scales
    if stacked:  # a layer view: the [L, E] stacks as L x E weights (a free reshape), this layer's E from L_i E on
        codes, scales = codes.reshape(-1, *codes.shape[2:]), scales.reshape(-1, *scales.shape[2:])
        tile_expert = tile_expert + w.layer * e
    parts = _kernel_call(codes, scales, _padded(x_p, k, p), tile_expert, tile_rows, tile_m=tile_m,
                         mx=w.fmt_name == "mxfp4", chunks_per_step=chunks_per_step, split_k=1,
                         steps_in_flight=steps_in_flight, interpret=interpret, regs=a_operand == "registers")
    y_p = _sum_splits(parts)[:, :n_true]  # [P, N]; rows of skipped tiles were never written, and are never read
    y = jnp.take(y_p, jnp.minimum(dest, p - 1), axis=0)
    y = jnp.where((dest < p)[:, None], y, 0.0)  # rows past the groups: 0, as ragged_dot gives them
    return y * be.per_row_factor(w.factor, be.row_groups(group_sizes_e, m)) if apply_factor else y


def reference(x: jax.Array, w_q: fmt.NVFP4Tensor | fmt.MXFP4Tensor) -> jax.Array:
    """The xla backend's w4a16 product: x (as bf16) . block_values^T in float32, then the tensor factor."""
    y = jnp.dot(x.astype(BF16).astype(F32), w_q.block_values().T, precision=lax.Precision.HIGHEST)
    return y * (w_q.global_decode_scale() if isinstance(w_q, fmt.NVFP4Tensor) else jnp.float32(1.0))


def accumulation_bound(x: jax.Array, w_q: fmt.NVFP4Tensor | fmt.MXFP4Tensor) -> jax.Array:
    """|fp4_matmul - reference| <= this, elementwise: two float32 sums of K exact products in different orders
    each err by at most (K - 1) u sum|x_k w_k| (u = 2^-24; the products are exact in float32), and the factor
    multiply adds an ulp."""
    k = x.shape[-1]
    absdot = jnp.dot(jnp.abs(x.astype(BF16).astype(F32)), jnp.abs(w_q.block_values()).T,
                     precision=lax.Precision.HIGHEST)
    f = w_q.global_decode_scale() if isinstance(w_q, fmt.NVFP4Tensor) else jnp.float32(1.0)
    return (2 * (k - 1) + 4) * jnp.float32(2.0**-24) * absdot * f


# --- the backend -------------------------------------------------------------------------------------------------
# `fp4_gemm`: this kernel for the dense and the grouped (per-expert) dot of 4-bit weights (NVFP4 with tensor
# scaling, MXFP4) with bf16 or quantized activations; the xla backend's dots for unquantized float32 activations
# and other weight formats, and its quantizers.


def _is_fp4(fmt_name: str, scaling: str) -> bool:
    return (fmt_name == "nvfp4" and scaling == "tensor") or fmt_name in fmt.MXFP4_FORMATS


def _quantize_kn(w_kn: jax.Array, fmt_name: str, scaling: str = "tensor"):
    """w^T quantized by the reference; a 4-bit result in the kernel's layout (one matrix [K, N])."""
    q = be.reference_quantize_kn(w_kn, fmt_name, scaling)
    return prepare_weight(q) if _is_fp4(fmt_name, scaling) else q


def _dot(x_mk: jax.Array, w, prec) -> jax.Array:
    if not isinstance(w, FP4GemmWeight):
        if be.is_quantized(w) or not _is_fp4(prec.weight, prec.weight_scaling):
            return be.reference_dot(x_mk, w, prec)  # not a 4-bit weight: xla's
        w = _quantize_kn(w, prec.weight, prec.weight_scaling)  # a raw weight, quantized for this call
    if prec.act == "none" and x_mk.dtype != BF16:  # the kernel's bf16 operand would round them: xla's dot
        return jnp.concatenate([be.reference_dot(x_mk, p.to_tensor(), prec) for p in w.unmerged()], axis=-1)
    # W4A4 / W4A8 on Hopper: the activations quantized as the reference does (token-wise NVFP4, MXFP8, FP8, ...),
    # their exact values (bf16 holds every one) into the kernel, their factor and the weight's after the sum, in
    # the reference's order.
    xv, fx = be.fake_quant(x_mk, prec.act, prec.act_scaling)
    return fp4_matmul(xv.astype(BF16), w, apply_factor=False) * fx * w.factor


def _grouped_dot(x_mk: jax.Array, w, group_sizes_e: jax.Array, prec) -> jax.Array:
    if not isinstance(w, FP4GemmWeight):
        if be.is_quantized(w) or not _is_fp4(prec.weight, prec.weight_scaling):
            return be.reference_grouped_dot(x_mk, w, group_sizes_e, prec)  # not 4-bit weights: xla's
        w = jax.vmap(lambda m: _quantize_kn(m, prec.weight, prec.weight_scaling))(w)  # raw [E, K, N], per expert
    if prec.act == "none" and x_mk.dtype != BF16:
        return be.reference_grouped_dot(x_mk, jax.vmap(FP4GemmWeight.to_tensor)(w.sliced()), group_sizes_e, prec)
    xv, fx = be.fake_quant(x_mk, prec.act, prec.act_scaling)
    y = fp4_grouped_matmul(xv.astype(BF16), w, group_sizes_e, apply_factor=False)
    return y * fx * be.per_row_factor(w.factor, be.row_groups(group_sizes_e, x_mk.shape[0]))


def _probe() -> tuple[bool, str]:
    compiled = not mosaic.default_interpret()
    where = "compiled (Mosaic GPU)" if compiled else "Mosaic GPU's CPU interpreter (slow; for checks)"
    if compiled:
        kind = getattr(jax.devices()[0], "compute_capability", "")
        if not str(kind).startswith("9"):
            return False, f"the kernel uses Hopper's wgmma (sm_90); this GPU is compute capability {kind or '?'}"
    return True, f"4-bit weight GEMM, {where}; other formats and the quantizers are xla's"


BACKEND = be.Backend(
    "fp4_gemm", _probe, be.reference_quantize, be.reference_matmul, accelerated=lambda: False,
    quantize_kn=_quantize_kn, dot=_dot, grouped_dot=_grouped_dot, concat_weights=concat_weights,
    trace_key=mosaic.default_interpret,
)  # never picked by `auto` until a GPU measurement shows it faster (experiments/bench_gpu.py)


def register() -> None:
    """Register (or re-register) the `fp4_gemm` backend."""
    be.register_backend(BACKEND)


register()
