"""Qwen3-MoE sparse block: float32 softmax router, top-k (renormalized when norm_topk_prob), dropless grouped
expert compute (tokens sorted by expert, `qragged_dot`), and the statistics of HF's load-balancing loss.

Expert parallelism: when the active mesh (`jax.set_mesh`, as the Learner sets it) has an `expert` axis of size > 1,
the grouped compute runs under `shard_map`: each device holds E / n_expert experts; the routed tokens of its
expert group are all-gathered over the `expert` axis, each device runs its local experts on the assignments that
chose them (dropless), and the partial outputs are reduce-scattered back to the tokens' owners. The router and its
statistics stay in global (GSPMD) form, so routing and the aux loss are those of the single-device model.

Routing replay (R3, `rl.routing_replay`): `route` takes the expert ids another forward chose (the sampler's) and
uses them instead of its own top-k, the gating weights still coming from this forward's router probabilities at those
experts (renormalized as norm_topk_prob says), so the router keeps its gradient; an id of -1 keeps the own choice.

Row chunking: `ModelConfig.moe_row_chunk` > 0 runs the expert FFN over that many sorted assignment rows at a time
(`chunked_expert_ffn`). It is a plain int attribute of each MoE module, so it is static: part of the module's
graph definition and of every jit cache key over the model.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from triage_jax.models import invariant
from triage_jax.models.config import ModelConfig
from triage_jax.models.layers import Linear, make_param, policy_or_default
from triage_jax.models.sharding import EMBED, EXPERT, MLP
from triage_jax import sharding as shd
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


def route(logits_te: jax.Array, top_k: int, norm_topk_prob: bool, replay_tk: jax.Array | None = None,
          exact: bool = False):
    """float32 softmax over experts, top-k, optional renormalization -> (probs_te, weights_tk, experts_tk).

    replay_tk (ids [T, k], -1 = no replay for that entry): route to those experts instead, weighted by this
    forward's probabilities there (routing replay; gradients reach the router through them).
    exact: the softmax and the renormalization sum as `invariant.tree_sum`s (exact mode)."""
    softmax = invariant.softmax if exact else functools.partial(jax.nn.softmax, axis=-1)
    total = (lambda w: invariant.tree_sum(w, -1)[..., None]) if exact else (
        lambda w: jnp.sum(w, axis=-1, keepdims=True))
    probs_te = softmax(logits_te.astype(F32))
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if replay_tk is not None:
        experts_tk = jnp.where(replay_tk >= 0, replay_tk.astype(experts_tk.dtype), experts_tk)
        weights_tk = jnp.take_along_axis(probs_te, experts_tk, axis=-1)
    if norm_topk_prob:
        weights_tk = weights_tk / total(weights_tk)
    return probs_te, weights_tk, experts_tk


def routing_dtype(num_experts: int):
    """The smallest signed integer type holding expert ids 0..E-1 and the -1 of "not recorded" (compact storage)."""
    for dt in (jnp.int8, jnp.int16):
        if num_experts <= jnp.iinfo(dt).max + 1:
            return dt
    return jnp.int32


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

    def weight(self):
        """The kernel [E, K, N] in the compute dtype (or its QuantizedWeight)."""
        w = self.kernel.get_value()
        return w if isinstance(w, QuantizedWeight) else w.astype(self.dtype)

    def __call__(self, x_mk: jax.Array, group_sizes_e: jax.Array, policy: PrecisionPolicy | None = None):
        return grouped_dot(x_mk, self.weight(), group_sizes_e, policy, self.path)


def grouped_dot(x_mk, w_ekn, group_sizes_e, policy: PrecisionPolicy | None, path: str):
    """qragged_dot under the policy's precision for the layer at `path`."""
    policy = policy_or_default(policy)
    prec = policy.for_layer(path)
    dot = lambda x: qragged_dot(x, w_ekn, group_sizes_e, prec, backend=policy.backend, name=path)  # noqa: E731
    # Exact mode: rows appended past the last group (ragged_dot gives them zeros) keep the kernel's row count >= 64.
    # The groups span all rows, so they go through at once on every platform (a GPU's grouped GEMM then picks its
    # configuration by the row count: exact mode's MoE is not row-count invariant there; docs/numerics.md).
    return invariant.padded_rows(dot, x_mk, row_chunks=False) if policy.exact else dot(x_mk)


def expert_ffn(x_md, group_sizes_e, w_gate, w_up, w_down, policy, paths) -> jax.Array:
    """SwiGLU of each expert on its (sorted) rows: down(silu(gate(x)) * up(x))."""
    h_mf = (jax.nn.silu(grouped_dot(x_md, w_gate, group_sizes_e, policy, paths[0]))
            * grouped_dot(x_md, w_up, group_sizes_e, policy, paths[1]))
    return grouped_dot(h_mf, w_down, group_sizes_e, policy, paths[2])


