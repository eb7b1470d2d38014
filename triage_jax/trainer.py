"""The GRPO loop: rollout -> reward -> dynamic sampling -> advantages -> corrections -> updates -> sync -> log -> save.

Deterministic under the config seed: the key of iteration k is fold_in(seed, k) and the prompt iterator's
state is checkpointed with the parameters, so a run killed and resumed continues with identical numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from triage_jax import checkpoint as ckpt_lib
from triage_jax import models, sampler
from triage_jax.config import tokenizer_path, validate
from triage_jax.data import pipeline
from triage_jax.data.rewards import score_batch
from triage_jax.data.sources import load_dapo_math
from triage_jax.data.synthetic import SyntheticMathSource
from triage_jax.data.tokenizers import load_tokenizer
from triage_jax.learner import Learner, nonfinite_count, prepare_batch
from triage_jax.rl import diagnostics, grpo
from triage_jax.warmup import warm_start

log = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """Too many consecutive updates had a non-finite loss or gradient."""


@dataclasses.dataclass
class Rollout:
    """One filled rollout batch on the host (N = num_prompts * group_size rows)."""

    input_ids: np.ndarray  # [N, P + R]
    attn_mask: np.ndarray  # [N, P + R]
    resp_mask: np.ndarray  # [N, R]
    sampler_logp: np.ndarray  # [N, R]
    rewards: np.ndarray  # [N] (zero for fill rows)
    adv: np.ndarray  # [N]
    stats: dict[str, float]


def build_model_config(c: ml_collections.ConfigDict, vocab_size: int):
    """Model hyperparameters: the HF checkpoint's config, else the preset (tokenizer-sized vocab if asked)."""
    overrides = {"dtype": c.model.dtype, "param_dtype": c.model.param_dtype, "remat": c.model.remat,
                 "attn_chunk": c.model.attn_chunk}
    if c.model.hf_path:
        return models.ModelConfig.from_hf_config(os.path.join(c.model.hf_path, "config.json")).replace(**overrides)
    if c.model.vocab_size:
        overrides["vocab_size"] = c.model.vocab_size
    mc = models.get_model_config(c.model.preset, **overrides)
    if mc.vocab_size < vocab_size:
        raise ValueError(f"config.model.vocab_size: the model's vocabulary ({mc.vocab_size}) is smaller than the "
                         f"tokenizer's ({vocab_size})")
    return mc


def build_source(c: ml_collections.ConfigDict):
    if c.data.source == "synthetic":
        return SyntheticMathSource(c.data.num_examples, seed=c.seed, levels=tuple(c.data.levels),
                                   template=c.data.template)
    return load_dapo_math(c.data.path, max_malformed_fraction=c.data.max_bad_fraction).examples


