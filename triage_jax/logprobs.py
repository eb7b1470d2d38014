"""Teacher-forced token log-probs (the learner's log-prob), chunked over the vocabulary.

`token_logprobs` runs the model to its final hidden states and computes log_softmax(h @ W_head / T) at the target
tokens with an online logsumexp over vocabulary chunks, so the [B, T, V] logits tensor is never materialized (each
chunk is rematerialized in the backward pass too). The sampler uses `lm_head_logits` / `logprob_of` on the same
head so both sides compute one quantity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from triage_jax.models import invariant
from triage_jax.quant import PrecisionPolicy, QuantizedWeight, qdot

F32 = jnp.float32
LM_HEAD = "lm_head"
DEFAULT_VOCAB_CHUNK = 8192


def _head_precision(policy: PrecisionPolicy | None):
    return (policy or PrecisionPolicy()).for_layer(LM_HEAD)


def lm_head_logits(h_nd: jax.Array, w_dv, policy: PrecisionPolicy | None, temperature=1.0) -> jax.Array:
    """float32 logits / T of hidden states h[..., D] under the policy's "lm_head" precision.

    Same arithmetic as `Qwen3.logits`: a high-precision head multiplies in the compute dtype of h with float32
    accumulation and output; a quantized head (a policy rule, or a pre-quantized kernel) goes through qdot.
    """
    policy = policy or PrecisionPolicy()
    prec = policy.for_layer(LM_HEAD)
    if not prec.quantized and not isinstance(w_dv, QuantizedWeight):
        dot = lambda h: jnp.dot(h, w_dv.astype(h.dtype), preferred_element_type=F32)  # noqa: E731
    else:
        dot = lambda h: qdot(h, w_dv, prec, backend=policy.backend).astype(F32)  # noqa: E731
    if policy.exact:
        lead = h_nd.shape[:-1]
        logits = invariant.padded_rows(dot, h_nd.reshape(-1, h_nd.shape[-1])).reshape(*lead, -1)
    else:
        logits = dot(h_nd)
    return logits / jnp.asarray(temperature, F32)


def _check_temperature(temperature) -> None:
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs; got {temperature}")


def chunked_logprobs(h_btd: jax.Array, w_dv: jax.Array, targets_bt: jax.Array, *, policy=None,
                     temperature: float = 1.0, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                     return_entropy: bool = False):
    """log_softmax(h @ w / T)[targets] (and the entropy) by an online logsumexp over vocabulary chunks.

    A quantized LM head (a policy rule asking for it) quantizes the weight with per-tensor scales, which a chunk
    cannot reproduce; it is computed in one chunk.
    """
    _check_temperature(temperature)
    if h_btd.ndim != 3 or targets_bt.shape != h_btd.shape[:2]:
        raise ValueError(f"chunked_logprobs: expected h[B,T,D] and targets[B,T]; got {h_btd.shape}, "
                         f"{targets_bt.shape}")
    if vocab_chunk <= 0:
        raise ValueError(f"vocab_chunk must be positive; got {vocab_chunk}")
    d, v = w_dv.shape
    if d != h_btd.shape[-1]:
        raise ValueError(f"chunked_logprobs: hidden dim {h_btd.shape[-1]} != LM head rows {d} (head {w_dv.shape})")
    exact = policy is not None and policy.exact
    if isinstance(w_dv, QuantizedWeight) or _head_precision(policy).weight != "none" or exact:
        vocab_chunk = v  # exact mode: the sampler's one full-vocabulary normalizer
    chunk = min(vocab_chunk, v)
    n_chunks = -(-v // chunk)
    if n_chunks == 1:  # no scan: also the path of a quantized head, which a chunk cannot reproduce
        z_btv = lm_head_logits(h_btd, w_dv, policy, temperature)
        if exact:
            logp_bt = invariant.log_softmax_at(z_btv, targets_bt)
        else:
            lse_bt = jax.nn.logsumexp(z_btv, axis=-1)
            logp_bt = jnp.take_along_axis(z_btv, targets_bt.astype(jnp.int32)[..., None], axis=-1)[..., 0] - lse_bt
        if return_entropy:
            logp_btv = jax.nn.log_softmax(z_btv, axis=-1)
            return logp_bt, -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
        return logp_bt
    targets_bt = targets_bt.astype(jnp.int32)
    b, t = targets_bt.shape

    @jax.checkpoint
    def step(carry, c):
        m_bt, s_bt, sz_bt, tgt_bt = carry
        # Chunk c covers columns [c*chunk, (c+1)*chunk); the last one is read as the final `chunk` columns (no
        # padded copy of the head) with the columns that the previous chunk already counted masked out.
        start = jnp.minimum(c * chunk, v - chunk)
        w_dc = jax.lax.dynamic_slice_in_dim(w_dv, start, chunk, axis=1)
        new_c = start + jnp.arange(chunk) >= c * chunk
        z_btc = jnp.where(new_c, lm_head_logits(h_btd, w_dc, policy, temperature), -jnp.inf)
        # The running max only stabilizes the exponentials; the result does not depend on it.
        m_new = jax.lax.stop_gradient(jnp.maximum(m_bt, jnp.max(z_btc, axis=-1)))
        decay = jnp.exp(m_bt - m_new)
        shift = jnp.where(jnp.isfinite(m_bt), m_new - m_bt, 0.0)
        e_btc = jnp.exp(z_btc - m_new[..., None])
        s_new = s_bt * decay + jnp.sum(e_btc, axis=-1)
        # sz = sum exp(z - m) * (z - m), kept relative to the running max (no cancellation in the entropy).
        zc_btc = jnp.where(new_c, z_btc - m_new[..., None], 0.0)
        sz_new = decay * (sz_bt - s_bt * shift) + jnp.sum(e_btc * zc_btc, axis=-1)
        local = targets_bt - start
        hit = (targets_bt >= c * chunk) & (local < chunk)
        picked = jnp.take_along_axis(z_btc, jnp.clip(local, 0, chunk - 1)[..., None], axis=-1)[..., 0]
        tgt_new = jnp.where(hit, picked, tgt_bt)
        return (m_new, s_new, sz_new, tgt_new), None

    init = (jnp.full((b, t), -jnp.inf, F32), jnp.zeros((b, t), F32), jnp.zeros((b, t), F32),
            jnp.zeros((b, t), F32))
    (m_bt, s_bt, sz_bt, tgt_bt), _ = jax.lax.scan(step, init, jnp.arange(n_chunks))
    lse_bt = m_bt + jnp.log(s_bt)
    logp_bt = tgt_bt - lse_bt
    if return_entropy:
        return logp_bt, jnp.log(s_bt) - sz_bt / s_bt
    return logp_bt


def default_positions(attention_mask_bt: jax.Array) -> jax.Array:
    """RoPE positions of a (left- or right-) padded batch: index among the row's real tokens, 0 on pads."""
    m = attention_mask_bt.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def token_logprobs(model, input_ids_bt: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array, *, policy=None,
                   temperature: float = 1.0, vocab_chunk: int = DEFAULT_VOCAB_CHUNK, attention_mask_bt=None,
                   positions_bt=None, return_entropy: bool = False):
    """Teacher-forced log p(targets[b,t] | input_ids[b,:t+1]) at temperature T, zero where mask_bt is 0.

    mask_bt marks the positions whose log-prob counts (e.g. response tokens). attention_mask_bt marks real input
    tokens (default: all real); positions default to each token's index among its row's real tokens. With
    return_entropy, also returns the full-vocabulary entropy at temperature T per position (masked the same way).
    Differentiable in the model's parameters (gradient of the learner's log-prob).
    """
    if input_ids_bt.ndim != 2 or targets_bt.shape != input_ids_bt.shape or mask_bt.shape != input_ids_bt.shape:
        raise ValueError(f"token_logprobs: input_ids, targets and mask must share one [B, T] shape; got "
                         f"{input_ids_bt.shape}, {targets_bt.shape}, {mask_bt.shape}")
    if attention_mask_bt is None:
        attention_mask_bt = jnp.ones(input_ids_bt.shape, bool)
    if positions_bt is None:
        positions_bt = default_positions(attention_mask_bt)
    h_btd = model(input_ids_bt, positions_bt, attention_mask_bt, policy=policy, return_hidden=True)
    out = chunked_logprobs(h_btd, model.lm_head_kernel(), targets_bt, policy=policy, temperature=temperature,
                           vocab_chunk=vocab_chunk, return_entropy=return_entropy)
    m = mask_bt.astype(bool)
    if return_entropy:
        logp_bt, ent_bt = out
        return jnp.where(m, logp_bt, 0.0), jnp.where(m, ent_bt, 0.0)
    return jnp.where(m, out, 0.0)


