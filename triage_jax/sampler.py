"""The rollout engine: continuous batching over a fixed set of decode slots, with sampler log-probs.

A fixed number of slots share one KV cache (`models.kv_cache`: per layer [slots, KVH, S, Dh], stacked into one
array for a scan_layers model, each row filled from slot 0). Requests (G samples of each prompt) wait in a queue; a prompt is prefilled once and its KV
copied into the slots of its G samples; a finished sequence frees its slot and the next waiting sample takes it.
The decode loop runs `steps_per_round` tokens per host round trip, one compiled program per (slots, capacity); the
capacity follows the longest sequence held (a power of two, >= 64), so attention costs what the slots hold, not
what could be allocated. Once no request waits, the few sequences still decoding (a long-tail response) move
into a smaller slot set (`EngineConfig.compact_tail`), so they stop paying for every slot's matmuls and attention.

Deterministic: every draw is keyed by (request id, token index), never by a slot, and every per-token computation
has a fixed per-device shape (slots, prefill batch), so a request's tokens and log-probs do not depend on the slot
it lands in, the other requests, or continuous vs static batching, at the same capacity bucket; across capacity
buckets, and when a compacted tail runs in fewer slots, XLA's reduction order can move a log-prob's last bit (not
under an exact policy, docs/numerics.md#exact-mode); the tokens stay the same. The same config and seed always give
the same bits: the schedule itself is a function of the tokens.

Log-probs: for every drawn token the sampler reports log_softmax(logits / T) over the FULL vocabulary at the
sampling temperature T, before top-k / top-p truncation (what verl and vLLM report as rollout log-probs with a
temperature); the learner recomputes the same quantity with `triage_jax.logprobs`. Greedy decoding also reports
the log-prob at `temperature`.

Routing (MoE, `record_routing=True`): the engine also returns the expert ids every prompt and response token used
in every MoE layer (the prefill's for the prompt, each decode step's for the token it feeds), stored compactly
(`models.moe.routing_dtype`), for the learner to replay (R3, `rl.routing_replay`). They are per-token numbers like
the log-probs, so they do not depend on the slot or the batch either.

The sampler's precision policy is its own: weights are quantized once beforehand (`prepare_model`, i.e.
`models.prequantize_model`) and activations are quantized token-wise (`act_scaling="row"`, see `sampler_policy`),
so a token's numerics do not depend on the other tokens of its batch or on prefill versus decode.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding

from triage_jax import background
from triage_jax.logprobs import lm_head_logits, logprob_of
from triage_jax.models import kv_cache as kvc
from triage_jax.models.moe import routing_dtype
from triage_jax.models.sharding import BATCH, HEADS, KV, LENGTH
from triage_jax.quant import PRESETS, PrecisionPolicy

MIN_BUCKET = kvc.BLOCK  # the smallest cache capacity bucket
MIN_PROMPT_BUCKET = 8  # the smallest prefill width (its cache still holds MIN_BUCKET slots)
# The fewest slots per device a compacted tail keeps: XLA:CPU computes a one-row dot with a matrix-vector kernel,
# whose sums round differently from the 2-15-row kernel (measured: 2-15 slots bit-identical, 1 and 16+ one ulp off).
MIN_COMPACT_SLOTS = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to draw tokens. top_k=0 and top_p=1.0 disable those filters; stop tokens are kept in the response."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()
    greedy: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0 (use greedy=True for argmax); "
                             f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 disables it); got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1; got {self.max_new_tokens}")


@struct.dataclass
class SampleOutput:
    """Sampled responses. tokens/logprobs hold pad_id/0 where mask is 0 (after a row's stop token)."""

    tokens: jax.Array  # [B, N] int32 generated tokens, the stop token included
    lengths: jax.Array  # [B] int32 number of generated tokens (mask.sum(-1))
    logprobs: jax.Array  # [B, N] float32 sampler log-prob of each token (full vocabulary, temperature T)
    mask: jax.Array  # [B, N] bool
    prompt_tokens: jax.Array  # [B, P] int32 left-padded prompts
    prompt_mask: jax.Array  # [B, P] bool
    prompt_lengths: jax.Array  # [B] int32
    steps: jax.Array  # int32 scalar: decode steps run (< max_new_tokens when every row stopped early)
    # [B, P + N, L_moe, k] expert ids of each token of prompt ++ response in each MoE layer, -1 where none was
    # computed (pads, a response's last token, which is never fed); None unless the engine records routing.
    routing: jax.Array | None = None


def token_wise_rules(rules, act_scaling: str = "row") -> tuple:
    """Per-layer (regex, preset) rules with the sampler's activation scales (token-wise by default, as its preset)."""
    out = []
    for pattern, prec in rules:
        prec = PRESETS[prec] if isinstance(prec, str) else prec
        out.append((pattern, dataclasses.replace(prec, act_scaling=act_scaling) if prec.act != "none" else prec))
    return tuple(out)


def sampler_policy(preset: str = "bf16", kv_cache: str = "bf16", *, rules=(), act_scaling: str = "row",
                   **kw) -> PrecisionPolicy:
    """The sampler's policy: `preset` weights/activations with token-wise activation scales (its per-layer `rules`
    alike), and the KV format. act_scaling="tensor" (a mismatch dial, config.sampler.act_scaling) shares one
    float32 activation scale over the whole batch, so a response's numbers depend on what it is batched with."""
    return PrecisionPolicy.from_spec(preset, act_scaling=act_scaling, kv_cache=kv_cache,
                                     rules=token_wise_rules(rules, act_scaling), **kw)


def prepare_model(model, policy: PrecisionPolicy, *, mesh=None, rules=None, unstack: bool = True):
    """The sampler's copy (the learner -> sampler sync): per-layer modules (a scan_layers=True learner's layers
    unstacked: models.unstack_layers), the weights quantized once (no-op for high precision), a layer's q / k / v
    and gate / up merged where the backend merges them and the engine's `mesh` (by `rules`) does not split them
    (models.prequantize_model). unstack=False keeps a scanned model's layers stacked, its decode step a loop over
    them (config sampler.scan_layers; what the GPU benchmarks weigh against unrolled: experiments/bench_gpu.py's
    *_scan samplers)."""
    from triage_jax import models

    return models.prequantize_model(models.unstack_layers(model) if unstack else model, policy, mesh=mesh,
                                    rules=rules)


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two >= n (at least `minimum`): the compiled-shape bucket of a length."""
    return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def filter_logits(logits_bv: jax.Array, *, top_k: int = 0, top_p: float | jax.Array = 1.0,
                  use_top_p: bool | None = None) -> jax.Array:
    """Top-k then top-p (nucleus) filtering: logits outside the kept set become -inf.

    top-p keeps the smallest set of highest-probability tokens whose mass reaches top_p (a token is kept when the
    mass strictly before it is < top_p), computed on the top-k-filtered distribution like HF transformers. Tokens
    tied with the last kept logit are kept too.
    """
    v = logits_bv.shape[-1]
    neg = jnp.asarray(-jnp.inf, logits_bv.dtype)
    if 0 < top_k < v:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][..., -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, neg, logits_bv)
    if use_top_p is None:
        use_top_p = not (isinstance(top_p, (int, float)) and top_p >= 1.0)
    if use_top_p:
        sorted_bv = -jnp.sort(-logits_bv, axis=-1)
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        n_keep_b1 = jnp.maximum(jnp.sum(mass_before_bv < top_p, axis=-1, keepdims=True), 1)
        threshold_b1 = jnp.take_along_axis(sorted_bv, n_keep_b1 - 1, axis=-1)
        logits_bv = jnp.where(logits_bv < threshold_b1, neg, logits_bv)
    return logits_bv


@dataclasses.dataclass(frozen=True)
class _Static:
    """The compile-time part of a SamplingConfig (temperature, top_p and stop ids are traced)."""

    max_new_tokens: int
    top_k: int
    use_top_p: bool
    greedy: bool
    pad_id: int
    exact: bool = False  # exact mode's log-prob normalizer (PrecisionPolicy.exact)


def _static(cfg: SamplingConfig, pad_id: int, exact: bool = False) -> _Static:
    return _Static(cfg.max_new_tokens, cfg.top_k, cfg.top_p < 1.0, cfg.greedy, int(pad_id), bool(exact))


def _hyper(cfg: SamplingConfig):
    stop = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)
    return jnp.float32(cfg.temperature), jnp.float32(cfg.top_p), stop


def _draw(scaled_bv, keys_b, top_p, st: _Static):
    """One token per row from logits already divided by T (row b drawn with keys_b[b]), and its full-vocabulary
    log-prob."""
    if st.greedy:
        tok_b = jnp.argmax(scaled_bv, axis=-1).astype(jnp.int32)
    else:
        filtered = filter_logits(scaled_bv, top_k=st.top_k, top_p=top_p, use_top_p=st.use_top_p)
        tok_b = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys_b, filtered).astype(jnp.int32)
    return tok_b, logprob_of(scaled_bv, tok_b, st.exact)


def _token_keys(key, req_b, index_b):
    """The key of token `index_b` of request `req_b`: a request's draws never depend on its slot."""
    return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(key, r), i))(req_b, index_b)


