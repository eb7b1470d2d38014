"""The mismatch probe CLI on the tiny model: a real gap under W4A4 + FP8 KV, none when both sides agree."""

import json

import pytest

from triage_jax.tools import mismatch


def _run(capsys, *flags):
    assert mismatch.main(["--config=tiny", "--num_prompts=2", "--group_size=2", "--max_new_tokens=8", *flags]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert any(line.startswith("mean_abs_delta") for line in lines[:-1])  # the table
    return result


def test_w4a4_sampler_against_bf16_learner(capsys):
    r = _run(capsys, "--learner=bf16", "--sampler=w4a4", "--kv=fp8", "--prompts=random", "--prompt_len=5")
    assert r["num_responses"] == 4 and r["response_tokens"] == 32 and r["accuracy"] is None
    assert r["mean_abs_delta"] > 1e-3
    for key in ("frac_small", "delta_q05", "delta_q50", "delta_q95", "kl_k1", "kl_k3", "chi2_token", "tail_freq"):
        assert key in r and r[key] is not None
    assert r["delta_q05"] <= r["delta_q50"] <= r["delta_q95"]


def test_identical_precision_in_float32_has_no_mismatch(capsys):
    # Synthetic math prompts with the character tokenizer; responses are scored (a random model scores 0).
    r = _run(capsys, "--learner=bf16", "--sampler=bf16", "--dtype=float32", "--prompts=synthetic")
    assert r["num_responses"] == 4 and 4 <= r["response_tokens"] <= 32 and r["accuracy"] == 0.0
    assert r["mean_abs_delta"] < 1e-5


def test_hf_checkpoint_without_tokenizer_falls_back_to_random_prompts(capsys, tmp_path):
    from flax import nnx

    from triage_jax import models

    models.save_pretrained(models.Qwen3(models.get_model_config("tiny", num_hidden_layers=1), rngs=nnx.Rngs(3)),
                           tmp_path)
    r = _run(capsys, f"--checkpoint={tmp_path}", "--learner=bf16", "--sampler=w4a16", "--dtype=float32")
    assert r["config"] == str(tmp_path) and r["response_tokens"] == 32 and r["accuracy"] is None
    assert 0 < r["mean_abs_delta"] < 1.0  # 4-bit weights, float32 activations: a small, nonzero gap


def test_bad_flag_is_rejected(capsys):
    with pytest.raises(SystemExit):
        mismatch.main(["--sampler=int3"])
    assert "int3" in capsys.readouterr().err


@pytest.mark.slow  # 40 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_rules_dial(capsys):
    # --sampler_rules turning every decoder layer to BF16 makes a w4a4 sampler a bf16 one: no gap in float32;
    # keeping only the last of the 4 layers quantized leaves a gap in between.
    base = ("--learner=bf16", "--sampler=w4a4", "--dtype=float32", "--prompts=random", "--prompt_len=5")
    full = _run(capsys, *base)
    none = _run(capsys, *base, "--sampler_rules=first:4=bf16")
    part = _run(capsys, *base, "--sampler_rules=first:0.75=bf16")
    assert none["sampler_rules"] == ["^layers\\.(0|1|2|3)\\.=bf16"] and none["learner_rules"] == []
    assert none["mean_abs_delta"] < 1e-5 < part["mean_abs_delta"] and full["mean_abs_delta"] > 1e-4
    both = _run(capsys, *base, "--rules=last:1=bf16", "--learner_rules=attn=w4a16")
    assert both["sampler_rules"] == ["^layers\\.(3)\\.=bf16"]
    assert both["learner_rules"] == ["attn=w4a16", "^layers\\.(3)\\.=bf16"]


def test_bad_rule_is_a_clear_error(capsys):
    assert mismatch.main(["--config=tiny", "--rules=last:9=bf16"]) == 2
    assert "precision rule 'last:9=bf16'" in capsys.readouterr().err
    assert mismatch.main(["--config=tiny", "--learner_rules=attn=w3a3"]) == 2
    assert "unknown preset 'w3a3'" in capsys.readouterr().err


@pytest.mark.slow  # 44 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_exact_flag_gives_zero_delta_from_a_config_file(capsys):
    r = _run(capsys, "--config=configs/tiny.py", "--learner=w4a4", "--sampler=w4a4", "--exact", "--prompts=random",
             "--prompt_len=10")
    assert r["exact"] and r["max_abs_delta"] == 0.0 and r["mean_abs_delta"] == 0.0 and r["response_tokens"] > 0


@pytest.mark.slow  # 71 s on 2 busy cores (pytest -n 2)
def test_exact_flag_with_long_synthetic_prompts(capsys):
    # ~350-token prompts: without `invariant.rounded` an FMA fused in one program but not the other moved last bits.
    r = _run(capsys, "--config=configs/tiny.py", "--learner=w4a4", "--sampler=w4a4", "--exact", "--num_prompts=4")
    assert r["max_abs_delta"] == 0.0 and r["response_tokens"] > 40


@pytest.mark.parametrize("flags,needle", [
    (["--learner=bf16", "--sampler=w4a4"], "one precision"),
    (["--learner=w4a4", "--sampler=w4a4", "--kv=fp8"], "--kv=bf16"),
    (["--learner=w4a4", "--sampler=w4a4", "--sampler_rules=lm_head=bf16"], "same per-layer rules"),
])
def test_exact_flag_rejects_sides_that_differ(capsys, flags, needle):
    with pytest.raises(SystemExit):
        mismatch.main(["--config=tiny", "--exact", *flags])
    assert needle in capsys.readouterr().err


def test_decomposition_starts_exact_and_adds_one_source_per_step():
    from triage_jax import probe

    steps = probe.decomposition("w4a4")
    assert steps[0].sampler == steps[0].learner == "bf16" and steps[0].sampler_exact and steps[0].learner_exact
    both = [s for s in steps if s.sampler == s.learner == "w4a4"]
    assert both[0].sampler_exact and both[0].learner_exact and both[0].kv == "bf16"  # the second zero row
    assert (steps[-1].sampler_exact, steps[-1].learner_exact, steps[-1].learner_act_scaling) == (False, False,
                                                                                                 "tensor")
    with pytest.raises(ValueError, match="not a quantized preset"):
        probe.decomposition("bf16")


@pytest.mark.slow
def test_decompose_table_rows(capsys):
    assert mismatch.main(["--config=tiny", "--num_prompts=2", "--group_size=2", "--max_new_tokens=8",
                          "--sampler=w4a4", "--decompose"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["decomposition"]}
    assert rows["exact bf16/bf16"]["max_abs_delta"] == 0.0 and rows["w4a4 on both sides"]["max_abs_delta"] == 0.0
    assert rows["+ sampler activations nvfp4"]["mean_abs_delta"] > rows["+ sampler weights nvfp4"]["mean_abs_delta"]
    assert rows["+ learner act scales per tensor"]["mean_abs_delta"] > 0