def logprob_of(logits_bv: jax.Array, tokens_b: jax.Array, exact: bool = False) -> jax.Array:
    """log_softmax(logits)[tokens] over the full vocabulary (logits already divided by the temperature); exact:
    exact mode's normalizer (`invariant.log_softmax_at`, what the learner computes then too)."""
    if exact:
        return invariant.log_softmax_at(logits_bv, tokens_b)
    return jnp.take_along_axis(jax.nn.log_softmax(logits_bv, axis=-1), tokens_b[:, None], axis=-1)[:, 0]


def response_logprobs(model, prompt_bp: jax.Array, prompt_mask_bp: jax.Array, response_bn: jax.Array,
                      response_mask_bn: jax.Array, *, policy=None, temperature: float = 1.0,
                      vocab_chunk: int = DEFAULT_VOCAB_CHUNK, return_entropy: bool = False, return_aux: bool = False,
                      routing_bslk=None):
    """Teacher-forced log-probs [B, N] of responses after LEFT-padded prompts (as the sampler returns them), zero
    off the response mask; with return_entropy also the entropies, with return_aux also the MoE aux loss.

    The sequence is prompt ++ response; a response token's RoPE position continues its row's real prompt tokens,
    exactly as the sampler placed it (so in float32 this reproduces the sampler's log-probs). Only the N positions
    that predict response tokens go through the LM head. Target ids must lie in [0, V). routing_bslk: the MoE
    expert ids [B, P + N, L_moe, k] the sampler used for prompt ++ response (`SampleOutput.routing`), replayed.
    """
    p = prompt_bp.shape[1]
    seq_bs = jnp.concatenate([prompt_bp, response_bn], axis=1).astype(jnp.int32)
    real_bs = jnp.concatenate([prompt_mask_bp, response_mask_bn], axis=1).astype(bool)
    routing_bslk = None if routing_bslk is None else jnp.asarray(routing_bslk)
    if policy is not None and policy.exact:
        h_bnd, aux = slot_aligned_hidden(model, seq_bs, real_bs, prompt_mask_bp, response_bn.shape[1], policy,
                                          routing_bslk)
    else:
        h_btd, aux = model(seq_bs[:, :-1], default_positions(real_bs)[:, :-1], real_bs[:, :-1], policy=policy,
                           return_hidden=True, return_aux=True,
                           routing_btlk=None if routing_bslk is None else routing_bslk[:, :-1])
        h_bnd = h_btd[:, p - 1:]
    logp_bn, ent_bn = chunked_logprobs(h_bnd, model.lm_head_kernel(), response_bn, policy=policy,
                                       temperature=temperature, vocab_chunk=vocab_chunk, return_entropy=True)
    m = response_mask_bn.astype(bool)
    out = (jnp.where(m, logp_bn, 0.0),)
    if return_entropy:
        out += (jnp.where(m, ent_bn, 0.0),)
    if return_aux:
        out += (aux["moe_aux_loss"],)
    return out[0] if len(out) == 1 else out


