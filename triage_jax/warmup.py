"""Supervised warm-up: teach a from-scratch tiny model part of the synthetic task before RL, and cache it.

RL needs a policy whose groups are neither all right nor all wrong. The tiny configs have no pretrained
checkpoint, so a short SFT on reference solutions produces one; the result is saved as an HF checkpoint under
`warmup.cache_dir/<hash of everything that shapes it>` and reused by every later run with the same settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from triage_jax import models
from triage_jax.data.synthetic import SyntheticMathSource
from triage_jax.logprobs import token_logprobs

log = logging.getLogger(__name__)


def cache_path(c: ml_collections.ConfigDict, model_cfg, tok, source: SyntheticMathSource) -> str:
    """Folder of the cached warm-up checkpoint for these settings.

    Keyed by what the SFT trains on, so a config that only widens the RL response budget beyond the longest
    reference chain (sampler.max_new_tokens) shares the warm-up: its SFT rows are the same padded length.
    """
    warm = {k: v for k, v in c.warmup.to_dict().items() if k != "cache_dir"}
    key = {
        "model": repr(model_cfg), "tokenizer": c.tokenizer, "template": c.data.template,
        "levels": list(c.data.levels), "num_examples": c.data.num_examples, "warmup": warm,
        "seq_len": warmup_seq_len(c, tok, source), "seed": c.seed, "version": 1,
    }
    # Keys added after version 1 enter only when set, so the cached warm-ups of older configs keep their names.
    if c.data.style:
        key["style"] = c.data.style
    if c.tokenizer == "bpe":
        key["bpe"] = c.bpe.to_dict()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return os.path.join(c.warmup.cache_dir, digest)


def sft_batch(source: SyntheticMathSource, tok, indices, seq_len: int):
    """Right-padded [prompt | solution <eos>] rows with the loss on the solution and <eos> only."""
    ids = np.full((len(indices), seq_len), tok.pad_id, np.int32)
    attn = np.zeros((len(indices), seq_len), bool)
    loss = np.zeros((len(indices), seq_len), np.float32)
    for r, i in enumerate(indices):
        prompt, solution = source.sft_pair(int(i))
        p = tok.encode_prompt(prompt)
        s = tok.encode(solution) + [tok.eos_ids[0]]
        row = (p + s)[:seq_len]
        ids[r, : len(row)] = row
        attn[r, : len(row)] = True
        loss[r, len(p): len(row)] = 1.0
    return ids, attn, loss


def sft_seq_len(source: SyntheticMathSource, tok, limit: int, sample: int = 2048) -> int:
    """Padded SFT length: the longest [prompt | solution <eos>] of a sample, rounded up to 8, at most `limit`
    (padding to the sampler's full window would waste most of each step on pads)."""
    longest = max(len(tok.encode_prompt(p)) + len(tok.encode(s)) + 1
                  for p, s in (source.sft_pair(i) for i in range(min(sample, len(source)))))
    return min(limit, -(-longest // 8) * 8)


def warmup_seq_len(c: ml_collections.ConfigDict, tok, source: SyntheticMathSource) -> int:
    """The SFT row length of config `c`'s warm-up (at most the sampler's prompt + response window)."""
    return sft_seq_len(source, tok, c.sampler.max_prompt_len + c.sampler.max_new_tokens)


def train_sft(model: nnx.Module, source: SyntheticMathSource, tok, *, steps: int, batch_size: int, lr: float,
              seq_len: int, seed: int, progress: bool = False, on_step=None) -> list[float]:
    """Cross-entropy on reference solutions (in place on `model`); returns the loss curve. `on_step(k, model_at)`
    is called after update k with a function giving the model at that point (warm-up curves, without changing
    the schedule or the batches)."""
    graphdef, params = nnx.split(model, nnx.Param)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), max(steps, 2), lr * 0.05)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, ids, attn, loss_mask):
        def f(p):
            m = nnx.merge(graphdef, p)
            logp = token_logprobs(m, ids[:, :-1], ids[:, 1:], loss_mask[:, 1:], attention_mask_bt=attn[:, :-1])
            return -jnp.sum(logp) / jnp.maximum(jnp.sum(loss_mask[:, 1:]), 1.0)

        loss, g = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    it = range(steps)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="warm-up (SFT)", leave=False)
    for _ in it:
        idx = rng.integers(0, len(source), batch_size)
        params, opt_state, loss = step(params, opt_state, *sft_batch(source, tok, idx, seq_len))
        losses.append(float(loss))
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"warm-up loss became {losses[-1]} at step {len(losses)}")
        if on_step is not None:
            on_step(len(losses), lambda p=params: nnx.merge(graphdef, p))
    nnx.update(model, params)
    return losses


def warm_start(c: ml_collections.ConfigDict, model_cfg, tok, source: SyntheticMathSource, *,
               progress: bool = False, on_step=None) -> nnx.Module:
    """The cached warmed-up model for these settings, training (and caching) it first when absent (`on_step`:
    see train_sft)."""
    path = cache_path(c, model_cfg, tok, source)
    if os.path.exists(os.path.join(path, "config.json")):
        log.info("warm-up: reusing %s", path)
        return models.from_pretrained(path, **model_cfg.execution())
    model = models.Qwen3(model_cfg, rngs=nnx.Rngs(c.seed))
    seq_len = warmup_seq_len(c, tok, source)
    losses = train_sft(model, source, tok, steps=c.warmup.steps, batch_size=c.warmup.batch_size, lr=c.warmup.lr,
                       seq_len=seq_len, seed=c.seed, progress=progress, on_step=on_step)
    log.info("warm-up: SFT loss %.3f -> %.3f over %d steps", losses[0], losses[-1], len(losses))
    # Write beside, then rename: a crash never leaves a half-written cache entry that looks complete.
    tmp = f"{path}.tmp{os.getpid()}"
    models.save_pretrained(model, tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process cached the same warm-up first: keep its copy (same settings, same bits)
        shutil.rmtree(tmp, ignore_errors=True)
    return model
