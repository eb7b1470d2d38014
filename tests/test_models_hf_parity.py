"""Parity with the HF transformers reference (CPU torch) on small random Qwen3 / Qwen3-MoE checkpoints."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from triage_jax.models import from_pretrained  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, max_position_embeddings=256, initializer_range=0.08, attn_implementation="eager")


def _randomize_norms(model):
    """HF initializes norm weights to 1; random ones make the test see which norm goes where."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def _dense(tie: bool):
    cfg = transformers.Qwen3Config(intermediate_size=160, num_hidden_layers=2, tie_word_embeddings=tie,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **COMMON)
    return transformers.Qwen3ForCausalLM(cfg)


def _moe(norm_topk_prob: bool, mlp_only_layers=()):
    cfg = transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, num_hidden_layers=3, mlp_only_layers=list(mlp_only_layers),
        tie_word_embeddings=False, router_aux_loss_coef=0.01,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **COMMON)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _batch(seed=0, b=3, t=12, left_pad=(0, 3, 7)):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(b, t))
    mask = np.ones((b, t), np.int64)
    for i, p in enumerate(left_pad):
        mask[i, :p] = 0
        ids[i, :p] = 0
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, pos


def _hf_logits(hf, ids, mask, pos, **kw):
    hf.eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos),
                 **kw)
    return out.logits.float().numpy(), out


def _kl(ref_logits, logits):
    """KL(ref || ours) per token, in float64."""
    lp = ref_logits.astype(np.float64) - _lse(ref_logits.astype(np.float64))
    lq = logits.astype(np.float64) - _lse(logits.astype(np.float64))
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def _lse(x):
    m = x.max(-1, keepdims=True)
    return m + np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def _save(hf, tmp_path, name):
    _randomize_norms(hf)
    path = tmp_path / name
    hf.save_pretrained(path)
    return path


CASES = [
    ("dense_untied", lambda: _dense(False)),
    ("dense_tied", lambda: _dense(True)),
    ("moe_norm_topk", lambda: _moe(True)),
    ("moe_no_norm_mixed_layers", lambda: _moe(False, mlp_only_layers=(1,))),
]


def _checkpoint(index, tmp_path_factory):
    torch.manual_seed(index)
    name, build = CASES[index]
    hf = build()
    return hf, _save(hf, tmp_path_factory.mktemp("hf"), name)


@pytest.fixture(scope="module", params=range(len(CASES)), ids=[c[0] for c in CASES])
def hf_checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory)


MOE_CASES = [i for i, c in enumerate(CASES) if c[0].startswith("moe")]


@pytest.fixture(scope="module", params=MOE_CASES, ids=[CASES[i][0] for i in MOE_CASES])
def moe_checkpoint(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory)


def test_float32_logits_match_hf_with_left_padding(hf_checkpoint):
    hf, path = hf_checkpoint
    ids, mask, pos = _batch()
    ref, _ = _hf_logits(hf, ids, mask, pos)
    model = from_pretrained(path, dtype="float32")
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.max(np.abs(ours[real] - ref[real])) <= 1e-4
    assert np.max(_kl(ref[real], ours[real])) <= 1e-6
    # Default positions (cumsum of the mask) equal the explicit ones.
    ours_default = np.asarray(model(jnp.asarray(ids), attention_mask_bt=jnp.asarray(mask)))
    np.testing.assert_array_equal(ours_default[real], ours[real])


def test_bfloat16_mean_kl_vs_float32_hf(hf_checkpoint):
    hf, path = hf_checkpoint
    ids, mask, pos = _batch(seed=1)
    ref, _ = _hf_logits(hf, ids, mask, pos)
    model = from_pretrained(path, dtype="bfloat16")
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    real = mask.astype(bool)
    kl = _kl(ref[real], ours[real])
    assert np.mean(kl) <= 1e-3
    assert np.max(np.abs(ours[real] - ref[real])) > 0  # really ran in bf16


def test_moe_aux_loss_matches_hf(moe_checkpoint):
    hf, path = moe_checkpoint
    ids, mask, pos = _batch(seed=2)
    _, out = _hf_logits(hf, ids, mask, pos, output_router_logits=True)
    model = from_pretrained(path)
    _, aux = model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask), return_aux=True)
    np.testing.assert_allclose(float(aux["moe_aux_loss"]), float(out.aux_loss), rtol=1e-5)
