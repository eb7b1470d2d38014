"""The one config schema (ml_collections) and its validation, run before any compilation.

Every config file in configs/ starts from `base_config()` and overrides values; the dict is locked, so a
misspelt key (in a file or a `--config.a.b=value` flag) fails at once. `validate` checks values and their
consistency and names the offending key.
"""

from __future__ import annotations

import os

import dataclasses
import math
import re

import ml_collections

from triage_jax.data.synthetic import ALL_LEVELS, STYLES
from triage_jax.data.tokenizers import BPE_MIN_VOCAB
from triage_jax.models.config import PRESETS as MODEL_PRESETS, REMAT_MODES
from triage_jax.quant import PRESETS
from triage_jax.quant.backends import backend_names
from triage_jax.quant.policy import ACT_SCALINGS, parse_rule
from triage_jax.rl.corrections import CORRECTIONS
from triage_jax.rl.delta import DELTA_SOURCES
from triage_jax.rl.grpo import AGGREGATIONS
from triage_jax.rl.monitor import ACTIONS as MONITOR_ACTIONS, MonitorConfig, monitor_config

# Keys that moved: setting one fails in `validate` with the new name (a tombstone of value None in the schema).
MOVED_KEYS = {
    "rl.max_response_len": "sampler.max_new_tokens (the one response length)",
    "rl.tis_c": "rl.token_tis.C / rl.seq_tis.C",
    "rl.mis_lo": "rl.seq_mis.lo", "rl.mis_hi": "rl.seq_mis.C",
    "rl.icepop_lo": "rl.icepop.a", "rl.icepop_hi": "rl.icepop.b",
    "rl.geo_lo": "rl.geo_rs.lo", "rl.geo_hi": "rl.geo_rs.hi",
}


class ConfigError(ValueError):
    """A config value is invalid or contradicts another; the message names the key."""


