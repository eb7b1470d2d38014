"""Config schema: every shipped config validates; bad values fail naming the key, before any compilation."""

import importlib.util
import pathlib

import pytest

from triage_jax import build
from triage_jax.config import ConfigError, base_config, validate

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def load(name):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("name", ["tiny", "tiny_moe", "organism"])
def test_cpu_configs_validate(name):
    validate(load(name))


@pytest.mark.parametrize("name", ["qwen3_0_6b", "qwen3_4b", "qwen3_30b_a3b"])
def test_paper_configs_need_paths(name, tmp_path):
    c = load(name)
    validate(c, check_paths=False)
    assert c.rl.num_prompts == 512 and c.rl.group_size == 16 and c.rl.mini_batch == 512
    assert c.optim.lr == 1e-6 and c.sampler.max_new_tokens == 20480 and c.rl.overlong_buffer == 4096
    with pytest.raises(ConfigError, match="--config.model.hf_path"):
        validate(c)
    c.model.hf_path = str(tmp_path)
    with pytest.raises(ConfigError, match="--config.data.path"):
        validate(c)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("rl.mini_batch", 48, "rl.mini_batch"),
        ("rl.micro_batch", 48, "rl.micro_batch"),
        ("sampler.precision", "w3a3", "sampler.precision"),
        ("rl.correction", "magic", "rl.correction"),
        ("rl.triage.g_hi", 0.01, "rl.triage.g_hi"),
        ("sampler.max_new_tokens", 0, "sampler.max_new_tokens"),
        ("sampler.compact_tail", 1, "sampler.compact_tail"),
        ("sampler.act_scaling", "block", "sampler.act_scaling"),
        # The overlong buffer is checked against the one response length, sampler.max_new_tokens (24).
        ("rl.overlong_buffer", 24, "sampler.max_new_tokens=24"),
        ("rl.token_tis.C", -1.0, "rl.token_tis"),
        ("rl.icepop.a", 9.0, "rl.icepop"),
        ("rl.seq_mis.lo", 3.0, "rl.seq_mis"),
        ("optim.lr", float("inf"), "optim.lr"),
        ("optim.lr", float("nan"), "optim.lr"),
        ("train.ckpt_every", 0, "train.ckpt_every"),
        ("train.keep_checkpoints", 0, "train.keep_checkpoints"),
        ("train.max_nonfinite", 0, "train.max_nonfinite"),
        ("train.save_deltas", -1, "train.save_deltas"),
        ("train.energy_every", -2, "train.energy_every"),
        ("warmup.steps", 0, "warmup.steps"),
        ("warmup.batch_size", 0, "warmup.batch_size"),
        ("rl.max_resample", -1, "rl.max_resample"),
        ("data.levels", (1, 99), "data.levels"),  # 99: no such synthetic level
        ("data.levels", (), "data.levels"),
        ("data.style", "latex", "data.style"),
        ("monitor.window", 1, "monitor.window"),
        ("monitor.min_points", 50, "monitor.min_points"),
        ("monitor.persistence_level1", 0.0, "monitor.persistence_level1"),
        ("monitor.action", "panic", "monitor.action"),
        ("monitor.action_level", 3, "monitor.action_level"),
        ("sampler.rules", ("lm_head$=w3a3",), "sampler.rules.*unknown preset 'w3a3'"),
        ("learner.rules", ("lm_head",), "learner.rules.*expected REGEX=PRESET"),
        ("learner.rules", ("last:9=bf16",), "learner.rules.*layer count in 1..4"),  # the tiny preset has 4
        ("sampler.rules", ("(unclosed=bf16",), "sampler.rules.*bad regex"),
        ("model.num_hidden_layers", -1, "model.num_hidden_layers"),
        ("sampler.xla_options", ("xla_gpu_enable_command_buffer",), "sampler.xla_options.*not NAME=VALUE"),
        ("sampler.backend", "fp4gemm", r"sampler.backend.*'fp4gemm' is not one of .*'fp4_gemm'"),
        ("learner.backend", "cuda", "learner.backend"),
        ("sampler.xla_options", ("xla_gpu_enable_comand_buffer=FUSION",), "sampler.xla_options.*comand"),
        ("sampler.xla_options", ("xla_gpu_enable_command_buffer=+WHILE",), "sampler.xla_options.*WHILE"),
    ],
)
def test_bad_values_name_the_key(key, value, match):
    c = base_config()
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_model_depth_override_reaches_the_model_and_the_layer_rules():
    """model.num_hidden_layers sets the preset's depth for the model the run builds and for what first:/last: rules
    count against (the warm-up cache keys on the model config, so it never serves the other depth)."""
    c = base_config()
    c.model.num_hidden_layers = 2
    assert build.model_config(c, 64).num_hidden_layers == 2
    c.learner.rules = ("last:2=bf16",)
    validate(c)
    c.learner.rules = ("last:3=bf16",)
    with pytest.raises(ConfigError, match="learner.rules.*layer count in 1..2"):
        validate(c)
    c.learner.rules, c.model.hf_path = (), "/some/hf"
    with pytest.raises(ConfigError, match="model.num_hidden_layers.*HF checkpoint '/some/hf' has its own"):
        validate(c)


