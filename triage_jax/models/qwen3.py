"""The Qwen3 / Qwen3-MoE decoder (Flax NNX): full forward for the learner, KV-cache path for the sampler.

Module paths (the strings per-layer precision rules match): "embed", "layers.{i}.attn.{q,k,v,o}_proj",
"layers.{i}.mlp.{gate,up,down}_proj", "layers.{i}.moe.router", "layers.{i}.moe.experts.{gate,up,down}_proj",
"layers.{i}.{input,post_attention}_norm", "final_norm", "lm_head".
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from triage_jax.models import invariant
from triage_jax.models import kv_cache as kvc
from triage_jax.models.attention import Attention, causal_padding_mask
from triage_jax.models.config import ModelConfig
from triage_jax.models.layers import (
    Embed, Linear, MergedLinear, QuantizedKernel, RMSNorm, policy_or_default, rope_cos_sin,
)
from triage_jax.models.mlp import MLP
from triage_jax.models.moe import GroupedLinear, MoE, load_balancing_loss
from triage_jax.models.sharding import BATCH, EMBED, LAYERS, LENGTH, QUANTIZED_NAMES, VOCAB, constrain
from triage_jax.quant import PrecisionPolicy, QuantizedWeight, concat_prequantized, get_backend, prequantize, qdot

F32 = jnp.float32

REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep the linear-layer outputs
}


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        nkw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, (EMBED,), **nkw)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, (EMBED,), **nkw)
        if cfg.is_moe_layer(layer):
            self.moe, self.mlp = MoE(cfg, layer, rngs=rngs), None
        else:
            self.moe, self.mlp = None, MLP(cfg, layer, rngs=rngs)

    def __call__(self, x_btd, cos_bth, sin_bth, mask_bts, token_mask_bt, policy=None, *, cache=None,
                 slot_bt=None, replay_btk=None, layer_index=None):
        """Pre-norm attention and FFN residual blocks -> (x_btd, RouterStats | None, experts_btk | None,
        cache | None); replay_btk: expert ids to replay in the MoE block (models.moe.route); layer_index: the
        cache layer to use (default: this layer's; traced under scan)."""
        h_btd = self.input_norm(x_btd, policy)
        if cache is None:
            a_btd = self.attn(h_btd, cos_bth, sin_bth, mask_bts, policy)
        else:
            a_btd, cache = self.attn(h_btd, cos_bth, sin_bth, mask_bts, policy, cache=cache, slot_bt=slot_bt,
                                     new_mask_bt=token_mask_bt, layer_index=layer_index)
        x_btd = x_btd + a_btd
        h_btd = self.post_attention_norm(x_btd, policy)
        stats = experts_btk = None
        if self.moe is not None:
            f_btd, stats, experts_btk = self.moe.routed(h_btd, policy, token_mask_bt, replay_btk)
        else:
            f_btd = self.mlp(h_btd, policy)
        x_btd = constrain(x_btd + f_btd, (BATCH, LENGTH, EMBED))
        return x_btd, stats, experts_btk, cache


class Qwen3(nnx.Module):
    """Qwen3 dense / MoE causal LM. Kernels are stored [in, out]; every matmul goes through `quant.qdot`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, std=cfg.initializer_range, rngs=rngs, **kw)
        if cfg.scan_layers:
            self.layers = _stacked_layers(cfg, rngs)  # one DecoderLayer whose variables carry a leading L axis
        else:
            self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, (EMBED,), **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            (cfg.hidden_size,), (cfg.vocab_size,), (EMBED, VOCAB), "lm_head", std=cfg.initializer_range,
            rngs=rngs, **kw,
        )
        self.tied_head_q = nnx.data(None)  # QuantizedKernel of embedding.T, set by prequantize_model for a tied head

    # ------------------------------------------------------------------ LM head
    def lm_head_kernel(self) -> jax.Array | QuantizedWeight:
        """The LM head's kernel [D, V] (the embedding transposed when tied), or its QuantizedWeight in a
        `prequantize_model` copy whose policy quantizes "lm_head"."""
        if self.lm_head is not None:
            return self.lm_head.kernel.get_value()
        if self.tied_head_q is not None:
            return self.tied_head_q.get_value()
        return self.embed.embedding[...].T

    def logits(self, hidden_btd: jax.Array, policy: PrecisionPolicy | None = None) -> jax.Array:
        """float32 logits [..., V] of final-norm hidden states under the policy's "lm_head" precision."""
        policy = policy_or_default(policy)
        prec = policy.for_layer("lm_head")
        if self.lm_head is not None:
            w = self.lm_head.kernel_2d()
        elif self.tied_head_q is not None:
            w = self.tied_head_q.get_value()
        else:
            w = self.embed.embedding[...].T.astype(self.cfg.dtype)
        if not prec.quantized and not isinstance(w, QuantizedWeight):
            # The high-precision head keeps float32 logits (qdot's plain path would round them to bf16).
            dot = lambda h: jnp.dot(h, w, preferred_element_type=F32)  # noqa: E731
        else:
            dot = lambda h: qdot(h, w, prec, backend=policy.backend, name="lm_head").astype(F32)  # noqa: E731
        if not policy.exact:
            return dot(hidden_btd)
        lead = hidden_btd.shape[:-1]
        return invariant.padded_rows(dot, hidden_btd.reshape(-1, hidden_btd.shape[-1])).reshape(*lead, -1)

    # ------------------------------------------------------------------ forward
    def __call__(self, input_ids_bt, positions_bt=None, attention_mask_bt=None, *, policy=None, cache=None,
                 return_hidden=False, return_aux=False, routing_btlk=None):
        """Logits [B, T, V] float32 (or final-norm hidden states if return_hidden).

        No cache: causal self-attention over the T tokens; attention_mask_bt (1 = real) hides pads, and default
        positions are cumsum(mask) - 1 (so left padding is handled), or arange(T) without a mask.
        With a cache (models.kv_cache): row b's T new tokens go to slots cache.lengths[b] + t, its real ones
        (mask 1, before any pad) advance cache.lengths; queries see their row's slots up to their own, and the
        positions are the slots. Returns (out, new_cache).
        return_aux appends {"moe_aux_loss": unscaled HF load-balancing loss (0 for dense)} to the outputs, and for
        an MoE model "experts_btlk": the int32 expert ids [B, T, L_moe, k] each token used in each MoE layer.
        routing_btlk (same layout, any int type; -1 = the layer's own choice) replays recorded expert ids: routing
        replay, with this forward's gating weights at those experts (models.moe.route).
        """
        cfg = self.cfg
        b, t = input_ids_bt.shape
        mask_bt = (jnp.ones((b, t), bool) if attention_mask_bt is None else attention_mask_bt.astype(bool))
        if mask_bt.shape != (b, t):
            raise ValueError(f"attention_mask_bt {mask_bt.shape} does not match input_ids_bt {(b, t)}")
        slot_bt = None
        if cache is None:
            slot_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            if positions_bt is None:
                positions_bt = (slot_bt if attention_mask_bt is None
                                else jnp.maximum(jnp.cumsum(mask_bt, axis=1) - 1, 0))
            mask_bts = causal_padding_mask(slot_bt, slot_bt, mask_bt)
            slot_bt = None
        else:
            if cache.batch != b:
                raise ValueError(f"cache batch {cache.batch} != input batch {b}")
            if t > cache.max_len:
                raise ValueError(f"cache overflow: {t} new tokens exceed the cache length {cache.max_len}")
            slot_bt = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            if positions_bt is None:
                positions_bt = slot_bt
            mask_bts = None
            cache = cache.replace(lengths=cache.lengths + jnp.sum(mask_bt, axis=1, dtype=jnp.int32))
        if positions_bt.shape != (b, t):
            raise ValueError(f"positions_bt {positions_bt.shape} does not match input_ids_bt {(b, t)}")

        x_btd = constrain(self.embed(input_ids_bt), (BATCH, LENGTH, EMBED))
        cos_bth, sin_bth = rope_cos_sin(positions_bt, cfg.head_dim, cfg.rope_theta, x_btd.dtype)
        stats, experts = [], []
        if cfg.scan_layers:
            replay_lbtk = None if routing_btlk is None else jnp.moveaxis(routing_btlk, 2, 0)
            x_btd, st, ex_lbtk, cache = _scan_layers(self.layers, x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy,
                                                     cfg, cache, slot_bt, replay_lbtk)
            if st is not None:
                stats.append(jax.tree.map(lambda a: jnp.sum(a, axis=0), st))  # pooled over layers, as HF does
                experts = list(ex_lbtk)
        else:
            for layer in self.layers:
                replay_btk = (routing_btlk[:, :, len(experts)]
                              if routing_btlk is not None and layer.moe is not None else None)
                if cache is None and cfg.remat != "none":
                    x_btd, st, ex = _remat_layer(layer, x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy,
                                                 cfg.remat, replay_btk)
                else:
                    x_btd, st, ex, cache = layer(x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy, cache=cache,
                                                 slot_bt=slot_bt, replay_btk=replay_btk)
                if st is not None:
                    stats.append(st)
                    experts.append(ex)
        h_btd = self.final_norm(x_btd, policy)
        out = h_btd if return_hidden else self.logits(h_btd, policy)
        outputs = (out,) if cache is None else (out, cache)
        if return_aux:
            aux = {"moe_aux_loss": load_balancing_loss(stats, max(cfg.num_experts, 1))}
            if experts:
                aux["experts_btlk"] = jnp.stack(experts, axis=2)
            outputs += (aux,)
        return outputs[0] if len(outputs) == 1 else outputs


def _remat_layer(layer, x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy, mode, replay_btk=None):
    def body(layer, x_btd, cos_bth, sin_bth, mask_bts, mask_bt, replay_btk):
        x_btd, st, ex, _ = layer(x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy, replay_btk=replay_btk)
        return x_btd, st, ex

    return nnx.remat(body, policy=REMAT_POLICIES[mode])(layer, x_btd, cos_bth, sin_bth, mask_bts, mask_bt,
                                                          replay_btk)


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """num_hidden_layers DecoderLayers as one module with a leading "layers" axis (for nnx.scan).

    Their module paths read "layers.0..."; `check_uniform_policy` makes sure the policy treats every layer alike.
    """

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def make(rngs):
        return DecoderLayer(cfg, 0, rngs=rngs)

    return make(rngs)


_LAYER_PATHS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj", "moe.router", "moe.experts.gate_proj", "moe.experts.up_proj",
                "moe.experts.down_proj", "input_norm", "post_attention_norm")


