"""The mismatch probe's library pieces (triage_jax.probe): prompts, scoring, diagnostics, and both sides on a tiny model."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax import data, models, probe
from triage_jax.rl import mismatch_metrics
from triage_jax.rl.delta import token_delta
from triage_jax.sampler import SamplingConfig


def test_prompts():
    tok = data.CharTokenizer()
    examples = data.synthetic_examples(3, seed=5)
    prompts, truths = probe.encode_examples(tok, examples)
    assert prompts == [tok.encode_prompt(ex.prompt) for ex in examples]
    assert truths == [ex.ground_truth for ex in examples]
    r = probe.random_prompts(50, 4, 7, seed=1)
    assert len(r) == 4 and all(len(p) == 7 and min(p) >= 1 and max(p) < 50 for p in r)
    assert r == probe.random_prompts(50, 4, 7, seed=1) != probe.random_prompts(50, 4, 7, seed=2)


def test_advantages_of_scored_groups_and_of_unscored_responses():
    tok = data.CharTokenizer()
    texts = ["Answer: 4", "Answer: 5", "Answer: 7", "Answer: 7"]  # group 0: one right; group 1: both right
    enc = [tok.encode(t) for t in texts]
    width = max(len(e) for e in enc)
    toks = np.array([e + [tok.pad_id] * (width - len(e)) for e in enc])
    mask = np.array([[j < len(e) for j in range(width)] for e in enc])
    adv, scored = probe.advantages(toks, mask, ["4", "7"], tok, 2)
    np.testing.assert_array_equal(scored.accuracy, [True, False, True, True])
    assert float(adv[0]) > 0 > float(adv[1]) and float(adv[2]) == float(adv[3]) == 0.0
    ones, none = probe.advantages(toks, mask, None, None, 2)
    assert none is None and np.all(np.asarray(ones) == 1.0) and ones.shape == (4,)


def test_diagnostics_lead_with_the_headline_and_match_the_library():
    rng = np.random.default_rng(0)
    delta = rng.normal(0, 0.05, (4, 12)).astype(np.float32)
    mask = np.ones((4, 12), bool)
    mask[1, 8:] = False
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    got = probe.diagnostics(adv, delta, mask)
    want = mismatch_metrics(adv, delta, mask.astype(np.float32))
    assert list(got)[: len(probe.HEADLINE)] == list(probe.HEADLINE)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), nan_ok=True), k


def test_both_sides_agree_in_float32_and_delta_is_rl_delta():
    model = models.Qwen3(models.get_model_config("tiny", num_hidden_layers=1, dtype="float32"), rngs=nnx.Rngs(0))
    prompts = probe.random_prompts(model.cfg.vocab_size, 2, 5, seed=0)
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0)
    out = probe.sample_responses(model, prompts, cfg, sampler="bf16", kv="bf16", seed=0, pad_id=0)
    lp = probe.recompute_logprobs(model, out, "bf16", temperature=1.0, vocab_chunk=model.cfg.vocab_size)
    assert lp.shape == out.logprobs.shape == (2, 6)
    delta = token_delta(lp, out.logprobs, out.mask)
    assert float(jnp.abs(delta).max()) < 1e-4  # float32 both ways: the same numbers up to reduction order
    np.testing.assert_array_equal(np.asarray(delta)[~np.asarray(out.mask)], 0.0)


def test_rules_reach_both_sides():
    # A rule matching every quantized layer turns the w4a4 preset into BF16 (the keep-high-precision defaults
    # already cover the rest): both sides then compute exactly what the bf16 preset does.
    model = models.Qwen3(models.get_model_config("tiny", num_hidden_layers=2, dtype="float32"), rngs=nnx.Rngs(0))
    prompts = probe.random_prompts(model.cfg.vocab_size, 2, 5, seed=0)
    cfg = SamplingConfig(max_new_tokens=4, temperature=1.0)
    every = (("^layers\\.", "bf16"),)
    ref = probe.sample_responses(model, prompts, cfg, sampler="bf16", kv="bf16", seed=0, pad_id=0)
    out = probe.sample_responses(model, prompts, cfg, sampler="w4a4", kv="bf16", seed=0, pad_id=0, rules=every)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.logprobs, ref.logprobs)
    v = model.cfg.vocab_size
    lp_ref = probe.recompute_logprobs(model, ref, "bf16", temperature=1.0, vocab_chunk=v)
    np.testing.assert_array_equal(probe.recompute_logprobs(model, ref, "w4a4", temperature=1.0, vocab_chunk=v,
                                                           rules=every), lp_ref)
    # one layer back in BF16 moves the learner's log-probs, but less than the whole w4a4 learner does
    lp_q = probe.recompute_logprobs(model, ref, "w4a4", temperature=1.0, vocab_chunk=v)
    lp_1 = probe.recompute_logprobs(model, ref, "w4a4", temperature=1.0, vocab_chunk=v, rules=(("^layers\\.1\\.", "bf16"),))
    assert 0 < float(jnp.abs(lp_1 - lp_ref).sum()) and float(jnp.abs(lp_1 - lp_q).sum()) > 0
    # the sampler side keeps its token-wise activation scales for rule presets
    (_, prec), = probe.sampler_rules((("attn", "w4a4"),))
    assert prec.act_scaling == "row" and probe.sampler_rules((("x", "bf16"),))[0][1].act_scaling == "tensor"