class Experts(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, std=cfg.initializer_range, rngs=rngs)
        p = f"layers.{layer}.moe.experts"
        self.gate_proj = GroupedLinear(e, d, f, (EXPERT, EMBED, MLP), f"{p}.gate_proj", **kw)  # w_edf
        self.up_proj = GroupedLinear(e, d, f, (EXPERT, EMBED, MLP), f"{p}.up_proj", **kw)  # w_edf
        self.down_proj = GroupedLinear(e, f, d, (EXPERT, MLP, EMBED), f"{p}.down_proj", **kw)  # w_efd

    def weights(self):
        return self.gate_proj.weight(), self.up_proj.weight(), self.down_proj.weight()

    @property
    def paths(self) -> tuple[str, str, str]:
        return self.gate_proj.path, self.up_proj.path, self.down_proj.path

    def __call__(self, x_md: jax.Array, group_sizes_e: jax.Array, policy=None) -> jax.Array:
        return expert_ffn(x_md, group_sizes_e, *self.weights(), policy, self.paths)


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
        self.row_chunk = cfg.moe_row_chunk  # static: rows per grouped-GEMM call, 0: all at once
        self.router = Linear(
            (cfg.hidden_size,), (cfg.num_experts,), (EMBED, EXPERT), f"layers.{layer}.moe.router",
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, std=cfg.initializer_range, rngs=rngs,
        )  # w_de (HF mlp.gate.weight [E, D])
        self.experts = Experts(cfg, layer, rngs=rngs)

    def __call__(self, x_btd: jax.Array, policy: PrecisionPolicy | None = None, mask_bt: jax.Array | None = None):
        """Returns (y_btd, RouterStats). Every token is routed (pads too, as in HF); stats skip masked tokens."""
        return self.routed(x_btd, policy, mask_bt)[:2]

    def routed(self, x_btd: jax.Array, policy: PrecisionPolicy | None = None, mask_bt: jax.Array | None = None,
               replay_btk: jax.Array | None = None):
        """(y_btd, RouterStats, experts_btk): the layer and the expert ids it used; replay_btk replays given ids
        (-1: the layer's own choice) with this layer's gating weights (see `route`)."""
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        logits_te = self.router(x_td, policy)  # compute dtype, like HF's F.linear
        exact = policy is not None and policy.exact
        replay_tk = None if replay_btk is None else replay_btk.reshape(b * t, self.top_k)
        probs_te, weights_tk, experts_tk = route(logits_te, self.top_k, self.norm_topk_prob, replay_tk, exact)
        mesh = expert_mesh(self.num_experts)
        if mesh is not None:
            y_td = expert_parallel_combine(x_td, weights_tk, experts_tk, self.experts.weights(), policy,
                                           self.experts.paths, mesh, row_chunk=self.row_chunk)
        else:
            y_td = combine_experts(x_td, weights_tk, experts_tk, self.experts.weights(), policy, self.experts.paths,
                                   self.num_experts, row_chunk=self.row_chunk).astype(x_btd.dtype)
        mask_t = jnp.ones((b * t,), bool) if mask_bt is None else mask_bt.reshape(-1).astype(bool)
        return (y_td.reshape(b, t, d), router_stats(probs_te, experts_tk, mask_t),
                experts_tk.reshape(b, t, self.top_k))