def load_config(name_or_path: str) -> ml_collections.ConfigDict:
    """A run config: configs/<name>.py of this checkout, or a path to a config file; its `get_config()`."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = name_or_path if name_or_path.endswith(".py") else os.path.join(root, "configs", f"{name_or_path}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config {name_or_path!r}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"_config_{os.path.basename(path)[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def base_config() -> ml_collections.ConfigDict:
    """All keys with defaults (the tiny CPU run); config files override."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.run_dir = "runs/default"
    # The persistent XLA compilation cache (triage_jax/compile_cache.py): "auto" ($JAX_COMPILATION_CACHE_DIR, else
    # ~/.cache/triage_jax/xla), "" off, or a folder. A second run loads the compiled programs.
    c.compile_cache = "auto"

    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"  # a models.config preset name, ignored when hf_path is set
    c.model.hf_path = ""  # HF checkpoint folder (config.json + safetensors)
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    c.model.remat = "none"
    c.model.attn_chunk = 0  # > 0: chunked (flash-style) attention in the learner for sequences longer than this
    c.model.vocab_size = 0  # 0: take it from the tokenizer (tiny presets)
    c.model.num_hidden_layers = 0  # 0: the preset's depth; > 0 overrides it (a shallower or deeper preset model)
    # The learner's layers stacked and scanned (one layer to compile: the 4B W4A4 learner step compiles in ~15 s
    # instead of minutes); the sampler unstacks them at each sync (its decode runs them unrolled; sampler.scan_layers
    # keeps them stacked). Needs one precision for every layer (no learner.rules) and no exact mode.
    c.model.scan_layers = False

    c.tokenizer = "char"  # "char", "bpe" (trained on the synthetic task's corpus, see c.bpe) or a tokenizer.json path

    c.bpe = ml_collections.ConfigDict()  # the task BPE of tokenizer="bpe" (saved as run_dir/tokenizer.json)
    c.bpe.vocab_size = 1024  # at most this many ids (fewer when the corpus runs out of pairs to merge)
    c.bpe.corpus_size = 4000  # synthetic problems (prompt + reference solution) it is trained on

    c.data = ml_collections.ConfigDict()
    c.data.source = "synthetic"  # "synthetic" or "dapo"
    c.data.path = ""  # DAPO-Math-17k parquet/jsonl when source == "dapo"
    c.data.template = "short"  # "short" or "dapo"
    c.data.style = ""  # synthetic problem text: "words", "symbolic", or "" for the template's default
    c.data.levels = (1,)  # synthetic levels: 1-4 short answers, 5-7 step-by-step chains (data.synthetic)
    c.data.num_examples = 20000
    c.data.max_bad_fraction = 0.01

    c.warmup = ml_collections.ConfigDict()  # supervised warm-up, runs when no base checkpoint exists
    c.warmup.enabled = True
    c.warmup.steps = 300
    c.warmup.batch_size = 64
    c.warmup.lr = 3e-3
    c.warmup.cache_dir = "runs/warmup_cache"

    c.sampler = ml_collections.ConfigDict()
    c.sampler.precision = "w4a4"
    c.sampler.kv_cache = "bf16"
    # NVFP4 activations' float32 scale: "row" (per token: a response's numbers never depend on its batch) or
    # "tensor" (one per matmul input, shared by every slot: a mismatch dial, as the learner's per-tensor default)
    c.sampler.act_scaling = "row"
    # The quantization backend of the sampler's GEMMs (quant.backends): "xla" (the reference; what the learner
    # computes), "fp4_gemm" (the Mosaic GPU 4-bit weight GEMM for Hopper: W4A16 / W4A8 / W4A4 samplers on an H100 /
    # H200), "auto" (the best available here), or any registered backend.
    c.sampler.backend = "xla"
    c.sampler.temperature = 1.0
    c.sampler.top_p = 1.0
    c.sampler.top_k = 0
    c.sampler.max_prompt_len = 32
    c.sampler.max_new_tokens = 24
    c.sampler.max_slots = 0  # decode slots of the rollout engine (0: one per response of a rollout batch)
    c.sampler.steps_per_round = 8  # decode steps per host round trip
    c.sampler.prefill_batch = 8  # prompts prefilled per call
    # Once nothing waits and at most 1/compact_tail of the slots decode, move them into a smaller slot set (0: never)
    c.sampler.compact_tail = 4
    # Per-layer precision rules ahead of sampler.precision (quant.policy.parse_rule: "REGEX=PRESET" on module paths,
    # "last:K=PRESET" / "first:K=PRESET" for decoder layers), e.g. ("lm_head$=w4a4",) quantizes the LM head too.
    c.sampler.rules = ()
    # XLA compiler options for the rollout engine's programs only, "NAME=VALUE" strings (sampler.EngineConfig
    # .xla_options; values true / false / numbers are typed), e.g.
    # ("xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",).
    c.sampler.xla_options = ()
    # Compile the engine's decode round for the larger KV-capacity buckets (up to max_prompt_len + max_new_tokens)
    # in the background once the rollout runs, so responses growing into them do not stall it to compile
    # (sampler.EngineConfig.compile_ahead).
    c.sampler.compile_ahead = True
    # The decode round's loop (sampler.EngineConfig.round_loop): "fixed" (steps_per_round steps: a known trip count,
    # no host round trip per step on a GPU), "early_exit" (stops once every response is done) or "auto" (fixed on
    # GPUs, early_exit elsewhere). The same tokens either way.
    c.sampler.round_loop = "auto"
    # The sampler's layers, for a scanned learner (model.scan_layers): False unrolls them at each sync (the decode
    # step one program of every layer's kernels), True keeps them stacked (the decode step a loop over the layers:
    # ~10x less XLA compile, the 4B W4A4 round ~5 s instead of ~35-50 s, compiled for an H200 on a CPU). Which
    # step is faster on a GPU is experiments/bench_gpu.py's to say (its `w4a4_scan` row): unrolled until then.
    c.sampler.scan_layers = False

    c.learner = ml_collections.ConfigDict()
    c.learner.precision = "bf16"
    c.learner.backend = "xla"
    c.learner.vocab_chunk = 0  # 0: no chunking of the LM head log-softmax
    c.learner.rules = ()  # per-layer precision rules ahead of learner.precision (as sampler.rules)
    # Compile the learner's programs (log-probs, corrections, update) for a rollout's prompt width on background
    # threads while the rollout generates, so a new width (the first step's, a longer prompt's) does not stop the
    # step to compile them one after another (learner.Learner.compile_thunks).
    c.learner.compile_ahead = True
    # Exact on-policy mode: sampler and learner run batch-invariant numerics (docs/numerics.md#exact-mode), so with
    # one precision on both sides the learner's recompute equals the sampler's log-probs bit for bit (delta = 0).
    c.learner.exact = False

    c.rl = ml_collections.ConfigDict()
    c.rl.num_prompts = 32  # prompts per rollout batch
    c.rl.group_size = 8  # responses per prompt (G)
    c.rl.mini_batch = 128  # responses per optimizer update
    c.rl.micro_batch = 64  # responses per gradient-accumulation micro-batch
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.28
    c.rl.dual_clip = 0.0  # 0: off; else c (> 1) for A < 0
    c.rl.agg = "token-mean"
    c.rl.std_normalize = True
    c.rl.dynamic_sampling = True
    c.rl.max_resample = 3  # extra rollout batches dynamic sampling may draw to fill a batch
    c.rl.overlong_buffer = 0
    c.rl.overlong_factor = 1.0
    c.rl.kl_coef = 0.0
    c.rl.correction = "triage"  # a key of rl.corrections.CORRECTIONS
    # Routing replay (R3, MoE only): the sampler records each token's expert ids per MoE layer and every learner
    # forward over the rollout (recompute, reference, updates) routes by them, gated by its own router.
    c.rl.routing_replay = False
    # Stale-policy (asynchronous) training (docs/rl_math.md#stale-rollouts): the rollout of step k comes from the
    # weights of step k - staleness (0: the synchronous loop), sampled while step k - staleness updates.
    c.rl.staleness = 0
    # The delta the correction and TRIAGE act on (rl.delta.DELTA_SOURCES): "total" = learner(current) - sampler,
    # "precision" = learner(behaviour weights) - sampler, "staleness" = learner(current) - learner(behaviour).
    c.rl.delta_source = "total"
    # Each correction's settings: a sub-dict named like its registry key, defaults from its config dataclass
    # (rl.token_tis.C, rl.seq_mis.lo, rl.icepop.b, rl.triage.segment_len, ...).
    for name, correction in CORRECTIONS.items():
        fields = {f.name: f.default for f in dataclasses.fields(correction.config_cls)}
        if fields:
            c.rl[name] = ml_collections.ConfigDict(fields)
    for key in MOVED_KEYS:
        sect, name = key.split(".")
        c[sect][name] = None

    # Early-warning monitor (rl.monitor): alarm/* scalars every step from the mismatch diagnostics, and an action.
    c.monitor = ml_collections.ConfigDict()
    c.monitor.enabled = True
    c.monitor.action = "none"  # "none" or "enable_correction" (switch to monitor.correction at action_level)
    c.monitor.action_level = 2  # the alarm level (1 or 2) that triggers the action
    c.monitor.correction = "token_tis"  # the correction an alarm switches on (its settings: rl.<name>)
    for f in dataclasses.fields(MonitorConfig):
        c.monitor[f.name] = f.default

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-4
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.grad_clip = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 50
    c.train.ckpt_every = 10
    c.train.keep_checkpoints = 3
    c.train.max_nonfinite = 3  # consecutive non-finite updates before the run stops
    c.train.energy_every = 10  # steps between delta_energy_realized measurements (a second learner forward); 0: off
    c.train.save_deltas = 0  # every k-th step's token deltas to run_dir/deltas (triage_jax.deltas, a pilot); 0: off
    c.train.progress = True

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.expert = 1
    # > 0: the sampler gets its own data-parallel mesh of this many devices, after the learner's (a sampler and a
    # learner sub-mesh, so a stale rollout samples while the learner updates); 0: it shares the learner's mesh.
    c.mesh.sampler_devices = 0
    c.lock()  # new keys are typos: reject them (values stay mutable)
    return c


