"""A pilot run's saved token deltas (train.save_deltas, triage_jax.deltas) and the thresholds CLI over them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from triage_jax import deltas
from triage_jax.rl.triage import TriageConfig, propose_thresholds
from triage_jax.trainer import Trainer

from test_trainer import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _step(rng, n, r, scale=0.05):
    d = rng.normal(0.0, scale, (n, r)).astype(np.float32)
    m = (np.arange(r)[None, :] < rng.integers(1, r + 1, (n, 1))).astype(np.float32)
    return d, m, rng.normal(size=n).astype(np.float32)


def test_roundtrip_pads_widths_and_filters_steps(tmp_path):
    rng = np.random.default_rng(0)
    a, b = _step(rng, 4, 70), _step(rng, 3, 130)
    deltas.write(str(tmp_path), 0, *a)
    deltas.write(str(tmp_path), 5, *b)
    assert deltas.saved_steps(str(tmp_path)) == [0, 5]
    pool = deltas.read(str(tmp_path))
    assert pool.delta.shape == (7, 130) and pool.steps == (0, 5)
    np.testing.assert_array_equal(pool.delta[:4, :70], np.where(a[1] > 0, a[0], 0))  # off-mask zeroed
    assert not pool.mask[:4, 70:].any() and not pool.delta[:4, 70:].any()
    np.testing.assert_array_equal(pool.delta[4:], np.where(b[1] > 0, b[0], 0))
    np.testing.assert_array_equal(pool.adv, np.concatenate([a[2], b[2]]))
    only = deltas.read(str(tmp_path), range(3, 9))
    assert only.steps == (5,) and only.delta.shape == (3, 130)
    # The proposal is propose_thresholds on the pooled tokens, on top of the run's own settings.
    base = TriageConfig(segment_len=32, k_rep=7)
    got, _ = deltas.propose(str(tmp_path), base)
    assert got == propose_thresholds(pool.delta, pool.mask, base)
    assert got.segment_len == 32 and got.k_rep == 7 and got.tau_tail != base.tau_tail
    assert set(deltas.overrides(got)) == {f"rl.triage.{k}" for k in deltas.THRESHOLD_KEYS}


def test_missing_or_misshaped_deltas_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.save_deltas"):
        deltas.read(str(tmp_path))
    deltas.write(str(tmp_path), 2, *_step(np.random.default_rng(1), 2, 8))
    with pytest.raises(FileNotFoundError, match="saved steps are 2..2"):
        deltas.read(str(tmp_path), range(5, 7))
    with pytest.raises(ValueError, match=r"delta \[N,R\]"):
        deltas.write(str(tmp_path), 3, np.zeros((2, 8)), np.ones((2, 7)), np.zeros(2))


@pytest.mark.slow  # 52 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_trainer_saves_every_kth_step_the_delta_its_metrics_come_from(tmp_path):
    c = small_config(tmp_path, **{"train.steps": 3, "train.save_deltas": 2, "train.energy_every": 0})
    hist = Trainer(c).run()
    assert deltas.saved_steps(c.run_dir) == [0, 2]
    for step in (0, 2):
        with np.load(deltas.path(c.run_dir, step)) as z:
            d, m, adv = z["delta"], z["mask"], z["adv"]
        n = c.rl.num_prompts * c.rl.group_size
        assert d.shape == m.shape and d.shape[0] == n and adv.shape == (n,)
        real = d[m > 0]
        assert real.size and np.any(real != 0)
        assert np.isclose(np.abs(real).mean(), hist[step]["mismatch/mean_abs_delta"], rtol=1e-5, atol=1e-8)
        assert np.isclose(m.sum(axis=1).mean(), hist[step]["response/length_mean"], rtol=1e-6)
        # The group advantages, in row order: each prompt's G responses are centred on their group mean.
        np.testing.assert_allclose(adv.reshape(-1, c.rl.group_size).sum(axis=1), 0.0, atol=1e-4)


def test_thresholds_cli_prints_the_proposal(tmp_path):
    rng = np.random.default_rng(2)
    for s in range(3):
        deltas.write(str(tmp_path), s, *_step(rng, 8, 64))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "triage_jax.tools.thresholds", f"--run_dir={tmp_path}",
                          "--steps=1:3"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["steps"] == [1, 2]
    want, _ = deltas.propose(str(tmp_path), TriageConfig(), range(1, 3))
    assert rec["proposed"] == {k: getattr(want, k) for k in deltas.THRESHOLD_KEYS}
    assert f"--config.rl.triage.tau_tail={want.tau_tail:.6g}" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "triage_jax.tools.thresholds", f"--run_dir={tmp_path / 'none'}"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert bad.returncode != 0 and "train.save_deltas" in bad.stderr
