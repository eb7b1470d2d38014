"""Smoke tests of experiments/bench_sampler.py's workload pieces (the countdown model forces exact stops) and of
bench_tunix.py's id tokenizer; the benchmarks themselves are run by hand (they time things)."""

import jax
import numpy as np

from experiments import bench_sampler as bs
from experiments.bench_tunix import IdTokenizer
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig


def test_skewed_lengths_are_long_tailed():
    lengths = bs.draw_lengths(256, 512, np.random.default_rng(0))
    assert lengths.shape == (256,) and lengths.min() >= 4 and lengths.max() == 512
    assert np.median(lengths) < 80 and (lengths >= 256).sum() >= 3  # most short, a few long


def test_countdown_model_stops_exactly_at_drawn_lengths():
    """Continuous and static batching both return exactly the drawn lengths (stop token last)."""
    max_new = 24
    model, vocab = bs.countdown_model(max_new)
    rng = np.random.default_rng(1)
    lengths = np.array([1, 2, 5, 24, 9, 3, 17, 4])
    prompts = [rng.integers(max_new + 2, vocab, 5).tolist() + [int(L) + 1] for L in lengths]
    cfg = SamplingConfig(max_new_tokens=max_new, greedy=True, stop_ids=(bs.STOP,))
    for config in (EngineConfig(max_slots=3, max_len=64), EngineConfig(max_slots=8, max_len=64, continuous=False)):
        out = Engine(cfg, config, pad_id=0, model=model).generate(prompts, jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
        toks = np.asarray(out.tokens)
        assert all(toks[i, L - 1] == bs.STOP for i, L in enumerate(lengths))
        np.testing.assert_array_equal(toks[3, :23], np.arange(24, 1, -1))  # c_23 ... c_1 (ids 24 ... 2), then stop


def test_matmul_ceiling_runs():
    tok_s, gflops, engine, hf = bs.matmul_ceiling(bs.models.get_model_config("tiny", num_hidden_layers=1), 4, 4, 1)
    assert tok_s > 0 and gflops > 0 and engine is None and hf is None


def test_tunix_id_tokenizer_round_trips():
    tok = IdTokenizer()
    assert tok.encode("5 17 99") == [5, 17, 99] and tok.decode([5, 17]) == "5 17" and tok.bos_id() is None


def test_bench_engines_are_configured_as_the_trainer_builds_them():
    """The benchmark times the trainer's engine: the same EngineConfig `build.engine` makes for those sampler
    settings (a prefill as wide as the prompt, a cache budget of prompt + response), not a hand-made one."""
    from triage_jax import build
    from triage_jax.config import base_config

    c = base_config()
    c.sampler.max_slots, c.sampler.max_prompt_len, c.sampler.max_new_tokens = 32, 32, 128
    config = bs.engine_config(32, 32, 128)
    assert config == build.engine_config(c)
    assert config.max_prompt_len == 32 and config.max_len == 160 and config.max_slots == 32
    assert bs.engine_config(8, 32, 128, continuous=False).continuous is False