def test_group_size_one_with_std_normalization_fails():
    c = base_config()
    c.rl.group_size, c.rl.num_prompts, c.rl.mini_batch, c.rl.micro_batch = 1, 64, 64, 64
    with pytest.raises(ConfigError, match="rl.group_size"):
        validate(c)


def test_batch_must_divide_over_data_axes():
    c = base_config()
    c.mesh.data, c.mesh.fsdp = 3, 1
    with pytest.raises(ConfigError, match="mesh.data"):
        validate(c)


def test_unknown_key_is_rejected():
    c = base_config()
    with pytest.raises(AttributeError):
        c.rl.no_such_key = 1


@pytest.mark.parametrize("old,new", [("rl.max_response_len", "sampler.max_new_tokens"), ("rl.tis_c", "rl.token_tis.C"),
                                     ("rl.icepop_hi", "rl.icepop.b"), ("rl.geo_lo", "rl.geo_rs.lo")])
def test_moved_keys_name_their_replacement(old, new):
    c = base_config()
    sect, name = old.split(".")
    c[sect][name] = 12
    with pytest.raises(ConfigError, match=f"config.{old}.*{new}"):
        validate(c)


def test_moved_key_on_the_command_line_names_its_replacement():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "triage_jax.main", "--config=configs/tiny.py",
                          "--config.rl.max_response_len=8"], cwd=CONFIGS.parent, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "sampler.max_new_tokens" in out.stderr


def test_correction_settings_are_registry_sub_dicts():
    """Every registered correction with settings has a sub-dict named like its key, defaulted from its config
    dataclass, and build.correction hands the active one to the learner."""
    import dataclasses

    from triage_jax.rl.corrections import CORRECTIONS

    c = base_config()
    for name, corr in CORRECTIONS.items():
        fields = {f.name: f.default for f in dataclasses.fields(corr.config_cls)}
        assert (c.rl[name].to_dict() if fields else {}) == fields
    c.rl.correction = "icepop"
    c.rl.icepop.b = 4.0
    got = build.correction(c)
    assert got.name == "icepop" and (got.cfg.a, got.cfg.b) == (0.5, 4.0)


def test_validation_reads_the_registries(monkeypatch):
    """A correction registered at run time is accepted without touching config.py."""
    import dataclasses

    from triage_jax.rl import corrections

    c = base_config()
    c.rl.correction = "my_rule"
    with pytest.raises(ConfigError, match="rl.correction"):
        validate(c)
    monkeypatch.setitem(corrections.CORRECTIONS, "my_rule", dataclasses.replace(corrections.CORRECTIONS["none"]))
    validate(c)


def test_broken_hf_config_json_fails_in_validation(tmp_path):
    c = base_config()
    c.model.hf_path = str(tmp_path)
    c.tokenizer = "char"
    with pytest.raises(ConfigError, match=r"config\.json does not exist"):
        validate(c)
    (tmp_path / "config.json").write_text('{"vocab_size": 12,')
    with pytest.raises(ConfigError, match=r"model\.hf_path: .*config\.json is not valid JSON"):
        validate(c)


def test_organism_config_covers_its_chains_and_splits_them_into_64_token_segments(tmp_path):
    """The response length holds every reference chain (with its stop token), the prompt length every prompt,
    and TRIAGE's segments are the paper's 64 tokens (1-3 segments per chain)."""

    c = load("organism")
    c.run_dir = str(tmp_path)
    validate(c)
    tok, src = build.tokenizer(c), build.source(c)
    # the count-up corpus runs out of merges well below bpe.vocab_size (290 ids): the preset's 1024 holds it
    assert 256 < tok.vocab_size <= build.model_config(c, tok.vocab_size).vocab_size
    pairs = [src.sft_pair(i) for i in range(1000)]
    resp = [len(tok.encode(s)) + 1 for _, s in pairs]
    assert 60 <= min(resp) and max(resp) <= c.sampler.max_new_tokens <= 256
    assert max(len(tok.encode_prompt(p)) for p, _ in pairs) <= c.sampler.max_prompt_len
    assert c.rl.triage.segment_len == 64 and 5e6 <= build.model_config(c, tok.vocab_size).num_params() <= 30e6