@functools.lru_cache(maxsize=64)
def check_uniform_policy(policy: PrecisionPolicy | None, num_layers: int) -> None:
    """Scanned layers share one traced body, so every layer must get the precision layer 0 gets."""
    policy = policy_or_default(policy)
    for sub in _LAYER_PATHS:
        p0 = policy.for_layer(f"layers.0.{sub}")
        for i in range(1, num_layers):
            if policy.for_layer(f"layers.{i}.{sub}") != p0:
                raise ValueError(f"scan_layers=True needs one precision for all layers; the policy gives "
                                 f"layers.{i}.{sub} a different one than layers.0.{sub}")


def _scan_layers(layers, x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy, cfg, cache, slot_bt, replay_lbtk):
    """The stacked layers under nnx.scan -> (x_btd, stacked stats, experts_lbtk, cache); replay_lbtk (or None) is
    scanned with the layers."""
    check_uniform_policy(policy, cfg.num_hidden_layers)
    if cache is None:
        def body(layer, x_btd, replay_btk):
            x_btd, st, ex, _ = layer(x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy, replay_btk=replay_btk)
            return x_btd, (st, ex)

        if cfg.remat != "none":
            body = nnx.remat(body, policy=REMAT_POLICIES[cfg.remat])

        if replay_lbtk is None:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
            def step(x_btd, layer):
                return body(layer, x_btd, None)

            x_btd, (st, ex) = step(x_btd, layers)
        else:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def step_replay(x_btd, layer, replay_btk):
                return body(layer, x_btd, replay_btk)

            x_btd, (st, ex) = step_replay(x_btd, layers, replay_lbtk)
        return x_btd, st, ex, None

    # The small per-layer arrays (norm weights, quantized weights' tensor scales) are selected from the whole stacks
    # by kvc.layer_rows (one small reduction a layer), weights a custom kernel reads at the layer index itself
    # (LAYER_INDEXED: fp4_gemm's) are handed over whole as the layer's view of them, the rest scanned (a dynamic
    # slice per layer, which XLA fuses into its own kernels and copies out before a custom kernel).
    graphdef, state = nnx.split(layers)
    leaves, treedef = jax.tree.flatten(state, is_leaf=_layer_indexed)
    kinds = ["view" if _layer_indexed(a) else "small" if math.prod(jnp.shape(a)[1:]) <= LAYER_ROW_MAX_ELEMENTS
             else "big" for a in leaves]
    small_l = [a.amax if k == "view" else a for a, k in zip(leaves, kinds) if k in ("small", "view")]
    big_l = [a for a, k in zip(leaves, kinds) if k == "big"]

    def step_cached(carry, big_i):
        # The stacked cache rides in the carry: layer i writes its new tokens into it in place and reads its slice.
        x_btd, cache, i = carry
        rows_i, big_i = iter(kvc.layer_rows(small_l, i)), iter(big_i)
        layer_leaves = [a.layer_view(i, next(rows_i)) if k == "view" else next(rows_i) if k == "small"
                        else next(big_i) for a, k in zip(leaves, kinds)]
        layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, layer_leaves))
        x_btd, st, ex, cache = layer(x_btd, cos_bth, sin_bth, mask_bts, mask_bt, policy, cache=cache,
                                     slot_bt=slot_bt, layer_index=i)
        return (x_btd, cache, i + 1), (st, ex)

    # A tuple cache is stacked for the scan and unstacked after it (two copies of it per call; the engine gives a
    # scanned model a stacked cache).
    (x_btd, out, _), (st, ex) = jax.lax.scan(step_cached, (x_btd, kvc.stack(cache), jnp.int32(0)), big_l,
                                             cfg.num_hidden_layers)
    return x_btd, st, ex, (out if cache.stacked else kvc.unstack(out))


