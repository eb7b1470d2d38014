"""End-to-end GRPO on the tiny model: logs + checkpoint + summary, exact resume, SIGTERM, non-finite updates."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax.config import ConfigError, base_config, flatten
from triage_jax.trainer import NonFiniteError, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(tmp_path, **over):
    c = base_config()
    c.run_dir = str(tmp_path / "run")
    c.warmup.cache_dir = str(tmp_path / "warm")
    c.model.num_hidden_layers = 2  # half the tiny preset: half the compile time, every code path still taken
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
                  "learner/repair_loss", "time/rollout", "time/learner", "time/sync", "correction/frac_clipped",
                  "alarm/rho_asym", "alarm/tail_persistence", "alarm/delta_q05", "alarm/level"):
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


def test_learner_programs_compile_ahead_while_the_rollout_generates(tmp_path):
    """learner.compile_ahead (the default): once the rollout's prompts are known, the learner's log-probs,
    corrections and update for their width compile on background threads, and the step's own calls compile none
    of them again (a mismatch with the arguments they pass would, on the main thread); the step's metrics are the
    bits of a run without it. A response length no other test uses: no earlier test's persistent-cache entry
    hides a compile."""
    from jax import monitoring

    programs = ("jit(_logprobs_impl)", "jit(prepare)", "jit(_update_impl)")
    compiled = []

    def listen(event, secs, **kw):
        if event.endswith("backend_compile_duration") and kw.get("fun_name") in programs:
            compiled.append((kw["fun_name"], threading.current_thread().name))

    steps = {}
    monitoring.register_event_duration_secs_listener(listen)
    try:
        for ahead in (True, False):
            c = small_config(tmp_path / str(ahead), **{"learner.compile_ahead": ahead, "sampler.max_new_tokens": 11,
                                                  "train.steps": 1, "train.energy_every": 0})
            steps[ahead] = Trainer(c).run()[0]
            if ahead:
                assert sorted(p for p, _ in compiled) == sorted(programs), compiled  # each once
                assert all(t.startswith("learner-compile") for _, t in compiled), compiled
    finally:
        monitoring.unregister_event_duration_listener(listen)
    np.testing.assert_equal({k: v for k, v in steps[True].items() if not k.startswith("time/")},
                            {k: v for k, v in steps[False].items() if not k.startswith("time/")})


@pytest.mark.slow  # three trainers: ~2 min on the shared 2-core CPU
def test_monitor_alarm_switches_the_correction_on_and_a_resume_keeps_it(tmp_path):
    # Thresholds any finite rho_asym crosses: level 2 as soon as the 2-step window holds 2 finite values.
    c = small_config(tmp_path, **{"rl.correction": "none", "monitor.action": "enable_correction",
                                  "monitor.correction": "token_tis", "monitor.window": 2, "monitor.min_points": 2,
                                  "monitor.rho_level1": 1e-9, "monitor.rho_level2": 1e-9, "train.steps": 3})
    tr = Trainer(c)
    hist = tr.run()
    first = next(i for i, m in enumerate(hist) if m["alarm/level"] >= 2)
    assert first >= 1 and [m["alarm/action_taken"] for m in hist] == [float(i >= first) for i in range(3)]
    assert tr.learner.correction.name == "token_tis"
    resumed = Trainer(c)
    assert resumed.restore() and resumed.learner.correction.name == "token_tis"
    off = Trainer(small_config(tmp_path / "off", **{"rl.correction": "none", "train.steps": 1}))
    assert "alarm/action_taken" not in off.run()[0] and off.learner.correction.name == "none"


def _tb_events(tb_dir):
    import glob

    from tensorboardX.proto import event_pb2

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    from common import _records

    out = []
    for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))):
        out.append([event_pb2.Event.FromString(r) for r in _records(path)])
    return out


def test_resume_is_exact(tmp_path):
    full = Trainer(small_config(tmp_path / "a")).run()
    c = small_config(tmp_path / "b")
    Trainer(c).run(max_steps=3)  # checkpoints at 2 and 3; step 3 logged ...
    import shutil

    shutil.rmtree(os.path.join(c.run_dir, "checkpoints", "3"))  # ... then "killed" before its checkpoint landed
    resumed = Trainer(c)
    assert resumed.restore() and resumed.step == 2
    rest = resumed.run(resume=False)
    # TensorBoard: the second event file purges what the first logged after step 2 (its step 3 is logged again).
    first, second = _tb_events(os.path.join(c.run_dir, "tb"))
    assert 3 in {e.step for e in first if e.summary.value}
    starts = [e.step for e in second if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [3]
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


def _sigterm_at(args, marker: str) -> tuple[int, str]:
    """Run the CLI, send SIGTERM when a stderr line contains `marker`: (exit status, its whole stderr)."""
    proc = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    head = []
    for line in proc.stderr:
        head.append(line)
        if marker in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=300)
    return proc.returncode, "".join(head) + rest


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    rc, log = _sigterm_at(_main_args(tmp_path, **{"train.steps": 1000, "train.ckpt_every": 1000}),
                          "step 2/1000")
    assert rc == 0, log[-3000:]
    assert "signal 15 received" in log
    steps = [int(d) for d in os.listdir(tmp_path / "run" / "checkpoints") if d.isdigit()]
    assert steps and max(steps) >= 2


def _score_by_length(texts, truths, reward="dapo"):
    """Stand-in grader: a response is "correct" when its length is even, so groups come out mixed, all right
    or all wrong depending on the draw (a barely warmed-up model answers nothing right)."""
    from triage_jax.data.rewards import BatchRewards

    correct = np.array([len(t) % 2 == 0 for t in texts])
    return BatchRewards(rewards=np.where(correct, 1.0, -1.0).astype(np.float32), accuracy=correct)


@pytest.mark.slow  # 61 s on 2 cores (pytest -n 2): the default run stays near 15 min
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


@pytest.mark.slow  # 42 s on 2 cores (pytest -n 2): the default run stays near 15 min
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


def test_nonfinite_message_names_a_finite_checkpoint_and_failure_save_refuses_nan(tmp_path):
    """lr-style poison never reaches disk: the streak error names the newest (finite) checkpoint, and a failure
    whose state is non-finite saves nothing (before: the poisoned state became the newest checkpoint, or the
    save clashed with the existing step and hid the original error)."""
    from triage_jax.checkpoint import NoUsableCheckpointError, abstract_like, is_finite

    c = small_config(tmp_path, **{"train.max_nonfinite": 2, "train.ckpt_every": 1, "train.steps": 6})
    tr = Trainer(c)
    tr.run(max_steps=1)
    assert tr.ckpt.all_steps() == [1]
    real_rollout = tr.rollout

    def poisoned(key):
        ro, s, secs = real_rollout(key)
        ro.adv[:] = np.nan
        return ro, s, secs

    tr.rollout = poisoned
    with pytest.raises(NonFiniteError, match=r"newest checkpoint \(finite\) is step 1 in .*checkpoints"):
        tr.run(resume=False)
    assert tr.ckpt.all_steps() == [1]
    # A state poisoned some other way, then a failure before any update: nothing is saved, the error is the
    # step's own (not a checkpoint clash).
    tr.learner.params = jax.tree.map(lambda x: x * jnp.nan, tr.learner.params)

    def boom(key):
        raise RuntimeError("boom")

    tr.rollout = boom
    with pytest.raises(RuntimeError, match="boom"):
        tr.run(resume=False)
    assert tr.ckpt.all_steps() == [1]
    step, state, _ = tr.ckpt.restore(abstract_like(tr._state()))
    assert step == 1 and is_finite(state)
    # Every checkpoint unusable: a clear error naming the folder and the flag that starts over.
    import pathlib

    for f in pathlib.Path(tr.ckpt.directory, "1").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(NoUsableCheckpointError, match=r"checkpoints.*--noresume"):
        tr.restore()
    with pytest.raises(NoUsableCheckpointError, match="--noresume"):  # also on the next start
        tr.restore()


def _dapo_file(path, prompts):
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"prompt": [{"role": "user", "content": p}], "reward_model": {"ground_truth": "7"},
                                "extra_info": {"index": i}}) + "\n")
    return str(path)


@pytest.mark.parametrize("bad, match", [("x" * 40, r"sampler\.max_prompt_len: 1 of 3 prompts are longer than 32"),
                                        ("caf\u00e9 ?", r"config\.tokenizer: prompt 'dapo-2'.*cannot be encoded")])
def test_dapo_prompts_fail_before_any_checkpoint_or_compile(tmp_path, bad, match):
    from triage_jax.config import ConfigError

    c = small_config(tmp_path, **{"data.source": "dapo", "data.template": "dapo",
                                  "data.path": _dapo_file(tmp_path / "d.jsonl", ["1+6?", "2+5?", bad])})
    with pytest.raises(ConfigError, match=match):
        Trainer(c)
    assert not os.path.exists(os.path.join(c.run_dir, "checkpoints"))


def _main_args(tmp_path, **over):
    """The CLI on configs/tiny.py with the flags that make its config small_config(tmp_path, **over) exactly: the
    same programs as the in-process runs, which the suite's compilation cache then serves instead of compiling
    them again in the subprocess."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(ROOT, "configs", "tiny.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    have, want = flatten(tiny.get_config()), flatten(small_config(tmp_path, **over))
    assert set(have) == set(want)
    return [sys.executable, "-m", "triage_jax.main", "--config=configs/tiny.py",
            *(f"--config.{k}={v}" for k, v in want.items() if v != have[k])]