@pytest.mark.parametrize("over,match", [
    ({"data.source": "dapo", "data.path": "x.parquet"}, "config.tokenizer: 'bpe' is trained on the synthetic"),
    ({"bpe.vocab_size": 200}, "config.bpe.vocab_size: must be >= 258"),
    ({"bpe.corpus_size": 0}, "config.bpe.corpus_size"),
    ({"model.preset": "tiny"}, r"config.model.vocab_size: the model's vocabulary \(128\) is smaller"),
    ({"monitor.action": "enable_correction"}, "rl.correction='triage' is already on"),
    ({"monitor.action": "enable_correction", "rl.correction": "none", "monitor.correction": "none"},
     "monitor.correction"),
])
def test_organism_bad_values_name_the_key(over, match):
    c = load("organism")
    for key, value in over.items():
        sect, name = key.split(".")
        c[sect][name] = value
    with pytest.raises(ConfigError, match=match):
        validate(c, check_paths=False)


def test_precision_rules_reach_both_policies():
    """sampler.rules / learner.rules go ahead of each side's preset (the sampler's with token-wise activation
    scales); exact mode needs them equal."""

    c = base_config()
    c.sampler.rules = ("lm_head$=w4a4",)
    c.learner.rules = ("last:1=w4a4", r"mlp\.down_proj=w4a16")
    validate(c)
    sp, lp = build.sampler_policy(c), build.learner_policy(c)
    head = sp.for_layer("lm_head")
    assert head.weight == "nvfp4" and head.act == "nvfp4" and head.act_scaling == "row"
    assert lp.for_layer("lm_head").weight == "none"  # the learner's keeps its default high-precision head
    assert lp.for_layer("layers.3.self_attn.q_proj").act == "nvfp4"  # the last of the preset's 4 layers
    assert lp.for_layer("layers.2.self_attn.q_proj").weight == "none"
    down = lp.for_layer("layers.0.mlp.down_proj")
    assert down.weight == "nvfp4" and down.act == "none"
    c.learner.exact, c.learner.precision = True, c.sampler.precision
    with pytest.raises(ConfigError, match="learner.exact.*same per-layer rules"):
        validate(c)
    c.learner.rules = c.sampler.rules
    validate(c)
    assert build.learner_policy(c).for_layer("lm_head") == build.sampler_policy(c).for_layer("lm_head")


def test_sampler_act_scaling_reaches_every_quantized_layer_of_the_sampler():
    """config.sampler.act_scaling="tensor" (the granularity dial) applies to the preset and to the rules' layers."""

    c = base_config()
    c.sampler.rules = ("lm_head$=w4a4",)
    assert build.sampler_policy(c).for_layer("layers.0.mlp.up_proj").act_scaling == "row"
    c.sampler.act_scaling = "tensor"
    validate(c)
    sp = build.sampler_policy(c)
    for layer in ("layers.0.mlp.up_proj", "layers.3.self_attn.o_proj", "lm_head"):
        assert sp.for_layer(layer).act == "nvfp4" and sp.for_layer(layer).act_scaling == "tensor", layer


def test_sampler_xla_options_reach_the_engine_typed():
    """"NAME=VALUE" strings become the engine's (name, value) pairs, booleans and numbers typed, lists kept."""
    from triage_jax import build
    from triage_jax.config import load_config

    c = load_config("configs/tiny.py")
    c.sampler.xla_options = ("xla_gpu_enable_command_buffer=FUSION,WHILE", "xla_cpu_enable_fast_math=false",
                             "xla_gpu_graph_min_graph_size=2")
    validate(c)
    assert build.engine_config(c).xla_options == (("xla_gpu_enable_command_buffer", "FUSION,WHILE"),
                                                  ("xla_cpu_enable_fast_math", False),
                                                  ("xla_gpu_graph_min_graph_size", 2))
    assert build.engine_config(c).compile_ahead  # the trainer compiles larger KV buckets ahead by default
    c.sampler.compile_ahead = False
    assert not build.engine_config(c).compile_ahead


