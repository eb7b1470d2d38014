"""Model config presets, validation and HF config.json conversion."""

import json

import pytest

from triage_jax.models import ModelConfig, get_model_config
from triage_jax.models.config import PRESETS


def test_presets_have_the_real_hf_values():
    c = get_model_config("qwen3_4b")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (151936, 2560, 9728, 36)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings, c.tie_word_embeddings) == (1e6, 1e-6, 40960,
                                                                                                 True)
    assert get_model_config("qwen3_4b_base").max_position_embeddings == 32768
    c = get_model_config("qwen3_0_6b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads) == (1024, 3072, 28, 16)
    c = get_model_config("qwen3_1_7b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_key_value_heads) == (2048, 6144, 28, 8)
    m = get_model_config("qwen3_30b_a3b")
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == (2048, 48, 32, 4)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == (128, 8, 768, True)
    assert not m.tie_word_embeddings and m.router_aux_loss_coef == 0.001
    # Published totals: Qwen3-4B 4.0B, Qwen3-30B-A3B 30.5B (3.3B active), Qwen3-0.6B 0.6B.
    assert abs(get_model_config("qwen3_4b").num_params() / 1e9 - 4.02) < 0.05
    assert abs(m.num_params() / 1e9 - 30.5) < 0.1
    assert abs(get_model_config("qwen3_0_6b").num_params() / 1e9 - 0.596) < 0.01
    from triage_jax.models.moe import num_active_params
    assert abs(num_active_params(m) / 1e9 - 3.3) < 0.1


def test_tiny_presets_are_small_and_cpu_friendly():
    tiny, moe = get_model_config("tiny"), get_model_config("tiny_moe")
    assert tiny.vocab_size == 128 and not tiny.is_moe and 1e6 < tiny.num_params() < 1e7
    assert moe.num_experts == 8 and moe.num_experts_per_tok == 2 and moe.moe_intermediate_size == 256
    assert 1e6 < moe.num_params() < 2e7
    assert get_model_config("tiny", vocab_size=131).vocab_size == 131
    import jax.numpy as jnp
    assert get_model_config("tiny", dtype=jnp.bfloat16).dtype == "bfloat16"


def test_unknown_preset_and_invalid_values_name_the_key():
    with pytest.raises(ValueError, match="unknown model config 'nope'"):
        get_model_config("nope")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="remat"):
        ModelConfig(remat="sometimes")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(hidden_size=0)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float8")


def test_hf_config_round_trip_for_every_preset():
    for name, cfg in PRESETS.items():
        back = ModelConfig.from_hf_config(cfg.to_hf_config(), dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        assert back == cfg, name


def test_from_hf_config_reads_real_style_files(tmp_path):
    moe = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": False, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(moe))
    assert ModelConfig.from_hf_config(tmp_path, dtype="bfloat16", param_dtype="bfloat16") == get_model_config(
        "qwen3_30b_a3b")
    # transformers 5 spellings: rope_parameters and num_local_experts.
    moe5 = {k: v for k, v in moe.items() if k not in ("rope_theta", "num_experts")}
    moe5.update(rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, num_local_experts=128)
    assert ModelConfig.from_hf_config(moe5).num_experts == 128
    assert ModelConfig.from_hf_config(moe5).rope_theta == 1e6


@pytest.mark.parametrize("change, key", [
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_from_hf_config_rejects_unsupported_with_the_key(change, key):
    base = get_model_config("qwen3_0_6b").to_hf_config()
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_config({**base, **change})


def test_from_hf_config_missing_key_is_named():
    base = get_model_config("qwen3_0_6b").to_hf_config()
    del base["hidden_size"]
    with pytest.raises(ValueError, match="'hidden_size'"):
        ModelConfig.from_hf_config(base)
    moe = get_model_config("tiny_moe").to_hf_config()
    del moe["moe_intermediate_size"]
    with pytest.raises(ValueError, match="'moe_intermediate_size'"):
        ModelConfig.from_hf_config(moe)


def test_moe_layer_rule_follows_hf():
    cfg = ModelConfig(num_hidden_layers=4, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8,
                      decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