# Per-layer arrays up to this many elements are selected by kv_cache.layer_rows in a scanned decode step.
LAYER_ROW_MAX_ELEMENTS = 1 << 14


def _layer_indexed(x) -> bool:
    """Stacked weights that a custom kernel reads at a layer index (`layer_view`; fp4_gemm's FP4GemmWeight, dense
    [L, ...] or per expert [L, E, ...])."""
    return bool(getattr(type(x), "LAYER_INDEXED", False)) and x.layer is None and jnp.ndim(x.codes) in (4, 5)


@functools.lru_cache(maxsize=4)
def _per_layer_skeleton(cfg: ModelConfig):
    """(graphdef, abstract state) of the per-layer model: built once per config (~1 s for 36 layers), not at
    every sync."""
    return nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))


def unstack_layers(model: Qwen3) -> Qwen3:
    """A scan_layers=True model as the per-layer model (scan_layers=False) with the same weights, each layer's
    variables a slice of the stacked ones; any other model as it is. The learner scans its layers (one layer to
    compile); the sampler's decode step runs them unrolled unless config sampler.scan_layers keeps them stacked
    (a scanned bf16 step copies its weights out of the stack at every step: tools/gpu_aot decode)."""
    if not model.cfg.scan_layers:
        return model
    cfg = model.cfg.replace(scan_layers=False)
    graphdef, state = _per_layer_skeleton(cfg)
    state = jax.tree.map(lambda v: v, state)  # a fresh State to fill (the cached one keeps no weights)
    pure = nnx.to_pure_dict(nnx.state(model))
    stacked = pure.pop("layers")
    pure["layers"] = {i: jax.tree.map(lambda v, i=i: v[i], stacked) for i in range(cfg.num_hidden_layers)}
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def prequantize_model(model: Qwen3, policy: PrecisionPolicy, *, mesh=None, rules=None) -> Qwen3:
    """A copy whose quantized-weight linear kernels are `QuantizedWeight`s, quantized once (for the sampler).

    The copy shares the untouched arrays with `model` (no copy of the high-precision weights); its forward under
    the same policy equals the on-the-fly quantized forward bit for bit, except where a backend merges a layer's
    projections into one kernel call (`_merge_projections`: fp4_gemm), whose float32 sums may then run in another
    order (within the kernel's accumulation bound). The xla backend's merged weights give the same bits on
    XLA:CPU (tests/test_quant_qdot.py). `mesh` / `rules`: where the sampler runs (its rules,
    sharding.sampler_rules); projections that this mesh splits are not merged.
    """
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)
    stacked = model.cfg.scan_layers
    if stacked:
        check_uniform_policy(policy, model.cfg.num_hidden_layers)
    for path, node in nnx.iter_graph(new):
        if not isinstance(node, (Linear, GroupedLinear)):
            continue
        prec = policy.for_layer(node.path)
        if prec.weight == "none" or isinstance(node.kernel.get_value(), QuantizedWeight):
            continue
        w = node.kernel_2d() if isinstance(node, Linear) else node.kernel.get_value().astype(node.dtype)
        per_layer = stacked and bool(path) and path[0] == "layers"
        n_in = len(node.in_dims) if isinstance(node, Linear) else 1
        n_out = len(node.out_dims) if isinstance(node, Linear) else 1
        names = _quantized_names(node.kernel.get_metadata().get("out_sharding"), n_in, n_out)
        node.kernel = QuantizedKernel(_quantize_kernel(w, prec, policy.backend, per_layer),
                                      **{QUANTIZED_NAMES: names})
    prec = policy.for_layer("lm_head")
    if new.lm_head is None and prec.weight != "none":
        w = new.embed.embedding[...].T.astype(new.cfg.dtype)
        names = _quantized_names(new.embed.embedding.get_metadata().get("out_sharding")[::-1], 1, 1)
        new.tied_head_q = QuantizedKernel(_quantize_kernel(w, prec, policy.backend, False), **{QUANTIZED_NAMES: names})
    _merge_projections(new, policy, mesh, rules)
    return new


