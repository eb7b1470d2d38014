"""Supervised warm-up on the long chains: the loss covers exactly each reference solution and its stop token,
it falls, and watching it (on_step) changes nothing."""

import jax
import numpy as np
from flax import nnx

from triage_jax import build, models
from triage_jax.config import base_config
from triage_jax.warmup import cache_path, sft_batch, sft_seq_len, train_sft


def _organism_like(tmp_path):
    c = base_config()
    c.run_dir = str(tmp_path)
    c.tokenizer, c.data.levels, c.data.style = "bpe", (5, 6), "words"
    c.bpe.vocab_size, c.bpe.corpus_size = 512, 400
    c.sampler.max_prompt_len, c.sampler.max_new_tokens = 80, 160
    tok, src = build.tokenizer(c), build.source(c)
    return c, tok, src


def test_sft_rows_train_on_the_whole_chain_and_its_stop_token(tmp_path):
    c, tok, src = _organism_like(tmp_path)
    seq = sft_seq_len(src, tok, c.sampler.max_prompt_len + c.sampler.max_new_tokens)
    ids, attn, loss = sft_batch(src, tok, [0, 1, 2, 3], seq)
    for r in range(4):
        prompt, solution = src.sft_pair(r)
        target = ids[r][loss[r] > 0]
        assert target[-1] == tok.eos_ids[0] and tok.decode(target) == solution  # nothing truncated
        assert len(target) >= 60 and attn[r].sum() == len(tok.encode_prompt(prompt)) + len(target)


def test_sft_loss_falls_and_on_step_only_observes(tmp_path):
    _, tok, src = _organism_like(tmp_path)
    mc = models.ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    kw = dict(steps=12, batch_size=4, lr=3e-3, seq_len=208, seed=0)
    seen = []
    a = models.Qwen3(mc, rngs=nnx.Rngs(0))
    la = train_sft(a, src, tok, on_step=lambda k, model_at: seen.append((k, model_at())), **kw)
    b = models.Qwen3(mc, rngs=nnx.Rngs(0))
    lb = train_sft(b, src, tok, **kw)
    assert la == lb and np.mean(la[-3:]) < la[0] - 0.5
    assert [k for k, _ in seen] == list(range(1, 13))
    final = nnx.state(seen[-1][1], nnx.Param)
    for x, y in zip(jax.tree.leaves(final), jax.tree.leaves(nnx.state(a, nnx.Param))):
        np.testing.assert_array_equal(x, y)  # the model at the last update is the trained model


def test_a_wider_response_budget_shares_the_warmup_a_truncating_one_does_not(tmp_path):
    """The warm-up cache is keyed by the SFT rows it trains on: a config that only widens sampler.max_new_tokens
    past the longest reference chain reuses the cached warm-up (its SFT is the same), one that cuts the chains
    (or changes the warm-up's settings) gets its own."""
    c, tok, src = _organism_like(tmp_path)
    c.sampler.max_new_tokens = 400
    mc = models.ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    path = cache_path(c, mc, tok, src)
    seq = sft_seq_len(src, tok, c.sampler.max_prompt_len + c.sampler.max_new_tokens)
    assert seq < c.sampler.max_prompt_len + c.sampler.max_new_tokens  # the chains end before the window does
    wide = c.copy_and_resolve_references()
    wide.sampler.max_new_tokens = 800
    assert cache_path(wide, mc, tok, src) == path
    cut = c.copy_and_resolve_references()
    cut.sampler.max_new_tokens = seq - c.sampler.max_prompt_len - 16
    steps = c.copy_and_resolve_references()
    steps.warmup.steps += 1
    assert len({path, cache_path(cut, mc, tok, src), cache_path(steps, mc, tok, src)}) == 3
