"""The GRPO loop: rollout -> reward -> dynamic sampling -> advantages -> corrections -> updates -> sync -> log -> save.

Deterministic under the config seed: the key of iteration k is fold_in(seed, k) and the prompt iterator's
state is checkpointed with the parameters, so a run killed and resumed continues with identical numbers.

Stale rollouts (`rl.staleness` = s >= 1, docs/rl_math.md#stale-rollouts): step k trains on a rollout sampled by
the weights of step max(k - s, 0), drawn on a background thread while step k - s updated (on the sampler's own
mesh with `mesh.sampler_devices`). The rollout of step j depends only on its behaviour weights, the seed (key
fold_in(seed, j)) and the loader state before it, never on when it ran, so a stale run is as deterministic as a
synchronous one; a checkpoint holds the s behaviour snapshots and the loader state before the oldest queued
rollout, and a resumed run samples its queue again from them (`_fill_queue`), bit for bit.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from triage_jax import background, build, sampler
from triage_jax import checkpoint as ckpt_lib
from triage_jax import deltas
from triage_jax import rollout as rollout_lib
from triage_jax.config import ConfigError, validate
from triage_jax.data import pipeline
from triage_jax.data.synthetic import SyntheticMathSource
from triage_jax.learner import nonfinite_count
from triage_jax.rl import diagnostics
from triage_jax.rl import monitor as monitor_lib
from triage_jax.rl.delta import token_delta

log = logging.getLogger(__name__)
# NaN metrics are logged on purpose (an empty denominator is drawn as a gap): not a warning per value.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
NULL_STREAM = 0x6E756C6C  # "null": the permutation nulls' keys are a stream of the seed apart from the rollouts'


class NonFiniteError(FloatingPointError):
    """Too many consecutive updates had a non-finite loss, gradient or new state."""


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived during start-up (before the first step): nothing was saved."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one GRPO step reports: its scalar metrics and the token deltas (the histogram, train.save_deltas)."""

    metrics: dict[str, float]
    delta_nr: np.ndarray  # float32 [N, R], the delta the correction acted on (rl.delta_source)
    mask_nr: np.ndarray  # float32 [N, R] real response tokens
    adv_n: np.ndarray  # float32 [N]

    @property
    def delta(self) -> np.ndarray:
        """The real tokens' delta, flat."""
        return self.delta_nr[self.mask_nr > 0]


@dataclasses.dataclass(frozen=True)
class QueuedRollout:
    """A rollout sampled ahead of its step (rl.staleness >= 1), by the weights of step `step` - s."""

    step: int  # the step that trains on it
    data_state: dict  # the prompt loader's state before it was drawn (a checkpoint stores the oldest's)
    rollout: rollout_lib.Rollout
    stats: dict[str, float]
    reward_s: float  # scoring seconds
    rollout_s: float  # sampling seconds (scoring excluded)
    started: float  # perf_counter at its start and end (the overlap measure)
    finished: float