@struct.dataclass
class Slots:
    """The engine's device state: the shared KV cache and, per slot, its request and what it generated."""

    cache: kvc.KVCache  # batch = slots
    tok: jax.Array  # int32 [S]: the last drawn token (the next one to feed)
    active: jax.Array  # bool [S]: decoding
    req: jax.Array  # int32 [S]: request id
    n_gen: jax.Array  # int32 [S]: tokens generated so far
    out_tok: jax.Array  # int32 [S, R]
    out_logp: jax.Array  # float32 [S, R]
    out_exp: jax.Array | None = None  # [S, R, L_moe, k] expert ids of each fed response token (-1: none); or None


def _routing_shape(model_cfg) -> tuple[int, int]:
    """(MoE layers, experts per token): the trailing dimensions of recorded routing."""
    return sum(map(model_cfg.is_moe_layer, range(model_cfg.num_hidden_layers))), model_cfg.num_experts_per_tok


def _empty_slots(model_cfg, slots: int, capacity: int, st: _Static, kv_format: str, dtype,
                 record_routing: bool = False, *, kv_combined: bool) -> Slots:
    r = st.max_new_tokens
    out_exp = (jnp.full((slots, r, *_routing_shape(model_cfg)), -1, routing_dtype(model_cfg.num_experts))
               if record_routing else None)
    return Slots(cache=kvc.init_kv_cache(model_cfg, slots, capacity, kv_format=kv_format, dtype=dtype,
                                         combined=kv_combined),
                 tok=jnp.zeros((slots,), jnp.int32), active=jnp.zeros((slots,), bool),
                 req=jnp.zeros((slots,), jnp.int32), n_gen=jnp.zeros((slots,), jnp.int32),
                 out_tok=jnp.full((slots, r), st.pad_id, jnp.int32), out_logp=jnp.zeros((slots, r), jnp.float32),
                 out_exp=out_exp)


class _Program:
    """One of the engine's compiled programs: `jax.jit(fn, **jit_kw)`, and per set of XLA compiler options
    (`EngineConfig.xla_options`) its own jit of fn with them (each its own compilation cache)."""

    def __init__(self, fn, **jit_kw):
        self.fn, self.jit_kw = fn, jit_kw
        self._jitted = {(): jax.jit(fn, **jit_kw)}
        functools.update_wrapper(self, fn)

    def with_options(self, options: tuple = ()):
        if options not in self._jitted:
            self._jitted[options] = jax.jit(self.fn, **self.jit_kw, compiler_options=dict(options))
        return self._jitted[options]

    def __call__(self, *args, **kw):
        return self._jitted[()](*args, **kw)

    def __getattr__(self, name):  # lower, eval_shape, _cache_size, ... of the default program
        return getattr(self._jitted[()], name)


def _program(**jit_kw):
    return lambda fn: _Program(fn, **jit_kw)


class StaticGraph:
    """A GraphDef as a jit static argument, hashed once: jit hashes its static arguments at every call, and a deep
    model's GraphDef hashes in milliseconds (2.1 ms for 36 layers, measured): once per decode round, host time the
    device waits for. Equal when the same object (the engine passes the one it made at `load`) or equal GraphDefs."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)


@functools.lru_cache(maxsize=16)
def static_graph(graphdef) -> StaticGraph:
    """The one StaticGraph of an (equal) GraphDef: every load of the same model structure passes the jitted
    programs the same object, so their cache finds it by identity, with no GraphDef comparison per call."""
    return StaticGraph(graphdef)


def _graph(graphdef):
    """The GraphDef of a program's static `graphdef` argument (a GraphDef or a StaticGraph)."""
    return graphdef.graphdef if isinstance(graphdef, StaticGraph) else graphdef


def _abstract(tree, shardings=None):
    """ShapeDtypeStructs of a tree's arrays (with these shardings, else none: how an uncommitted input keys jit)."""
    return jax.tree.map(lambda x, sh=None: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree,
                        *(() if shardings is None else (shardings,)))


def check_xla_options(options: tuple) -> tuple:
    """EngineConfig.xla_options as a tuple of (name, value) pairs, each checked by compiling a trivial program with
    it (milliseconds), so a misspelt option or a bad value fails at construction, not at the first rollout's
    compile. XLA takes the options of every backend anywhere (a GPU option is accepted, and ignored, on a CPU)."""
    pairs = []
    for item in options:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"EngineConfig.xla_options: {item!r} is not a (name, value) pair")
        pairs.append((item[0], item[1]))
    if pairs:
        try:
            jax.jit(lambda x: x + 1, compiler_options=dict(pairs)).lower(jnp.int32(0)).compile()
        except Exception as e:
            raise ValueError(f"EngineConfig.xla_options={tuple(pairs)!r}: XLA refuses them: {e}") from None
    return tuple(pairs)


def program_options(options: tuple, kv_format: str, kv_combined: bool) -> tuple:
    """The XLA options the engine's programs compile with: EngineConfig.xla_options and, with a combined FP8 KV
    cache, XLA's slice sinker off. A combined cache keeps a layer's keys and values in one buffer
    (models/kv_cache.py); in FP8 each half enters the attention's GEMMs through a convert, and the slice sinker
    turns the two converts of the two halves into one convert of the whole buffer, sliced after: a bf16 copy of
    the layer's cache every decode step, which no GEMM fusion takes (the 2-layer 4B decode step: 50 launches with
    it, 48 without, as with a bf16 cache). Elementwise ops give the same bits wherever they sit."""
    if kv_format != "fp8" or not kv_combined:
        return options
    opts = dict(options)
    passes = [p for p in str(opts.get("xla_disable_hlo_passes", "")).split(",") if p]
    opts["xla_disable_hlo_passes"] = ",".join(passes + ["slice-sinker"] * ("slice-sinker" not in passes))
    return tuple(opts.items())