def _merge_projections(model: Qwen3, policy: PrecisionPolicy, mesh=None, rules=None) -> None:
    """On a backend that merges quantized weights (Backend.concat_weights: fp4_gemm, one kernel launch per
    weight; xla, one 4-bit decode per weight), each layer's q / k / v and gate / up projections become one GEMM
    each (layers.MergedLinear; the parts set to None). Not for stacked layers, exact mode, parts with different
    precisions or unquantized, or parts that `mesh` splits: the merged kernel carries no logical names, so it is
    replicated (each device would decode every part's whole weight, and the outputs would be resharded). A
    custom kernel's weights (MESH_REPLICATED: fp4_gemm) are replicated anyway, and merge on any mesh."""
    if model.cfg.scan_layers or policy.exact or get_backend(policy.backend).concat_weights is None:
        return
    for layer in model.layers:
        groups = [(layer.attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))]
        if layer.mlp is not None:
            groups.append((layer.mlp, "gate_up_proj", ("gate_proj", "up_proj")))
        for owner, name, part_names in groups:
            parts = [getattr(owner, p) for p in part_names]
            if len({policy.for_layer(p.path) for p in parts}) != 1:
                continue
            kernels = [p.kernel for p in parts]
            if any(_split_on(mesh, rules, k.get_metadata().get(QUANTIZED_NAMES)) for k in kernels
                   if not (isinstance(k.get_value(), QuantizedWeight) and k.get_value().mesh_replicated)):
                continue
            merged = concat_prequantized([k.get_value() for k in kernels], policy.backend)
            if merged is None:
                continue
            setattr(owner, name, MergedLinear(parts, merged))
            for p in part_names:
                setattr(owner, p, None)


