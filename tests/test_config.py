"""Config schema: every shipped config validates; bad values fail naming the key, before any compilation."""

import importlib.util
import pathlib

import pytest

from triage_jax.config import ConfigError, base_config, validate

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def load(name):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_cpu_configs_validate(name):
    validate(load(name))


@pytest.mark.parametrize("name", ["qwen3_0_6b", "qwen3_4b", "qwen3_30b_a3b"])
def test_paper_configs_need_paths(name, tmp_path):
    c = load(name)
    validate(c, check_paths=False)
    assert c.rl.num_prompts == 512 and c.rl.group_size == 16 and c.rl.mini_batch == 512
    assert c.optim.lr == 1e-6 and c.rl.max_response_len == 20480 and c.rl.overlong_buffer == 4096
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
        ("sampler.max_new_tokens", 1000, "sampler.max_new_tokens"),
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
