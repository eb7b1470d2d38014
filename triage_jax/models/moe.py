"""Qwen3-MoE sparse block: float32 softmax router, top-k (renormalized when norm_topk_prob), dropless grouped
expert compute (tokens sorted by expert, `qragged_dot`), and the statistics of HF's load-balancing loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from triage_jax.models.config import ModelConfig
from triage_jax.models.layers import Linear, make_param, policy_or_default
from triage_jax.models.sharding import EMBED, EXPERT, MLP
from triage_jax.quant import PrecisionPolicy, QuantizedWeight, qragged_dot

F32 = jnp.float32


class RouterStats(NamedTuple):
    """Per-layer sums behind HF's load_balancing_loss_func (masked tokens excluded)."""

    tokens_per_expert: jax.Array  # f32 [E]: number of (token, slot) assignments to each expert
    router_prob_sum: jax.Array  # f32 [E]: sum over tokens of the router probability of each expert
    rows: jax.Array  # f32 []: number of tokens counted


def load_balancing_loss(stats: list[RouterStats] | tuple[RouterStats, ...], num_experts: int) -> jax.Array:
    """HF's Switch-style aux loss over all MoE layers: E * sum_e f_e * P_e, with the counts and probabilities of
    every layer pooled (not averaged per layer), f_e = assignments / rows and P_e = probability sum / rows.
    Unscaled: multiply by `router_aux_loss_coef` when adding it to the loss."""
    if not stats:
        return jnp.zeros((), F32)
    tokens = sum(s.tokens_per_expert for s in stats)
    probs = sum(s.router_prob_sum for s in stats)
    rows = jnp.maximum(sum(s.rows for s in stats), 1.0)
    return jnp.sum((tokens / rows) * (probs / rows)) * num_experts


def route(logits_te: jax.Array, top_k: int, norm_topk_prob: bool):
    """float32 softmax over experts, top-k, optional renormalization -> (probs_te, weights_tk, experts_tk)."""
    probs_te = jax.nn.softmax(logits_te.astype(F32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if norm_topk_prob:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return probs_te, weights_tk, experts_tk


def router_stats(probs_te: jax.Array, experts_tk: jax.Array, mask_t: jax.Array) -> RouterStats:
    m = mask_t.astype(F32)
    e = probs_te.shape[-1]
    tokens = jnp.zeros((e,), F32).at[experts_tk.reshape(-1)].add(jnp.repeat(m, experts_tk.shape[-1]))
    return RouterStats(tokens, jnp.sum(probs_te * m[:, None], axis=0), jnp.sum(m))


class GroupedLinear(nnx.Module):
    """Per-expert kernels W[E, K, N]; rows of x sorted by expert, `group_sizes_e` rows each."""

    def __init__(self, e: int, k: int, n: int, names, path: str, *, dtype: str, param_dtype: str, std: float,
                 rngs: nnx.Rngs):
        self.path, self.dtype = path, dtype
        self.kernel = make_param(rngs, (e, k, n), names, param_dtype, std=std)

    def __call__(self, x_mk: jax.Array, group_sizes_e: jax.Array, policy: PrecisionPolicy | None = None):
        policy = policy_or_default(policy)
        w = self.kernel.get_value()
        if not isinstance(w, QuantizedWeight):
            w = w.astype(self.dtype)
        return qragged_dot(x_mk, w, group_sizes_e, policy.for_layer(self.path), backend=policy.backend,
                           name=self.path)


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, std=cfg.initializer_range, rngs=rngs)
        p = f"layers.{layer}.moe.experts"
        self.gate_proj = GroupedLinear(e, d, f, (EXPERT, EMBED, MLP), f"{p}.gate_proj", **kw)  # w_edf
        self.up_proj = GroupedLinear(e, d, f, (EXPERT, EMBED, MLP), f"{p}.up_proj", **kw)  # w_edf
        self.down_proj = GroupedLinear(e, f, d, (EXPERT, MLP, EMBED), f"{p}.down_proj", **kw)  # w_efd

    def __call__(self, x_md: jax.Array, group_sizes_e: jax.Array, policy=None) -> jax.Array:
        h_mf = jax.nn.silu(self.gate_proj(x_md, group_sizes_e, policy)) * self.up_proj(x_md, group_sizes_e, policy)
        return self.down_proj(h_mf, group_sizes_e, policy)


def sort_by_expert(experts_tk: jax.Array, num_experts: int):
    """Order of the T*k (token, slot) assignments grouped by expert, their tokens, and the group sizes."""
    flat_e = experts_tk.reshape(-1)
    order_m = jnp.argsort(flat_e, stable=True)
    token_m = order_m // experts_tk.shape[-1]
    group_sizes_e = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    return order_m, token_m, group_sizes_e


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = Linear(
            (cfg.hidden_size,), (cfg.num_experts,), (EMBED, EXPERT), f"layers.{layer}.moe.router",
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, std=cfg.initializer_range, rngs=rngs,
        )  # w_de (HF mlp.gate.weight [E, D])
        self.experts = Experts(cfg, layer, rngs=rngs)

    def __call__(self, x_btd: jax.Array, policy: PrecisionPolicy | None = None, mask_bt: jax.Array | None = None):
        """Returns (y_btd, RouterStats). Every token is routed (pads too, as in HF); stats skip masked tokens."""
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        logits_te = self.router(x_td, policy)  # compute dtype, like HF's F.linear
        probs_te, weights_tk, experts_tk = route(logits_te, self.top_k, self.norm_topk_prob)
        order_m, token_m, group_sizes_e = sort_by_expert(experts_tk, self.num_experts)
        y_md = self.experts(x_td[token_m], group_sizes_e, policy)
        w_m = weights_tk.reshape(-1)[order_m].astype(x_btd.dtype)  # HF casts the routing weights to the dtype
        y_md = y_md * w_m[:, None]
        inverse_m = jnp.argsort(order_m)
        y_td = jnp.sum(y_md[inverse_m].reshape(b * t, self.top_k, d).astype(F32), axis=1).astype(x_btd.dtype)
        mask_t = jnp.ones((b * t,), bool) if mask_bt is None else mask_bt.reshape(-1).astype(bool)
        return y_td.reshape(b, t, d), router_stats(probs_te, experts_tk, mask_t)


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters touched per token (top-k experts only), for throughput accounting."""
    inactive = sum(
        3 * (cfg.num_experts - cfg.num_experts_per_tok) * cfg.hidden_size * cfg.moe_intermediate_size
        for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
    )
    return cfg.num_params() - inactive