def _fail(key: str, msg: str):
    raise ConfigError(f"config.{key}: {msg}")


def _one_of(c, key: str, allowed):
    value = c
    for part in key.split("."):
        value = value[part]
    if value not in allowed:
        _fail(key, f"{value!r} is not one of {list(allowed)}")


def _check_exact(c: ml_collections.ConfigDict) -> None:
    """learner.exact makes delta zero only when nothing else differs between the two sides."""
    if c.learner.precision != c.sampler.precision:
        _fail("learner.exact", f"exact mode needs one precision on both sides; learner.precision="
              f"{c.learner.precision!r} but sampler.precision={c.sampler.precision!r}")
    if tuple(c.sampler.rules) != tuple(c.learner.rules):
        _fail("learner.exact", f"exact mode needs the same per-layer rules on both sides; sampler.rules="
              f"{tuple(c.sampler.rules)} but learner.rules={tuple(c.learner.rules)}")
    if c.sampler.kv_cache != "bf16":
        _fail("learner.exact", f"exact mode needs sampler.kv_cache='bf16' (the compute dtype), got "
              f"{c.sampler.kv_cache!r}: an FP8 cache's scale comes from the prefill batch")
    if c.sampler.act_scaling != "row":
        _fail("learner.exact", f"exact mode needs sampler.act_scaling='row' (token-wise scales on both sides), got "
              f"{c.sampler.act_scaling!r}")
    if c.model.scan_layers:
        _fail("learner.exact", "exact mode needs the learner's layers unrolled like the sampler's "
              "(model.scan_layers=False): a scanned body is fused differently, and bf16 rounds elsewhere")
    for side in ("learner", "sampler"):
        if c[side].backend != "xla":
            _fail("learner.exact", f"exact mode runs both sides on the xla backend; {side}.backend="
                  f"{c[side].backend!r}")


