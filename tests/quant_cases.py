"""The quantizer cases whose bits must not depend on the backend: inputs that hit every rounding path, and every
quantizer / dequantizer of the project as a function of them. Shared by the CPU checks (tests/test_quant_ieee.py:
the portable division gives the CPU's bits; the CUDA programs hold no approximate operation) and the GPU ones
(tests/test_gpu.py: the GPU gives the CPU device's bits in the same process)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from triage_jax.models import kv_cache
from triage_jax.quant import formats as fmt

F32 = jnp.float32


def inputs(seed: int = 0, rows: int = 64, k: int = 256) -> dict[str, np.ndarray]:
    """float32 [rows, K] arrays: bf16-valued normals, values on E2M1 rounding midpoints, zero and tiny blocks,
    heavy tails, a wide exponent range, and subnormal-scale blocks."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((rows, k)).astype(np.float32)
    bf16 = np.asarray(jnp.asarray(normal, jnp.bfloat16).astype(F32))
    # Midpoints of the E2M1 grid (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) with 6 in every block, so the block scale
    # maps them onto exact ties, scaled per row by powers of two and an odd factor.
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    ties = rng.choice(mids, (rows, k)) * rng.choice([-1.0, 1.0], (rows, k))
    ties[:, ::16] = 6.0
    ties = (ties * (2.0 ** rng.integers(-8, 8, (rows, 1))) * rng.choice([1.0, 3.0, 0.7], (rows, 1))).astype(np.float32)
    zero_tiny = normal.copy()
    zero_tiny[::4, :32] = 0.0
    zero_tiny[1::4, :32] *= np.float32(1e-30)
    zero_tiny[2::4, 16:48] = np.float32(1e-42)  # float32 subnormals
    heavy = (rng.standard_cauchy((rows, k)) * rng.choice([1.0, 1e3], (rows, 1))).astype(np.float32)
    wide = (normal * (2.0 ** rng.integers(-60, 60, (rows, k)))).astype(np.float32)
    sub_scale = (normal * np.float32(1e-4)).astype(np.float32)
    sub_scale[:, :16] = 2688.0  # a large global amax: the other blocks' E4M3 scales go subnormal
    # The scale arithmetic's edges, row by row (row scaling; the tensor's amax is the largest row's): amax below
    # ~3e-35 (S_dec = 1 / S a subnormal, flushed), amax ~1e-34 with blocks at 1e-2 and 3e-4 of it (S_dec normal,
    # the block scale times S_dec a subnormal), amax at FLT_MAX (the smallest S, the largest S_dec: 1 / (s * S_dec)
    # closest to the subnormals), S clamped to FLT_MAX at amax ~ 2688 / FLT_MAX, the smallest normal amax.
    fmax, tiny = np.finfo(np.float32).max, np.finfo(np.float32).tiny
    ex = normal / np.abs(normal).max(axis=1, keepdims=True)  # rows with amax 1
    blocks = np.ones(k // 16, np.float32)
    blocks[1::3], blocks[2::3] = 1e-2, 3e-4
    for rows, amax in ((slice(0, 8), 1e-36), (slice(8, 16), 2e-35), (slice(16, 24), 1e-34), (slice(24, 32), fmax),
                       (slice(32, 40), np.float32(2688.0) / fmax), (slice(40, 48), 1e-30), (slice(48, 56), tiny)):
        ex[rows] *= np.float32(amax) * np.repeat(blocks, 16)
    ex[56:] *= np.float32(1e38)
    extremes = ex.astype(np.float32)
    return {"bf16": bf16, "ties": ties, "zero_tiny": zero_tiny, "heavy": heavy, "wide": wide, "sub_scale": sub_scale,
            "extremes": extremes}


def _nv(q: fmt.NVFP4Tensor) -> dict:
    return {"packed": q.packed, "scale": jax.lax.bitcast_convert_type(q.scale, jnp.uint8), "amax": q.amax,
            "dequantized": q.dequantize()}


def _mx4(q: fmt.MXFP4Tensor) -> dict:
    return {"packed": q.packed, "scale": q.exponents, "dequantized": q.dequantize()}


def _mx8(q: fmt.MXFP8Tensor) -> dict:
    return {"data": jax.lax.bitcast_convert_type(q.data, jnp.uint8),
            "scale": jax.lax.bitcast_convert_type(q.scale, jnp.uint8), "dequantized": q.dequantize()}


def _fp8(q: fmt.FP8Tensor) -> dict:
    return {"data": jax.lax.bitcast_convert_type(q.data, jnp.uint8), "scale": q.scale, "dequantized": q.dequantize()}


OPS = {
    "nvfp4_tensor": lambda x: _nv(fmt.quantize_nvfp4(x)),
    "nvfp4_row": lambda x: _nv(fmt.quantize_nvfp4(x, scaling="row")),
    "nvfp4_tile2d": lambda x: _nv(fmt.quantize_nvfp4(x, scaling="tile2d")),
    "nvfp4_amax_reuse": lambda x: _nv(fmt.quantize_nvfp4(x[:, :128], amax=jnp.max(jnp.abs(x)) * 1.5)),
    "nvfp4_kn": lambda x: _nv(fmt.quantize_nvfp4_kn(x.T)),
    "nvfp4_kn_tile2d": lambda x: _nv(fmt.quantize_nvfp4_kn(x.T, scaling="tile2d")),
    "nvfp4_fake": lambda x: fmt.nvfp4_fake_quant(x),
    "nvfp4_fake_row": lambda x: fmt.nvfp4_fake_quant(x, scaling="row"),
    "nvfp4_fake_kn": lambda x: fmt.nvfp4_fake_quant_kn(x.T),
    "nvfp4_sr": lambda x: _nv(fmt.quantize_nvfp4(x, sr_key=jax.random.key(7))),
    "nvfp4_rht_wgrad": lambda x: _nv(fmt.quantize_nvfp4(fmt.rht16(x, axis=0).T)),
    "rht16": lambda x: fmt.rht16(x, axis=0),
    "mxfp8": lambda x: _mx8(fmt.quantize_mxfp8(x)),
    "mxfp8_floor": lambda x: _mx8(fmt.quantize_mxfp8(x, rounding="floor")),
    "mxfp8_kn": lambda x: _mx8(fmt.quantize_mxfp8_kn(x.T)),
    "mxfp4_floor": lambda x: _mx4(fmt.quantize_mxfp4(x, "floor")),
    "mxfp4_rceil": lambda x: _mx4(fmt.quantize_mxfp4(x, "rceil")),
    "mxfp4_kn": lambda x: _mx4(fmt.quantize_mxfp4_kn(x.T, "rceil")),
    "mxfp4_fake": lambda x: fmt.mxfp4_fake_quant(x, "floor"),
    "fp8": lambda x: _fp8(fmt.quantize_fp8(x)),
    "fp8_fixed_scale": lambda x: _fp8(fmt.quantize_fp8(x, scale=jnp.float32(0.0123))),
    "kv_fp8": lambda x: jax.lax.bitcast_convert_type(
        kv_cache.quantize_fp8_kv(x, kv_cache.fp8_write_scale(jnp.float32(0.0), x[None, :, None, :],
                                                            jnp.ones((1, x.shape[0]), jnp.int32), 2.0)), jnp.uint8),
}


def run(op: str, x) -> list[np.ndarray]:
    """The op's outputs on x (jitted), as host arrays in a fixed order."""
    return [np.asarray(a) for a in jax.tree.leaves(jax.jit(OPS[op])(x))]


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of an array (NaNs compared by bits, signed zeros told apart)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind == "f" else a
