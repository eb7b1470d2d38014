"""HF safetensors import/export: exact round trips, sharded checkpoints, errors that name the key."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from triage_jax.models import Qwen3, from_pretrained, get_model_config, prequantize_model, save_pretrained
from triage_jax.quant import PrecisionPolicy, QuantizedWeight

SMALL = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, initializer_range=0.1)
MOE = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,))


def _params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    jax.tree.map(lambda x, y: (np.testing.assert_array_equal(x, y), x.dtype == y.dtype or pytest.fail("dtype")),
                 pa, pb)


@pytest.mark.parametrize("kind", ["dense_tied", "dense_untied", "moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_exact(tmp_path, kind, dtype):
    extra = {"dense_tied": dict(SMALL, tie_word_embeddings=True),
             "dense_untied": dict(SMALL, tie_word_embeddings=False),
             "moe": dict(MOE, tie_word_embeddings=False)}[kind]
    cfg = get_model_config("tiny", **extra, dtype=dtype, param_dtype=dtype)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    save_pretrained(model, tmp_path)
    back = from_pretrained(tmp_path, dtype=dtype)
    assert back.cfg == cfg
    _assert_same_params(model, back)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in keys) == (kind != "dense_tied")
    if kind == "moe":
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys and "model.layers.0.mlp.gate.weight" in keys
        assert "model.layers.1.mlp.gate_proj.weight" in keys  # mlp_only_layers keep a dense MLP


def test_sharded_checkpoint_with_index(tmp_path):
    model = Qwen3(get_model_config("tiny", **MOE, tie_word_embeddings=False), rngs=nnx.Rngs(1))
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert all((tmp_path / f).exists() for f in files)
    _assert_same_params(model, from_pretrained(tmp_path))


def test_transformers_loads_what_we_save(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = Qwen3(get_model_config("tiny", **MOE, tie_word_embeddings=False), rngs=nnx.Rngs(2))
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = np.arange(10)[None] * 7 % 48
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), ref, atol=1e-4)


def test_from_pretrained_with_policy_prequantizes(tmp_path):
    model = Qwen3(get_model_config("tiny", **SMALL), rngs=nnx.Rngs(3))
    save_pretrained(model, tmp_path)
    q = from_pretrained(tmp_path, policy=PrecisionPolicy.from_spec("w4a16"))
    assert isinstance(q.layers[1].mlp.down_proj.kernel.get_value(), QuantizedWeight)
    with pytest.raises(ValueError, match="pre-quantized"):
        save_pretrained(prequantize_model(model, PrecisionPolicy.from_spec("w4a16")), tmp_path / "q")


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_key_wrong_shape_unexpected_key_and_architecture_are_named(tmp_path):
    model = Qwen3(get_model_config("tiny", **MOE, tie_word_embeddings=False), rngs=nnx.Rngs(4))
    save_pretrained(model, tmp_path)
    key = "model.layers.0.mlp.experts.2.up_proj.weight"

    _rewrite(tmp_path, lambda t: t.pop(key))
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        from_pretrained(tmp_path)

    _rewrite(tmp_path, lambda t: t.__setitem__(key, np.zeros((16, 31), np.float32)))
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj\.weight.*\(16, 31\).*\(16, 32\)"):
        from_pretrained(tmp_path)

    _rewrite(tmp_path, lambda t: (t.__setitem__(key, np.zeros((16, 32), np.float32)),
                                  t.__setitem__("model.layers.5.mlp.up_proj.weight", np.zeros(3, np.float32))))
    with pytest.raises(ValueError, match=r"unexpected key.*layers\.5\.mlp\.up_proj"):
        from_pretrained(tmp_path)

    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        from_pretrained(tmp_path)


def test_loading_never_materializes_a_random_init(tmp_path, monkeypatch):
    """The model is built abstractly (nnx.eval_shape: no concrete random init) and every variable is filled."""
    model = Qwen3(get_model_config("tiny", **SMALL), rngs=nnx.Rngs(5))
    save_pretrained(model, tmp_path)
    concrete = []
    real_normal = jax.random.normal

    def spy(*a, **k):
        out = real_normal(*a, **k)
        concrete.append(not isinstance(out, jax.core.Tracer))
        return out

    monkeypatch.setattr(jax.random, "normal", spy)
    back = from_pretrained(tmp_path)
    assert concrete and not any(concrete)
    assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(nnx.state(back)))
    _assert_same_params(model, back)


def test_truncated_safetensors_and_broken_config_json_name_the_file(tmp_path):
    """Before: a bare SafetensorError / JSONDecodeError that names no file."""
    from triage_jax.models.hf_io import HFCheckpointError

    model = Qwen3(get_model_config("tiny", **SMALL), rngs=nnx.Rngs(0))
    save_pretrained(model, tmp_path)
    st = tmp_path / "model.safetensors"
    good = st.read_bytes()
    st.write_bytes(good[: len(good) // 2])
    with pytest.raises(HFCheckpointError, match=r"model\.safetensors.*(truncated|re-download)"):
        from_pretrained(tmp_path)
    st.write_bytes(good)
    cfg = tmp_path / "config.json"
    cfg.write_text(cfg.read_text()[:-20])
    with pytest.raises(HFCheckpointError, match=r"config\.json is not valid JSON"):
        from_pretrained(tmp_path)
