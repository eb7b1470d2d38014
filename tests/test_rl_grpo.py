"""GRPO / DAPO math (docs/rl_math.md): advantages, clipped surrogate, aggregation modes and their exact
micro-batch accumulation, dynamic sampling, overlong shaping, k3 KL, entropy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triage_jax.rl.grpo import (AGGREGATIONS, aggregate, dynamic_sampling_keep, entropy_from_logits, metric_means,
                                group_advantages, k3_kl, masked_entropy, overlong_penalty, policy_loss)

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def test_group_advantages_hand_case():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    # Group 1: mean 0.5, Bessel std sqrt(4 * 0.25 / 3) = sqrt(1/3); group 2 is flat -> 0.
    std = math.sqrt(1 / 3)
    want = np.array([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / np.array([std + 1e-6] * 4 + [1e-6] * 4)
    np.testing.assert_allclose(group_advantages(rewards, 4), want, rtol=1e-6)
    np.testing.assert_allclose(group_advantages(rewards, 4, std_normalize=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    np.testing.assert_allclose(group_advantages(rewards.astype(np.int32), 2, std_normalize=False),
                               [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


@pytest.mark.parametrize("rewards, g, kwargs, msg", [
    (np.zeros(6), 4, {}, "not a multiple of group_size=4"),
    (np.zeros((2, 4)), 4, {}, r"rewards: expected shape \[N\]"),
    (np.zeros(4), 1, {}, "group_size >= 2"),
    (np.zeros(4), 0, {"std_normalize": False}, "positive int"),
])
def test_group_advantages_errors(rewards, g, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        group_advantages(rewards.astype(np.float32), g, **kwargs)


def test_dynamic_sampling_and_overlong():
    # Correctness 0/1: keep a group when 0 < (number correct) < G.
    correct = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0], np.float32)
    np.testing.assert_array_equal(dynamic_sampling_keep(correct, 4), [True, True, False])
    np.testing.assert_array_equal(dynamic_sampling_keep(correct, 2), [False, True, True, False, False, False])
    np.testing.assert_array_equal(dynamic_sampling_keep(correct.astype(bool), 4), [True, True, False])
    # L = 20, B = 4: no penalty up to 16 tokens, linear to -1 at 20, floored at -1 beyond.
    lens = np.array([10, 16, 17, 18, 20, 25])
    np.testing.assert_allclose(overlong_penalty(lens, 20, 4), [0, 0, -0.25, -0.5, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty(lens, 20, 4, 2.0), [0, 0, -0.5, -1.0, -2.0, -2.0])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lens, 20, 0)


def test_policy_loss_hand_cases():
    # ratio 1.5 or 0.5, A = +-1, eps (0.2, 0.28):
    #  A=+1, r=1.5: -min(1.5, 1.28) = -1.28 (clipped)   A=-1, r=1.5: -min(-1.5, -1.28) = 1.5
    #  A=+1, r=0.5: -min(0.5, 0.8)  = -0.5              A=-1, r=0.5: -min(-0.5, -0.8) = 0.8 (clipped)
    lr = np.log(np.array([[1.5, 1.5, 0.5, 0.5, 1.0]], np.float32))
    logp, old = lr, np.zeros_like(lr)
    adv = np.array([[1.0, -1.0, 1.0, -1.0, 1.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]], bool)
    old_pad = old.copy()
    old_pad[0, 4] = np.inf  # padding holds garbage
    s, d, sums = policy_loss(logp, old_pad, adv, mask)
    assert float(d) == 4 and float(sums["tokens"]) == 4 and float(sums["clipfrac"]) == 2  # sums, then means
    m = metric_means(sums)
    np.testing.assert_allclose(s, -1.28 + 1.5 - 0.5 + 0.8, rtol=1e-5)
    assert float(m["clipfrac"]) == 0.5 and float(m["clipfrac_high"]) == 0.25 and float(m["clipfrac_low"]) == 0.25
    np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-6)
    # Dual clip c = 3: A = -1, r = 5 -> 5 capped at 3.
    s, _, m = policy_loss(np.log(np.array([[5.0]], np.float32)), np.zeros((1, 1), np.float32),
                          np.array([-1.0], np.float32), np.ones((1, 1)), dual_clip=3.0)
    assert float(s) == pytest.approx(3.0) and float(metric_means(m)["dual_clipfrac"]) == 1.0
    # No real token: the sums are 0 and the means NaN (an empty denominator, reported).
    _, _, m = policy_loss(logp, old, adv, np.zeros_like(mask))
    assert float(m["clipfrac"]) == 0 and np.isnan(float(metric_means(m)["clipfrac"]))
    # Weights scale the per-token loss.
    s, _, _ = policy_loss(logp, old, adv, mask, weights=np.array([[2, 0, 1, 1, 9]], np.float32))
    np.testing.assert_allclose(s, -2.56 - 0.5 + 0.8, rtol=1e-5)


def test_policy_loss_gradient_and_log_ratio_clip():
    # At ratio 1 (unclipped) d loss_sum / d logp = -A on real tokens; weights get no gradient.
    logp = jnp.zeros((2, 3))
    adv = jnp.array([1.0, -2.0])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    g = jax.grad(lambda lp: policy_loss(lp, jnp.zeros((2, 3)), adv, mask)[0])(logp)
    np.testing.assert_allclose(g, [[-1, -1, 0], [2, 0, 0]])
    gw = jax.grad(lambda w: policy_loss(logp, jnp.zeros((2, 3)), adv, mask, weights=w)[0])(jnp.ones((2, 3)))
    assert np.all(np.asarray(gw) == 0)
    # vmap over stacked micro-batches equals one call per micro-batch.
    lp = jnp.asarray(np.random.default_rng(0).normal(0, 0.3, (3, 2, 3)), jnp.float32)
    s_v, d_v, _ = jax.vmap(lambda x: policy_loss(x, jnp.zeros((2, 3)), adv, mask, agg="seq-mean-token-mean"))(lp)
    for b in range(3):
        s_b, d_b, _ = policy_loss(lp[b], jnp.zeros((2, 3)), adv, mask, agg="seq-mean-token-mean")
        assert float(s_v[b]) == pytest.approx(float(s_b), rel=1e-6) and float(d_v[b]) == float(d_b)
    # log-ratio clipped at +-20: a huge gap stays finite.
    s, _, _ = policy_loss(jnp.full((1, 1), 100.0), jnp.zeros((1, 1)), jnp.array([-1.0]), jnp.ones((1, 1)))
    assert float(s) == pytest.approx(math.exp(20.0), rel=1e-5)


def test_aggregation_modes_hand_case():
    loss = np.array([[1.0, 2.0, 7.0, 7.0], [3.0, 4.0, 5.0, 6.0], [9.0, 9.0, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)  # the third row is a padding row
    want = {"token-mean": (21.0, 6.0), "seq-mean-token-mean": (1.5 + 4.5, 2.0), "seq-mean-token-sum": (21.0, 2.0),
            "seq-mean-token-sum-norm": (21.0 / 8, 2.0)}
    assert set(AGGREGATIONS) == set(MODES)
    for mode, (s, d) in want.items():
        got_s, got_d = aggregate(loss, mask, mode, max_len=8)
        assert (float(got_s), float(got_d)) == pytest.approx((s, d)), mode
    with pytest.raises(ValueError, match="max_len"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        aggregate(loss, mask, "mean")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=8, max_size=8), st.sampled_from([2, 4, 8]), st.integers(0, 2**31 - 1))
def test_micro_batch_accumulation_is_exact(lens, n_micro, seed):
    rng = np.random.default_rng(seed)
    n, t = 8, 12
    logp = rng.normal(-1, 0.3, (n, t)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (n, t))).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    mask = np.arange(t)[None, :] < np.array(lens)[:, None]
    weights = rng.uniform(0.2, 2, (n, t)).astype(np.float32)
    # Equal micro-batches (as the learner splits them; one compile per size), rows in a random order.
    perm = rng.permutation(n)
    bounds = list(range(0, n + 1, n // n_micro))
    for mode in MODES:
        full_s, full_d, _ = policy_loss(logp, old, adv, mask, weights=weights, agg=mode, max_len=t, dual_clip=3.0)
        acc_s = acc_d = 0.0
        for a, b in zip(bounds[:-1], bounds[1:]):
            rows = perm[a:b]
            s, d, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], weights=weights[rows], agg=mode,
                                  max_len=t, dual_clip=3.0)
            acc_s, acc_d = acc_s + float(s), acc_d + float(d)
        assert acc_d == float(full_d), mode
        if acc_d:
            assert acc_s / acc_d == pytest.approx(float(full_s) / float(full_d), rel=1e-5, abs=1e-6), mode


def test_k3_kl_and_entropy():
    logp = np.array([[-1.0, -2.0, 0.0]], np.float32)
    ref = np.array([[-1.0, -2.0 + math.log(2.0), 50.0]], np.float32)
    kl = k3_kl(logp, ref, np.array([[1, 1, 0]]))
    np.testing.assert_allclose(kl, [[0.0, 2 - math.log(2.0) - 1, 0.0]], atol=1e-6)
    # k3 >= 0 with zero gradient at ref == logp.
    g = jax.grad(lambda lp: jnp.sum(k3_kl(lp, jnp.asarray(logp), jnp.ones((1, 3)))))(jnp.asarray(logp))
    np.testing.assert_allclose(g, 0.0, atol=1e-6)
    logits = np.array([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]], np.float32)
    np.testing.assert_allclose(entropy_from_logits(logits), [[math.log(4.0), 0.0]], atol=1e-5)
    s, d = masked_entropy(logits, np.array([[1, 0]]))
    assert float(d) == 1 and float(s) == pytest.approx(math.log(4.0))


@pytest.mark.parametrize("kwargs, err, msg", [
    ({"logp": np.zeros((2, 3), np.int32)}, TypeError, "logp"),
    ({"old_logp": np.zeros((2, 4), np.float32)}, ValueError, r"old_logp: shape \(2, 4\) does not match logp"),
    ({"adv": np.zeros(3, np.float32)}, ValueError, r"adv: shape \(3,\)"),
    ({"mask": np.ones((2,))}, ValueError, "mask"),
    ({"weights": np.ones((2, 2), np.float32)}, ValueError, "weights"),
    ({"eps_low": 1.0}, ValueError, "eps_low"),
    ({"dual_clip": 0.5}, ValueError, "dual_clip"),
    ({"agg": "sum"}, ValueError, "unknown loss aggregation"),
])
def test_policy_loss_bad_inputs(kwargs, err, msg):
    args = dict(logp=np.zeros((2, 3), np.float32), old_logp=np.zeros((2, 3), np.float32),
                adv=np.zeros(2, np.float32), mask=np.ones((2, 3)))
    args.update(kwargs)
    with pytest.raises(err, match=msg):
        policy_loss(args.pop("logp"), args.pop("old_logp"), args.pop("adv"), args.pop("mask"), **args)