def validate(c: ml_collections.ConfigDict, *, check_paths: bool = True) -> None:
    """Check values and cross-key consistency; raise ConfigError naming the key. Cheap: no JAX work."""
    for key, new in MOVED_KEYS.items():
        sect, name = key.split(".")
        if c[sect][name] is not None:
            _fail(key, f"this key is gone: set config.{new} instead")
    _one_of(c, "sampler.precision", PRESETS)
    _one_of(c, "learner.precision", PRESETS)
    _one_of(c, "sampler.kv_cache", ("bf16", "fp8"))
    _one_of(c, "sampler.act_scaling", ACT_SCALINGS)
    _one_of(c, "sampler.backend", backend_names())
    _one_of(c, "learner.backend", backend_names())
    _one_of(c, "rl.agg", AGGREGATIONS)
    _one_of(c, "rl.correction", CORRECTIONS)
    _one_of(c, "model.remat", REMAT_MODES)
    _one_of(c, "data.source", ("synthetic", "dapo"))
    _one_of(c, "data.template", ("short", "dapo"))
    _one_of(c, "data.style", ("",) + STYLES)
    levels = tuple(c.data.levels) if isinstance(c.data.levels, (tuple, list)) else (c.data.levels,)
    if not levels or any(v not in ALL_LEVELS for v in levels):
        _fail("data.levels", f"{c.data.levels!r} must be a non-empty tuple of synthetic levels from {list(ALL_LEVELS)}")
    if c.tokenizer == "bpe":
        _check_bpe(c)
    _one_of(c, "model.dtype", ("float32", "bfloat16"))
    if c.model.num_hidden_layers < 0:
        _fail("model.num_hidden_layers", f"must be >= 0 (0: the preset's depth), got {c.model.num_hidden_layers}")
    if c.model.num_hidden_layers and c.model.hf_path:
        _fail("model.num_hidden_layers", f"sets a preset's depth; the HF checkpoint {c.model.hf_path!r} has its own "
              f"(leave it 0)")
    _one_of(c, "model.param_dtype", ("float32", "bfloat16"))
    _one_of(c, "model.scan_layers", (False, True))
    _one_of(c, "sampler.scan_layers", (False, True))
    if c.sampler.scan_layers and not c.model.scan_layers:
        _fail("sampler.scan_layers", "keeps the learner's stacked layers, and model.scan_layers=False stacks none "
              "(set model.scan_layers=True)")
    if c.sampler.scan_layers and tuple(c.sampler.rules):
        _fail("sampler.scan_layers", f"scanned layers share one precision; sampler.rules={tuple(c.sampler.rules)} "
              f"gives some layers their own (set sampler.scan_layers=False)")
    if c.model.scan_layers and tuple(c.learner.rules):
        _fail("model.scan_layers", f"scanned layers share one precision; learner.rules={tuple(c.learner.rules)} "
              f"gives some layers their own (set model.scan_layers=False)")

    for key in ("rl.num_prompts", "rl.group_size", "rl.mini_batch", "rl.micro_batch", "train.steps",
                "sampler.max_new_tokens", "sampler.max_prompt_len", "sampler.steps_per_round",
                "sampler.prefill_batch"):
        sect, name = key.split(".")
        if int(c[sect][name]) < 1:
            _fail(key, f"must be >= 1, got {c[sect][name]}")
    if int(c.sampler.compact_tail) == 1 or int(c.sampler.compact_tail) < 0:
        _fail("sampler.compact_tail", f"must be 0 (never) or >= 2, got {c.sampler.compact_tail}")
    from triage_jax.sampler import ROUND_LOOPS

    _one_of(c, "sampler.round_loop", ROUND_LOOPS)
    try:
        from triage_jax.sampler import check_xla_options

        check_xla_options(xla_options(c))
    except ValueError as e:
        _fail("sampler.xla_options", str(e))
    for name in ("data", "fsdp", "tensor", "expert"):
        if int(c.mesh[name]) < 1:
            _fail(f"mesh.{name}", f"must be >= 1, got {c.mesh[name]}")

    for side in ("sampler", "learner"):
        _check_rules(c, side)
    if c.learner.exact:
        _check_exact(c)

    rl = c.rl
    if rl.group_size == 1 and rl.std_normalize:
        _fail("rl.group_size", "group size 1 with rl.std_normalize=True: the group std is undefined")
    if rl.group_size == 1 and rl.dynamic_sampling:
        _fail("rl.group_size", "group size 1 with rl.dynamic_sampling=True drops every group")
    batch = rl.num_prompts * rl.group_size
    if batch % rl.mini_batch:
        _fail("rl.mini_batch", f"{rl.mini_batch} does not divide the rollout batch "
              f"num_prompts*group_size = {rl.num_prompts}*{rl.group_size} = {batch}")
    if rl.mini_batch % rl.micro_batch:
        _fail("rl.micro_batch", f"{rl.micro_batch} does not divide rl.mini_batch = {rl.mini_batch}")
    from triage_jax.sharding import batch_axes

    axes = batch_axes()
    data_axes = 1
    for a in axes:
        data_axes *= int(c.mesh[a])
    if rl.micro_batch % data_axes:
        _fail("rl.micro_batch", f"{rl.micro_batch} is not divisible by the mesh axes the batch is split over "
              f"({'*'.join(f'mesh.{a}={c.mesh[a]}' for a in axes)} = {data_axes})")
    _check_staleness(c)
    slots = int(c.sampler.max_slots) or batch
    if int(c.mesh.sampler_devices) > 0 and slots % int(c.mesh.sampler_devices):
        _fail("mesh.sampler_devices", f"{slots} decode slots (sampler.max_slots, 0: one per response) do not "
              f"split over the sampler's {c.mesh.sampler_devices} devices")
    if c.sampler.max_slots < 0:
        _fail("sampler.max_slots", f"must be >= 0 (0: one slot per response), got {c.sampler.max_slots}")
    if slots % data_axes:
        _fail("sampler.max_slots", f"{slots} decode slots do not split over the mesh axes the batch is split over "
              f"({'*'.join(f'mesh.{a}={c.mesh[a]}' for a in axes)} = {data_axes})")
    if not 0 <= rl.eps_low < 1 or rl.eps_high < 0:
        _fail("rl.eps_low", f"clip range eps_low={rl.eps_low}, eps_high={rl.eps_high} is invalid")
    if rl.dual_clip and rl.dual_clip <= 1:
        _fail("rl.dual_clip", f"dual clip constant must be > 1 (or 0 for off), got {rl.dual_clip}")
    length = c.sampler.max_new_tokens
    if rl.overlong_buffer < 0 or rl.overlong_buffer >= length:
        _fail("rl.overlong_buffer", f"{rl.overlong_buffer} must be in [0, sampler.max_new_tokens={length}) "
              f"(the response length L of the overlong penalty)")
    # Every correction's sub-dict must build its config dataclass (the active one and TRIAGE, which also
    # segments the diagnostics, matter; the others are checked so a typo never waits for a later run).
    from triage_jax.rl.corrections import make_config

    for name in CORRECTIONS:
        if name in rl:
            try:
                make_config(name, rl[name].to_dict())
            except (ValueError, TypeError) as e:
                # Name the first setting the dataclass's message mentions (its messages name their fields).
                named = [k for k in rl[name] if re.search(rf"\b{re.escape(k)}\b", str(e))]
                _fail(f"rl.{name}" + (f".{named[0]}" if named else ""), str(e))
    if not 0 < c.sampler.temperature:
        _fail("sampler.temperature", f"must be > 0, got {c.sampler.temperature}")
    if not 0 < c.sampler.top_p <= 1:
        _fail("sampler.top_p", f"must be in (0, 1], got {c.sampler.top_p}")
    if not (math.isfinite(c.optim.lr) and c.optim.lr > 0):
        _fail("optim.lr", f"must be a finite number > 0, got {c.optim.lr}")
    for key in ("train.ckpt_every", "train.keep_checkpoints", "train.max_nonfinite"):
        sect, name = key.split(".")
        if int(c[sect][name]) < 1:
            _fail(key, f"must be >= 1, got {c[sect][name]}")
    for key in ("train.energy_every", "train.save_deltas"):
        v = c.train[key.split(".")[1]]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail(key, f"must be an int >= 0 (0: off), got {v!r}")
    if c.warmup.enabled:
        for key in ("warmup.steps", "warmup.batch_size"):
            if int(c.warmup[key.split(".")[1]]) < 1:
                _fail(key, f"must be >= 1 while warmup.enabled (set warmup.enabled=False to skip the warm-up), "
                      f"got {c.warmup[key.split('.')[1]]}")
    if rl.max_resample < 0:
        _fail("rl.max_resample", f"must be >= 0, got {rl.max_resample}")
    if rl.routing_replay and _num_experts(c) == 0:
        model = (f"config.model.hf_path={c.model.hf_path!r}" if c.model.hf_path
                 else f"config.model.preset={c.model.preset!r}")
        _fail("rl.routing_replay", f"replays MoE expert routing, but {model} is a dense model (num_experts=0); "
              f"use an MoE model (e.g. configs/tiny_moe.py) or set rl.routing_replay=False")
    _check_monitor(c)

    if check_paths:
        if c.model.preset.startswith("qwen3") and not c.model.hf_path:
            _fail("model.hf_path", f"preset {c.model.preset!r} needs its HF checkpoint: pass --config.model.hf_path=DIR")
        if c.model.hf_path and not os.path.isdir(c.model.hf_path):
            _fail("model.hf_path", f"{c.model.hf_path!r} is not a directory (pass --config.model.hf_path=/path/to/hf)")
        if c.data.source == "dapo":
            if not c.data.path:
                _fail("data.path", "data.source='dapo' needs the DAPO-Math-17k file: pass --config.data.path=...")
            if not os.path.exists(c.data.path):
                _fail("data.path", f"{c.data.path!r} does not exist (pass --config.data.path=...)")
        tok = tokenizer_path(c)
        if tok not in ("char", "bpe") and not os.path.exists(tok):
            _fail("tokenizer", f"{tok!r} does not exist (pass --config.tokenizer=/path/tokenizer.json)")
        if c.model.hf_path:
            _check_hf_config_json(os.path.join(c.model.hf_path, "config.json"))