def _split_on(mesh, rules, names) -> bool:
    """Whether a quantized kernel with these logical names is split over `mesh` by the sampler's `rules`."""
    if mesh is None or names is None:
        return False
    from triage_jax import sharding as shd  # here: triage_jax.sharding imports this package

    rules = shd.sampler_rules(rules if rules is not None else shd.DEFAULT_RULES)
    return any(shd.split_count(mesh, a) > 1 for a in shd.logical_to_mesh(names, rules, mesh))


def _quantized_names(names, n_in: int, n_out: int):
    """The logical names of a quantized kernel's stored [..., N, K] layout from its parameter's [..., *in, *out]
    names: N is named by its first output axis and K by its first input axis (the major factor of each flattened
    group, so splitting N or K evenly splits that axis); None when the parameter has no names."""
    if names is None:
        return None
    lead = tuple(names[: len(names) - n_in - n_out])
    return lead + (names[len(lead) + n_in], names[len(lead)])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_kernel(w, prec, backend: str, per_layer: bool):
    """Quantize one kernel, always compiled: the forward quantizes on the fly inside jit, and XLA may compile
    `amax / 448` as a reciprocal multiply, so an eager quantization could differ from it in a scale's last bit."""
    quantize = functools.partial(prequantize, prec=prec, backend=backend)
    return jax.vmap(quantize)(w) if per_layer else quantize(w)  # stacked: one scale per layer, as scan sees it
