"""The jitted sampler: prefill + one compiled decode loop over a preallocated KV cache, with sampler log-probs.

Prompts of different lengths are LEFT-padded to a length bucket so that every row's new tokens land in the same
cache slots; the prompt bucket and the cache length are powers of two, so repeated calls with similar lengths reuse
one compiled program per (batch, prompt bucket, cache length, max_new_tokens). The decode loop is one
`jax.lax.while_loop` that stops early once every row has emitted a stop token; the cache is donated to it.

Log-probs: for every drawn token the sampler reports log_softmax(logits / T) over the FULL vocabulary at the
sampling temperature T, before top-k / top-p truncation (what verl and vLLM report as rollout log-probs with a
temperature); the learner recomputes the same quantity with `triage_jax.logprobs.token_logprobs`. Greedy decoding
also reports the log-prob at `temperature`.

The sampler's precision policy is its own: weights are quantized once beforehand (`prepare_model`, i.e.
`models.prequantize_model`) and activations are quantized token-wise (`act_scaling="row"`, see `sampler_policy`),
so a token's numerics do not depend on the other tokens of its batch or on prefill versus decode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from triage_jax.logprobs import default_positions, lm_head_logits, logprob_of
from triage_jax.quant import PrecisionPolicy

MIN_BUCKET = 16


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


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Left-padded prompts (host arrays) and the bucketed cache length they will be decoded in."""

    ids_bp: np.ndarray
    mask_bp: np.ndarray
    lengths_b: np.ndarray
    cache_len: int


@struct.dataclass
class DecodeState:
    """What prefill hands to the decode loop."""

    cache: object
    first_token_b: jax.Array
    first_logp_b: jax.Array


def sampler_policy(preset: str = "bf16", kv_cache: str = "bf16", **kw) -> PrecisionPolicy:
    """The sampler's policy: `preset` weights/activations with token-wise activation scales, and the KV format."""
    return PrecisionPolicy.from_spec(preset, act_scaling="row", kv_cache=kv_cache, **kw)