def _check_staleness(c: ml_collections.ConfigDict) -> None:
    """rl.staleness is a step count; rl.delta_source names a delta that exists at that staleness."""
    s = c.rl.staleness
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        _fail("rl.staleness", f"must be an integer >= 0 (0: synchronous), got {s!r}")
    _one_of(c, "rl.delta_source", DELTA_SOURCES)
    if c.rl.delta_source == "staleness" and s == 0:
        _fail("rl.delta_source", "'staleness' is 0 on every token of a synchronous run (rl.staleness=0): the "
              "correction would act on nothing; set --config.rl.staleness >= 1 or rl.delta_source='total'")
    d = c.mesh.sampler_devices
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        _fail("mesh.sampler_devices", f"must be an integer >= 0 (0: the sampler shares the learner's mesh), got {d!r}")


def _num_experts(c: ml_collections.ConfigDict) -> int | None:
    """The model's expert count as the preset or the HF config.json says (None when that cannot be read here)."""
    if not c.model.hf_path:
        preset = MODEL_PRESETS.get(c.model.preset)
        return None if preset is None else preset.num_experts
    import json

    try:
        with open(os.path.join(c.model.hf_path, "config.json")) as f:
            return int(json.load(f).get("num_experts") or 0)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _check_monitor(c: ml_collections.ConfigDict) -> None:
    """The monitor's thresholds build a MonitorConfig; its action and the correction it switches on exist."""
    m = c.monitor
    try:
        monitor_config(m.to_dict())
    except (ValueError, TypeError) as e:
        named = [k for k in m if re.search(rf"\b{re.escape(k)}\b", str(e))]
        _fail("monitor" + (f".{named[0]}" if named else ""), str(e))
    _one_of(c, "monitor.action", MONITOR_ACTIONS)
    _one_of(c, "monitor.action_level", (1, 2))
    if m.action == "enable_correction":
        _one_of(c, "monitor.correction", [k for k in CORRECTIONS if k != "none"])
        if not m.enabled:
            _fail("monitor.action", "'enable_correction' needs monitor.enabled=True")
        if c.rl.correction != "none":
            _fail("monitor.action", f"'enable_correction' switches a correction on, but rl.correction="
                  f"{c.rl.correction!r} is already on (set --config.rl.correction=none)")


