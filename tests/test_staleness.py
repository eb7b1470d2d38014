"""Stale-policy training (rl.staleness, docs/rl_math.md#stale-rollouts): the rollout of step k comes from the
weights of step k - s, the mismatch splits exactly into precision + staleness, the correction acts on the chosen
part, and a stale run is deterministic and resumes bit for bit."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from triage_jax import build, sampler
from triage_jax.config import ConfigError, base_config, validate
from triage_jax.learner import Correction, prepare
from triage_jax.rl import corrections as corr
from triage_jax.rl import diagnostics
from triage_jax.rl.delta import DELTA_SOURCES, delta_anchor, delta_parts, select_delta, token_delta
from triage_jax.rl.triage import TriageConfig
from triage_jax.trainer import Trainer

from test_trainer import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _logps(seed=0, n=6, t=10):
    """Sampler, behaviour-learner and current-learner log-probs of a batch with ragged padding."""
    r = np.random.default_rng(seed)
    sampler_nt = -r.exponential(1.0, (n, t)).astype(np.float32)
    behaviour_nt = sampler_nt + r.normal(0, 0.05, (n, t)).astype(np.float32)
    current_nt = behaviour_nt + r.normal(0, 0.3, (n, t)).astype(np.float32)
    mask_nt = (np.arange(t)[None, :] < r.integers(1, t + 1, n)[:, None]).astype(np.float32)
    mask_nt[-1] = 0  # a row without a token
    adv_n = r.normal(size=n).astype(np.float32)
    return sampler_nt, behaviour_nt, current_nt, mask_nt, adv_n


# ------------------------------------------------------------------------------------------------ pure math
def test_delta_parts_add_up_exactly_and_match_their_definitions():
    s, b, c, m, _ = _logps()
    parts = delta_parts(c, b, s, m)
    np.testing.assert_array_equal(parts.precision, token_delta(b, s, m))
    np.testing.assert_array_equal(parts.staleness, token_delta(c, b, m))
    np.testing.assert_array_equal(parts.total, parts.precision + parts.staleness)  # bit for bit, by construction
    # ... and the total is the direct learner(current) - sampler delta up to one float32 rounding.
    np.testing.assert_allclose(parts.total, token_delta(c, s, m), rtol=0, atol=1e-6)
    for d in parts:
        assert np.all(np.asarray(d)[m == 0] == 0)  # padding is exactly 0
    # The anchor of each source: l_old - l_ref is that source's delta (the repair term's reference).
    for source in DELTA_SOURCES:
        ref = delta_anchor(source, parts, s, b)
        np.testing.assert_allclose(np.where(m > 0, c - ref, 0), select_delta(parts, source), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(delta_anchor("total", parts, s, b), s)  # the synchronous loop's, unchanged
    with pytest.raises(ValueError, match="not one of"):
        select_delta(parts, "sampler")


def _prepare(correction, behaviour, source="total", seed=0):
    s, b, c, m, adv = _logps(seed)
    n, t = m.shape
    ids = np.zeros((n, 4 + t), np.int32)
    attn = np.ones((n, 4 + t), bool)
    return prepare(ids, attn, m, adv, s, c, np.zeros_like(c), None, b if behaviour else None,
                   correction=correction, triage=TriageConfig(segment_len=4), delta_source=source), (s, b, c, m, adv)


@pytest.mark.parametrize("source", DELTA_SOURCES)
def test_the_correction_acts_on_the_chosen_delta(source):
    """token_tis weights are min(exp(delta_source), C), and every part gets its own diagnostics."""
    cfg = corr.make_config("token_tis", {"C": 1.1})
    (batch, metrics, delta), (s, b, c, m, adv) = _prepare(Correction("token_tis", cfg), True, source)
    parts = delta_parts(c, b, s, m)
    want = corr.apply_correction("token_tis", adv=adv, delta=select_delta(parts, source), mask=m, cfg=cfg)
    np.testing.assert_array_equal(batch.weights, want.weights)
    np.testing.assert_array_equal(batch.anchor_logp, delta_anchor(source, parts, s, b))
    np.testing.assert_array_equal(delta, parts.total)
    for prefix, d in (("mismatch", parts.total), ("mismatch_precision", parts.precision),
                      ("mismatch_staleness", parts.staleness)):
        ref = diagnostics.mismatch_metrics(adv, d, m, TriageConfig(segment_len=4), weights=want.weights)
        for k in ("mean_abs_delta", "delta_q05", "rho_asym", "tail_freq", "energy", "b_amp"):
            np.testing.assert_allclose(metrics[f"{prefix}/{k}"], ref[k], rtol=1e-6, equal_nan=True)
    # The three are different numbers here (the test would not see a mixed-up prefix otherwise).
    assert len({float(metrics[f"{p}/mean_abs_delta"]) for p in ("mismatch", "mismatch_precision",
                                                                 "mismatch_staleness")}) == 3


def test_triage_gates_the_chosen_delta():
    tcfg = TriageConfig(segment_len=4, tau_tail=0.05, g_lo=0.0, g_hi=0.02, f_lo=0.0, f_hi=0.2)
    (batch, _, _), (s, b, c, m, adv) = _prepare(Correction("triage", tcfg), True, "staleness")
    want = corr.apply_correction("triage", adv=adv, delta=token_delta(c, b, m), mask=m, cfg=tcfg)
    np.testing.assert_array_equal(batch.weights, want.weights)
    assert np.any(np.asarray(want.weights)[m > 0] != 1.0)  # the gate did something


def test_behaviour_equal_to_current_weights_gives_the_synchronous_numbers():
    """A stale rollout whose behaviour weights are the current ones (staleness 0 in effect): mismatch/* and the
    correction are the synchronous path's (behaviour_logp=None), and delta_staleness is 0."""
    s, _, c, m, adv = _logps()
    n, t = m.shape
    ids, attn = np.zeros((n, 4 + t), np.int32), np.ones((n, 4 + t), bool)
    kw = dict(correction=Correction("triage", TriageConfig(segment_len=4)), triage=TriageConfig(segment_len=4))
    sync_batch, sync_m, sync_d = prepare(ids, attn, m, adv, s, c, np.zeros_like(c), None, None, **kw)
    stale_batch, stale_m, stale_d = prepare(ids, attn, m, adv, s, c, np.zeros_like(c), None, c, **kw)
    np.testing.assert_array_equal(sync_d, stale_d)
    np.testing.assert_array_equal(sync_batch.weights, stale_batch.weights)
    for k, v in sync_m.items():
        np.testing.assert_array_equal(v, stale_m[k], err_msg=k)
    assert float(stale_m["mismatch_staleness/mean_abs_delta"]) == 0.0
    assert not any(k.startswith("mismatch_precision/") for k in sync_m)
    with pytest.raises(ValueError, match="behaviour_logp"):
        prepare(ids, attn, m, adv, s, c, np.zeros_like(c), None, None, delta_source="staleness", **kw)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("key, value, match", [
    ("rl.staleness", -1, r"config\.rl\.staleness: must be an integer >= 0"),
    ("rl.delta_source", "sampler", r"config\.rl\.delta_source: 'sampler' is not one of"),
    ("rl.delta_source", "staleness", r"config\.rl\.delta_source: 'staleness' is 0 on every token"),
    ("mesh.sampler_devices", -1, r"config\.mesh\.sampler_devices: must be an integer >= 0"),
    ("mesh.sampler_devices", 3, r"config\.mesh\.sampler_devices: 256 decode slots .* do not split over"),
])
def test_config_errors_name_the_key(key, value, match):
    c = base_config()
    sect, name = key.split(".")
    c[sect][name] = value
    with pytest.raises(ConfigError, match=match):
        validate(c, check_paths=False)


def test_config_accepts_stale_settings():
    c = base_config()
    c.rl.staleness, c.rl.delta_source, c.mesh.sampler_devices = 2, "staleness", 2
    validate(c, check_paths=False)
    c.rl.staleness, c.rl.delta_source = 0, "precision"  # = total in a synchronous run
    validate(c, check_paths=False)


# ------------------------------------------------------------------------------------------------ trainer
def _np(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.slow  # 109 s on 2 busy cores (pytest -n 2)
def test_staleness_1_trains_on_the_rollouts_of_the_previous_weights(tmp_path):
    """Exact mode (W4A4 both sides), rl.staleness=1, 3 steps. Each step's behaviour weights are the weights of
    step k-1 (step 0: the initial ones), the rollout it trains on is what those weights sample from its key and
    prompts (and not what the current weights sample), delta_precision is exactly 0 (the learner at the weights
    that sampled equals the sampler bit for bit), and delta_staleness is the learner's current-vs-behaviour
    log-prob difference."""
    c = small_config(tmp_path, **{"rl.staleness": 1, "learner.exact": True, "learner.precision": "w4a4",
                                  "train.steps": 3, "train.energy_every": 0})
    tr = Trainer(c)
    seen = []
    learn = tr._learn

    def spy(ro, behaviour=None):
        q = tr.queue[0]
        seen.append(dict(step=q.step, data_state=q.data_state, ro=ro, current=_np(tr.learner.params),
                         behaviour=_np(behaviour)))
        return learn(ro, behaviour)

    tr._learn = spy
    hist = tr.run()
    assert [s["step"] for s in seen] == [0, 1, 2]
    for k, s in enumerate(seen):
        jax.tree.map(np.testing.assert_array_equal, s["behaviour"], seen[max(k - 1, 0)]["current"])
    for m in hist:
        assert m["mismatch_precision/mean_abs_delta"] == 0.0
        assert m["mismatch/mean_abs_delta"] == m["mismatch_staleness/mean_abs_delta"]
        for key in ("time/rollout", "time/rollout_wait", "time/overlap_hidden", "time/overlap_frac"):
            assert np.isfinite(m[key]) and m[key] >= 0, key
    assert hist[0]["mismatch_staleness/mean_abs_delta"] == 0.0  # step 0 samples with its own (initial) weights
    assert hist[2]["mismatch_staleness/mean_abs_delta"] > 0  # w_1 != w_2
    # Manual: the weights of step 1 sample step 2's rollout from its key and loader state.
    s2 = seen[2]
    tr.loader.set_state(s2["data_state"])
    tr.engine.load(sampler.prepare_model(tr.learner.model(jax.tree.map(jnp.asarray, s2["behaviour"])),
                                         tr.sampler_policy))
    manual, _, _ = tr.rollout(jax.random.fold_in(jax.random.key(c.seed), 2))
    np.testing.assert_array_equal(manual.input_ids, s2["ro"].input_ids)
    np.testing.assert_array_equal(manual.sampler_logp, s2["ro"].sampler_logp)
    tr.loader.set_state(s2["data_state"])
    tr.engine.load(sampler.prepare_model(tr.learner.model(jax.tree.map(jnp.asarray, s2["current"])),
                                         tr.sampler_policy))
    own, _, _ = tr.rollout(jax.random.fold_in(jax.random.key(c.seed), 2))
    assert not np.array_equal(own.sampler_logp, s2["ro"].sampler_logp)  # the test can tell the weights apart
    # delta_staleness = learner(current) - learner(behaviour), recomputed by hand.
    ro = s2["ro"]
    cur = tr.learner.logprobs(ro.input_ids, ro.attn_mask, tr.R, params=jax.tree.map(jnp.asarray, s2["current"]))[0]
    beh = tr.learner.logprobs(ro.input_ids, ro.attn_mask, tr.R, params=jax.tree.map(jnp.asarray, s2["behaviour"]))[0]
    np.testing.assert_array_equal(np.where(ro.resp_mask > 0, beh, 0), ro.sampler_logp)  # exact: precision 0
    d = token_delta(cur, beh, ro.resp_mask)
    np.testing.assert_allclose(hist[2]["mismatch_staleness/mean_abs_delta"],
                               float(jnp.sum(jnp.abs(d)) / ro.resp_mask.sum()), rtol=1e-6)


def _untimed(m):
    return {k: v for k, v in m.items() if not k.startswith("time/")}


@pytest.mark.slow  # 135 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_stale_run_is_deterministic_and_resumes_exactly(tmp_path):
    """rl.staleness=2 (a ring of two snapshots, two queued rollouts): a rerun gives the same numbers, and a run
    killed after step 3's log but before its checkpoint resumes from step 2 (snapshots restored, the queue
    sampled again from them) bit-identical to the uninterrupted run, also across a failed step."""
    over = {"rl.staleness": 2, "rl.delta_source": "staleness", "train.steps": 4}
    full = Trainer(small_config(tmp_path / "a", **over)).run()
    assert full[3]["mismatch_staleness/mean_abs_delta"] > 0
    c = small_config(tmp_path / "b", **over)
    first = Trainer(c).run(max_steps=3)
    for a, b in zip(full[:3], first):  # a deterministic rerun
        np.testing.assert_equal(_untimed(a), _untimed(b))
    shutil.rmtree(os.path.join(c.run_dir, "checkpoints", "3"))
    resumed = Trainer(c)
    assert resumed.restore() and resumed.step == 2 and len(resumed.behaviour) == 2 and not resumed.queue
    # ... and step 3 fails before its updates (the background rollout already drew prompts): the trainer goes back
    # to the step boundary (loader rewound, queue dropped), and running on continues as if nothing had happened.
    learn, failed = resumed._learn, []

    def fail_once_at_3(ro, behaviour=None):
        if resumed.step == 3 and not failed:
            failed.append(True)
            raise RuntimeError("boom")
        return learn(ro, behaviour)

    resumed._learn = fail_once_at_3
    with pytest.raises(RuntimeError, match="boom"):
        resumed.run(resume=False)
    assert resumed.step == 3 and not resumed.queue and resumed.ckpt.latest_step() == 3  # the failure save
    rest = resumed.run(resume=False)
    assert len(rest) == 4
    for a, b in zip(full[2:], rest[2:]):
        np.testing.assert_equal(_untimed(a), _untimed(b))
    assert rest[2]["time/rollout_fill"] > 0 and rest[3]["time/rollout_fill"] > 0  # the queue was sampled again
    # A reader (tools.eval) restores the stale run's checkpoint, snapshots included in its layout.
    model, _, step = build.load_policy(c)
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, _np(nnx.state(model, nnx.Param)), _np(resumed.learner.params))


SPLIT_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "tests")
    import pathlib, jax, numpy as np
    from test_trainer import small_config
    from triage_jax.trainer import Trainer

    out = {}
    for split in (0, 1):
        c = small_config(pathlib.Path(sys.argv[1]) / str(split), **{"rl.staleness": 1, "train.steps": 3,
                                                                   "mesh.sampler_devices": split})
        tr = Trainer(c)
        hist = tr.run()
        out[split] = {"hist": [{k: v for k, v in m.items() if not k.startswith("time/")} for m in hist],
                      "hidden": [m["time/overlap_hidden"] for m in hist],
                      "slot_devices": sorted(str(d) for d in tr.engine.last_slot_devices),
                      "learner_devices": sorted(str(d) for d in tr.learner.mesh.devices.flat)}
    print("RESULT", json.dumps(out))
""")


@pytest.mark.slow  # two trainers in a 2-device subprocess: ~2 min on 2 cores
def test_sampler_submesh_samples_on_its_own_device_with_the_same_numbers(tmp_path):
    """mesh.sampler_devices=1 on 2 simulated devices: the engine's slots live on the second device, the learner on
    the first, the rollout of step k+1 overlaps step k's update, and every number equals the shared-device run."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    got = subprocess.run([sys.executable, "-c", SPLIT_SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(next(l for l in got.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    shared, split = out["0"], out["1"]
    assert shared["slot_devices"] == shared["learner_devices"]
    assert split["slot_devices"] != split["learner_devices"] and len(split["slot_devices"]) == 1
    assert all(h > 0 for h in split["hidden"])
    for a, b in zip(shared["hist"], split["hist"]):
        np.testing.assert_equal(a, b)


def test_sampler_mesh_needs_devices_after_the_learners():
    c = base_config()
    assert build.sampler_mesh(c) is None  # the default: the sampler shares the learner's mesh
    c.mesh.sampler_devices = len(jax.devices())  # the learner's mesh already takes the first device
    with pytest.raises(ValueError, match=r"config\.mesh\.sampler_devices: .*xla_force_host_platform_device_count"):
        build.sampler_mesh(c)