@_program(static_argnames=("graphdef", "policy", "capacity", "kv_format", "record_routing", "kv_combined"))
def _prefill(graphdef, state, ids_pb, mask_pb, k_scale, v_scale, temperature, *, policy, capacity, kv_format,
             kv_combined, record_routing=False):
    """Right-padded prompts [PB, Pb] into a fresh cache of `capacity` slots (a multiple of 64, >= Pb; the
    engine's FP8 scales, if set): their KV, the
    scaled logits after each prompt's last token and, when recording routing, the prompt tokens' expert ids
    [PB, Pb, L_moe, k] (compact, -1 on pads; else None)."""
    model = nnx.merge(_graph(graphdef), state)
    pb = ids_pb.shape[0]
    cache = kvc.init_kv_cache(model.cfg, pb, capacity, kv_format=kv_format, dtype=jnp.dtype(model.cfg.dtype),
                              combined=kv_combined)
    cache = cache.replace(k_scale=k_scale, v_scale=v_scale)
    h_btd, cache, *aux = model(ids_pb, attention_mask_bt=mask_pb, policy=policy, cache=cache, return_hidden=True,
                               return_aux=record_routing)
    last_b = jnp.sum(mask_pb, axis=1) - 1
    h_bd = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)[:, 0]
    experts = None
    if record_routing:
        dt = routing_dtype(model.cfg.num_experts)
        experts = jnp.where(mask_pb[:, :, None, None], aux[0]["experts_btlk"], -1).astype(dt)
    return cache, lm_head_logits(h_bd, model.lm_head_kernel(), policy, temperature), experts


@_program(static_argnames=("st",), donate_argnames=("slots",))
def _insert(slots: Slots, pre: kvc.KVCache, logits_pv, slot_m, row_m, req_m, key, top_p, stop_s, *, st: _Static):
    """Copy prefilled prompt rows row_m into slots slot_m (slot index >= S: unused entry) and draw each sample's
    first token from its prompt's logits."""
    cache = kvc.insert_rows(slots.cache, pre, slot_m, row_m).replace(
        k_scale=pre.k_scale, v_scale=pre.v_scale,
        lengths=slots.cache.lengths.at[slot_m].set(pre.lengths[row_m], mode="drop"))
    tok_m, logp_m = _draw(logits_pv[row_m], _token_keys(key, req_m, jnp.zeros_like(req_m)), top_p, st)
    alive_m = ~jnp.isin(tok_m, stop_s) & (st.max_new_tokens > 1)
    if slots.out_exp is not None:
        slots = slots.replace(out_exp=slots.out_exp.at[slot_m].set(-1, mode="drop"))
    return slots.replace(
        cache=cache, tok=slots.tok.at[slot_m].set(tok_m, mode="drop"),
        active=slots.active.at[slot_m].set(alive_m, mode="drop"), req=slots.req.at[slot_m].set(req_m, mode="drop"),
        n_gen=slots.n_gen.at[slot_m].set(1, mode="drop"),
        out_tok=slots.out_tok.at[slot_m].set(jnp.full((slot_m.shape[0], st.max_new_tokens), st.pad_id,
                                                      jnp.int32).at[:, 0].set(tok_m), mode="drop"),
        out_logp=slots.out_logp.at[slot_m].set(jnp.zeros((slot_m.shape[0], st.max_new_tokens),
                                                         jnp.float32).at[:, 0].set(logp_m), mode="drop"))


@_program(static_argnames=("graphdef", "policy", "st", "steps", "fixed"), donate_argnames=("slots",))
def _decode_round(graphdef, state, slots: Slots, key, temperature, top_p, stop_s, *, policy, st: _Static,
                  steps: int, fixed: bool = False):
    """`steps` decode steps of every active slot: feed each slot's last token, draw the next one. Fewer once every
    slot is done, unless `fixed`: then always `steps` (a step with no active slot changes nothing), so the loop's
    trip count is a compile-time constant and XLA:GPU runs it without copying the loop condition to the host and
    waiting for the device at every step (EngineConfig.round_loop)."""
    rows_s = jnp.arange(slots.tok.shape[0])

    def cond(c):
        i, sl, _ = c
        return i < steps if fixed else (i < steps) & jnp.any(sl.active)

    def body(c):
        i, sl, st_w = c
        # The weights ride in the loop's carry (unchanged) and the model is built inside: nnx.scan (scan_layers=True)
        # cannot use graph nodes from the trace outside the loop.
        model = nnx.merge(_graph(graphdef), st_w)
        # Every FP8 scale is set: a slot decodes only after its insertion, whose prefill set every layer's scale.
        h_s1d, cache, *aux = model(sl.tok[:, None], attention_mask_bt=sl.active[:, None], policy=policy,
                                   cache=sl.cache.replace(scales_set=True), return_hidden=True,
                                   return_aux=sl.out_exp is not None)
        cache = cache.replace(scales_set=sl.cache.scales_set)  # the loop's carry keeps its structure
        # The head's kernel is taken inside the loop, next to its dot, as the learner's program has it: hoisted out,
        # the tied head's transpose can reach the dot in another layout, and another layout sums in another order.
        scaled_sv = lm_head_logits(h_s1d[:, 0], model.lm_head_kernel(), policy, temperature)
        new_s, logp_s = _draw(scaled_sv, _token_keys(key, sl.req, sl.n_gen), top_p, st)
        idx_s = jnp.where(sl.active, sl.n_gen, st.max_new_tokens)  # inactive rows write nowhere (dropped)
        if sl.out_exp is not None:  # the fed token is response token n_gen - 1
            fed_s = jnp.where(sl.active, sl.n_gen - 1, st.max_new_tokens)
            sl = sl.replace(out_exp=sl.out_exp.at[rows_s, fed_s].set(
                aux[0]["experts_btlk"][:, 0].astype(sl.out_exp.dtype), mode="drop"))
        n_gen = sl.n_gen + sl.active
        done_s = sl.active & (jnp.isin(new_s, stop_s) | (n_gen >= st.max_new_tokens))
        return i + 1, sl.replace(
            cache=cache, tok=jnp.where(sl.active, new_s, sl.tok), active=sl.active & ~done_s, n_gen=n_gen,
            out_tok=sl.out_tok.at[rows_s, idx_s].set(new_s, mode="drop"),
            out_logp=sl.out_logp.at[rows_s, idx_s].set(logp_s, mode="drop")), st_w

    return jax.lax.while_loop(cond, body, (jnp.int32(0), slots, state))[1]


@functools.partial(jax.jit, static_argnames=("capacity",), donate_argnames=("slots",))
def _resize_jit(slots: Slots, *, capacity: int) -> Slots:
    return slots.replace(cache=kvc.resize(slots.cache, capacity))