def xla_options(c: ml_collections.ConfigDict) -> tuple:
    """sampler.xla_options ("NAME=VALUE" strings) as EngineConfig's (name, value) pairs (parse_xla_options)."""
    return parse_xla_options(c.sampler.xla_options)


def parse_xla_options(items) -> tuple:
    """"NAME=VALUE" strings (or one) as (name, value) pairs: true / false become booleans and integers / floats
    numbers, anything else stays a string (e.g. a comma list of enum values)."""
    if isinstance(items, str):
        items = (items,)
    pairs = []
    for item in items:
        name, eq, value = str(item).partition("=")
        if not eq or not name.strip():
            raise ValueError(f"{item!r} is not NAME=VALUE")
        value = value.strip()
        typed: object = value
        if value.lower() in ("true", "false"):
            typed = value.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    typed = kind(value)
                    break
                except ValueError:
                    pass
        pairs.append((name.strip(), typed))
    return tuple(pairs)


def flatten(c, prefix: str = "") -> dict:
    """{"section.key": value} of a config or its JSON dict (nested dicts become dotted keys): for comparing two
    configs key by key, or writing one as --config.* flags."""
    out = {}
    for k, v in c.items():
        out.update(flatten(v, f"{prefix}{k}.") if hasattr(v, "items") else {prefix + k: v})
    return out


