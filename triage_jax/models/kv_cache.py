"""Preallocated KV cache [L, B, S, KVH, Dh] in bf16/float32, or FP8 (E4M3) with a per-layer per-tensor scale.

FP8 scale rule: a layer's scale is set by the first write into it (scale == 0 marks "unset"), as
amax(real tokens of that write) * headroom / 448, so the prefill sets it with `headroom` (default 2x) of room for
later tokens; every later write reuses the scale and clips to +-448 before the cast (numerics.md, FP8 per-tensor).
A calibrated scale can be fixed up front with `init_kv_cache(..., fp8_scale=s)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from triage_jax.models.config import ModelConfig

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
KV_FORMATS = ("bf16", "f32", "fp8")


@struct.dataclass
class KVCache:
    """k, v: [L, B, S, KVH, Dh]; k_scale, v_scale: float32 [L] (1.0 and unused unless fp8); valid_bs: bool [B, S]."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    valid_bs: jax.Array
    fp8_headroom: float = struct.field(pytree_node=False, default=2.0)

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype == FP8

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_kv_cache(cfg: ModelConfig, batch: int, max_len: int, *, kv_format: str = "bf16", dtype=None,
                  fp8_scale: float | None = None, fp8_headroom: float = 2.0) -> KVCache:
    """An empty cache. kv_format "bf16" stores `dtype` (default bfloat16; "f32" or dtype=float32 for exact tests)."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"init_kv_cache: kv_format={kv_format!r}; expected one of {KV_FORMATS}")
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_kv_cache: batch={batch} and max_len={max_len} must be positive")
    if fp8_headroom < 1.0:
        raise ValueError(f"init_kv_cache: fp8_headroom={fp8_headroom} must be >= 1")
    if kv_format == "fp8":
        store = FP8
        scale0 = 0.0 if fp8_scale is None else float(fp8_scale)
    else:
        store = jnp.dtype(dtype) if dtype is not None else (F32 if kv_format == "f32" else jnp.bfloat16)
        scale0 = 1.0
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    scales = jnp.full((cfg.num_hidden_layers,), scale0, F32)
    return KVCache(
        k=jnp.zeros(shape, store), v=jnp.zeros(shape, store), k_scale=scales, v_scale=scales,
        valid_bs=jnp.zeros((batch, max_len), bool), fp8_headroom=float(fp8_headroom),
    )


def fp8_write_scale(current: jax.Array, x_btkh: jax.Array, mask_bt: jax.Array, headroom: float) -> jax.Array:
    """The layer's scale after this write: kept if set, else amax(real tokens) * headroom / 448 (1.0 if all zero)."""
    amax = jnp.max(jnp.where(mask_bt[:, :, None, None], jnp.abs(x_btkh.astype(F32)), 0.0))
    fresh = jnp.where(amax > 0, amax * (headroom / FP8_MAX), 1.0)
    return jnp.where(current > 0, current, fresh).astype(F32)


def quantize_fp8_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """E4M3 codes of x / scale, clipped to +-448 before the cast (an out-of-range cast is not saturating)."""
    return jnp.clip(x.astype(F32) / scale, -FP8_MAX, FP8_MAX).astype(FP8)


def write_layer(cache_lbskh: jax.Array, scales_l: jax.Array, layer: int, new_btkh: jax.Array, mask_bt: jax.Array,
                index, headroom: float) -> tuple[jax.Array, jax.Array]:
    """Write the T new keys (or values) of one layer at slots [index, index+T); returns (cache, scales)."""
    if cache_lbskh.dtype == FP8:
        scale = fp8_write_scale(scales_l[layer], new_btkh, mask_bt, headroom)
        scales_l = scales_l.at[layer].set(scale)
        stored = quantize_fp8_kv(new_btkh, scale)
    else:
        stored = new_btkh.astype(cache_lbskh.dtype)
    zero = jnp.zeros((), jnp.int32)
    cache_lbskh = jax.lax.dynamic_update_slice(
        cache_lbskh, stored[None], (jnp.int32(layer), zero, jnp.asarray(index, jnp.int32), zero, zero)
    )
    return cache_lbskh, scales_l


def read_layer(cache_lbskh: jax.Array, scales_l: jax.Array, layer: int, dtype) -> jax.Array:
    """One layer's keys (or values) [B, S, KVH, Dh] in the compute dtype (dequantized when fp8)."""
    x = cache_lbskh[layer]
    if x.dtype == FP8:
        return (x.astype(F32) * scales_l[layer]).astype(dtype)
    return x.astype(dtype)
