"""End-to-end GRPO on the tiny model: logs + checkpoint + summary, exact resume, SIGTERM, non-finite updates."""

import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax.config import base_config
from triage_jax.trainer import NonFiniteError, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(tmp_path, **over):
    c = base_config()
    c.run_dir = str(tmp_path / "run")
    c.warmup.cache_dir = str(tmp_path / "warm")
    c.warmup.steps = 4
    c.warmup.batch_size = 8
    c.rl.num_prompts, c.rl.group_size = 2, 4
    c.rl.mini_batch, c.rl.micro_batch = 4, 2
    c.rl.max_resample = 1
    c.rl.dynamic_sampling = False  # a barely warmed-up model answers every prompt wrong: keep the rows
    c.rl.overlong_buffer = 8  # ...and length shaping gives its equally wrong responses distinct rewards
    c.train.steps = 4
    c.train.ckpt_every = 2
    c.train.energy_every = 2
    c.train.progress = False
    c.sampler.max_new_tokens = 12
    c.rl.triage.k_rep = 0  # exercise the repair term from the first update
    for k, v in over.items():
        node = c
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = v
    return c


def test_run_writes_logs_checkpoint_summary(tmp_path):
    c = small_config(tmp_path)
    tr = Trainer(c)
    hist = tr.run()
    assert len(hist) == 4
    assert any(m["learner/policy_loss"] != 0 for m in hist)  # advantages are not all zero
    for m in hist:
        for k in ("reward/mean", "mismatch/mean_abs_delta", "mismatch/rho_asym", "learner/loss",
                  "learner/repair_loss", "time/rollout", "time/learner", "time/sync", "correction/frac_clipped"):
            assert k in m, k
        assert np.isfinite(m["learner/loss"]) and np.isfinite(m["mismatch/mean_abs_delta"])
        assert m["mismatch/mean_abs_delta"] > 0  # W4A4 sampler vs BF16 learner always disagree a little
    assert [("mismatch/delta_energy_realized" in m) for m in hist] == [True, False, True, False]
    assert tr.ckpt.all_steps() == [2, 4]
    assert os.listdir(os.path.join(c.run_dir, "tb"))
    s = tr.summary()
    assert "reward/mean" in s["metrics"]
    assert json.load(open(os.path.join(c.run_dir, "summary.json")))["steps"] == 4
    assert json.load(open(os.path.join(c.run_dir, "config.json")))["rl"]["group_size"] == 4


def test_resume_is_exact(tmp_path):
    full = Trainer(small_config(tmp_path / "a")).run()
    c = small_config(tmp_path / "b")
    Trainer(c).run(max_steps=2)  # "killed" after the checkpoint at step 2
    resumed = Trainer(c)
    assert resumed.restore() and resumed.step == 2
    rest = resumed.run(resume=False)
    def untimed(m):
        return {k: v for k, v in m.items() if not k.startswith("time/")}

    assert len(rest) == len(full)
    for a, b in zip(full[2:], rest[2:]):
        # Bit-identical, NaN (an empty diagnostic denominator) included.
        np.testing.assert_equal(untimed(a), untimed(b))


def test_nonfinite_streak(tmp_path):
    c = small_config(tmp_path, **{"train.max_nonfinite": 3})
    tr = Trainer(c)
    before = jax.tree.map(np.asarray, tr.learner.params)
    real_rollout = tr.rollout

    def poisoned(key):
        ro, s, secs = real_rollout(key)
        ro.adv[:] = np.nan
        return ro, s, secs

    tr.rollout = poisoned
    m = tr.train_step().metrics  # two skipped updates: streak 2 < 3
    assert m["learner/skipped_update"] == 1.0
    after = jax.tree.map(np.asarray, tr.learner.params)
    jax.tree.map(np.testing.assert_array_equal, before, after)
    with pytest.raises(NonFiniteError, match="max_nonfinite"):
        tr.train_step()


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "triage_jax.main", "--config=configs/tiny.py", f"--config.run_dir={run_dir}",
            f"--config.warmup.cache_dir={tmp_path / 'warm'}", "--config.warmup.steps=2",
            "--config.warmup.batch_size=4", "--config.rl.num_prompts=2", "--config.rl.group_size=4",
            "--config.rl.mini_batch=8", "--config.rl.micro_batch=4", "--config.train.steps=1000",
            "--config.train.ckpt_every=1000", "--config.train.progress=False", "--config.sampler.max_new_tokens=8",
            "--config.rl.max_resample=0"]
    proc = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "step 2/1000" in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=300)
    log = "".join(lines) + rest
    assert proc.returncode == 0, log[-3000:]
    assert "signal 15 received" in log
    steps = [int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()]
    assert steps and max(steps) >= 2