def slot_aligned_hidden(model, seq_bs, real_bs, prompt_mask_bp, n: int, policy, routing_bslk=None):
    """Exact mode: the hidden states [B, N, D] that predict the N response tokens, computed with each row's real
    tokens moved to columns 0.. (left padding removed), so every token sits at the slot, and so at the position in
    every reduction, that the sampler's KV cache gave it. Replayed expert ids [B, S, L, k] move with their tokens."""
    s = seq_bs.shape[1]
    plen_b = jnp.sum(prompt_mask_bp, axis=1, dtype=jnp.int32)
    src_bs = jnp.arange(s, dtype=jnp.int32)[None, :] + (prompt_mask_bp.shape[1] - plen_b)[:, None]
    inside_bs = src_bs < s
    src_bs = jnp.minimum(src_bs, s - 1)
    ids_bs = jnp.take_along_axis(seq_bs, src_bs, axis=1)
    real_bs = jnp.take_along_axis(real_bs, src_bs, axis=1) & inside_bs
    if routing_bslk is not None:
        routing_bslk = jnp.take_along_axis(routing_bslk, src_bs[:, :, None, None], axis=1)
        routing_bslk = jnp.where(inside_bs[:, :, None, None], routing_bslk, -1)[:, :-1]
    h_btd, aux = model(ids_bs[:, :-1], default_positions(real_bs)[:, :-1], real_bs[:, :-1], policy=policy,
                       return_hidden=True, return_aux=True, routing_btlk=routing_bslk)
    at_bn = (plen_b - 1)[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(h_btd, at_bn[:, :, None], axis=1), aux
