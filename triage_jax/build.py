"""Config -> components: the one place that reads an `ml_collections` config and builds what the run uses.

The trainer, the tools, the experiments and the notebooks all build through here, so a config key means the same
thing everywhere and the library modules (learner, sampler, rl/) only ever see typed settings.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections
import numpy as np
from flax import nnx

from triage_jax import checkpoint as ckpt_lib
from triage_jax import models
from triage_jax.config import num_layers, tokenizer_path, xla_options
from triage_jax.data.sources import load_dapo_math
from triage_jax.data.synthetic import SyntheticMathSource, held_out_source
from triage_jax.data.tokenizers import load_tokenizer, task_bpe_tokenizer
from triage_jax.learner import Correction, LossSettings, OptimSettings
from triage_jax.quant import PrecisionPolicy
from triage_jax.quant.policy import parse_rules
from triage_jax.rl import corrections as corr
from triage_jax.rl.monitor import MonitorConfig, monitor_config
from triage_jax.rl.triage import TriageConfig
from triage_jax.sampler import SamplingConfig, sampler_policy as _sampler_policy, token_wise_rules


BPE_CORPUS_SEED = 0  # the task BPE's corpus is one fixed stream: every seed of a config shares its tokenizer


def tokenizer(c: ml_collections.ConfigDict):
    """The run's tokenizer: characters, the task BPE (trained here, deterministically, on `bpe.corpus_size`
    problems + reference solutions of the configured levels, and saved as run_dir/tokenizer.json), a
    tokenizer.json, or the one beside the HF checkpoint."""
    if c.tokenizer == "bpe":
        corpus = SyntheticMathSource(c.bpe.corpus_size, seed=BPE_CORPUS_SEED, levels=tuple(c.data.levels),
                                     template=c.data.template, style=c.data.style or None)
        texts = (f"{p}\n{s}" for p, s in (corpus.sft_pair(i) for i in range(len(corpus))))
        return task_bpe_tokenizer(texts, c.bpe.vocab_size, os.path.join(os.path.abspath(c.run_dir), "tokenizer.json"))
    return load_tokenizer(tokenizer_path(c))


def source(c: ml_collections.ConfigDict):
    """The training prompts: the synthetic task (seeded by config.seed) or the DAPO-Math file."""
    if c.data.source == "synthetic":
        return SyntheticMathSource(c.data.num_examples, seed=c.seed, levels=tuple(c.data.levels),
                                   template=c.data.template, style=c.data.style or None)
    return load_dapo_math(c.data.path, max_malformed_fraction=c.data.max_bad_fraction).examples


def held_out(c: ml_collections.ConfigDict, num_examples: int) -> SyntheticMathSource:
    """Synthetic problems training never sees (same levels, template and style as the run's source)."""
    return held_out_source(num_examples, seed=c.seed, levels=tuple(c.data.levels), template=c.data.template,
                           style=c.data.style or None)


def model_config(c: ml_collections.ConfigDict, vocab_size: int) -> models.ModelConfig:
    """Model hyperparameters: the HF checkpoint's config, else the preset (tokenizer-sized vocab and another depth
    if asked)."""
    overrides = {"dtype": c.model.dtype, "param_dtype": c.model.param_dtype, "remat": c.model.remat,
                 "attn_chunk": c.model.attn_chunk, "scan_layers": bool(c.model.scan_layers)}
    if c.model.hf_path:
        return models.ModelConfig.from_hf_config(os.path.join(c.model.hf_path, "config.json")).replace(**overrides)
    if c.model.vocab_size:
        overrides["vocab_size"] = c.model.vocab_size
    if c.model.num_hidden_layers:
        overrides["num_hidden_layers"] = c.model.num_hidden_layers
    mc = models.get_model_config(c.model.preset, **overrides)
    if mc.vocab_size < vocab_size:
        raise ValueError(f"config.model.vocab_size: the model's vocabulary ({mc.vocab_size}) is smaller than the "
                         f"tokenizer's ({vocab_size})")
    return mc


def initial_model(c: ml_collections.ConfigDict, model_cfg, tok, src, *, progress: bool = False) -> nnx.Module:
    """The policy RL starts from: the HF checkpoint, the cached supervised warm-up, or a seeded random init."""
    from triage_jax.warmup import warm_start

    if c.model.hf_path:  # its weights, run as model_config says (dtypes, remat, chunked attention, scan)
        return models.from_pretrained(c.model.hf_path, **model_cfg.execution())
    if c.warmup.enabled and c.data.source == "synthetic":
        return warm_start(c, model_cfg, tok, src, progress=progress)
    return models.Qwen3(model_cfg, rngs=nnx.Rngs(c.seed))


def precision_rules(c: ml_collections.ConfigDict, side: str) -> tuple[tuple[str, str], ...]:
    """config.<side>.rules as (regex, preset) pairs; first:/last:K against the model's decoder layers."""
    specs = tuple(c[side].rules)
    if not specs:
        return ()
    layers = num_layers(c)
    if layers is None:  # an HF checkpoint: its config.json has the count
        layers = model_config(c, 0).num_hidden_layers
    return parse_rules(specs, layers)


def learner_policy(c: ml_collections.ConfigDict) -> PrecisionPolicy:
    """The learner's policy; exact mode: the sampler's (token-wise activation scales, batch-invariant numerics)."""
    rules = precision_rules(c, "learner")
    if c.learner.exact:
        return PrecisionPolicy.from_spec(c.learner.precision, act_scaling="row", backend=c.learner.backend,
                                         rules=token_wise_rules(rules), exact=True)
    return PrecisionPolicy.from_spec(c.learner.precision, backend=c.learner.backend, rules=rules)


def sampler_policy(c: ml_collections.ConfigDict) -> PrecisionPolicy:
    return _sampler_policy(c.sampler.precision, c.sampler.kv_cache, rules=precision_rules(c, "sampler"),
                           act_scaling=c.sampler.act_scaling, exact=bool(c.learner.exact), backend=c.sampler.backend)


def sampling(c: ml_collections.ConfigDict, tok) -> SamplingConfig:
    """How rollouts are drawn; `sampler.max_new_tokens` is the run's one response length."""
    return SamplingConfig(temperature=c.sampler.temperature, top_p=c.sampler.top_p, top_k=c.sampler.top_k,
                          max_new_tokens=c.sampler.max_new_tokens, stop_ids=tuple(tok.eos_ids))


def engine(c: ml_collections.ConfigDict, tok, model=None, *, mesh=None):
    """The rollout engine: `sampler.max_slots` decode slots (0: one per response of a rollout batch) split over
    the (learner's) mesh's batch axes, sequences of up to max_prompt_len + max_new_tokens tokens; it records
    MoE routing for the learner to replay when `rl.routing_replay`."""
    from triage_jax.sampler import Engine

    return Engine(sampling(c, tok), engine_config(c), policy=sampler_policy(c), pad_id=tok.pad_id, model=model,
                  mesh=mesh, record_routing=c.rl.routing_replay)


def engine_config(c: ml_collections.ConfigDict):
    """The engine's slots and scheduling from `sampler.*` (benchmarks build theirs here too, to time what runs)."""
    from triage_jax.sampler import EngineConfig

    slots = c.sampler.max_slots or c.rl.num_prompts * c.rl.group_size
    return EngineConfig(max_slots=slots, max_len=c.sampler.max_prompt_len + c.sampler.max_new_tokens,
                        steps_per_round=c.sampler.steps_per_round, prefill_batch=c.sampler.prefill_batch,
                        max_prompt_len=c.sampler.max_prompt_len, compact_tail=c.sampler.compact_tail,
                        xla_options=xla_options(c), compile_ahead=bool(c.sampler.compile_ahead),
                        round_loop=c.sampler.round_loop)


def triage(c: ml_collections.ConfigDict) -> TriageConfig:
    """TRIAGE's thresholds (`rl.triage`): the correction's settings, and the diagnostics' segmenting."""
    return TriageConfig.from_dict(c.rl.triage.to_dict())


def correction(c: ml_collections.ConfigDict) -> Correction:
    """The configured correction: its registry name and its settings from the sub-dict named like it."""
    name = c.rl.correction
    settings = c.rl[name].to_dict() if name in c.rl else {}
    return Correction(name, corr.make_config(name, settings))


def monitor(c: ml_collections.ConfigDict) -> MonitorConfig | None:
    """The early-warning monitor's window and thresholds (`monitor.*`), None when monitor.enabled is off."""
    return monitor_config(c.monitor.to_dict()) if c.monitor.enabled else None


def alarm_correction(c: ml_collections.ConfigDict, model_cfg) -> tuple[Correction, LossSettings]:
    """What monitor.action='enable_correction' switches the learner to: monitor.correction with its rl.<name>
    settings, and the loss settings that go with it (TRIAGE's repair term when it is TRIAGE)."""
    name = c.monitor.correction
    settings = c.rl[name].to_dict() if name in c.rl else {}
    return (Correction(name, corr.make_config(name, settings)),
            dataclasses.replace(loss(c, model_cfg), triage=triage(c) if name == "triage" else None))


def loss(c: ml_collections.ConfigDict, model_cfg) -> LossSettings:
    """The learner's static loss settings (clip range, aggregation, KL, TRIAGE repair, MoE aux)."""
    return LossSettings(
        eps_low=c.rl.eps_low, eps_high=c.rl.eps_high, dual_clip=c.rl.dual_clip or None, agg=c.rl.agg,
        kl_coef=c.rl.kl_coef, temperature=c.sampler.temperature,
        vocab_chunk=c.learner.vocab_chunk or model_cfg.vocab_size,
        triage=triage(c) if c.rl.correction == "triage" else None,
        aux_coef=model_cfg.router_aux_loss_coef if model_cfg.num_experts else 0.0,
    )


def optim(c: ml_collections.ConfigDict) -> OptimSettings:
    o = c.optim
    return OptimSettings(lr=o.lr, warmup_steps=o.warmup_steps, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                         grad_clip=o.grad_clip)


def learner_mesh(c: ml_collections.ConfigDict):
    """The learner's (data, fsdp, tensor, expert) mesh (`mesh.*`) over the first devices."""
    from triage_jax import sharding as shd

    return shd.make_mesh(c.mesh.to_dict())


def sampler_mesh(c: ml_collections.ConfigDict):
    """The sampler's own data-parallel mesh of `mesh.sampler_devices` devices, the ones after the learner's mesh
    (a sampler and a learner sub-mesh: a stale rollout samples there while the learner updates); None when
    mesh.sampler_devices=0 (the sampler shares the learner's mesh)."""
    import jax

    from triage_jax import sharding as shd

    k = int(c.mesh.sampler_devices)
    if not k:
        return None
    n_learner = int(np.prod([int(c.mesh[a]) for a in shd.MESH_AXES]))
    devices = jax.devices()
    if n_learner + k > len(devices):
        raise ValueError(f"config.mesh.sampler_devices: the learner's mesh takes {n_learner} device(s) and the "
                         f"sampler's {k} more, but {len(devices)} are available (on CPU, simulate more with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n_learner + k})")
    return shd.make_mesh({"data": k}, devices[n_learner:n_learner + k])


def learner(c: ml_collections.ConfigDict, model: nnx.Module, *, mesh=None, abstract: bool = False):
    """The run's Learner for `model` on the config's mesh (or `mesh`); the correction acts on `rl.delta_source`."""
    from triage_jax.learner import Learner

    return Learner(model, loss=loss(c, model.cfg), correction=correction(c), triage=triage(c), optim=optim(c),
                   policy=learner_policy(c), micro_batch=c.rl.micro_batch,
                   mesh=mesh if mesh is not None else learner_mesh(c), abstract=abstract,
                   delta_source=c.rl.delta_source)


def run_state(c: ml_collections.ConfigDict, params, opt_state, behaviour=None) -> dict[str, Any]:
    """The checkpointed run state: parameters and optimizer state, plus with `rl.staleness` = s >= 1 the s
    behaviour-weight snapshots its queued rollouts were sampled by (oldest first; `behaviour` None: s copies of
    `params`' layout, for an abstract restore)."""
    state = {"params": params, "opt_state": opt_state}
    if c.rl.staleness:
        state["behaviour"] = list(behaviour) if behaviour is not None else [params] * int(c.rl.staleness)
    return state


def checkpointer(c: ml_collections.ConfigDict, *, keep: int | None = None) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(os.path.join(os.path.abspath(c.run_dir), "checkpoints"),
                                 keep=c.train.keep_checkpoints if keep is None else keep)


def check_layout(c: ml_collections.ConfigDict, ck, step: int | None = None) -> None:
    """Checkpoint `step` (default: the newest) holds the learner's layers as model.scan_layers says (stacked or per
    layer; its metadata says which, per layer before the key existed): else a ConfigError naming the key, before
    a restore would find every checkpoint's tree different."""
    from triage_jax.config import ConfigError

    step = ck.latest_step() if step is None else step
    meta = None if step is None else ck.read_meta(step)
    if meta is None:
        return  # no checkpoint, or an unreadable one: the restore reports it
    saved, now = bool(meta.get("scan_layers", False)), bool(c.model.scan_layers)
    if saved != now:
        raise ConfigError(f"config.model.scan_layers={now}, but the checkpoints under {ck.directory} hold the "
                          f"learner's layers {'stacked' if saved else 'per layer'} (step {step} was saved with "
                          f"model.scan_layers={saved}): use --config.model.scan_layers={saved}")


def load_policy(c: ml_collections.ConfigDict, step: int | None = None) -> tuple[nnx.Module, Any, int | None]:
    """(model, tokenizer, step) of a run's checkpoint (newest or `step`), else of config.model.hf_path."""
    import jax

    from triage_jax.learner import make_optimizer

    tok = tokenizer(c)
    mc = model_config(c, tok.vocab_size)
    ck = checkpointer(c)
    if ck.all_steps():
        check_layout(c, ck, step)
        abstract_model = nnx.eval_shape(lambda: models.Qwen3(mc, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(abstract_model, nnx.Param)
        abstract = run_state(c, params, jax.eval_shape(make_optimizer(optim(c)).init, params))
        got = ck.restore(abstract, step)
        if got is None:
            raise FileNotFoundError(f"no usable checkpoint{'' if step is None else f' at step {step}'} under "
                                    f"{ck.directory}")
        return nnx.merge(graphdef, got[1]["params"]), tok, got[0]
    if c.model.hf_path:  # its weights, run as model_config says (dtypes, remat, chunked attention, scan)
        return models.from_pretrained(c.model.hf_path, **mc.execution()), tok, None
    raise FileNotFoundError(f"no checkpoint under {ck.directory} and no config.model.hf_path to evaluate")