def _resize(slots: Slots, *, capacity: int) -> Slots:
    """The slots with the KV cache at `capacity`. The old cache buffers cannot be reused for the new shape (the
    other fields are), so JAX's warning that some donated buffers were unusable is expected here and silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return _resize_jit(slots, capacity=capacity)


def _take_slots_fn(slots: Slots, slot_k) -> Slots:
    """Slots slot_k of `slots`, in that order: every per-slot array gathered (the per-layer FP8 scales kept)."""
    def take(x):
        return None if x is None else jnp.take(x, slot_k, axis=0)

    cache = kvc.map_layers(take, slots.cache).replace(lengths=take(slots.cache.lengths))
    return slots.replace(cache=cache, tok=take(slots.tok), active=take(slots.active), req=take(slots.req),
                         n_gen=take(slots.n_gen), out_tok=take(slots.out_tok), out_logp=take(slots.out_logp),
                         out_exp=take(slots.out_exp))


_take_slots = jax.jit(_take_slots_fn)  # one device; on a mesh `Engine._take_program` (its output split)


@jax.jit
def _harvest(slots: Slots, slot_k):
    exp = None if slots.out_exp is None else slots.out_exp[slot_k]
    return slots.out_tok[slot_k], slots.out_logp[slot_k], exp


ROUND_LOOPS = ("auto", "fixed", "early_exit")  # EngineConfig.round_loop
KV_LAYOUTS = ("auto", "combined", "split")  # EngineConfig.kv_layout


def combined_kv(kv_layout: str, platform: str) -> bool:
    """Whether the engine's KV cache keeps a layer's keys and values in one buffer (EngineConfig.kv_layout) on
    devices of `platform`."""
    return kv_layout == "combined" or (kv_layout == "auto" and kvc.combined_default(platform))


def fixed_round_loop(round_loop: str, platform: str) -> bool:
    """Whether the decode round runs a fixed number of steps (EngineConfig.round_loop) on devices of `platform`."""
    return round_loop == "fixed" or (round_loop == "auto" and platform == "gpu")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Slots and scheduling. `max_len` bounds a sequence (prompt + response); `continuous=False` runs static
    waves (every slot filled, decoded until all are done, then refilled): the baseline continuous batching beats."""

    max_slots: int
    max_len: int
    steps_per_round: int = 8
    prefill_batch: int = 8
    continuous: bool = True
    # Continuous mode, once nothing waits: when at most 1/compact_tail of the slots still decode, move them into
    # a slot set that fits them (a power of two per device, >= MIN_COMPACT_SLOTS), so a long-tail response does not keep
    # every slot's matmuls and attention running (0: never).
    compact_tail: int = 4
    # The longest prompt expected (0: not known): prompts are prefilled at least at its power-of-two bucket
    # (>= MIN_PROMPT_BUCKET), else at least MIN_BUCKET columns wide.
    max_prompt_len: int = 0
    # XLA compiler options for the engine's programs (prefill, insert, decode round), as (name, value) pairs, e.g.
    # (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),) to run
    # the decode loop as one CUDA graph; per program, so the learner's programs and the user's XLA_FLAGS are
    # untouched. Checked at construction (`check_xla_options`).
    xla_options: tuple = ()
    # Compile the first round's programs (prefill, insert, decode round) side by side on threads before running it,
    # instead of one after another as each is first called: a fresh process's first rollout waits for the slowest
    # compile, not for their sum (XLA compiles with the GIL released).
    parallel_compile: bool = True
    # Once a round runs at a capacity, compile the decode round at the larger capacity buckets (up to max_len) on a
    # background thread, so a sequence growing into the next bucket finds its program compiled instead of stalling
    # the rollout while it compiles (a long response crosses several buckets in the first rollout). Off by
    # default: it compiles programs a short generate never uses.
    compile_ahead: bool = False
    # The decode round's loop (ROUND_LOOPS): "early_exit" stops a round once every slot is done, which makes its
    # trip count data-dependent: XLA:GPU then copies the loop condition to the host and blocks until the device is
    # idle before each step (its WhileThunk), so the host cannot queue a step's kernels while the previous step
    # runs. "fixed" always runs steps_per_round steps (a known trip count: no per-step host round trip; the last
    # round of a generate may compute up to steps_per_round - 1 steps with no active slot, changing nothing).
    # "auto": fixed on GPUs, early_exit elsewhere (XLA:CPU evaluates the condition in place; TPUs on device).
    # Tokens and log-probs are the same bits either way.
    round_loop: str = "auto"
    # The KV cache's layout (KV_LAYOUTS, models/kv_cache.py): "combined" keeps a layer's keys and values in one
    # buffer, written by one scatter (one kernel a layer less per decode step on a GPU); "split" in two (XLA:CPU
    # copies each half of a combined buffer out before its dot: the whole cache every step). "auto": combined
    # off the CPU. The same tokens and log-probs either way.
    kv_layout: str = "auto"

    def __post_init__(self):
        for name in ("max_slots", "max_len", "steps_per_round", "prefill_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.compact_tail == 1 or self.compact_tail < 0:
            raise ValueError(f"EngineConfig.compact_tail must be 0 (never) or >= 2, got {self.compact_tail}")
        if self.max_prompt_len < 0:
            raise ValueError(f"EngineConfig.max_prompt_len must be >= 0 (0: not known), got {self.max_prompt_len}")
        if self.round_loop not in ROUND_LOOPS:
            raise ValueError(f"EngineConfig.round_loop must be one of {ROUND_LOOPS}, got {self.round_loop!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"EngineConfig.kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        object.__setattr__(self, "xla_options", check_xla_options(tuple(self.xla_options)))


class Engine:
    """Continuous batching over `config.max_slots` decode slots; `load` a (prepared) model, then `generate`."""

    def __init__(self, cfg: SamplingConfig, config: EngineConfig, *, policy: PrecisionPolicy | None = None,
                 pad_id: int = 0, model=None, mesh=None, rules=None, record_routing: bool = False):
        """mesh: the learner's mesh; the slots split over its batch axes (data x fsdp x expert), every slot
        computation keeping its per-device shape, so a request's numbers do not depend on the device count.
        record_routing: return each token's MoE expert ids (`SampleOutput.routing`; an MoE model only)."""
        from triage_jax import sharding as shd

        self.cfg, self.config = cfg, config
        # The learner's table with the weights replicated over the data-parallel axes (split over tensor, expert).
        self.mesh, self.rules = mesh, shd.sampler_rules(rules if rules is not None else shd.DEFAULT_RULES)
        self.shards = 1
        if mesh is not None:
            self.shards = int(np.prod([mesh.shape.get(a, 1) for a in shd.batch_axes(self.rules)]))
            if config.max_slots % self.shards:
                raise ValueError(f"config.sampler.max_slots: {config.max_slots} decode slots do not split over the "
                                 f"{self.shards} batch shards of mesh {dict(mesh.shape)}")
        # prefill_batch rows per shard: the prefill's per-device shape, like the decode's, is the device count's.
        self.prefill_batch = config.prefill_batch * self.shards
        self.prompt_bucket = (min(bucket_length(config.max_prompt_len, MIN_PROMPT_BUCKET), MIN_BUCKET)
                              if config.max_prompt_len else MIN_BUCKET)  # the narrowest prefill
        self.policy = policy or PrecisionPolicy()
        self.st = _static(cfg, pad_id, self.policy.exact)
        self.pad_id = int(pad_id)
        self.record_routing = bool(record_routing)
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        self.fixed_rounds = fixed_round_loop(config.round_loop, platform)  # the decode round's loop, resolved
        self.kv_combined = combined_kv(config.kv_layout, platform)  # and the KV cache's layout
        # What its programs compile with.
        self.xla_options = program_options(config.xla_options, self.policy.kv_cache, self.kv_combined)
        self.rounds = 0  # decode rounds run by the last generate (steps <= rounds * steps_per_round)
        self.capacities: list[int] = []  # the cache capacity of each of those rounds
        self.slot_counts: list[int] = []  # and its number of slots (smaller once the tail is compacted)
        self.prefills = 0  # prefill calls of the last generate
        self._compiled_first_rounds: set = set()  # shapes `_compile_first_round` compiled
        self._ahead: dict = {}  # decode-round shapes compiled (or compiling) ahead -> their Future
        self._take_programs: dict = {}  # the tail compaction's gather on a mesh, per slot count (_take_program)
        self.graphdef = self.state = None
        if model is not None:
            self.load(model)

    def load(self, model) -> None:
        """Use these weights from now on (the learner -> sampler sync hands the prepared model over). On a mesh
        they are resharded device to device by the sampler's rules: replicated over the data-parallel axes,
        attention heads, MLP columns and the vocabulary split over tensor (tensor parallelism), experts over
        expert; weights held on other devices (the learner's, when the sampler has a mesh of its own) are copied."""
        self.graphdef, self.state = split_model(model)
        self._graph = static_graph(self.graphdef)  # what the programs get: hashed once per load, not per call
        self.model_cfg = nnx.merge(self.graphdef, self.state).cfg
        if self.mesh is not None:
            self._check_tensor_split()
            self.state = self._on_mesh(self.state)
        if self.record_routing and not self.model_cfg.is_moe:
            raise ValueError("Engine(record_routing=True) needs an MoE model; this one is dense (num_experts=0)")
        if self.config.max_len > self.model_cfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_len={self.config.max_len} exceeds the model's "
                             f"max_position_embeddings={self.model_cfg.max_position_embeddings}")

    # ------------------------------------------------------------------------------------------ helpers
    def _check(self, prompts):
        if len(prompts) == 0:
            raise ValueError("generate: got an empty list of prompts")
        r, cap = self.cfg.max_new_tokens, self.config.max_len
        vocab = self.model_cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
            if len(p) + r > cap:
                raise ValueError(f"generate: prompt {i} has {len(p)} tokens; with max_new_tokens={r} it needs "
                                 f"{len(p) + r} cache slots but max_cache_len={cap}")
            row = np.asarray(p)
            if ((row < 0) | (row >= vocab)).any():
                raise ValueError(f"generate: prompt {i} has token ids {row[(row < 0) | (row >= vocab)][:5].tolist()} "
                                 f"outside [0, {vocab})")

    def _context(self):
        from triage_jax import sharding as shd

        return shd.activate(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    def _place(self, slots: Slots) -> Slots:
        return slots if self.mesh is None else jax.device_put(slots, self.slot_shardings(slots))

    def slot_shardings(self, slots: Slots) -> Slots:
        """Where the slot arrays live on the mesh: split over the batch shards, the KV buffers ([2 (keys, values)]
        when combined, slots, KV heads, capacity, head dim) also by heads like the k / v projections that fill them;
        the per-layer FP8 scales replicated. (Concrete or abstract slots; the dry-run compiles with these.)"""
        from triage_jax import sharding as shd

        s = slots.tok.shape[0]
        out = jax.tree.map(lambda x: shd.batch_sharding(self.mesh, x.ndim, self.rules) if x.ndim and x.shape[0] == s
                           else shd.replicated(self.mesh), slots)
        rep = jax.tree.map(lambda _: shd.replicated(self.mesh), slots.cache.k_scale)  # [L] may equal the slots
        out = out.replace(cache=out.cache.replace(k_scale=rep, v_scale=rep))
        names = (None,) * slots.cache.combined + (None,) * slots.cache.stacked + (BATCH, HEADS, LENGTH, KV)
        kv = NamedSharding(self.mesh, shd.logical_to_mesh(names, self.rules, self.mesh))
        return out.replace(cache=out.cache.replace(kv=jax.tree.map(lambda _: kv, slots.cache.kv)))

    def state_shardings(self, state):
        """Where the (prepared) weights live on the mesh: `sharding.sampler_state_shardings` by the engine's rules."""
        from triage_jax import sharding as shd

        return shd.sampler_state_shardings(state, self.mesh, self.rules)

    def _on_mesh(self, state):
        return jax.device_put(state, self.state_shardings(state))

    def _heads_split(self) -> int:
        """How many ways the attention heads (and the KV cache's heads) are split over the mesh."""
        from triage_jax import sharding as shd

        return shd.split_count(self.mesh, shd.logical_to_mesh((HEADS,), self.rules, self.mesh)[0])

    def _check_tensor_split(self) -> None:
        t, m = self._heads_split(), self.model_cfg
        if t > 1 and (m.num_key_value_heads % t or m.num_attention_heads % t):
            raise ValueError(f"config.mesh.tensor: the sampler splits attention heads {t} ways, but the model has "
                             f"{m.num_attention_heads} query and {m.num_key_value_heads} KV heads")

    def _take_program(self, slots: Slots, slot_k: jax.Array):
        """The program of _take_slots_fn(slots, slot_k) on this engine's devices. On a mesh its output is split over
        the batch shards as every slot array is (`slot_shardings`): left to the partitioner, the gathered slots came
        out replicated, every device holding the whole compacted cache and a copy split it again (on 8 H200s, 32 of
        128 slots of the 4B at capacity 4,096: 19.33 GB per device where its share is 2.42 GB; tests/test_gpu_aot.py)."""
        if self.mesh is None:
            return _take_slots
        key = (slot_k.shape[0], jax.tree.structure(slots))
        fn = self._take_programs.get(key)
        if fn is None:
            out = jax.eval_shape(_take_slots_fn, slots, slot_k)
            fn = self._take_programs[key] = jax.jit(_take_slots_fn, out_shardings=self.slot_shardings(out))
        return fn

    def _compacted(self, slots: Slots, owner: dict, host_len: np.ndarray):
        """The tail compaction (EngineConfig.compact_tail): (slots, owner, host_len) moved into the smallest slot
        set that holds the occupied slots (a power of two per device, >= MIN_COMPACT_SLOTS), or the inputs
        unchanged when that would not shrink them. A request's numbers do not move: its draws are keyed by its id,
        and a slot's computation depends on no other slot (tests/test_engine.py checks the bits)."""
        s, k = slots.tok.shape[0], self.config.compact_tail
        if not k or len(owner) * k > s:
            return slots, owner, host_len
        new = self.shards * max(MIN_COMPACT_SLOTS, bucket_length(-(-len(owner) // self.shards), 1))
        if new >= s:
            return slots, owner, host_len
        kept = sorted(owner)
        spare = next(j for j in range(s) if j not in owner)  # an empty slot pads the new set
        idx = np.array(kept + [spare] * (new - len(kept)), np.int32)
        slot_k = jnp.asarray(idx)
        slots = self._take_program(slots, slot_k)(slots, slot_k)
        owner = {j: owner[old] for j, old in enumerate(kept)}
        return slots, owner, np.concatenate([host_len[kept], np.zeros(new - len(kept), host_len.dtype)])

    def _capacity(self, need: int) -> int:
        cap = bucket_length(need)
        return min(cap, -(-self.config.max_len // kvc.BLOCK) * kvc.BLOCK)

    # ------------------------------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int]], key, *, n: int = 1) -> SampleOutput:
        """`n` samples of each prompt; row i * n + j is sample j of prompt i (its request id)."""
        if self.graphdef is None:
            raise RuntimeError("Engine.generate before Engine.load(model)")
        self._check(prompts)
        with self._context():
            return self._generate(prompts, key, n)

    def _first_round_programs(self, prompts, key, n: int) -> list:
        """Thunks that compile the programs the first round of `_generate(prompts, key, n)` calls first (ahead of
        time, for the same arguments it will pass, so its jit calls find them compiled): the prefill of the first
        prompt batch, the insert of its samples, the decode round at the round's capacity; none when these shapes
        were compiled before. They mirror `_generate`'s scheduling; where they do not match a call (other prompt
        batches of the first admission, later capacities) that call compiles as before."""
        c, st, s, pb = self.config, self.st, self.config.max_slots, self.prefill_batch
        opts, kv_format = self.xla_options, self.policy.kv_cache
        lens = np.array([len(p) for p in prompts], np.int64)
        temperature, top_p, stop_s = _hyper(self.cfg)
        slots_at = functools.partial(self._abstract_slots, s)
        cap0 = self._capacity(int(lens.max()) + 1)
        which = list(range(min(pb, len(prompts))))
        p = bucket_length(int(lens[which].max()), self.prompt_bucket)
        cap_pre = -(-p // kvc.BLOCK) * kvc.BLOCK
        scales = slots_at(cap0).cache.k_scale  # the engine's (placed) FP8 scales
        prefill = _prefill.with_options(opts)
        pre_kw = dict(policy=self.policy, capacity=cap_pre, kv_format=kv_format, record_routing=self.record_routing,
                      kv_combined=self.kv_combined)

        def pre_args():
            # Host-built inputs as the calls build them (jnp.asarray inside the engine's context: on a mesh their
            # type carries it), so made on the compiling thread, inside that context.
            ids = jnp.zeros((pb, p), jnp.int32)
            return self._graph, self.state, ids, ids.astype(bool), scales, scales, temperature

        m = min(len(which) * n, s)
        need = int(lens[which].max()) + 1
        cap_ins = cap0 if need <= cap0 and cap_pre <= cap0 else self._capacity(max(need, cap_pre))
        m_bucket = min(bucket_length(m, 1), s)
        key_a = jax.ShapeDtypeStruct(jnp.shape(key), jnp.asarray(key).dtype)
        held = int(lens[: -(-s // n)].max())  # the longest prompt of the first s samples (the first admission)
        cap_dec = self._capacity(held + c.steps_per_round + 1)
        if not (cap_dec > cap_ins or cap_dec <= cap_ins // 2):
            cap_dec = cap_ins
        signature = (hash(self._graph), p, m_bucket, cap_ins, cap_dec, key_a.shape, str(key_a.dtype),
                     stop_s.shape)
        if signature in self._compiled_first_rounds:
            return []
        self._compiled_first_rounds.add(signature)
        graph, *arrays = pre_args()
        pre_out = _abstract(jax.eval_shape(functools.partial(prefill, graph, **pre_kw), *arrays))

        def insert(pre):
            vec = jnp.zeros((m_bucket,), jnp.int32)
            _insert.with_options(opts).lower(slots_at(cap_ins), pre[0], pre[1], vec, vec, vec, key_a, top_p, stop_s,
                                             st=st).compile()

        def prefill_then_insert():
            # On a mesh the insert takes the prefill's outputs as that compile lays them out (known once compiled).
            compiled = prefill.lower(*pre_args(), **pre_kw).compile()
            insert(_abstract(pre_out, compiled.output_shardings))

        decode = [functools.partial(self.compile_decode, s, cap_dec, key_a)] if st.max_new_tokens > 1 else []
        if self.mesh is not None:
            return [prefill_then_insert, *decode]
        # One device: a jit call's uncommitted inputs and a single-device program's outputs both key the compile
        # cache like an abstract value without a sharding, so the three compile side by side.
        return [lambda: prefill.lower(*pre_args(), **pre_kw).compile(), lambda: insert(pre_out), *decode]

    def _compile_first_round(self, prompts, key, n: int) -> None:
        """Run `_first_round_programs` on threads and wait for them (already compiled: milliseconds). A failure
        here is left to the real call to report."""
        try:
            thunks = self._first_round_programs(prompts, key, n)
        except Exception:  # noqa: BLE001 - an optimization only: the real calls raise what is wrong
            return
        if not thunks:
            return
        with concurrent.futures.ThreadPoolExecutor(len(thunks), thread_name_prefix="engine-compile") as pool:
            for f in [pool.submit(self._in_context, t) for t in thunks]:
                f.exception()

    def _ahead_key(self, count: int, capacity: int, key) -> tuple:
        return hash(self._graph), count, capacity, jnp.shape(key), str(jnp.asarray(key).dtype)

    def _start_ahead(self, count: int, capacity: int, key) -> None:
        """EngineConfig.compile_ahead: compile the decode round for `count` slots at each capacity bucket above
        `capacity` (smallest first) on a background thread, unless done or under way."""
        top = self._capacity(self.config.max_len)
        caps, c = [], capacity * 2
        while c < top:
            caps.append(c)
            c *= 2
        caps += [top] if top > capacity else []
        key_a = jax.ShapeDtypeStruct(jnp.shape(key), jnp.asarray(key).dtype)
        todo = {cap: concurrent.futures.Future() for cap in caps if self._ahead_key(count, cap, key) not in self._ahead}
        if not todo:
            return
        self._ahead.update({self._ahead_key(count, cap, key): f for cap, f in todo.items()})

        def work():
            for cap, f in todo.items():
                if background.stopping():  # the process is exiting: compile nothing more
                    f.set_exception(RuntimeError("compile-ahead stopped at exit"))
                    continue
                try:
                    self.compile_decode(count, cap, key_a)
                    f.set_result(None)
                except Exception as e:  # noqa: BLE001 - reported by the real call, which compiles it again
                    f.set_exception(e)

        # A daemon thread, stopped and joined at exit (triage_jax.background): a process that ends waits for at
        # most the compile under way, not for programs it will never run.
        background.start(threading.Thread(target=work, name="engine-compile-ahead", daemon=True))

    def _wait_ahead(self, count: int, capacity: int, key) -> None:
        """Before a decode round: if its program is being compiled ahead, wait for that (not compile it twice)."""
        f = self._ahead.get(self._ahead_key(count, capacity, key)) if self._ahead else None
        if f is not None:
            f.exception()

    def _in_context(self, thunk) -> None:
        """thunk() inside the engine's mesh and rules context (it is per thread: a compiling thread enters it)."""
        with self._context():
            thunk()

    def _abstract_slots(self, count: int, capacity: int, kv_combined: bool | None = None) -> Slots:
        """The engine's slots (`count` of them, KV capacity `capacity`) as abstract values laid out as `_place`
        lays them out (`kv_combined`: the KV layout, default the engine's)."""
        combined = self.kv_combined if kv_combined is None else kv_combined
        empty = jax.eval_shape(lambda: _empty_slots(self.model_cfg, count, capacity, self.st, self.policy.kv_cache,
                                                    jnp.dtype(self.model_cfg.dtype), self.record_routing,
                                                    kv_combined=combined))
        return _abstract(empty, self.slot_shardings(empty) if self.mesh is not None else None)

    def compile_decode(self, count: int, capacity: int, key, device=None, compiler_options=None):
        """The decode round for `count` slots at KV capacity `capacity`, compiled for the arguments a generate
        passes it (`key`: the generate's key, or its abstract value), e.g. to read its optimized HLO; a round
        that ran or compiled before is not compiled again. `device`: compile it for that device instead (no mesh;
        the weights may be abstract), with the round loop its platform runs - e.g. a compile-only H200 of
        tools/gpu_aot.py; `compiler_options`: XLA options for this compile (e.g. xla_dump_to)."""
        key_a = jax.ShapeDtypeStruct(jnp.shape(key), key.dtype)
        temperature, top_p, stop_s = _hyper(self.cfg)
        args = (self.state, self._abstract_slots(count, capacity), key_a, temperature, top_p, stop_s)
        fixed, options = self.fixed_rounds, self.xla_options
        if device is not None:
            if self.mesh is not None:
                raise ValueError("compile_decode(device=...) compiles for one device; this engine has a mesh")
            combined = combined_kv(self.config.kv_layout, device.platform)
            options = program_options(self.config.xla_options, self.policy.kv_cache, combined)
            args = (self.state, self._abstract_slots(count, capacity, combined), *args[2:])
            args = _abstract(args, jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), args))
            fixed = fixed_round_loop(self.config.round_loop, device.platform)
        with self._context():
            return _decode_round.with_options(options).lower(
                self._graph, *args, policy=self.policy, st=self.st, steps=self.config.steps_per_round,
                fixed=fixed).compile(compiler_options)

    def compile_prefill(self, prompt_len: int, device, compiler_options=None):
        """The prefill of `prefill_batch` prompts of `prompt_len` tokens, compiled for `device` (no mesh; the weights
        may be abstract), as compile_decode(device=...) compiles the decode round: e.g. a compile-only H200 of
        tools/gpu_aot.py. A generate's first call compiles this program beside its decode round."""
        if self.mesh is not None:
            raise ValueError("compile_prefill(device=...) compiles for one device; this engine has a mesh")
        combined = combined_kv(self.config.kv_layout, device.platform)
        options = program_options(self.config.xla_options, self.policy.kv_cache, combined)
        rows = (self.prefill_batch, prompt_len)
        scales = self._abstract_slots(self.config.max_slots, self.config.max_len, combined).cache.k_scale
        temperature, _, _ = _hyper(self.cfg)
        args = (self.state, jax.ShapeDtypeStruct(rows, jnp.int32), jax.ShapeDtypeStruct(rows, jnp.bool_), scales,
                scales, temperature)
        args = _abstract(args, jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), args))
        with self._context():
            return _prefill.with_options(options).lower(
                self._graph, *args, policy=self.policy, capacity=-(-prompt_len // kvc.BLOCK) * kvc.BLOCK,
                kv_format=self.policy.kv_cache, record_routing=self.record_routing, kv_combined=combined
            ).compile(compiler_options)

    def _generate(self, prompts, key, n: int) -> SampleOutput:
        c, st, s = self.config, self.st, self.config.max_slots
        temperature, top_p, stop_s = _hyper(self.cfg)
        r = st.max_new_tokens
        num = len(prompts) * n
        kv_format, dtype = self.policy.kv_cache, jnp.dtype(self.model_cfg.dtype)
        lens = np.array([len(p) for p in prompts], np.int32)
        if c.parallel_compile:
            self._compile_first_round(prompts, key, n)
        cap = self._capacity(int(lens.max()) + 1)
        slots = self._place(_empty_slots(self.model_cfg, s, cap, st, kv_format, dtype, self.record_routing,
                                         kv_combined=self.kv_combined))
        out_tok = np.full((num, r), self.pad_id, np.int32)
        out_logp = np.zeros((num, r), np.float32)
        out_len = np.zeros(num, np.int32)
        out_exp = ([None] * num) if self.record_routing else None  # each request's [R, L_moe, k] routing
        prompt_pre = {}  # prompt -> (its prefill batch, row): where its tokens' routing is

        pending = collections.deque(range(len(prompts)))  # prompts not prefilled yet
        waiting: collections.deque = collections.deque()  # (prefill batch, row, prompt, next sample)
        free = list(range(s))
        owner = {}  # slot -> request id
        host_len = np.zeros(s, np.int64)  # tokens each occupied slot holds after the last round (host mirror)
        done_reqs = 0
        self.rounds, self.capacities, self.slot_counts, self.prefills = 0, [], [], 0
        while done_reqs < num:
            # Admit waiting samples into free slots (static mode: only into an empty engine).
            if free and (c.continuous or len(free) == s):
                targets: dict[int, list] = {}
                while free and (waiting or pending):
                    if not waiting:
                        batch_prompts = [pending.popleft() for _ in range(min(self.prefill_batch, len(pending)))]
                        pre = self._prefill(prompts, batch_prompts, slots)
                        waiting.extend([pre, row, i, 0] for row, i in enumerate(batch_prompts))
                        prompt_pre.update((i, (pre, row)) for row, i in enumerate(batch_prompts))
                    entry = waiting[0]
                    pre, row, i, j = entry
                    slot = free.pop(0)
                    req = i * n + j
                    targets.setdefault(id(pre), [pre, []])[1].append((slot, row, req))
                    owner[slot] = req
                    host_len[slot] = len(prompts[i])
                    entry[3] = j + 1
                    if j + 1 == n:
                        waiting.popleft()
                for pre, items in targets.values():
                    need = int(host_len[[t[0] for t in items]].max()) + 1
                    if need > slots.cache.max_len or pre[0].max_len > slots.cache.max_len:
                        slots = _resize(slots, capacity=self._capacity(max(need, pre[0].max_len)))
                    # A power-of-two number of entries (unused ones dropped): the copy moves what the prefill
                    # batch fills, not every slot, with one compiled insert per bucket.
                    m_bucket = min(bucket_length(len(items), 1), s)
                    slot_m = np.full(m_bucket, s, np.int32)
                    row_m = np.zeros(m_bucket, np.int32)
                    req_m = np.zeros(m_bucket, np.int32)
                    for m, (slot, row, req) in enumerate(items):
                        slot_m[m], row_m[m], req_m[m] = slot, row, req
                    slots = _insert.with_options(self.xla_options)(
                        slots, pre[0], pre[1], jnp.asarray(slot_m), jnp.asarray(row_m), jnp.asarray(req_m), key,
                        top_p, stop_s, st=st)
            # Capacity for this round: the longest held sequence plus the round's tokens.
            occupied = np.array(sorted(owner), np.int64)
            need = int(host_len[occupied].max()) + c.steps_per_round + 1
            cap = self._capacity(need)
            if cap != slots.cache.max_len and (cap > slots.cache.max_len or cap <= slots.cache.max_len // 2):
                slots = _resize(slots, capacity=max(cap, self._capacity(int(host_len[occupied].max()) + 1)))
            if r > 1:  # (one-token responses all ended at the insert's draw: nothing to decode)
                self._wait_ahead(slots.tok.shape[0], slots.cache.max_len, key)
                slots = _decode_round.with_options(self.xla_options)(
                    self._graph, self.state, slots, key, temperature, top_p, stop_s, policy=self.policy, st=st,
                    steps=c.steps_per_round, fixed=self.fixed_rounds)
                if c.compile_ahead:
                    self._start_ahead(slots.tok.shape[0], slots.cache.max_len, key)
                self.rounds += 1
                self.capacities.append(slots.cache.max_len)
                self.slot_counts.append(slots.tok.shape[0])
            active, n_gen = jax.device_get((slots.active, slots.n_gen))
            finished = [slot for slot in occupied if not active[slot]]
            for slot in occupied:
                host_len[slot] = len(prompts[owner[slot] // n]) + n_gen[slot] - 1
            if finished:
                # A power-of-two count of slot indices (repeats of the last): one compiled gather per bucket,
                # not one per number of finished slots.
                idx = np.full(min(bucket_length(len(finished), 1), slots.tok.shape[0]), finished[-1], np.int32)
                idx[:len(finished)] = finished
                toks, logps, exps = jax.device_get(_harvest(slots, jnp.asarray(idx)))
                for k, slot in enumerate(finished):
                    req = owner.pop(slot)
                    out_tok[req], out_logp[req], out_len[req] = toks[k], logps[k], n_gen[slot]
                    if out_exp is not None:
                        out_exp[req] = exps[k]
                    free.append(slot)
                    done_reqs += 1
                free.sort()
            if c.continuous and not waiting and not pending:
                slots, owner, host_len = self._compacted(slots, owner, host_len)
                free = [j for j in range(slots.tok.shape[0]) if j not in owner]
        first_kv = jax.tree.leaves(slots.cache.kv)[0]
        self.last_slot_devices = first_kv.devices()
        self.last_kv_sharding = first_kv.sharding  # after the last round: split by slots (and heads)
        mask = np.arange(r)[None, :] < out_len[:, None]
        p = int(lens.max())
        ids = np.full((num, p), self.pad_id, np.int32)
        pmask = np.zeros((num, p), bool)
        for i, prompt in enumerate(prompts):
            ids[i * n:(i + 1) * n, p - len(prompt):] = prompt
            pmask[i * n:(i + 1) * n, p - len(prompt):] = True
        routing = None
        if out_exp is not None:
            routing = jnp.asarray(_lay_out_routing(prompts, n, prompt_pre, out_exp, mask, p))
        return SampleOutput(tokens=jnp.asarray(np.where(mask, out_tok, self.pad_id)), lengths=jnp.asarray(out_len),
                            logprobs=jnp.asarray(np.where(mask, out_logp, 0.0)), mask=jnp.asarray(mask),
                            prompt_tokens=jnp.asarray(ids), prompt_mask=jnp.asarray(pmask),
                            prompt_lengths=jnp.asarray(np.repeat(lens, n)),
                            steps=jnp.int32(int(out_len.max())), routing=routing)

    def _prefill(self, prompts, which, slots: Slots):
        """Prefill prompts `which` (a fixed batch of `prefill_batch` rows, unused ones padding)."""
        pb = self.prefill_batch
        # The prefill width never goes below the engine's prompt bucket (the one of max_prompt_len, when known),
        # so a prompt's numbers do not depend on the lengths of the prompts batched with it; that bucket can be
        # shorter than the cache's 64-slot granule (the prompt is computed at it and written into a fresh cache of
        # the granule's capacity): a 32-token prompt budget prefills 32 columns, not 64.
        p = bucket_length(max(len(prompts[i]) for i in which), self.prompt_bucket)
        capacity = -(-p // kvc.BLOCK) * kvc.BLOCK
        ids = np.full((pb, p), self.pad_id, np.int32)
        mask = np.zeros((pb, p), bool)
        mask[len(which):, 0] = True  # padding rows hold one token, so every row has a last position
        for row, i in enumerate(which):
            ids[row, :len(prompts[i])] = prompts[i]
            mask[row, :len(prompts[i])] = True
        temperature, _, _ = _hyper(self.cfg)
        self.prefills += 1
        return _prefill.with_options(self.xla_options)(
            self._graph, self.state, jnp.asarray(ids), jnp.asarray(mask), slots.cache.k_scale, slots.cache.v_scale,
            temperature, policy=self.policy, capacity=capacity, kv_format=self.policy.kv_cache,
            record_routing=self.record_routing, kv_combined=self.kv_combined)


def _lay_out_routing(prompts, n: int, prompt_pre: dict, out_exp: list, mask_nr: np.ndarray, p: int) -> np.ndarray:
    """SampleOutput.routing [N, P + R, L_moe, k]: each prompt's prefill routing, left-padded like its tokens, then
    its samples' response routing (-1 past the response)."""
    exp_r = out_exp[0]
    num, r = mask_nr.shape
    routing = np.full((num, p + r, *exp_r.shape[1:]), -1, exp_r.dtype)
    fetched = {}  # one device -> host copy per prefill batch
    for i, prompt in enumerate(prompts):
        pre, row = prompt_pre[i]
        if id(pre) not in fetched:
            fetched[id(pre)] = np.asarray(jax.device_get(pre[2]))
        routing[i * n:(i + 1) * n, p - len(prompt):p] = fetched[id(pre)][row, :len(prompt)]
    for req in range(num):
        routing[req, p:] = np.where(mask_nr[req][:, None, None], out_exp[req], -1)
    return routing


def split_model(model_or_split):
    """(graphdef, state) of an NNX model, or the pair itself."""
    if isinstance(model_or_split, tuple):
        if len(model_or_split) != 2:
            raise ValueError(f"expected a model or a (graphdef, state) pair; got a tuple of {len(model_or_split)}")
        return model_or_split
    return nnx.split(model_or_split)


def generate(model_or_split, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, *,
             policy: PrecisionPolicy | None = None, key: jax.Array, pad_id: int, max_cache_len: int | None = None,
             n: int = 1, max_slots: int | None = None, record_routing: bool = False) -> SampleOutput:
    """`n` samples of each prompt (lists of token ids, any lengths) with the sampler's policy, through an Engine
    (slots default: one per request, at most 256); row i * n + j is sample j of prompt i.

    Pass a model prepared with `prepare_model(model, policy)` so that weights are quantized once; raw weights
    give the same numbers but quantize at every step. The same key gives the same tokens. record_routing: also
    return each token's MoE expert ids (`SampleOutput.routing`).
    """
    max_len = max_cache_len or bucket_length(max(len(p) for p in prompts) + cfg.max_new_tokens)
    slots = max_slots or min(len(prompts) * n, 256)
    engine = Engine(cfg, EngineConfig(max_slots=slots, max_len=max_len), policy=policy, pad_id=pad_id,
                    model=model_or_split, record_routing=record_routing)
    return engine.generate(prompts, key, n=n)
