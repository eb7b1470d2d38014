"""Exact mode: the learner's recompute equals the sampler's log-probs bit for bit (delta = 0) under one precision.

docs/numerics.md#exact-mode. The sampler side runs the rollout engine (prefill, slot insertion, the decode loop);
the learner side is `response_logprobs` on the left-padded rows the engine returns, as the trainer computes it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax.config import ConfigError, base_config, validate
from triage_jax.logprobs import response_logprobs
from triage_jax.models import Qwen3, invariant
from triage_jax.models.config import PRESETS
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model, sampler_policy


def _model(preset: str, dtype: str, layers: int = 2):
    return Qwen3(dataclasses.replace(PRESETS[preset], dtype=dtype, num_hidden_layers=layers), rngs=nnx.Rngs(0))


def _prompts(vocab: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(2, 20))).tolist() for _ in range(n)]


def _sample(model, policy, prompts, *, slots: int, continuous: bool = True, max_len: int = 64, n: int = 2):
    engine = Engine(SamplingConfig(max_new_tokens=24), EngineConfig(max_slots=slots, max_len=max_len,
                                                                   continuous=continuous),
                    policy=policy, model=prepare_model(model, policy))
    return engine.generate(prompts, jax.random.key(1), n=n)


def _delta(model, policy, out) -> np.ndarray:
    lp = jax.jit(lambda m, *a: response_logprobs(m, *a, policy=policy))(
        model, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    return (np.asarray(lp) - np.asarray(out.logprobs))[np.asarray(out.mask)]


# The default run keeps the two far corners (dense float32, MoE W4A4 bfloat16); the rest run with -m slow.
@pytest.mark.parametrize("preset,precision,dtype", [
    ("tiny", "bf16", "float32"), pytest.param("tiny", "bf16", "bfloat16", marks=pytest.mark.slow),
    pytest.param("tiny", "w4a4", "bfloat16", marks=pytest.mark.slow),
    pytest.param("tiny_moe", "bf16", "float32", marks=pytest.mark.slow), ("tiny_moe", "w4a4", "bfloat16"),
])
def test_exact_mode_learner_recompute_equals_sampler_logprobs(preset, precision, dtype):
    model = _model(preset, dtype)
    policy = sampler_policy(precision, exact=True)
    out = _sample(model, policy, _prompts(model.cfg.vocab_size, 12), slots=10)
    d = _delta(model, policy, out)
    assert d.size > 200 and np.all(d == 0.0), f"{np.count_nonzero(d)} of {d.size} tokens differ, max {abs(d).max()}"


def test_default_mode_is_not_exact_so_the_check_can_fail():
    """The same check without exact mode finds nonzero deltas (float32, same precision): it measures something."""
    model = _model("tiny", "float32")
    policy = sampler_policy("bf16")
    d = _delta(model, policy, _sample(model, policy, _prompts(model.cfg.vocab_size, 12), slots=10))
    assert np.count_nonzero(d) > 0


# ~80 s of compiles (four engine shapes); the default run checks the same for the default mode
# (test_engine.py::test_schedule_never_changes_a_request) and exact mode's sampler == learner bits.
@pytest.mark.slow
def test_exact_tokens_and_logprobs_do_not_depend_on_slots_or_batching():
    """Slot count (1 row vs 64+), continuous vs static waves and the capacity (64 vs 256): identical outputs."""
    model = _model("tiny", "bfloat16")
    policy = sampler_policy("w4a4", exact=True)
    prompts = _prompts(model.cfg.vocab_size, 6, seed=3)
    ref = _sample(model, policy, prompts, slots=12)
    for kw in (dict(slots=1), dict(slots=5, continuous=False), dict(slots=12, max_len=256)):
        out = _sample(model, policy, prompts, **kw)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=str(kw))
        np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(ref.logprobs), err_msg=str(kw))


def test_tree_sum_is_a_fixed_order_unchanged_by_zero_padding():
    x = jax.random.normal(jax.random.key(0), (3, 40)) * 1e3
    s40 = invariant.tree_sum(x)
    # the halving order by hand: pad to 64, then 32, 16, 8, 4, 2, 1
    y = np.pad(np.asarray(x), ((0, 0), (0, 24)))
    while y.shape[1] > 1:
        h = y.shape[1] // 2
        y = (y[:, :h] + y[:, h:]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(s40), y[:, 0])
    padded = jnp.pad(x, ((0, 0), (0, 2048 - 40)))
    np.testing.assert_array_equal(np.asarray(invariant.tree_sum(padded)), np.asarray(s40))
    np.testing.assert_array_equal(np.asarray(invariant.tree_sum(x[:1])), np.asarray(s40[:1]))


def test_products_are_rounded_before_a_tree_sum_adds_them():
    # XLA's CPU backend fuses a * b + c into an FMA where both sit in one fusion: the tree's first add must not.
    a, b = (np.random.default_rng(i).standard_normal((512, 2)).astype(np.float32) for i in (0, 1))
    by_hand = (a[:, 0] * b[:, 0]).astype(np.float32) + (a[:, 1] * b[:, 1]).astype(np.float32)
    fused = jax.jit(lambda a, b: (a * b)[:, 0] + (a * b)[:, 1])(a, b)
    assert not np.array_equal(np.asarray(fused), by_hand)  # the contraction this guards against happens here
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a, b: invariant.tree_sum(a * b))(a, b)), by_hand)


def test_gpu_row_chunks_give_each_row_its_unchunked_bits():
    """The GPU's exact-mode matmuls (invariant._in_row_chunks: chunks of exactly 64 rows, the last zero-padded),
    run here: each row comes back in its place with the bits the dot gives it on all rows at once (CPU dots are
    row-count invariant from 64 rows on), row counts around the chunk size included; a quantized dot too."""
    from triage_jax.quant import qdot
    from triage_jax.sampler import sampler_policy as policy_for

    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((256, 96)), jnp.float32)
    prec = policy_for("w4a4").for_layer("layers.0.mlp.up_proj")
    for fn in (lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32), lambda x: qdot(x, w, prec)):
        for m in (65, 128, 130, 300):
            x = jnp.asarray(rng.standard_normal((m, 256)), jnp.float32)
            got = jax.jit(lambda a: invariant._in_row_chunks(fn, a))(x)
            want = jax.jit(fn)(x)
            assert got.shape == want.shape == (m, 96)
            assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)), m


def test_rope_rounds_both_products_before_adding_them_in_every_program():
    """RoPE gives torch's two-rounding bits whatever program it sits in: alone, after the q norm with the angles
    computed in the same program (the learner's forward), and as the unguarded sum XLA would contract."""
    from triage_jax.models.layers import RMSNorm, apply_rope, rope_cos_sin

    x = jax.random.normal(jax.random.key(0), (2, 300, 4, 64))
    pos = jnp.broadcast_to(jnp.arange(300), (2, 300))
    cos, sin = jax.jit(rope_cos_sin, static_argnums=(1, 2, 3))(pos, 64, 1e6, jnp.float32)

    def by_hand(x, cos, sin):
        xn, c, s = np.asarray(x), np.asarray(cos)[:, :, None], np.asarray(sin)[:, :, None]
        rot = np.concatenate([-xn[..., 32:], xn[..., :32]], axis=-1)
        return (xn * c).astype(np.float32) + (rot * s).astype(np.float32)

    def unguarded(x, cos, sin):
        rot = jnp.concatenate([-x[..., 32:], x[..., :32]], axis=-1)
        return x * cos[:, :, None, :] + rot * sin[:, :, None, :]

    assert not np.array_equal(np.asarray(jax.jit(unguarded)(x, cos, sin)), by_hand(x, cos, sin))  # XLA contracts
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_rope)(x, cos, sin)), by_hand(x, cos, sin))
    norm = RMSNorm(64, 1e-6, (None,), dtype="float32", param_dtype="float32")

    @jax.jit
    def fused(x, pos):
        c, s = rope_cos_sin(pos, 64, 1e6, jnp.float32)
        return norm(x), c, s, apply_rope(norm(x), c, s)

    normed, c, s, got = fused(x, pos)
    np.testing.assert_array_equal(np.asarray(got), by_hand(normed, c, s))


def test_exact_attention_gradient_matches_default_attention():
    q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))
    k, v = (jax.random.normal(jax.random.key(i), (2, 2, 5, 8)) for i in (1, 2))
    vis = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (2, 5, 5))

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, vis, 0.3)))

    g_exact = jax.jit(jax.grad(loss(invariant.attention), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(invariant._reference_attention), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_exact, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key,value,needle", [
    ("sampler.precision", "bf16", "one precision"),
    ("sampler.kv_cache", "fp8", "kv_cache"),
    ("sampler.act_scaling", "tensor", "act_scaling='row'"),
    ("learner.backend", "pallas", "xla backend"),
])
def test_exact_config_needs_matching_sides(key, value, needle):
    c = base_config()
    c.learner.exact, c.learner.precision = True, c.sampler.precision
    validate(c, check_paths=False)  # matching sides are fine
    sect, name = key.split(".")
    c[sect][name] = value
    with pytest.raises(ConfigError, match=needle) as e:
        validate(c, check_paths=False)
    assert "learner.exact" in str(e.value)