class Trainer:
    """Owns the run: data, learner, sampler copy of the weights, logs and checkpoints."""

    def __init__(self, c: ml_collections.ConfigDict, *, progress: bool | None = None):
        validate(c)
        self.cfg = c
        self.progress = c.train.progress if progress is None else progress
        self.run_dir = os.path.abspath(c.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.json"), "w") as f:
            f.write(c.to_json(indent=2))  # what this run was, for notebooks and tools/eval
        self.tok = load_tokenizer(tokenizer_path(c))
        self.source = build_source(c)
        self.model_cfg = build_model_config(c, self.tok.vocab_size)
        self.P, self.R = c.sampler.max_prompt_len, c.sampler.max_new_tokens
        self.G = c.rl.group_size
        self.N = c.rl.num_prompts * self.G
        self._check_prompts()

        model = self._initial_model()
        self.n_mini = self.N // c.rl.mini_batch
        self.learner = Learner(model, c, total_steps=c.train.steps * self.n_mini)
        self.ref_params = (jax.tree.map(jnp.copy, self.learner.params) if c.rl.kl_coef else None)
        self.sampler_policy = sampler.sampler_policy(c.sampler.precision, c.sampler.kv_cache)
        self.scfg = sampler.SamplingConfig(temperature=c.sampler.temperature, top_p=c.sampler.top_p,
                                           top_k=c.sampler.top_k, max_new_tokens=self.R,
                                           stop_ids=tuple(self.tok.eos_ids))
        self.loader = pipeline.make_prompt_loader(self.source, batch_size=c.rl.num_prompts, seed=c.seed,
                                                  shard_index=jax.process_index(),
                                                  shard_count=jax.process_count())
        self.ckpt = ckpt_lib.Checkpointer(os.path.join(self.run_dir, "checkpoints"), keep=c.train.keep_checkpoints)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self._stop_signal = None
        self._sync()

    # ---------------------------------------------------------------------------------------------- setup
    def _initial_model(self) -> nnx.Module:
        c = self.cfg
        if c.model.hf_path:
            return models.from_pretrained(c.model.hf_path, dtype=c.model.dtype)
        if c.warmup.enabled and c.data.source == "synthetic":
            return warm_start(c, self.model_cfg, self.tok, self.source, progress=self.progress)
        return models.Qwen3(self.model_cfg, rngs=nnx.Rngs(c.seed))

    def _check_prompts(self):
        """Fail before any compilation if a synthetic prompt cannot fit sampler.max_prompt_len."""
        if isinstance(self.source, SyntheticMathSource):
            longest = max(len(self.tok.encode_prompt(self.source[i].prompt)) for i in range(min(len(self.source), 512)))
            if longest > self.P:
                raise ValueError(f"config.sampler.max_prompt_len={self.P} is shorter than a {longest}-token prompt")

    def _sync(self) -> float:
        """Learner -> sampler weights: quantize once into the sampler's policy. Returns seconds."""
        t0 = time.perf_counter()
        self.sampler_model = sampler.prepare_model(self.learner.model(), self.sampler_policy)
        jax.block_until_ready(nnx.state(self.sampler_model))
        return time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------------- rollout
    def _sample_groups(self, examples, key) -> dict[str, np.ndarray]:
        prompts = [self.tok.encode_prompt(ex.prompt) for ex in examples for _ in range(self.G)]
        for p in prompts:
            if len(p) > self.P:
                raise ValueError(f"a {len(p)}-token prompt exceeds config.sampler.max_prompt_len={self.P}")
        out = sampler.generate(self.sampler_model, prompts, self.scfg, policy=self.sampler_policy, key=key,
                               pad_id=self.tok.pad_id, max_cache_len=self.P + self.R)
        tokens = np.asarray(out.tokens)[:, : self.R]
        mask = np.asarray(out.mask)[:, : self.R]
        logp = np.asarray(out.logprobs)[:, : self.R]
        lengths = mask.sum(-1)
        t0 = time.perf_counter()
        texts = [self.tok.decode(tokens[i, : lengths[i]]) for i in range(len(prompts))]
        truths = [ex.ground_truth for ex in examples for _ in range(self.G)]
        scored = score_batch(texts, truths, reward="dapo")
        rewards = np.asarray(scored.rewards, np.float32)
        if self.cfg.rl.overlong_buffer:
            rewards = rewards + np.asarray(grpo.overlong_penalty(lengths, self.R, self.cfg.rl.overlong_buffer,
                                                                 self.cfg.rl.overlong_factor))
        reward_s = time.perf_counter() - t0
        ids = np.full((len(prompts), self.P + self.R), self.tok.pad_id, np.int32)
        attn = np.zeros(ids.shape, bool)
        for i, p in enumerate(prompts):
            ids[i, self.P - len(p): self.P] = p
            attn[i, self.P - len(p): self.P] = True
        ids[:, self.P:] = np.where(mask, tokens, self.tok.pad_id)
        attn[:, self.P:] = mask
        return {"ids": ids, "attn": attn, "mask": mask.astype(np.float32), "logp": np.where(mask, logp, 0.0),
                "rewards": rewards, "correct": np.asarray(scored.accuracy, bool), "lengths": lengths,
                "reward_s": reward_s}

    def rollout(self, key) -> tuple[Rollout, float]:
        """Fill a batch of num_prompts groups, drawing up to rl.max_resample extra prompt batches when dynamic
        sampling drops flat groups; rows still missing are fill rows with an empty mask (they add nothing)."""
        c = self.cfg
        want = c.rl.num_prompts
        kept: list[dict[str, np.ndarray]] = []
        all_rewards, all_correct, all_lengths = [], [], []
        reward_s = 0.0
        n_groups = n_kept = 0
        for attempt in range(1 + (c.rl.max_resample if c.rl.dynamic_sampling else 0)):
            examples = next(self.loader)
            s = self._sample_groups(examples, jax.random.fold_in(key, attempt))
            reward_s += s.pop("reward_s")
            all_rewards.append(s["rewards"])
            all_correct.append(s["correct"])
            all_lengths.append(s["lengths"])
            keep = (np.asarray(grpo.dynamic_sampling_keep(s["rewards"], self.G)) if c.rl.dynamic_sampling
                    else np.ones(len(examples), bool))
            n_groups += len(keep)
            n_kept += int(keep.sum())
            rows = np.repeat(keep, self.G)
            kept.append({k: v[rows] for k, v in s.items()})
            if sum(len(k["rewards"]) for k in kept) >= self.N:
                break
        cat = {k: np.concatenate([d[k] for d in kept])[: self.N] for k in kept[0]}
        n_real = len(cat["rewards"])
        fill = self.N - n_real
        if fill:
            pad = {k: np.zeros((fill,) + v.shape[1:], v.dtype) for k, v in cat.items()}
            pad["ids"][:] = self.tok.pad_id
            cat = {k: np.concatenate([cat[k], pad[k]]) for k in cat}
        adv = np.array(grpo.group_advantages(cat["rewards"], self.G, std_normalize=c.rl.std_normalize))
        adv[n_real:] = 0.0
        rewards = np.concatenate(all_rewards)
        lengths = np.concatenate(all_lengths)
        stats = {
            "reward/mean": float(rewards.mean()), "reward/accuracy": float(np.concatenate(all_correct).mean()),
            "response/length_mean": float(lengths.mean()),
            "response/truncated_frac": float((lengths >= self.R).mean()),
            "dynamic_sampling/kept_groups_frac": n_kept / max(n_groups, 1),
            "dynamic_sampling/batch_fill": n_real / self.N, "dynamic_sampling/rollouts": float(len(all_rewards)),
        }
        return Rollout(cat["ids"], cat["attn"], cat["mask"], cat["logp"].astype(np.float32), cat["rewards"], adv,
                       stats), reward_s

    # ---------------------------------------------------------------------------------------------- one step
    def train_step(self) -> dict[str, float]:
        c = self.cfg
        key = jax.random.fold_in(jax.random.key(c.seed), self.step)
        t_start = time.perf_counter()
        t0 = time.perf_counter()
        ro, reward_s = self.rollout(key)
        rollout_s = time.perf_counter() - t0 - reward_s

        t0 = time.perf_counter()
        old_logp, entropy = self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R)
        ref_logp = (self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R, params=self.ref_params)[0]
                    if self.ref_params is not None else jnp.zeros_like(old_logp))
        jax.block_until_ready((old_logp, ref_logp))
        t1 = time.perf_counter()
        batch, metrics, delta = prepare_batch(
            c, input_ids=jnp.asarray(ro.input_ids), attn_mask=jnp.asarray(ro.attn_mask),
            resp_mask=jnp.asarray(ro.resp_mask), adv=jnp.asarray(ro.adv), sampler_logp=jnp.asarray(ro.sampler_logp),
            old_logp=old_logp, ref_logp=ref_logp)
        jax.block_until_ready((batch, metrics))
        correction_s = time.perf_counter() - t1
        upd = []
        self._updating = True
        for j in range(self.n_mini):
            sl = slice(j * c.rl.mini_batch, (j + 1) * c.rl.mini_batch)
            mb = jax.tree.map(lambda x: x[sl], batch)
            upd.append(self.learner.update(mb, self.step * self.n_mini + j))
        upd = jax.device_get(upd)
        energy = None
        if c.train.energy_every and self.step % c.train.energy_every == 0:
            # rl_math.md delta_energy_realized: D after the update minus D before, same tokens, second forward.
            new_logp, _ = self.learner.logprobs(ro.input_ids, ro.attn_mask, self.R)
            delta_after = jnp.where(batch.resp_mask > 0, new_logp - batch.sampler_logp, 0.0)
            energy = float(diagnostics.delta_energy_realized(delta, delta_after, batch.resp_mask))
        learner_s = time.perf_counter() - t0

        sync_s = self._sync()
        self._updating = False
        out = dict(ro.stats)
        mask = np.asarray(ro.resp_mask)
        out["entropy"] = float((np.asarray(entropy) * mask).sum() / max(mask.sum(), 1))
        out.update({k: float(v) for k, v in jax.device_get(metrics).items()})
        if energy is not None:
            out["mismatch/delta_energy_realized"] = energy
        for k in upd[0]:
            out[f"learner/{k}"] = float(np.mean([u[k] for u in upd]))
        skipped = int(np.sum([u["skipped_update"] for u in upd]))
        total_s = time.perf_counter() - t_start
        out.update({"time/rollout": rollout_s, "time/reward": reward_s, "time/learner": learner_s,
                    "time/learner_corrections": correction_s,
                    "time/sync": sync_s, "time/orchestration": total_s - rollout_s - reward_s - learner_s - sync_s,
                    "time/step": total_s})
        self._delta_for_hist = np.asarray(delta)[mask > 0]
        streak = int(nonfinite_count(self.learner.opt_state))
        if skipped:
            log.warning("step %d: %d update(s) skipped for a non-finite loss or gradient (streak %d)",
                        self.step, skipped, streak)
        if streak >= c.train.max_nonfinite:
            raise NonFiniteError(f"{streak} consecutive updates had a non-finite loss or gradient (step {self.step}; "
                                 f"limit config.train.max_nonfinite={c.train.max_nonfinite}); the last good "
                                 f"checkpoint is in {self.ckpt.directory}")
        return out

    # ---------------------------------------------------------------------------------------------- state
    def _state(self) -> dict[str, Any]:
        return {"params": self.learner.params, "opt_state": self.learner.opt_state}

    def save(self, data_state: dict | None = None) -> None:
        meta = {"step": self.step, "data": data_state or self.loader.get_state(), "seed": self.cfg.seed,
                "history": self.history}
        self.ckpt.save(self.step, self._state(), json.loads(json.dumps(meta, default=float)))

    def restore(self) -> bool:
        """Resume from the newest usable checkpoint; False when there is none."""
        got = self.ckpt.restore(ckpt_lib.abstract_like(self._state()))
        if got is None:
            return False
        step, state, meta = got
        self.learner.params, self.learner.opt_state = state["params"], state["opt_state"]
        self.loader.set_state(meta["data"])
        self.step = int(meta["step"])
        self.history = list(meta.get("history", []))
        self._sync()
        log.info("resumed from step %d", self.step)
        return True

    # ---------------------------------------------------------------------------------------------- loop
    def _on_sigterm(self, signum, frame):
        self._stop_signal = signum
        log.warning("signal %d received: finishing this step, saving a checkpoint and exiting", signum)

    def run(self, *, resume: bool = True, max_steps: int | None = None) -> list[dict[str, float]]:
        """Train until config.train.steps (or `max_steps` more steps); returns the per-step metrics."""
        from tensorboardX import SummaryWriter

        c = self.cfg
        if resume:
            self.restore()
        end = c.train.steps if max_steps is None else min(c.train.steps, self.step + max_steps)
        lead = jax.process_index() == 0  # one host writes logs; checkpoints are collective (orbax)
        writer = SummaryWriter(os.path.join(self.run_dir, "tb")) if lead else None
        prev = signal.signal(signal.SIGTERM, self._on_sigterm)
        bar = None
        if self.progress and lead:
            from tqdm import tqdm

            bar = tqdm(total=end, initial=self.step, desc="GRPO", dynamic_ncols=True)
        self._updating = False
        try:
            while self.step < end:
                data_state = self.loader.get_state()
                try:
                    m = self.train_step()
                except Exception:
                    if not self._updating:  # parameters still at the step boundary: keep this point resumable
                        self.save(data_state)
                    raise
                m["step"] = self.step
                self.history.append(m)
                self.step += 1
                self._log(writer, m)
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
            signal.signal(signal.SIGTERM, prev)
            if writer is not None:
                writer.close()
            if bar is not None:
                bar.close()
        return self.history

    def _log(self, writer, m: dict[str, float]) -> None:
        if writer is None:
            return
        for k, v in m.items():
            if k != "step" and np.isfinite(v):
                writer.add_scalar(k, v, self.step)
        if self._delta_for_hist.size:
            writer.add_histogram("mismatch/delta", self._delta_for_hist, self.step)
        writer.flush()

    def summary(self) -> dict[str, Any]:
        """First vs last steps of the key metrics, and the mean time breakdown; written to summary.json."""
        h = self.history
        if not h:
            return {}
        k = max(1, min(5, len(h) // 4))
        keys = ["reward/mean", "reward/accuracy", "response/length_mean", "mismatch/mean_abs_delta",
                "mismatch/rho_asym", "mismatch/delta_q05", "mismatch/tail_persistence", "entropy",
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


def load_policy(c: ml_collections.ConfigDict, step: int | None = None):
    """(model, tokenizer, step) of a run's checkpoint (newest or `step`), else of config.model.hf_path."""
    from triage_jax.learner import make_optimizer

    tok = load_tokenizer(tokenizer_path(c))
    mc = build_model_config(c, tok.vocab_size)
    ck = ckpt_lib.Checkpointer(os.path.join(os.path.abspath(c.run_dir), "checkpoints"))
    if ck.all_steps():
        abstract_model = nnx.eval_shape(lambda: models.Qwen3(mc, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(abstract_model, nnx.Param)
        abstract = {"params": params, "opt_state": jax.eval_shape(make_optimizer(c.optim, 1).init, params)}
        got = ck.restore(abstract, step)
        if got is None:
            raise FileNotFoundError(f"no usable checkpoint{'' if step is None else f' at step {step}'} under "
                                    f"{ck.directory}")
        return nnx.merge(graphdef, got[1]["params"]), tok, got[0]
    if c.model.hf_path:
        return models.from_pretrained(c.model.hf_path, dtype=c.model.dtype), tok, None
    raise FileNotFoundError(f"no checkpoint under {ck.directory} and no config.model.hf_path to evaluate")