def num_layers(c: ml_collections.ConfigDict) -> int | None:
    """The model's decoder-layer count: model.num_hidden_layers, else its preset's (None for an HF checkpoint: read
    when it is loaded)."""
    if c.model.hf_path or c.model.preset not in MODEL_PRESETS:
        return None
    return int(c.model.num_hidden_layers) or MODEL_PRESETS[c.model.preset].num_hidden_layers


def _check_rules(c: ml_collections.ConfigDict, side: str) -> None:
    """<side>.rules: a tuple of rule strings that parse (first:/last: against the preset's layer count)."""
    key = f"{side}.rules"
    specs = c[side].rules
    if isinstance(specs, str) or not isinstance(specs, (tuple, list)):
        _fail(key, f"must be a tuple of rule strings such as ('lm_head$=w4a4',), got {specs!r}")
    for spec in specs:
        if not isinstance(spec, str):
            _fail(key, f"{spec!r} is not a rule string")
        try:
            parse_rule(spec, num_layers(c))
        except ValueError as e:
            _fail(key, str(e))


def _check_bpe(c: ml_collections.ConfigDict) -> None:
    """tokenizer='bpe': a synthetic corpus to train on, a vocabulary size it can hold, a model that fits it."""
    if c.data.source != "synthetic":
        _fail("tokenizer", f"'bpe' is trained on the synthetic task's corpus; data.source={c.data.source!r} needs "
              "a tokenizer.json (--config.tokenizer=/path/tokenizer.json)")
    if int(c.bpe.vocab_size) < BPE_MIN_VOCAB:
        _fail("bpe.vocab_size", f"must be >= {BPE_MIN_VOCAB} (256 bytes, the specials, one merge), "
              f"got {c.bpe.vocab_size}")
    if int(c.bpe.corpus_size) < 1:
        _fail("bpe.corpus_size", f"must be >= 1, got {c.bpe.corpus_size}")
    if not c.model.hf_path:
        model_vocab = int(c.model.vocab_size) or (MODEL_PRESETS[c.model.preset].vocab_size
                                                  if c.model.preset in MODEL_PRESETS else None)
        if model_vocab is not None and model_vocab < int(c.bpe.vocab_size):
            _fail("model.vocab_size", f"the model's vocabulary ({model_vocab}) is smaller than "
                  f"bpe.vocab_size={c.bpe.vocab_size}")


def _check_hf_config_json(path: str) -> None:
    """The HF checkpoint's config.json exists and is a JSON object (a broken one names the file here)."""
    import json

    if not os.path.isfile(path):
        _fail("model.hf_path", f"{path} does not exist: the HF checkpoint folder needs its config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail("model.hf_path", f"{path} is not valid JSON ({e})")
    if not isinstance(data, dict):
        _fail("model.hf_path", f"{path} holds a JSON {type(data).__name__}, expected an object")


def tokenizer_path(c: ml_collections.ConfigDict) -> str:
    """'char', 'bpe', the configured tokenizer.json, or (when empty) the one beside the HF checkpoint."""
    if c.tokenizer:
        return c.tokenizer
    if not c.model.hf_path:
        raise ConfigError("config.tokenizer: empty and no config.model.hf_path to take tokenizer.json from")
    return os.path.join(c.model.hf_path, "tokenizer.json")