def _score_by_length(texts, truths, reward="dapo"):
    """Stand-in grader: a response is "correct" when its length is even, so groups come out mixed, all right
    or all wrong depending on the draw (a barely warmed-up model answers nothing right)."""
    from triage_jax.data.rewards import BatchRewards

    correct = np.array([len(t) % 2 == 0 for t in texts])
    return BatchRewards(rewards=np.where(correct, 1.0, -1.0).astype(np.float32), accuracy=correct)


def test_dynamic_sampling_with_fill_rows(tmp_path, monkeypatch):
    """The trainer's dynamic-sampling path: flat groups dropped, the batch short of groups gets fill rows, the
    fill rows are spread so no mini-batch is left without a real token, and the counters say so."""
    from triage_jax import rollout

    monkeypatch.setattr(rollout, "score_batch", _score_by_length)
    c = small_config(tmp_path, **{"rl.dynamic_sampling": True, "rl.max_resample": 0, "rl.num_prompts": 4,
                                  "rl.mini_batch": 8, "rl.micro_batch": 4, "rl.overlong_buffer": 0})
    tr = Trainer(c)
    hist = tr.run(max_steps=3)
    fills = [m["dynamic_sampling/batch_fill"] for m in hist]
    assert any(0 < f < 1 for f in fills), fills  # some groups kept, some dropped
    for m in hist:
        kept = round(m["dynamic_sampling/batch_fill"] * 4)
        # 4 groups of 4 over 2 mini-batches: a mini-batch is empty only when no group was kept.
        assert m["learner/empty_minibatches"] == (2 if kept == 0 else 0)
    assert tr.learner.num_updates == sum(2 - m["learner/empty_minibatches"] for m in hist)
    assert hist[-1]["learner/updates"] == tr.learner.num_updates


def test_no_kept_group_takes_no_step_and_logs_nan(tmp_path, monkeypatch):
    """Every group flat: the whole batch is fill rows, no mini-batch takes an optimizer step (params and
    AdamW state bit-identical, update count 0), and the learner's NaN metrics reach TensorBoard."""
    from triage_jax import rollout
    from triage_jax.data.rewards import BatchRewards

    monkeypatch.setattr(rollout, "score_batch", lambda texts, truths, reward="dapo": BatchRewards(
        rewards=np.full(len(texts), -1.0, np.float32), accuracy=np.zeros(len(texts), bool)))
    c = small_config(tmp_path, **{"rl.dynamic_sampling": True, "rl.max_resample": 1})
    tr = Trainer(c)
    before = jax.tree.map(np.asarray, (tr.learner.params, tr.learner.opt_state))
    hist = tr.run(max_steps=1)
    after = jax.tree.map(np.asarray, (tr.learner.params, tr.learner.opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    m = hist[0]
    assert m["dynamic_sampling/batch_fill"] == 0 and m["dynamic_sampling/rollouts"] == 2
    assert m["learner/empty_minibatches"] == 2 and tr.learner.num_updates == 0
    assert np.isnan(m["learner/loss"]) and np.isnan(m["learner/clipfrac"])

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    from common import read_scalars

    scalars = read_scalars(os.path.join(c.run_dir, "tb"))
    assert np.isnan(scalars["learner/clipfrac"][1]).all()  # logged as NaN, not dropped
    assert scalars["learner/empty_minibatches"][1].tolist() == [2.0]