def test_sigterm_during_startup_exits_cleanly(tmp_path):
    """Before: killed by the signal (exit -15). Now: nothing saved, exit 0, one line saying so. The signal goes out
    when the warm-up's log line appears (the Trainer is being built; the first step is seconds away), not after a
    fixed sleep: with the suite's compilation cache warm, 3 steps can finish within any fixed delay."""
    rc, err = _sigterm_at(_main_args(tmp_path, **{"train.steps": 3}), "warm-up: SFT loss")
    assert "warm-up: SFT loss" in err, err[-3000:]
    assert rc == 0, err[-3000:]
    assert "before the first step" in err or "during start-up: nothing saved" in err, err[-3000:]
    assert "saving a checkpoint" not in err, err[-3000:]
    ck = tmp_path / "run" / "checkpoints"
    assert not ck.exists() or not [d for d in os.listdir(ck) if d.isdigit()]


def test_sigterm_before_the_trainer_ends_the_process_even_inside_a_gc_callback():
    """The CLI's start-up handler (before the Trainer takes the signal over) must end the process wherever the main
    thread is. A handler that raised SystemExit was swallowed when it ran inside a gc callback (jax registers one):
    the run went on to train 3 steps and save (seen in the suite, a SIGTERM ~1 s into start-up)."""
    code = textwrap.dedent("""
        import gc, os, signal, time
        from triage_jax import main
        signal.signal(signal.SIGTERM, main._startup_sigterm)
        def callback(phase, info):
            if phase == "start":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler runs here, inside the gc callback
        gc.callbacks.append(callback)
        gc.collect()
        print("still running")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "during start-up: nothing saved" in out.stderr
    assert "still running" not in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("case", ["data", "missing_config"])
def test_cli_errors_are_one_line(tmp_path, case):
    if case == "data":
        bad = tmp_path / "d.jsonl"
        bad.write_text("not json\n" * 10)
        args = _main_args(tmp_path, **{"data.source": "dapo", "data.path": str(bad)})
        want = "error: DAPO-Math file"
    else:
        args = [sys.executable, "-m", "triage_jax.main", "--config=configs/nope.py"]
        want = "error: config file 'configs/nope.py' not found"
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and want in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow  # 51 s on 2 busy cores (pytest -n 2)
def test_exact_mode_run_has_zero_mismatch(tmp_path):
    """learner.exact with W4A4 on both sides: every rollout has delta = 0 on every token (the learner's recompute
    before the step's updates equals the sampler's log-probs, also after a weight sync), and the run still learns."""
    c = small_config(tmp_path, **{"learner.exact": True, "learner.precision": "w4a4", "train.steps": 2,
                                  "train.ckpt_every": 2})
    hist = Trainer(c).run()
    for m in hist:
        assert m["mismatch/mean_abs_delta"] == 0.0
        assert m["mismatch/delta_q05"] == 0.0 and m["mismatch/delta_q95"] == 0.0
    assert any(m["learner/policy_loss"] != 0 for m in hist)


def test_scanned_learner_trains_with_an_unrolled_sampler_and_resumes(tmp_path):
    """model.scan_layers=True (the paper configs): the learner's layers are stacked, every sync hands the sampler
    the unrolled copy (its decode step), and the stacked checkpoint restores; resuming it with the layers
    unrolled fails naming the key, and leaves the checkpoints where they are. With sampler.scan_layers=True the
    sampler keeps them stacked, and its first step's numbers are the unrolled sampler's, bit for bit."""
    c = small_config(tmp_path, **{"model.scan_layers": True, "model.remat": "full", "train.steps": 2})
    tr = Trainer(c)
    hist = tr.run()
    assert tr.learner.model().cfg.scan_layers
    assert tr.learner.model().layers.attn.q_proj.kernel[...].shape[0] == 2
    assert not tr.sampler_model.cfg.scan_layers and len(tr.sampler_model.layers) == 2
    assert len(hist) == 2 and all(np.isfinite(m["learner/loss"]) for m in hist)
    assert all(m["mismatch/mean_abs_delta"] > 0 for m in hist)
    resumed = Trainer(c)
    assert resumed.restore() and resumed.step == 2
    for a, b in zip(jax.tree.leaves(tr.learner.params), jax.tree.leaves(resumed.learner.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    unrolled = Trainer(small_config(tmp_path, **{"model.remat": "full", "train.steps": 2}))
    with pytest.raises(ConfigError, match=r"model\.scan_layers=False, but .* hold the learner's layers stacked"):
        unrolled.restore()
    assert unrolled.ckpt.all_steps() == [2] and not unrolled.ckpt.unusable()
    # The tools' loader (eval, probe) reads the layout the same way.
    from triage_jax import build

    with pytest.raises(ConfigError, match=r"model\.scan_layers=False, but"):
        build.load_policy(unrolled.cfg)
    model, _, step = build.load_policy(c)
    assert step == 2 and model.cfg.scan_layers
    # sampler.scan_layers=True keeps the layers stacked in the sampler (its decode a loop over them): on the CPU
    # the same rollout bits as the unrolled sampler, so the first step's numbers are the unrolled run's.
    stacked = Trainer(small_config(tmp_path / "stacked", **{
        "model.scan_layers": True, "model.remat": "full", "train.steps": 1, "sampler.scan_layers": True,
        "warmup.cache_dir": c.warmup.cache_dir}))
    first = stacked.run()[0]
    assert stacked.sampler_model.cfg.scan_layers
    from flax import nnx

    assert all(a.shape[0] == 2 for a in jax.tree.leaves(nnx.state(stacked.sampler_model.layers)))  # [L, ...]
    same = {k: (first[k], hist[0][k]) for k in hist[0] if not k.startswith("time/")}
    assert all(a == b or (np.isnan(a) and np.isnan(b)) for a, b in same.values()), same
    assert first["mismatch/mean_abs_delta"] > 0 and first["response/length_mean"] > 0, first
