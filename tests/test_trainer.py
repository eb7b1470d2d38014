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
    c.rl.max_response_len = 12
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
        ro, s = real_rollout(key)
        ro.adv[:] = np.nan
        return ro, s

    tr.rollout = poisoned
    m = tr.train_step()  # two skipped updates: streak 2 < 3
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
            "--config.rl.max_response_len=8", "--config.rl.max_resample=0"]
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