def prepare_model(model, policy: PrecisionPolicy):
    """Quantize the weights once for generation (the learner -> sampler sync); no-op for high precision."""
    from triage_jax import models

    return models.prequantize_model(model, policy)


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two >= n (at least `minimum`): the compiled-shape bucket of a length."""
    return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def prepare_batch(prompts: Sequence[Sequence[int]], *, pad_id: int, max_new_tokens: int,
                  max_cache_len: int | None = None, vocab_size: int | None = None) -> PromptBatch:
    """Left-pad prompts to a length bucket and pick the cache length; errors name the offending lengths."""
    if len(prompts) == 0:
        raise ValueError("generate: got an empty list of prompts")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"generate: prompt(s) {np.flatnonzero(lengths == 0).tolist()} are empty; every prompt "
                         f"needs at least one token")
    longest = int(lengths.max())
    if max_cache_len is None:
        p_bucket = bucket_length(longest)
        cache_len = bucket_length(p_bucket + max_new_tokens)
    else:
        cache_len = int(max_cache_len)
        if longest + max_new_tokens > cache_len:
            raise ValueError(
                f"generate: prompt {int(lengths.argmax())} has {longest} tokens; with max_new_tokens="
                f"{max_new_tokens} it needs {longest + max_new_tokens} cache slots but max_cache_len={cache_len}")
        p_bucket = min(bucket_length(longest), cache_len - max_new_tokens)
    ids = np.full((len(prompts), p_bucket), pad_id, np.int32)
    mask = np.zeros((len(prompts), p_bucket), bool)
    for b, p in enumerate(prompts):
        row = np.asarray(p, np.int64)
        if vocab_size is not None and ((row < 0) | (row >= vocab_size)).any():
            bad = row[(row < 0) | (row >= vocab_size)]
            raise ValueError(f"generate: prompt {b} has token ids {bad[:5].tolist()} outside [0, {vocab_size})")
        ids[b, p_bucket - len(p):] = row
        mask[b, p_bucket - len(p):] = True
    return PromptBatch(ids, mask, lengths, cache_len)


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


def _static(cfg: SamplingConfig, pad_id: int) -> _Static:
    return _Static(cfg.max_new_tokens, cfg.top_k, cfg.top_p < 1.0, cfg.greedy, int(pad_id))


def _draw(scaled_bv, key, top_p, st: _Static):
    """One token per row from logits already divided by T, and its full-vocabulary log-prob."""
    if st.greedy:
        tok_b = jnp.argmax(scaled_bv, axis=-1).astype(jnp.int32)
    else:
        filtered = filter_logits(scaled_bv, top_k=st.top_k, top_p=top_p, use_top_p=st.use_top_p)
        tok_b = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    return tok_b, logprob_of(scaled_bv, tok_b)


def _hyper(cfg: SamplingConfig):
    stop = jnp.asarray(cfg.stop_ids if cfg.stop_ids else (-1,), jnp.int32)
    return jnp.float32(cfg.temperature), jnp.float32(cfg.top_p), stop


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "st", "cache_len"))
def _prefill(graphdef, state, ids_bp, mask_bp, key, temperature, top_p, *, policy, st, cache_len):
    from triage_jax.models.kv_cache import init_kv_cache

    model = nnx.merge(graphdef, state)
    b, p = ids_bp.shape
    cache = init_kv_cache(model.cfg, b, cache_len, kv_format=policy.kv_cache, dtype=jnp.dtype(model.cfg.dtype))
    h_bpd, cache = model(ids_bp, default_positions(mask_bp), mask_bp, policy=policy, cache=cache,
                         cache_index=jnp.int32(0), return_hidden=True)
    # Left padding: the last slot holds every row's last prompt token.
    scaled_bv = lm_head_logits(h_bpd[:, -1], model.lm_head_kernel(), policy, temperature)
    tok_b, logp_b = _draw(scaled_bv, jax.random.fold_in(key, 0), top_p, st)
    return DecodeState(cache=cache, first_token_b=tok_b, first_logp_b=logp_b)


@functools.partial(jax.jit, static_argnames=("graphdef", "policy", "st"), donate_argnames=("cache",))
def _decode(graphdef, state, cache, first_token_b, first_logp_b, prompt_len_b, start_slot, key, temperature, top_p,
            stop_s, *, policy, st):
    model = nnx.merge(graphdef, state)
    w_dv = model.lm_head_kernel()
    n = st.max_new_tokens
    b = prompt_len_b.shape[0]
    tok_b = first_token_b
    done_b = jnp.isin(tok_b, stop_s)
    toks_bn = jnp.full((b, n), st.pad_id, jnp.int32).at[:, 0].set(tok_b)
    logps_bn = jnp.zeros((b, n), jnp.float32).at[:, 0].set(first_logp_b)
    ones_b1 = jnp.ones((b, 1), bool)

    def cond(c):
        i, _, _, done_b, _, _ = c
        return (i < n) & ~jnp.all(done_b)

    def body(c):
        i, cache, tok_b, done_b, toks_bn, logps_bn = c
        # Feed the token drawn at step i-1: cache slot start+i-1, RoPE position prompt_len+i-1.
        pos_b1 = (prompt_len_b + i - 1)[:, None]
        h_b1d, cache = model(tok_b[:, None], pos_b1, ones_b1, policy=policy, cache=cache,
                             cache_index=start_slot + i - 1, return_hidden=True)
        scaled_bv = lm_head_logits(h_b1d[:, 0], w_dv, policy, temperature)
        new_b, logp_b = _draw(scaled_bv, jax.random.fold_in(key, i), top_p, st)
        new_b = jnp.where(done_b, st.pad_id, new_b)
        logp_b = jnp.where(done_b, 0.0, logp_b)
        toks_bn = jax.lax.dynamic_update_slice(toks_bn, new_b[:, None], (0, i))
        logps_bn = jax.lax.dynamic_update_slice(logps_bn, logp_b[:, None], (0, i))
        done_b = done_b | jnp.isin(new_b, stop_s)
        return i + 1, cache, new_b, done_b, toks_bn, logps_bn

    init = (jnp.int32(1), cache, tok_b, done_b, toks_bn, logps_bn)
    steps, cache, _, _, toks_bn, logps_bn = jax.lax.while_loop(cond, body, init)
    # A row's response runs up to and including its first stop token.
    is_stop_bn = jnp.isin(toks_bn, stop_s)
    first_stop_b = jnp.where(is_stop_bn.any(-1), jnp.argmax(is_stop_bn, axis=-1), n - 1)
    mask_bn = jnp.arange(n)[None, :] <= first_stop_b[:, None]
    # The cache is returned so that its donated buffer is updated in place rather than copied into the loop.
    return (jnp.where(mask_bn, toks_bn, st.pad_id), (first_stop_b + 1).astype(jnp.int32),
            jnp.where(mask_bn, logps_bn, 0.0), mask_bn, steps, cache)


def split_model(model_or_split):
    """(graphdef, state) of an NNX model, or the pair itself."""
    if isinstance(model_or_split, tuple):
        if len(model_or_split) != 2:
            raise ValueError(f"expected a model or a (graphdef, state) pair; got a tuple of {len(model_or_split)}")
        return model_or_split
    return nnx.split(model_or_split)


def prefill(graphdef, state, batch: PromptBatch, cfg: SamplingConfig, *, policy: PrecisionPolicy, key,
            pad_id: int) -> DecodeState:
    """Run the prompts through the model into a fresh cache of batch.cache_len slots and draw the first token."""
    temperature, top_p, _ = _hyper(cfg)
    return _prefill(graphdef, state, jnp.asarray(batch.ids_bp), jnp.asarray(batch.mask_bp), key, temperature,
                    top_p, policy=policy, st=_static(cfg, pad_id), cache_len=batch.cache_len)


def decode(graphdef, state, dstate: DecodeState, batch: PromptBatch, cfg: SamplingConfig, *,
           policy: PrecisionPolicy, key, pad_id: int) -> SampleOutput:
    """The compiled decode loop after `prefill` (consumes dstate: its cache is donated)."""
    temperature, top_p, stop_s = _hyper(cfg)
    p_bucket = batch.ids_bp.shape[1]
    toks, lengths, logps, mask, steps, _ = _decode(
        graphdef, state, dstate.cache, dstate.first_token_b, dstate.first_logp_b, jnp.asarray(batch.lengths_b),
        jnp.int32(p_bucket), key, temperature, top_p, stop_s, policy=policy, st=_static(cfg, pad_id))
    return SampleOutput(tokens=toks, lengths=lengths, logprobs=logps, mask=mask,
                        prompt_tokens=jnp.asarray(batch.ids_bp), prompt_mask=jnp.asarray(batch.mask_bp),
                        prompt_lengths=jnp.asarray(batch.lengths_b), steps=steps)


def generate(model_or_split, prompts: Sequence[Sequence[int]], cfg: SamplingConfig, *,
             policy: PrecisionPolicy | None = None, key: jax.Array, pad_id: int,
             max_cache_len: int | None = None) -> SampleOutput:
    """Sample a response for each prompt (lists of token ids, any lengths) with the sampler's policy.

    Pass a model prepared with `prepare_model(model, policy)` so that weights are quantized once; raw weights
    give the same numbers but quantize at every step. The same key gives the same tokens.
    """
    policy = policy or PrecisionPolicy()
    graphdef, state = split_model(model_or_split)
    model = model_or_split if not isinstance(model_or_split, tuple) else nnx.merge(graphdef, state)
    model_cfg = getattr(model, "cfg", None)
    batch = prepare_batch(prompts, pad_id=pad_id, max_new_tokens=cfg.max_new_tokens, max_cache_len=max_cache_len,
                          vocab_size=getattr(model_cfg, "vocab_size", None))
    dstate = prefill(graphdef, state, batch, cfg, policy=policy, key=key, pad_id=pad_id)
    return decode(graphdef, state, dstate, batch, cfg, policy=policy, key=key, pad_id=pad_id)