def chunked_expert_ffn(x_md, group_sizes_e, weights, policy, paths, rows: int) -> jax.Array:
    """`expert_ffn` over blocks of `rows` sorted rows (rematerialized in the backward pass); the groups a block
    cuts are clipped to it, so the result equals one call (rows past the groups stay zero).

    A backend that expands ragged_dot densely (XLA on CPU) holds [E, rows, F] per call, so this bounds the MoE
    temporaries at long sequences (the memory dry-run's --moe_chunk). Exact for unquantized and per-row-scaled
    activations; a per-tensor activation scale (NVFP4's global scale) is then taken per chunk.
    """
    m = x_md.shape[0]
    if rows <= 0 or m <= rows:
        return expert_ffn(x_md, group_sizes_e, *weights, policy, paths)
    n = -(-m // rows)
    x_pd = jnp.pad(x_md, ((0, n * rows - m), (0, 0)))
    ends_e = jnp.cumsum(group_sizes_e)
    starts_e = ends_e - group_sizes_e

    @jax.checkpoint
    def block(start):
        sizes_e = (jnp.clip(ends_e - start, 0, rows) - jnp.clip(starts_e - start, 0, rows)).astype(jnp.int32)
        x_cd = jax.lax.dynamic_slice_in_dim(x_pd, start, rows)
        return expert_ffn(x_cd, sizes_e, *weights, policy, paths)

    y = jax.lax.map(block, jnp.arange(n, dtype=jnp.int32) * rows)
    return y.reshape(n * rows, -1)[:m]


def combine_experts(x_td, weights_tk, experts_tk, weights, policy, paths, num_experts: int,
                    expert_offset=0, row_chunk: int = 0) -> jax.Array:
    """sum_k w[t, k] * FFN_{e[t, k]}(x[t]) over experts [expert_offset, expert_offset + E_local) (all of them on
    one device); assignments to other experts are sorted last and fall outside every group (ragged_dot gives 0).
    row_chunk > 0: the FFN over that many sorted rows at a time (chunked_expert_ffn; a static Python int).
    Returns the float32 sum (the caller rounds once, after any cross-device sum)."""
    t, d = x_td.shape
    top_k = experts_tk.shape[-1]
    local_tk = experts_tk - expert_offset
    # Experts held elsewhere get the sentinel group E_local: sorted after every local group, outside all of them.
    local_tk = jnp.where((local_tk >= 0) & (local_tk < num_experts), local_tk, num_experts)
    order_m, token_m, group_sizes_e = sort_by_expert(local_tk, num_experts + 1)
    y_md = chunked_expert_ffn(x_td[token_m], group_sizes_e[:num_experts], weights, policy, paths, row_chunk)
    w_m = weights_tk.reshape(-1)[order_m].astype(x_td.dtype)  # HF casts the routing weights to the dtype
    y_md = y_md * w_m[:, None]
    inverse_m = jnp.argsort(order_m)
    y_tkd = y_md[inverse_m].reshape(t, top_k, d).astype(F32)
    if policy is not None and policy.exact:
        return invariant.tree_sum(y_tkd, 1)
    return jnp.sum(y_tkd, axis=1)  # float32 [T, D]


def expert_mesh(num_experts: int):
    """The active mesh when it has an `expert` axis of size > 1 (expert parallelism on), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("expert", 1) <= 1:
        return None
    if num_experts % mesh.shape["expert"]:
        raise ValueError(f"expert parallelism: num_experts={num_experts} is not divisible by the mesh's expert "
                         f"axis ({mesh.shape['expert']}); pick config.mesh.expert dividing it")
    return mesh


def _expert_spec(leaf, num_experts: int) -> P:
    """Experts split over `expert` on their leading axis; anything without an expert axis is replicated."""
    return P("expert") if getattr(leaf, "ndim", 0) >= 1 and leaf.shape[0] == num_experts else P()


def expert_parallel_combine(x_td, weights_tk, experts_tk, weights, policy, paths, mesh,
                            row_chunk: int = 0) -> jax.Array:
    """`combine_experts` with the experts split over the mesh's `expert` axis (see the module docstring).

    Tokens keep their batch sharding (the logical "batch" rule); the expert kernels enter with [E/ep, K, N] local
    blocks (their fsdp / tensor shards are gathered at the boundary, as FSDP does for any weight).
    """
    ep = mesh.shape["expert"]
    num_experts = weights[0].shape[0]
    spec = shd.logical_to_mesh(("batch",), shd.DEFAULT_RULES, mesh)
    batch_axes = () if spec[0] is None else ((spec[0],) if isinstance(spec[0], str) else tuple(spec[0]))
    shards = 1
    for a in batch_axes:
        shards *= mesh.shape[a]
    if x_td.shape[0] % shards:
        raise ValueError(f"expert parallelism: {x_td.shape[0]} tokens do not split over the batch axes "
                         f"{batch_axes} ({shards} shards)")
    tok = P(spec[0], None)
    w_specs = jax.tree.map(lambda w: _expert_spec(w, num_experts), weights)
    tokens_split = "expert" in batch_axes
    dtype = x_td.dtype

    def local(x_td, w_tk, e_tk, weights):
        if tokens_split:  # this device's expert group routes the same gathered tokens
            x_td, w_tk, e_tk = (jax.lax.all_gather(a, "expert", tiled=True) for a in (x_td, w_tk, e_tk))
        offset = jax.lax.axis_index("expert") * (num_experts // ep)
        # float32 partial sums over this device's experts, summed across devices before the one rounding.
        y_td = combine_experts(x_td, w_tk, e_tk, weights, policy, paths, num_experts // ep, offset, row_chunk)
        if tokens_split:
            y_td = jax.lax.psum_scatter(y_td, "expert", scatter_dimension=0, tiled=True)
        else:
            y_td = jax.lax.psum(y_td, "expert")
        return y_td.astype(dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, w_specs), out_specs=tok,
                         check_vma=False)(x_td, weights_tk, experts_tk, weights)


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters touched per token (top-k experts only), for throughput accounting."""
    inactive = sum(
        3 * (cfg.num_experts - cfg.num_experts_per_tok) * cfg.hidden_size * cfg.moe_intermediate_size
        for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
    )
    return cfg.num_params() - inactive
