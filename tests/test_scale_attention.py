"""Chunked (flash-style) attention equals jax.nn.dot_product_attention: values and gradients, GQA, padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax.models.attention import causal_padding_mask
from triage_jax.models.chunked_attention import chunked_attention


def _inputs(b=2, t=37, n=4, kh=2, h=8, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, n, h), dtype)
    k = jax.random.normal(kk, (b, t, kh, h), dtype)
    v = jax.random.normal(kv, (b, t, kh, h), dtype)
    real = np.ones((b, t), bool)
    real[0, :5] = False  # left padding: rows 0..4 of sequence 0 see no key
    slot = jnp.broadcast_to(jnp.arange(t), (b, t))
    return q, k, v, causal_padding_mask(slot, slot, jnp.asarray(real)), real


@jax.jit
def _dot_product_attention(q, k, v, mask, scale):
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale)


@pytest.mark.parametrize("q_chunk,k_chunk", [(8, 16), (37, 37), (5, 64), (64, 3)])
def test_values_equal_dot_product_attention(q_chunk, k_chunk):
    q, k, v, mask, real = _inputs()
    want = _dot_product_attention(q, k, v, mask, 8 ** -0.5)
    got = jax.jit(lambda *a: chunked_attention(*a, scale=8 ** -0.5, q_chunk=q_chunk, k_chunk=k_chunk))(q, k, v,
                                                                                                       mask)
    assert got.shape == want.shape
    # Rows with a visible key match everywhere; with no padded keys (k_chunk | T) the empty rows match too.
    sel = real if 37 % k_chunk else np.ones_like(real)
    np.testing.assert_allclose(np.asarray(got)[sel], np.asarray(want)[sel], rtol=2e-5, atol=2e-6)


def test_gradients_equal_dot_product_attention():
    q, k, v, mask, real = _inputs(seed=1)
    w = jnp.asarray(real, jnp.float32)[:, :, None, None]

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)

    ref = jax.jit(jax.grad(loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                                                             scale=0.3)), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.grad(loss(lambda q, k, v: chunked_attention(q, k, v, mask, scale=0.3, q_chunk=8,
                                                                  k_chunk=16)), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_bfloat16_close_to_dot_product_attention():
    q, k, v, mask, real = _inputs(dtype=jnp.bfloat16, seed=2)
    want = _dot_product_attention(q, k, v, mask, 8 ** -0.5)
    got = jax.jit(lambda *a: chunked_attention(*a, scale=8 ** -0.5, q_chunk=16, k_chunk=8))(q, k, v, mask)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], atol=2e-2)


def test_bad_shapes_are_named():
    q, k, v, mask, _ = _inputs()
    with pytest.raises(ValueError, match="chunked_attention"):
        chunked_attention(q, k, v, mask[:, :, :5], scale=1.0)


def test_long_sequence_attention_swaps_in_for_long_calls_only():
    from flax import nnx

    from triage_jax import models
    from triage_jax.models.chunked_attention import long_sequence_attention

    model = models.Qwen3(models.get_model_config("tiny", num_hidden_layers=2), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(0), (2, 24), 0, 128)
    mask = jnp.asarray(np.arange(24)[None] >= np.asarray([[0], [5]]))
    want = nnx.jit(lambda m, i, a: m(i, attention_mask_bt=a))(model, ids, mask)
    original = jax.nn.dot_product_attention
    with long_sequence_attention(min_len=16, q_chunk=8, k_chunk=8):
        assert jax.nn.dot_product_attention is not original
        got = jax.jit(lambda i, m: model(i, attention_mask_bt=m))(ids, mask)
        long_jaxpr = str(jax.make_jaxpr(lambda i: model(i))(ids))
        short_jaxpr = str(jax.make_jaxpr(lambda i: model(i))(ids[:, :8]))  # below min_len: the original kernel
    assert jax.nn.dot_product_attention is original
    assert "scan[" in long_jaxpr and "scan[" not in short_jaxpr
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-4, atol=1e-4)


def test_model_with_attn_chunk_equals_dense_attention():
    """ModelConfig.attn_chunk routes long learner sequences through chunked attention: same logits and grads."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from triage_jax import models

    cfg = models.get_model_config("tiny", num_hidden_layers=2)
    dense = models.Qwen3(cfg, rngs=nnx.Rngs(0))
    chunked = nnx.merge(nnx.graphdef(models.Qwen3(cfg.replace(attn_chunk=8), rngs=nnx.Rngs(0))), nnx.state(dense))
    ids = jax.random.randint(jax.random.key(1), (2, 29), 2, 100)
    mask = jnp.ones((2, 29), bool).at[0, :5].set(False)  # left padding
    real = np.asarray(mask)  # pad positions attend to nothing: their outputs are don't-care
    forward = nnx.jit(lambda m, i, a: m(i, attention_mask_bt=a))  # eager, each of ~250 ops compiles alone
    np.testing.assert_allclose(np.asarray(forward(chunked, ids, mask))[real],
                               np.asarray(forward(dense, ids, mask))[real], rtol=2e-5, atol=2e-5)

    def loss(m):
        return jnp.sum(jnp.where(mask[..., None], m(ids, attention_mask_bt=mask), 0.0) ** 2)

    g_dense, g_chunk = nnx.jit(nnx.grad(loss))(dense), nnx.jit(nnx.grad(loss))(chunked)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), nnx.state(g_dense),
                 nnx.state(g_chunk))