class Trainer:
    """Owns the run: data, learner, sampler copy of the weights, logs and checkpoints."""

    def __init__(self, c: ml_collections.ConfigDict, *, progress: bool | None = None):
        validate(c)
        self.cfg = c
        # SIGTERM from here on is recorded: during start-up it stops at the next phase boundary with nothing
        # saved (Interrupted); during the loop it finishes the step, saves and exits.
        self._stop_signal = None
        self._prev_sigterm = None
        self._training = False  # inside run()'s step loop (what a SIGTERM then does differs)
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.progress = c.train.progress if progress is None else progress
        self.run_dir = os.path.abspath(c.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.json"), "w") as f:
            f.write(c.to_json(indent=2))  # what this run was, for notebooks and tools/eval
        self.tok = build.tokenizer(c)
        self.source = build.source(c)
        self.model_cfg = build.model_config(c, self.tok.vocab_size)
        self.P, self.R = c.sampler.max_prompt_len, c.sampler.max_new_tokens
        self.G = c.rl.group_size
        self.N = c.rl.num_prompts * self.G
        self._check_prompts()
        self._startup_check()

        model = build.initial_model(c, self.model_cfg, self.tok, self.source, progress=self.progress)
        self._startup_check()
        self.n_mini = self.N // c.rl.mini_batch
        self.learner = build.learner(c, model)
        self.ref_params = (jax.tree.map(jnp.copy, self.learner.params) if c.rl.kl_coef else None)
        self.sampler_policy = build.sampler_policy(c)
        # Slots split like the learner's batch, or over the sampler's own mesh (mesh.sampler_devices).
        self.engine = build.engine(c, self.tok, mesh=build.sampler_mesh(c) or self.learner.mesh)
        # Stale rollouts: the s behaviour snapshots (oldest first; the weights of steps k-s .. k-1, the initial
        # weights before step s) and the rollouts they sampled for steps k .. k+s-1, drawn on one background thread.
        self.staleness = int(c.rl.staleness)
        self.behaviour = ([jax.tree.map(jnp.copy, self.learner.params)] * self.staleness)
        self.queue: collections.deque[QueuedRollout] = collections.deque()
        self._ahead = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
                       if self.staleness else None)
        self.loader = pipeline.make_prompt_loader(self.source, batch_size=c.rl.num_prompts, seed=c.seed,
                                                  shard_index=jax.process_index(),
                                                  shard_count=jax.process_count())
        self.ckpt = build.checkpointer(c)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.monitor_cfg = build.monitor(c)
        self.monitor_state = monitor_lib.MonitorState()
        self.alarm_switched = False  # monitor.action='enable_correction' has switched the correction on
        # learner.compile_ahead: prompt width -> the futures of its learner programs compiling in the background.
        self._learner_ahead: dict[int, list[concurrent.futures.Future]] = {}
        self._sync()
        self._startup_check()

    # ---------------------------------------------------------------------------------------------- setup
    def _startup_check(self):
        if self._stop_signal is not None:
            raise Interrupted(f"signal {self._stop_signal} received during start-up: nothing saved")

    def _check_prompts(self):
        """Fail before any compilation or checkpoint if a prompt cannot be encoded or fit sampler.max_prompt_len:
        synthetic prompts by a sample (they share one format), file prompts (DAPO) every one."""
        synthetic = isinstance(self.source, SyntheticMathSource)
        n = min(len(self.source), 512) if synthetic else len(self.source)
        too_long, longest = 0, (0, None)
        for i in range(n):
            ex = self.source[i]
            try:
                length = len(self.tok.encode_prompt(ex.prompt))
            except Exception as e:  # noqa: BLE001 - any tokenizer failure is a config/data mismatch
                raise ConfigError(f"config.tokenizer: prompt {getattr(ex, 'uid', i)!r} of config.data.source="
                                  f"{self.cfg.data.source!r} cannot be encoded ({e})") from None
            if length > self.P:
                too_long += 1
                if length > longest[0]:
                    longest = (length, getattr(ex, "uid", i))
        if too_long:
            raise ConfigError(f"config.sampler.max_prompt_len: {too_long} of {n} prompts are longer than "
                              f"{self.P} tokens (longest: {longest[0]} tokens, {longest[1]!r}); raise "
                              f"--config.sampler.max_prompt_len or filter the data")

    def _sync(self) -> float:
        """Learner -> sampler weights: quantize once into the sampler's policy. Returns seconds.

        Stale rollouts: the engine samples while the updates donate the learner's weights, so it gets a copy
        (`sampler_params`, which the next step keeps as its behaviour snapshot) rather than the learner's arrays
        (unquantized modules would alias them)."""
        t0 = time.perf_counter()
        params = None
        if self.staleness:
            self.sampler_params = params = jax.tree.map(jnp.copy, self.learner.params)
        self.sampler_model = self._prepare(params)
        jax.block_until_ready(nnx.state(self.sampler_model))
        self.engine.load(self.sampler_model)
        return time.perf_counter() - t0

    def _prepare(self, params):
        """The sampler's copy of these learner parameters (None: the learner's own), for the engine's mesh."""
        return sampler.prepare_model(self.learner.model(params), self.sampler_policy, mesh=self.engine.mesh,
                                     rules=self.engine.rules, unstack=not self.cfg.sampler.scan_layers)

    # ---------------------------------------------------------------------------------------------- rollout
    def rollout(self, key) -> tuple[rollout_lib.Rollout, dict[str, float], float]:
        """A filled batch of num_prompts groups (dynamic sampling draws up to rl.max_resample extra prompt
        batches), its fill rows spread over the mini-batches; returns (rollout, stats, scoring seconds)."""
        c = self.cfg
        reward_s = 0.0

        def draw(attempt: int) -> rollout_lib.Rollout:
            nonlocal reward_s
            ro, secs = rollout_lib.sample_groups(
                self.engine, next(self.loader), tok=self.tok,
                group_size=self.G, prompt_len=self.P, key=jax.random.fold_in(key, attempt),
                overlong_buffer=c.rl.overlong_buffer, overlong_factor=c.rl.overlong_factor,
                before_generate=self._compile_learner_ahead if attempt == 0 else None)
            reward_s += secs
            return ro

        ro, stats = rollout_lib.collect(draw, num_prompts=c.rl.num_prompts, group_size=self.G,
                                        dynamic_sampling=c.rl.dynamic_sampling, max_resample=c.rl.max_resample,
                                        std_normalize=c.rl.std_normalize, prompt_len=self.P, resp_len=self.R,
                                        pad_id=self.tok.pad_id)
        # The learner's rows keep only the prompt columns some prompt fills (the forwards cost what they hold).
        ro = rollout_lib.trim_prompt_padding(rollout_lib.spread_fill(ro, self.n_mini))
        return ro, stats, reward_s

    def _compile_learner_ahead(self, prompts) -> None:
        """learner.compile_ahead: start compiling the learner's programs for these prompts' width (the width the
        rollout gets unless dynamic sampling drops the longest prompt's group) on background threads, while the
        engine generates; `_learn` waits for them. Not with MoE routing replay (its calls pass routing)."""
        c = self.cfg
        if not c.learner.compile_ahead or c.rl.routing_replay:
            return
        width = rollout_lib.prompt_width(max(map(len, prompts)), self.P)
        if width in self._learner_ahead:
            return
        thunks = self.learner.compile_thunks(self.N, width, self.R, mini_batch=c.rl.mini_batch,
                                             behaviour=bool(self.staleness), null_key=self.null_key(self.step))
        self._learner_ahead[width] = background.run(thunks, "learner-compile")

    def _wait_learner_ahead(self, width: int) -> None:
        """Before the learner's calls on a rollout of this prompt width: wait for its programs if compiling ahead
        (else the calls would compile them a second time). A failed compile is left to the call to report."""
        for f in self._learner_ahead.get(width, ()):
            f.exception()

    # ---------------------------------------------------------------------------------------------- stale rollouts
    def _key(self, step: int) -> jax.Array:
        """The key of step `step`'s rollout: fold_in(seed, step), whenever and wherever it is drawn."""
        return jax.random.fold_in(jax.random.key(self.cfg.seed), step)

    def null_key(self, step: int) -> jax.Array:
        """The key of step `step`'s permutation nulls (diagnostics.NULL_METRICS): its own stream of the seed."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.seed), NULL_STREAM), step)

    def _draw_ahead(self, step: int) -> QueuedRollout:
        """The rollout of step `step` with the engine's loaded weights (on the background thread while an update
        runs, or in `_fill_queue`): it reads only the engine, the loader and the seed, so it is the same either way."""
        t0 = time.perf_counter()
        data_state = self.loader.get_state()
        ro, stats, reward_s = self.rollout(self._key(step))
        t1 = time.perf_counter()
        return QueuedRollout(step, data_state, ro, stats, reward_s, t1 - t0 - reward_s, t0, t1)

    def _fill_queue(self) -> float:
        """Sample the queued rollouts a stale run needs before step k: those of steps k .. k+s-1, each by its
        behaviour snapshot (the initial weights at the start; the checkpointed snapshots after a resume), as the
        uninterrupted run sampled them during earlier updates. Returns seconds (0 when the queue is full)."""
        if len(self.queue) == self.staleness:
            return 0.0
        t0 = time.perf_counter()
        for i in range(len(self.queue), self.staleness):
            self.engine.load(self._prepare(self.behaviour[i]))
            self.queue.append(self._draw_ahead(self.step + i))
        self.engine.load(self.sampler_model)  # the current weights again: they sample step k + s
        return time.perf_counter() - t0

    def _data_state(self) -> dict:
        """The loader state a checkpoint of this step boundary stores: before the oldest queued rollout (a resume
        samples the queue again from there), else the loader's own."""
        return self.queue[0].data_state if self.queue else self.loader.get_state()

    # ---------------------------------------------------------------------------------------------- one step
    def train_step(self) -> StepResult:
        c = self.cfg
        t_start = time.perf_counter()
        behaviour = ahead = None
        if self.staleness:
            fill_s = self._fill_queue()
            queued = self.queue[0]
            ro, stats, reward_s = queued.rollout, queued.stats, queued.reward_s
            behaviour = self.behaviour[0]  # the weights that sampled `ro`
            snapshot = self.sampler_params  # the current weights' copy (the updates donate the learner's)
            # Step k + s's rollout, by the current weights (loaded in the engine), while this step updates.
            ahead = self._ahead.submit(self._draw_ahead, self.step + self.staleness)
        else:
            t0 = time.perf_counter()
            ro, stats, reward_s = self.rollout(self._key(self.step))
            rollout_s = time.perf_counter() - t0 - reward_s
        try:
            entropy, metrics, delta, upd, energy, learner_s, correction_s = self._learn(ro, behaviour)
        except BaseException:
            if ahead is not None:  # back to this step boundary: the queue is sampled again from the checkpoint's
                concurrent.futures.wait([ahead])
                self.loader.set_state(self.queue[0].data_state)
                self.queue.clear()
            raise
        out = {}
        if ahead is not None:
            t_join = time.perf_counter()
            drawn = ahead.result()
            wait_s = time.perf_counter() - t_join
            self.queue.popleft()
            self.queue.append(drawn)
            self.behaviour = self.behaviour[1:] + [snapshot]
            busy = drawn.finished - drawn.started
            hidden = max(0.0, min(drawn.finished, t_join) - drawn.started)
            # This step's rollout work is the one drawn ahead (step k + s), behind this step's update.
            rollout_s, reward_s = drawn.rollout_s, drawn.reward_s
            out.update({"time/rollout_wait": wait_s, "time/overlap_hidden": hidden,
                        "time/overlap_frac": hidden / busy if busy > 0 else float("nan"),
                        "time/rollout_fill": fill_s})

        sync_s = self._sync()
        out.update(stats)
        mask = ro.resp_mask
        out["entropy"] = float((np.asarray(entropy) * mask).sum() / max(mask.sum(), 1))
        out.update({k: float(v) for k, v in jax.device_get(metrics).items()})
        if energy is not None:
            out["mismatch/delta_energy_realized"] = energy
        # Learner metrics: the mean over the mini-batches that took a step; NaN (logged as such) when none did.
        stepped = [u for u in upd if not u["empty_minibatch"]]
        for k in upd[0]:
            if k != "empty_minibatch":
                out[f"learner/{k}"] = float(np.mean([u[k] for u in stepped])) if stepped else float("nan")
        out["learner/empty_minibatches"] = float(len(upd) - len(stepped))
        out["learner/updates"] = float(self.learner.num_updates)
        skipped = int(np.sum([u["skipped_update"] for u in upd]))
        total_s = time.perf_counter() - t_start
        # Main-thread time not in the phases: the background rollout is not on it, only the wait for it.
        serial_s = (out["time/rollout_wait"] + out["time/rollout_fill"] if ahead is not None
                    else rollout_s + reward_s)
        out.update({"time/rollout": rollout_s, "time/reward": reward_s, "time/learner": learner_s,
                    "time/learner_corrections": correction_s,
                    "time/sync": sync_s, "time/orchestration": total_s - serial_s - learner_s - sync_s,
                    "time/step": total_s})
        streak = int(nonfinite_count(self.learner.opt_state))
        if skipped:
            log.warning("step %d: %d update(s) skipped for a non-finite loss, gradient or new state (streak %d)",
                        self.step, skipped, streak)
        if streak >= c.train.max_nonfinite:
            last = self.ckpt.latest_step()
            # Every checkpoint on disk is finite: saves refuse NaN/Inf and restores verify the fingerprint.
            where = (f"the newest checkpoint (finite) is step {last} in {self.ckpt.directory}" if last is not None
                     else f"no checkpoint was written yet under {self.ckpt.directory}")
            raise NonFiniteError(f"{streak} consecutive updates had a non-finite loss, gradient or new state "
                                 f"(step {self.step}; limit config.train.max_nonfinite={c.train.max_nonfinite}); "
                                 f"{where}")
        return StepResult(out, np.asarray(delta, np.float32), np.asarray(mask, np.float32),
                          np.asarray(ro.adv, np.float32))

    def _learn(self, ro: rollout_lib.Rollout, behaviour=None):
        """Old log-probs, corrections + diagnostics, the mini-batch updates and the energy measurement of one
        rollout; `behaviour` (the weights that sampled a stale rollout, or None) adds the learner's log-probs at
        them, which split the mismatch into precision and staleness."""
        c = self.cfg
        t0 = time.perf_counter()
        self._wait_learner_ahead(ro.input_ids.shape[1] - self.R)
        # With rl.routing_replay the rollout carries the sampler's MoE expert ids: every learner forward replays them.
        old_logp, entropy = self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R, routing=ro.routing)
        ref_logp = (self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R, params=self.ref_params,
                                          routing=ro.routing)[0]
                    if self.ref_params is not None else jnp.zeros_like(old_logp))
        behaviour_logp = (None if behaviour is None else
                          self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R, params=behaviour,
                                                routing=ro.routing)[0])
        jax.block_until_ready((old_logp, ref_logp, behaviour_logp))
        t1 = time.perf_counter()
        batch, metrics, delta = self.learner.prepare(
            input_ids=ro.input_ids, attn_mask=ro.attn_mask, resp_mask=ro.resp_mask, adv=ro.adv,
            sampler_logp=ro.sampler_logp, old_logp=old_logp, ref_logp=ref_logp, routing=ro.routing,
            behaviour_logp=behaviour_logp, null_key=self.null_key(self.step))
        jax.block_until_ready((batch, metrics))
        correction_s = time.perf_counter() - t1
        upd = []
        for j in range(self.n_mini):
            sl = slice(j * c.rl.mini_batch, (j + 1) * c.rl.mini_batch)
            upd.append(self.learner.update(jax.tree.map(lambda x: x[sl], batch)))
        upd = jax.device_get(upd)
        energy = None
        if c.train.energy_every and self.step % c.train.energy_every == 0:
            # delta_energy_realized (docs/rl_math.md): D after the update minus D before, same tokens (total delta).
            new_logp, _ = self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R, routing=ro.routing)
            delta_after = token_delta(new_logp, batch.sampler_logp, batch.resp_mask)
            energy = float(diagnostics.delta_energy_realized(delta, delta_after, batch.resp_mask))
        return entropy, metrics, delta, upd, energy, time.perf_counter() - t0, correction_s

    # ---------------------------------------------------------------------------------------------- state
    def _state(self) -> dict[str, Any]:
        return build.run_state(self.cfg, self.learner.params, self.learner.opt_state, self.behaviour)

    def _failure_save(self, data_state: dict) -> None:
        """Save the step boundary a failing step started from: only a finite state, and never in a way that hides
        the failure (a save error is logged; the caller re-raises the original exception)."""
        try:
            self.save(data_state)
            log.warning("step %d failed; its starting state is saved as checkpoint %d in %s", self.step, self.step,
                        self.ckpt.directory)
        except ckpt_lib.NonFiniteStateError:
            log.error("step %d failed and the state is not finite: nothing saved (newest checkpoint: %s in %s)",
                      self.step, self.ckpt.latest_step(), self.ckpt.directory)
        except Exception as e:  # noqa: BLE001 - the step's own error is what the caller raises
            log.error("step %d failed, and so did saving its starting state: %s", self.step, e)

    def save(self, data_state: dict | None = None) -> None:
        meta = {"step": self.step, "data": data_state or self._data_state(), "seed": self.cfg.seed,
                "history": self.history, "scan_layers": bool(self.cfg.model.scan_layers)}
        self.ckpt.save(self.step, self._state(), json.loads(json.dumps(meta, default=float)))

    def restore(self) -> bool:
        """Resume from the newest usable checkpoint (unusable ones are moved aside); False when there is none.
        Raises NoUsableCheckpointError when every checkpoint is unusable (rerun with --noresume to start over)."""
        hint = " Pass --noresume (Trainer.run(resume=False)) to start over from step 0."
        self.ckpt.recover()
        try:  # a layout the config does not match fails naming model.scan_layers, before any checkpoint is moved
            build.check_layout(self.cfg, self.ckpt)
        except ConfigError as e:
            raise ConfigError(f"{e}, or start over with --noresume") from None
        try:
            got = self.ckpt.restore(ckpt_lib.abstract_like(self._state()), required_meta=("step", "data"),
                                    owner=True)
        except ckpt_lib.NoUsableCheckpointError as e:
            raise ckpt_lib.NoUsableCheckpointError(str(e) + "." + hint) from None
        if got is None:
            if self.ckpt.unusable():
                raise ckpt_lib.NoUsableCheckpointError(
                    f"no usable checkpoint under {self.ckpt.directory}: the ones found earlier were unusable and "
                    f"moved aside to {self.ckpt.unusable_dir}.{hint}")
            return False
        step, state, meta = got
        self.learner.params, self.learner.opt_state = state["params"], state["opt_state"]
        if self.staleness:  # the queue is sampled again from these snapshots before the next step
            self.behaviour = list(state["behaviour"])
            self.queue.clear()
        self.loader.set_state(meta["data"])
        self.step = int(meta["step"])
        self.history = list(meta.get("history", []))
        self._replay_monitor()
        self._sync()
        log.info("resumed from step %d", self.step)
        return True

    # ---------------------------------------------------------------------------------------------- monitor
    def _watch(self, m: dict[str, float]) -> None:
        """Feed this step's metrics to the early-warning monitor: add its alarm/* levels to `m` and take the
        configured action once an alarm reaches monitor.action_level."""
        if self.monitor_cfg is None:
            return
        self.monitor_state, alarms = monitor_lib.update(self.monitor_state, m, self.monitor_cfg)
        m.update(alarms)
        c = self.cfg.monitor
        if c.action == "enable_correction" and not self.alarm_switched and alarms["alarm/level"] >= c.action_level:
            self._switch_correction()
            log.warning("step %d: alarm level %d (%s): switching the correction on: %s", self.step,
                        int(alarms["alarm/level"]),
                        ", ".join(k for k in monitor_lib.ALARMS if alarms[f"alarm/{k}"] >= c.action_level),
                        c.correction)
        if c.action != "none":
            m["alarm/action_taken"] = float(self.alarm_switched)

    def _switch_correction(self) -> None:
        self.learner.set_correction(*build.alarm_correction(self.cfg, self.model_cfg))
        self._learner_ahead.clear()  # programs of the replaced correction: the new ones compile anew
        self.alarm_switched = True

    def _replay_monitor(self) -> None:
        """Rebuild the monitor's window from the restored history (and its action, if one had been taken)."""
        if self.monitor_cfg is None:
            return
        self.monitor_state, _ = monitor_lib.replay(self.history, self.monitor_cfg)
        if self.history and self.history[-1].get("alarm/action_taken", 0.0) and not self.alarm_switched:
            self._switch_correction()

    # ---------------------------------------------------------------------------------------------- loop
    def _on_sigterm(self, signum, frame):
        self._stop_signal = signum
        if self._training:
            log.warning("signal %d received: finishing this step, saving a checkpoint and exiting", signum)
        else:
            log.warning("signal %d received during start-up: stopping before the first step, nothing saved", signum)

    def run(self, *, resume: bool = True, max_steps: int | None = None) -> list[dict[str, float]]:
        """Train until config.train.steps (or `max_steps` more steps); returns the per-step metrics."""
        from tensorboardX import SummaryWriter

        c = self.cfg
        if resume:
            self.restore()
        end = c.train.steps if max_steps is None else min(c.train.steps, self.step + max_steps)
        on_main = threading.current_thread() is threading.main_thread()
        prev = signal.signal(signal.SIGTERM, self._on_sigterm) if on_main else None
        if self._stop_signal is not None:  # arrived during start-up or the restore: nothing to save
            log.warning("signal %d received before the first step: exiting without saving", self._stop_signal)
            if on_main:
                signal.signal(signal.SIGTERM, self._prev_sigterm or signal.SIG_DFL)
            return self.history
        lead = jax.process_index() == 0  # one host writes logs; checkpoints are collective (orbax)
        tb = os.path.join(self.run_dir, "tb")
        # Logs of a previous attempt past this step (a crash after its last checkpoint) are purged on resume:
        # TensorBoard hides every event at or after purge_step written before it (metrics go out at step + 1).
        purge = self.step + 1 if os.path.isdir(tb) and os.listdir(tb) else None
        writer = SummaryWriter(tb, purge_step=purge) if lead else None
        bar = None
        if self.progress and lead:
            from tqdm import tqdm

            bar = tqdm(total=end, initial=self.step, desc="GRPO", dynamic_ncols=True)
        self._training = True
        try:
            while self.step < end:
                data_state = self._data_state()
                version = self.learner.version
                try:
                    res = self.train_step()
                except Exception:
                    if self.learner.version == version:  # no update yet: the step boundary is still resumable
                        self._failure_save(data_state)
                    raise
                m = dict(res.metrics)
                m["step"] = self.step
                self._watch(m)
                self.history.append(m)
                self.step += 1
                self._log(writer, m, res.delta)
                if lead and c.train.save_deltas and m["step"] % c.train.save_deltas == 0:
                    deltas.write(self.run_dir, m["step"], res.delta_nr, res.mask_nr, res.adv_n)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{m['reward/mean']:+.3f}", acc=f"{m['reward/accuracy']:.2f}",
                                    dlt=f"{m['mismatch/mean_abs_delta']:.4f}")
                else:
                    log.info("step %d/%d reward %+.3f acc %.2f |delta| %.4f loss %.4f (%.1fs)", self.step, end,
                             m["reward/mean"], m["reward/accuracy"], m["mismatch/mean_abs_delta"],
                             m["learner/loss"], m["time/step"])
                if self.step % c.train.ckpt_every == 0 or self.step == end or self._stop_signal is not None:
                    self.save()
                if self._stop_signal is not None:
                    break
        finally:
            self._training = False
            if on_main:
                signal.signal(signal.SIGTERM, self._prev_sigterm if self._prev_sigterm is not None else prev)
            if writer is not None:
                writer.close()
            if bar is not None:
                bar.close()
        return self.history

    def _log(self, writer, m: dict[str, float], delta: np.ndarray) -> None:
        if writer is None:
            return
        for k, v in m.items():
            if k != "step":  # NaN included: an empty denominator is drawn as a gap, never hidden
                writer.add_scalar(k, v, self.step)
        if delta.size:
            writer.add_histogram("mismatch/delta", delta, self.step)
        writer.flush()

    def summary(self) -> dict[str, Any]:
        """First vs last steps of the key metrics, and the mean time breakdown; written to summary.json."""
        h = self.history
        if not h:
            return {}
        k = max(1, min(5, len(h) // 4))
        keys = ["reward/mean", "reward/accuracy", "response/length_mean", "mismatch/mean_abs_delta",
                "mismatch/rho_asym", "mismatch/rho_asym_excess", "mismatch/rho_asym_direction", "mismatch/delta_q05",
                "mismatch/tail_persistence", "mismatch/tail_persistence_excess", "entropy",
                "learner/loss", "learner/repair_loss"]
        def window_mean(xs):
            xs = [x for x in xs if np.isfinite(x)]  # NaN = an empty denominator that step (spec), not a zero
            return float(np.mean(xs)) if xs else float("nan")

        rows = {}
        for key in keys:
            if key in h[0]:
                rows[key] = {"start": window_mean([x[key] for x in h[:k]]),
                             "end": window_mean([x[key] for x in h[-k:]])}
        times = {t: float(np.mean([x[t] for x in h[1:] or h])) for t in h[0] if t.startswith("time/")}
        out = {"steps": self.step, "window": k, "metrics": rows, "mean_time_s": times}
        if jax.process_index() == 0:
            with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
                json.dump(out, f, indent=2)
        return out

