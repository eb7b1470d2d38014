"""Teacher-forced, vocabulary-chunked log-probs: exact against the unchunked computation, and differentiable."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax.logprobs import chunked_logprobs, default_positions, response_logprobs, token_logprobs
from triage_jax.models import Qwen3, get_model_config
from triage_jax.quant import PrecisionPolicy



# Model calls are jitted: eager, a forward compiles each of its ~100 ops as a program of its own.
_forward = nnx.jit(lambda m, *a: m(*a))


@pytest.fixture(scope="module")
def model():
    return Qwen3(get_model_config("tiny", num_hidden_layers=2), rngs=nnx.Rngs(0))


def _reference(h_btd, w_dv, targets_bt, temperature):
    z = jnp.einsum("btd,dv->btv", h_btd, w_dv, precision="highest") / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0], ent


@pytest.mark.parametrize("vocab_chunk", [7, 48, 128, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_matches_unchunked(vocab_chunk, temperature):
    kh, kw, kt = jax.random.split(jax.random.key(1), 3)
    h = 3.0 * jax.random.normal(kh, (2, 5, 32))
    w = jax.random.normal(kw, (32, 128))
    targets = jax.random.randint(kt, (2, 5), 0, 128)
    logp, ent = chunked_logprobs(h, w, targets, temperature=temperature, vocab_chunk=vocab_chunk,
                                 return_entropy=True)
    ref_logp, ref_ent = _reference(h, w, targets, temperature)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-6)


def test_chunked_gradient_matches_unchunked():
    kh, kw, kt = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(kh, (2, 4, 16))
    w = jax.random.normal(kw, (16, 100))
    targets = jax.random.randint(kt, (2, 4), 0, 100)
    wt = jax.random.normal(kt, (2, 4))

    def chunked(h, w):
        return jnp.sum(wt * chunked_logprobs(h, w, targets, temperature=0.8, vocab_chunk=32))

    def ref(h, w):
        return jnp.sum(wt * _reference(h, w, targets, 0.8)[0])

    g = jax.jit(jax.grad(chunked, argnums=(0, 1)))(h, w)
    g_ref = jax.jit(jax.grad(ref, argnums=(0, 1)))(h, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tied", [("float32", True), ("bfloat16", False)])
def test_token_logprobs_equals_model_logits(dtype, tied):
    cfg = get_model_config("tiny", num_hidden_layers=1, dtype=dtype, tie_word_embeddings=tied)
    model = Qwen3(cfg, rngs=nnx.Rngs(1))
    ids = jax.random.randint(jax.random.key(3), (2, 9), 2, 128)
    targets = jnp.roll(ids, -1, axis=1)
    mask = jnp.array([[1] * 8 + [0], [0, 0, 1, 1, 1, 1, 1, 1, 0]], bool)
    attn = jnp.array([[1] * 9, [0, 0] + [1] * 7], bool)  # the second row is left-padded
    pos = default_positions(attn)
    logp, ent = nnx.jit(lambda m: token_logprobs(m, ids, targets, mask, temperature=0.7, vocab_chunk=48,
                                                 attention_mask_bt=attn, return_entropy=True))(model)
    logits = _forward(model, ids, pos, attn) / 0.7
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
    ref_ent = -jnp.sum(jax.nn.softmax(logits, -1) * jax.nn.log_softmax(logits, -1), -1)
    np.testing.assert_allclose(logp, jnp.where(mask, ref, 0.0), atol=1e-5)
    np.testing.assert_allclose(ent, jnp.where(mask, ref_ent, 0.0), atol=1e-5)
    assert np.all(np.asarray(logp)[~np.asarray(mask)] == 0.0)


def test_token_logprobs_is_differentiable_in_the_parameters(model):
    ids = jax.random.randint(jax.random.key(4), (2, 6), 2, 128)
    targets = jnp.roll(ids, -1, axis=1)
    mask = jnp.ones((2, 6), bool).at[:, -1].set(False)

    def loss_chunked(m):
        return jnp.sum(token_logprobs(m, ids, targets, mask, vocab_chunk=40))

    def loss_ref(m):
        lp = jax.nn.log_softmax(m(ids), -1)
        return jnp.sum(jnp.where(mask, jnp.take_along_axis(lp, targets[..., None], -1)[..., 0], 0.0))

    g = jax.tree.leaves(nnx.jit(nnx.grad(loss_chunked))(model))
    g_ref = jax.tree.leaves(nnx.jit(nnx.grad(loss_ref))(model))
    assert len(g) == len(g_ref) > 0
    for a, b in zip(g, g_ref):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    assert max(float(jnp.abs(a).max()) for a in g) > 0


def test_response_logprobs_aligns_responses_after_left_padded_prompts(model):
    prompt = jnp.array([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = prompt > 0
    resp = jnp.array([[11, 12, 13], [14, 15, 0]])
    resp_mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
    lp = nnx.jit(lambda m: response_logprobs(m, prompt, prompt_mask, resp, resp_mask, vocab_chunk=64))(model)
    # Row 0 alone without its padding: the same log-probs.
    seq = jnp.array([[5, 6, 11, 12, 13]])
    full = jax.nn.log_softmax(_forward(model, seq[:, :-1]), -1)
    ref = jnp.take_along_axis(full, seq[:, 1:, None], -1)[0, 1:, 0]
    np.testing.assert_allclose(lp[0], ref, atol=1e-5)
    assert lp.shape == (2, 3) and float(lp[1, 2]) == 0.0


def test_quantized_lm_head_uses_the_whole_vocabulary():
    policy = PrecisionPolicy.from_spec("bf16", rules=[("lm_head", "w4a16")])
    kh, kw, kt = jax.random.split(jax.random.key(5), 3)
    h = jax.random.normal(kh, (1, 3, 32))
    w = jax.random.normal(kw, (32, 128))
    targets = jax.random.randint(kt, (1, 3), 0, 128)
    from triage_jax.quant import qdot

    z = qdot(h, w, policy.for_layer("lm_head"))
    ref = jnp.take_along_axis(jax.nn.log_softmax(z, -1), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(chunked_logprobs(h, w, targets, policy=policy, vocab_chunk=16), ref, atol=1e-6)
    # and differs from high precision (the rule is honoured)
    assert float(jnp.abs(chunked_logprobs(h, w, targets, vocab_chunk=16) - ref).max()) > 1e-4


def test_bad_inputs_are_named(model):
    ids = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        token_logprobs(model, ids, ids[:, :3], jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, ids, jnp.ones((2, 4), bool), temperature=0.0)
    with pytest.raises(ValueError, match="vocab_chunk"):
        chunked_logprobs(jnp.zeros((1, 2, 8)), jnp.zeros((8, 16)), jnp.zeros((1, 2), int), vocab_chunk=0)