def test_sampler_round_loop_reaches_the_engine_and_is_checked():
    """sampler.round_loop: "auto" by default (the engine resolves it by platform), any of ROUND_LOOPS reaches
    EngineConfig, a misspelt one fails naming the key and the choices before anything is built."""
    from triage_jax import build
    from triage_jax.config import load_config

    c = load_config("configs/tiny.py")
    assert build.engine_config(c).round_loop == "auto"
    c.sampler.round_loop = "early_exit"
    validate(c)
    assert build.engine_config(c).round_loop == "early_exit"
    c.sampler.round_loop = "fixd"
    with pytest.raises(ValueError, match=r"sampler.round_loop.*'fixd' is not one of \['auto', 'fixed', 'early_exit'\]"):
        validate(c)


def test_sampler_backend_reaches_the_samplers_copy():
    """sampler.backend="fp4_gemm" (the Hopper 4-bit weight GEMM) is what the trainer's sampler copy is prepared
    for (its q / k / v become one kernel weight at the sync); the default is the learner's xla; exact mode refuses
    any other backend on either side."""
    from flax import nnx

    from triage_jax import models, sampler
    from triage_jax.config import load_config
    from triage_jax.models.layers import MergedLinear

    c = load_config("configs/tiny.py")
    assert build.sampler_policy(c).backend == "xla"
    c.sampler.backend = "fp4_gemm"
    validate(c)
    policy = build.sampler_policy(c)
    assert policy.backend == "fp4_gemm" and policy.for_layer("layers.0.mlp.down_proj").act == "nvfp4"
    model = models.Qwen3(models.get_model_config("tiny", num_hidden_layers=1), rngs=nnx.Rngs(0))
    copy = sampler.prepare_model(model, policy)
    assert isinstance(copy.layers[0].attn.qkv_proj, MergedLinear)
    c.learner.exact, c.learner.precision = True, c.sampler.precision
    with pytest.raises(ConfigError, match="learner.exact.*sampler.backend='fp4_gemm'"):
        validate(c)
    c.sampler.backend = "xla"
    validate(c)


def test_scan_layers_reaches_the_learners_model_and_the_hf_checkpoints(tmp_path):
    """model.scan_layers (on in the paper configs) stacks the learner's layers, from a preset and from an HF
    checkpoint alike; an HF checkpoint gets the run's execution settings too (the paper configs' remat and chunked
    attention: without them a 20k-token learner step runs out of memory), not the checkpoint's defaults."""
    from flax import nnx

    from triage_jax import models

    assert load("qwen3_4b").model.scan_layers and not base_config().model.scan_layers
    c = base_config()
    c.model.scan_layers, c.model.remat, c.model.attn_chunk = True, "full", 32
    mc = build.model_config(c, 64)
    assert mc.scan_layers
    models.save_pretrained(models.Qwen3(mc.replace(scan_layers=False), rngs=nnx.Rngs(0)), tmp_path)
    c.model.hf_path, c.model.dtype, c.model.param_dtype = str(tmp_path), "bfloat16", "float32"
    model = build.initial_model(c, build.model_config(c, 64), tok=None, src=None)
    got = model.cfg
    assert (got.scan_layers, got.remat, got.attn_chunk, got.dtype, got.param_dtype) == (
        True, "full", 32, "bfloat16", "float32")
    assert model.layers.attn.q_proj.kernel[...].shape[0] == got.num_hidden_layers  # stacked
    assert model.layers.attn.q_proj.kernel[...].dtype == "float32"


@pytest.mark.parametrize("over,match", [
    ({"learner.rules": ("last:1=bf16",)}, r"model\.scan_layers: scanned layers share one precision"),
    ({"learner.exact": True, "sampler.precision": "bf16", "learner.precision": "bf16",
      "sampler.act_scaling": "row"}, r"learner\.exact: exact mode needs the learner's layers unrolled"),
    ({"sampler.scan_layers": True, "sampler.rules": ("last:1=bf16",)},
     r"sampler\.scan_layers: scanned layers share one precision"),
    ({"sampler.scan_layers": True, "model.scan_layers": False},
     r"sampler\.scan_layers: keeps the learner's stacked layers, and model\.scan_layers=False stacks none"),
])
def test_scan_layers_refuses_what_a_scanned_learner_cannot_do(over, match):
    c = base_config()
    c.model.scan_layers = True
    validate(c)
    for key, value in over.items():
        sect, name = key.split(".")
        c[sect][name] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)
