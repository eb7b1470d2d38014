"""Qwen3 attention: GQA, RMSNorm on q and k over head_dim before rotate-half RoPE, causal + padding masks.

The projections go through the quantized dot; scores and softmax run in high precision
(`jax.nn.dot_product_attention`: float32 logits and softmax).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from triage_jax.models import invariant
from triage_jax.models import kv_cache as kvc
from triage_jax.models.config import ModelConfig
from triage_jax.models.layers import Linear, RMSNorm, apply_rope
from triage_jax.models.chunked_attention import chunked_attention
from triage_jax.models.sharding import BATCH, EMBED, HEADS, KV, LENGTH, constrain
from triage_jax.quant import PrecisionPolicy


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        d, n, kvh, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer, self.head_dim, self.attn_chunk = layer, h, cfg.attn_chunk
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, std=cfg.initializer_range, rngs=rngs)
        p = f"layers.{layer}.attn"
        self.q_proj = Linear((d,), (n, h), (EMBED, HEADS, KV), f"{p}.q_proj", **kw)  # w_dnh
        self.k_proj = Linear((d,), (kvh, h), (EMBED, HEADS, KV), f"{p}.k_proj", **kw)  # w_dkh
        self.v_proj = Linear((d,), (kvh, h), (EMBED, HEADS, KV), f"{p}.v_proj", **kw)  # w_dkh
        self.o_proj = Linear((n, h), (d,), (HEADS, KV, EMBED), f"{p}.o_proj", **kw)  # w_nhd
        nkw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, (KV,), **nkw)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, (KV,), **nkw)
        self.qkv_proj = nnx.data(None)  # a MergedLinear of q / k / v in a prequantize_model copy (then those None)

    def _qk_norm_rope(self, q_btnh, k_btkh, cos_bth, sin_bth, policy):
        """q and k each normalized by its own RMSNorm, then rotated."""
        return (apply_rope(self.q_norm(q_btnh, policy), cos_bth, sin_bth),
                apply_rope(self.k_norm(k_btkh, policy), cos_bth, sin_bth))

    def _qk_norm_rope_merged(self, y, cos_bth, sin_bth, policy):
        """_qk_norm_rope on the merged q / k / v output y [B, T, (N + 2 KVH) Dh], q and k as one [B, T, N + KVH, Dh]
        slice (each head by its own norm's weight): one normalization kernel a layer on a GPU instead of two.

        Not on the CPU: XLA:CPU picks a row reduction's summation order by the array's shape (rows of 64 sum
        otherwise in a [30, 6, 64] array than in [30, 4, 64]), so the one slice rounded differently from the parts
        and the sampler's copy lost the on-the-fly forward's bits (tests/test_models_qwen3.py); the CPU takes
        _qk_norm_rope on the split output.
        """
        (n, h), (kvh, _), _ = self.qkv_proj.out_dims
        b, t = y.shape[:2]
        qk = y[..., :(n + kvh) * h].reshape(b, t, n + kvh, h)
        heads = jnp.arange(n + kvh)[:, None] < n
        w = jnp.where(heads, self.q_norm.weight[...], self.k_norm.weight[...]).astype(qk.dtype)
        qk = apply_rope(w * self.q_norm.normalize(qk, policy), cos_bth, sin_bth)
        return qk[:, :, :n], qk[:, :, n:]

    def __call__(self, x_btd: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array, mask_bts: jax.Array | None,
                 policy: PrecisionPolicy | None = None, *, cache: kvc.KVCache | None = None,
                 slot_bt: jax.Array | None = None, new_mask_bt: jax.Array | None = None, layer_index=None):
        """Self-attention over the T new tokens (no cache), or, with a cache, over each row's cached slots after
        writing the new tokens to slots slot_bt (their rows' next free slots), in the cache's layer `layer_index`
        (default: this module's layer; a traced index when scanned layers share one module).

        mask_bts: bool [B, T, S] (no cache only), True where query t may attend to key s.
        Returns y_btd, or (y_btd, cache) when a cache is given.
        """
        exact = policy is not None and policy.exact
        if self.qkv_proj is not None:
            y = self.qkv_proj.flat(x_btd, policy)
            q_btnh, k_btkh, v_btkh = self.qkv_proj.split(y)
            q_btnh, k_btkh = jax.lax.platform_dependent(
                q_btnh, k_btkh, cpu=lambda q, k: self._qk_norm_rope(q, k, cos_bth, sin_bth, policy),
                default=lambda q, k: self._qk_norm_rope_merged(y, cos_bth, sin_bth, policy))
        else:
            q_btnh, k_btkh, v_btkh = (self.q_proj(x_btd, policy), self.k_proj(x_btd, policy),
                                      self.v_proj(x_btd, policy))
            q_btnh, k_btkh = self._qk_norm_rope(q_btnh, k_btkh, cos_bth, sin_bth, policy)
        q_btnh = constrain(q_btnh, (BATCH, LENGTH, HEADS, KV))
        if cache is not None:
            i = self.layer if layer_index is None else layer_index
            cache = cache.write(i, k_btkh, v_btkh, new_mask_bt, slot_bt)
            k_buf, v_buf = cache.layer(i)
            k_scale, v_scale = cache.scales(i)
            if exact:
                k_bksh = kvc.read(k_buf, k_scale, q_btnh.dtype)
                v_bksh = kvc.read(v_buf, v_scale, q_btnh.dtype)
                visible_bts = jnp.arange(k_bksh.shape[2], dtype=jnp.int32)[None, None, :] <= slot_bt[:, :, None]
                out_btnh = invariant.attention(q_btnh, k_bksh, v_bksh, visible_bts, self.head_dim**-0.5)
            else:
                out_btnh = kvc.cached_attention(q_btnh, k_buf, v_buf, slot_bt, self.head_dim**-0.5, k_scale,
                                                v_scale, stacked=cache.stacked)
            return self.o_proj(out_btnh, policy), cache
        t = q_btnh.shape[1]
        if exact:
            # The learner's side of exact mode: its sequence's tokens sit at the slots the sampler's cache held.
            visible_bts = jnp.tril(jnp.ones((1, t, t), bool)) if mask_bts is None else mask_bts
            out_btnh = invariant.causal_attention(q_btnh, k_btkh, v_btkh, visible_bts, self.head_dim**-0.5)
        elif self.attn_chunk and t > self.attn_chunk and mask_bts is not None:
            # Long learner sequences: never materialize the [B, N, T, T] scores (20k-token responses).
            out_btnh = chunked_attention(q_btnh, k_btkh, v_btkh, mask_bts, scale=self.head_dim**-0.5,
                                         q_chunk=self.attn_chunk, k_chunk=2 * self.attn_chunk)
        else:
            out_btnh = jax.nn.dot_product_attention(
                q_btnh, k_btkh, v_btkh, mask=None if mask_bts is None else mask_bts[:, None, :, :],
                scale=self.head_dim**-0.5,
            )
        return self.o_proj(out_btnh, policy)


def causal_padding_mask(q_slot_bt: jax.Array, k_slot_bs: jax.Array, k_valid_bs: jax.Array) -> jax.Array:
    """bool [B, T, S]: key s is visible to query t iff it is valid and its slot is <= the query's slot."""
    return (k_slot_bs[:, None, :] <= q_slot_bt[:, :, None]) & k_valid_bs[:, None, :]

