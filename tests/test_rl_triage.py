"""TRIAGE gating and repair (docs/rl_math.md#triage): hand-computed cases, a loop-based numpy reference, properties."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from triage_jax.rl.triage import (TriageConfig, gate_weights, propose_thresholds, repair_loss, repair_loss_sum,
                                  segment_stats, segment_weights)

CFG4 = TriageConfig(segment_len=4)  # default thresholds, short segments so small arrays hold several
N, T, L = 6, 20, 8  # property-test shape: 3 segments of 8, the last one partial
CFG8 = TriageConfig(segment_len=L)

gate_jit = jax.jit(gate_weights, static_argnums=3)
repair_jit = jax.jit(repair_loss, static_argnums=5)


# ------------------------------------------------------------------------------------------- numpy reference


def ref_alpha(adv, delta, mask, cfg):
    """Direct transcription of docs/rl_math.md#triage with Python loops (float64 sums, float32 threshold tests)."""
    adv, delta, mask = np.asarray(adv, np.float64), np.asarray(delta, np.float64), np.asarray(mask) != 0
    n, t = delta.shape
    a = adv if adv.ndim == 2 else np.broadcast_to(adv[:, None], (n, t))
    w = np.ones((n, t))
    for i in range(n):
        for s0 in range(0, t, cfg.segment_len):
            idx = [j for j in range(s0, min(s0 + cfg.segment_len, t)) if mask[i, j]]
            if not idx:
                continue
            dbar = np.mean(delta[i, idx])
            f = np.mean(delta[i, idx] < -np.float32(cfg.tau_tail))  # thresholds compare in float32
            risk = min(max((-dbar - cfg.g_lo) / (cfg.g_hi - cfg.g_lo), (f - cfg.f_lo) / (cfg.f_hi - cfg.f_lo)), 1.0)
            w_s = 1 - (1 - cfg.w_min) * max(risk, 0.0)
            for j in idx:
                if a[i, j] < 0 and delta[i, j] < 0:
                    w[i, j] = w_s
    alpha = np.zeros((n, t))
    for i in range(n):
        if mask[i].any():
            alpha[i, mask[i]] = w[i, mask[i]] / np.mean(w[i, mask[i]])
    return alpha


# ------------------------------------------------------------------------------------------------ strategies

finite = st.floats(-1.0, 1.0, width=32, allow_subnormal=False)
# Deltas that hit the thresholds, zero, exact ties and tails.
delta_el = st.one_of(finite, st.sampled_from([0.0, -0.0, -0.02, -0.1, -0.3, -0.31, 0.3, -2.0]))


@st.composite
def batches(draw, n=N, t=T, token_adv=False):
    delta = np.array(draw(st.lists(delta_el, min_size=n * t, max_size=n * t)), np.float32).reshape(n, t)
    lens = np.array(draw(st.lists(st.integers(0, t), min_size=n, max_size=n)))
    mask = np.arange(t)[None, :] < lens[:, None]
    if token_adv:
        adv = np.array(draw(st.lists(st.sampled_from([-1.5, -0.5, 0.0, 0.5, 1.0]), min_size=n * t,
                                     max_size=n * t)), np.float32).reshape(n, t)
    else:
        adv = np.array(draw(st.lists(st.sampled_from([-1.5, -1.0, -0.25, 0.0, 0.5, 2.0]), min_size=n,
                                     max_size=n)), np.float32)
    return adv, delta, mask


# ------------------------------------------------------------------------------------------------ hand cases


def test_config_defaults_match_spec():
    c = TriageConfig()
    assert (c.segment_len, c.tau_tail, c.g_lo, c.g_hi, c.f_lo, c.f_hi, c.w_min) == (64, 0.3, 0.02, 0.10, 0.10,
                                                                                   0.30, 0.2)
    assert (c.tau_rep, c.beta, c.lambda_rep, c.k_rep) == (0.0, 0.1, 0.5, 100)
    assert hash(c) == hash(TriageConfig())  # usable as a static jit argument


@pytest.mark.parametrize("overrides, key", [
    ({"g_lo": 0.1, "g_hi": 0.1}, "g_hi > g_lo"), ({"f_lo": 0.3, "f_hi": 0.2}, "f_hi > f_lo"),
    ({"w_min": 0.0}, "w_min"), ({"w_min": 1.5}, "w_min"), ({"segment_len": 0}, "segment_len"),
    ({"segment_len": 2.5}, "segment_len"), ({"beta": 0.0}, "beta"), ({"k_rep": -1}, "k_rep"),
    ({"lambda_rep": -0.1}, "lambda_rep"), ({"tau_tail": float("nan")}, "tau_tail"), ({"tau_tail": -0.1}, "tau_tail"),
])
def test_config_rejects_bad_values(overrides, key):
    with pytest.raises(ValueError, match=key):
        TriageConfig(**overrides)


def test_config_from_dict():
    assert TriageConfig.from_dict({"w_min": 0.5, "segment_len": 32}) == TriageConfig(w_min=0.5, segment_len=32)
    with pytest.raises(ValueError, match=r"TriageConfig: unknown config key\(s\) \['wmin'\]"):
        TriageConfig.from_dict({"wmin": 0.5})


def test_segment_stats_boundaries_padding_partial_segment():
    # T = 10 with L = 4: segments [0,4), [4,8), [8,10) (padded to 12); response 0 has 9 tokens, response 1 has 3.
    delta = np.array([[-0.1, -0.2, 0.3, 0.0, -0.4, -0.4, 0.1, 0.1, -0.5, 99.0],
                      [0.2, -0.4, 0.2, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0]], np.float32)
    mask = np.arange(10)[None, :] < np.array([[9], [3]])
    st_ = segment_stats(delta, mask, CFG4)
    np.testing.assert_array_equal(st_.n, [[4, 4, 1], [3, 0, 0]])
    np.testing.assert_array_equal(st_.valid, [[True, True, True], [True, False, False]])
    np.testing.assert_allclose(st_.dbar, [[0.0, -0.15, -0.5], [0.0, 0.0, 0.0]], atol=1e-7)
    np.testing.assert_allclose(st_.f, [[0.0, 0.5, 1.0], [1 / 3, 0.0, 0.0]], atol=1e-7)


def test_gate_weights_hand_case():
    # One response of 9 tokens (T = 10, L = 4), A < 0. Spec thresholds:
    #  seg0 delta -0.06 x4: risk = max((0.06-0.02)/0.08, (0-0.1)/0.2) = 0.5 -> w = 1 - 0.8*0.5 = 0.6 on all 4;
    #  seg1 [0.1, 0, -0.5, 0.1]: dbar = -0.075 -> 0.6875, f = 1/4 -> 0.75 -> risk 0.75, w = 0.4 on the -0.5 token
    #       only (0.1 and the tie at 0 keep 1);
    #  seg2 [-0.2 | pad]: dbar = -0.2 -> risk 1 -> w = w_min = 0.2.
    # sum w = 2.4 + 3.4 + 0.2 = 6, wbar = 6/9 = 2/3, alpha = 1.5 * w.
    delta = np.array([[-0.06] * 4 + [0.1, 0.0, -0.5, 0.1] + [-0.2, 5.0]], np.float32)
    mask = np.array([[1] * 9 + [0]], np.float32)
    alpha = gate_weights(np.array([-1.0], np.float32), delta, mask, CFG4)
    want = np.array([[0.9] * 4 + [1.5, 1.5, 0.6, 1.5] + [0.3, 0.0]])
    np.testing.assert_allclose(alpha, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.sum(alpha), 9.0, rtol=1e-6)
    # Positive and zero advantage: untouched.
    for a in (1.0, 0.0):
        np.testing.assert_array_equal(gate_weights(np.array([a], np.float32), delta, mask, CFG4), mask)


def test_gate_weights_response_shorter_than_one_segment():
    # 3 tokens in a segment of 64: dbar = (-0.5 - 0.1 + 0.3)/3 = -0.1 -> risk 1 (g); f = 1/3 -> risk 1; w = 0.2 on
    # the two negative tokens, 1 on the positive one; wbar = 1.4/3, alpha = [3/7, 3/7, 15/7].
    delta = np.zeros((1, 64), np.float32)
    delta[0, :3] = [-0.5, -0.1, 0.3]
    mask = np.arange(64)[None] < 3
    alpha = gate_weights(np.array([-2.0], np.float32), delta, mask)
    np.testing.assert_allclose(alpha[0, :3], [3 / 7, 3 / 7, 15 / 7], rtol=1e-5)
    assert np.all(np.asarray(alpha[0, 3:]) == 0)


def test_all_negative_batch_is_renormalized_back_to_one():
    # Every token is amplifying and the segment weight is shared: alpha = w / wbar = 1 exactly.
    delta = np.full((3, 8), -0.5, np.float32)
    mask = np.ones((3, 8), bool)
    alpha = gate_weights(np.full(3, -1.0, np.float32), delta, mask, TriageConfig(segment_len=8))
    np.testing.assert_allclose(alpha, 1.0, rtol=1e-6)


def test_all_positive_batch_and_ties_at_zero_untouched():
    delta = np.array([[0.5, 0.0, -0.0, 0.2], [0.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.ones((2, 4), bool)
    alpha = gate_weights(np.array([-1.0, -1.0], np.float32), delta, mask, CFG4)
    np.testing.assert_array_equal(alpha, 1.0)
    # Negative delta but A exactly 0: not gated (strict A < 0).
    alpha = gate_weights(np.zeros(2, np.float32), -np.abs(delta) - 1.0, mask, CFG4)
    np.testing.assert_array_equal(alpha, 1.0)


def test_token_level_advantages_select_tokens():
    delta = np.array([[-1.0, -1.0, -1.0, -1.0]], np.float32)
    adv = np.array([[-1.0, 1.0, 0.0, -1.0]], np.float32)
    # risk 1 (dbar = -1) -> w = 0.2 on tokens 0 and 3; wbar = (0.2+1+1+0.2)/4 = 0.6.
    alpha = gate_weights(adv, delta, np.ones((1, 4)), CFG4)
    np.testing.assert_allclose(alpha, [[1 / 3, 5 / 3, 5 / 3, 1 / 3]], rtol=1e-6)


def test_repair_hand_case():
    # Response 0 (A = 1): gaps logp - sampler_logp = [-0.3, -0.1] -> dbar = -0.2, q = 0.2,
    # phi = 0.01 * (sqrt(1 + 4) - 1); response 1 (A = -1) and response 2 (A = 2, empty) do not count.
    logp = np.array([[-1.3, -2.1, 0.0], [-5.0, -5.0, -5.0], [-1.0, -1.0, -1.0]], np.float32)
    sampler = np.array([[-1.0, -2.0, 9.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], bool)
    adv = np.array([1.0, -1.0, 2.0], np.float32)
    phi = 0.01 * (math.sqrt(5.0) - 1.0)
    np.testing.assert_allclose(repair_loss(adv, logp, sampler, mask, 100), 0.5 * phi, rtol=1e-5)
    np.testing.assert_allclose(repair_loss(adv, logp, sampler, mask, 99), 0.0)
    total, count = repair_loss_sum(adv, logp, sampler, mask, 150)
    assert float(count) == 1.0
    np.testing.assert_allclose(total, 0.5 * phi, rtol=1e-5)
    # tau_rep = -0.25 puts the mean gap -0.2 above the threshold: no repair.
    assert float(repair_loss(adv, logp, sampler, mask, 100, TriageConfig(tau_rep=-0.25))) == 0.0
    # Gradient: d/dlogp_t = lambda * phi'(q) * (-1/n) with phi'(q) = q / sqrt(1 + (q/beta)^2).
    g = jax.grad(lambda lp: repair_loss(adv, lp, sampler, mask, 100))(jnp.asarray(logp))
    dq = 0.2 / math.sqrt(5.0)
    np.testing.assert_allclose(g[0, :2], [-0.5 * dq / 2] * 2, rtol=1e-4)
    assert np.all(np.asarray(g)[~np.array([[1, 1, 0], [0, 0, 0], [0, 0, 0]], bool)] == 0)


def test_repair_token_level_adv_uses_response_mean():
    logp = np.full((2, 2), -1.0, np.float32)
    sampler = np.zeros((2, 2), np.float32)  # gap -1 everywhere
    mask = np.ones((2, 2), bool)
    adv = np.array([[3.0, -1.0], [1.0, -3.0]], np.float32)  # means +1 and -1: only response 0 counts
    phi = 0.01 * (math.sqrt(1.0 + 100.0) - 1.0)
    np.testing.assert_allclose(repair_loss(adv, logp, sampler, mask, 100), 0.5 * phi, rtol=1e-5)


def test_propose_thresholds_reads_the_pilot_distribution():
    # 4 responses of 100 tokens (L = 50). Response r: 4 at -2, 2 at -1, 44 at 0, then 50 at -0.01 r.
    delta = np.zeros((4, 100), np.float32)
    delta[:, :4], delta[:, 4:6] = -2.0, -1.0
    delta[:, 50:] = -0.01 * np.arange(4, dtype=np.float32)[:, None]
    mask = np.ones_like(delta, bool)
    cfg = propose_thresholds(delta, mask, TriageConfig(segment_len=50), g_quantiles=(0.25, 0.5))
    # q05 of the 400 values: position 19.95 between -1 and -1 -> tau = 1; tail (< -1) = 16/400 = 4%.
    assert cfg.tau_tail == pytest.approx(1.0)
    assert (cfg.f_lo, cfg.f_hi) == pytest.approx((0.08, 0.24))
    # -dbar per segment: 0.2 (x4) and 0, 0.01, 0.02, 0.03; sorted quantile positions 1.75 and 3.5.
    assert (cfg.g_lo, cfg.g_hi) == pytest.approx((0.0175, 0.115), rel=1e-4)
    assert cfg.segment_len == 50 and cfg.w_min == 0.2
    # Default quantiles (0.9, 0.99) both land on 0.2: g_hi is nudged above g_lo so the config stays valid.
    cfg = propose_thresholds(delta, mask, TriageConfig(segment_len=50))
    assert cfg.g_lo == pytest.approx(0.2) and cfg.g_hi == pytest.approx(0.2001)
    with pytest.raises(ValueError, match="no real token"):
        propose_thresholds(delta, np.zeros_like(mask))


@pytest.mark.parametrize("fn, args, err, msg", [
    (gate_weights, (np.zeros(2), np.zeros((2, 3), np.int32), np.ones((2, 3))), TypeError, "delta"),
    (gate_weights, (np.zeros(2), np.zeros((2, 3)), np.ones((2, 4))), ValueError, r"mask: expected shape \(2, 3\)"),
    (gate_weights, (np.zeros(3), np.zeros((2, 3)), np.ones((2, 3))), ValueError, r"adv: shape \(3,\)"),
    (gate_weights, (np.zeros((2, 4)), np.zeros((2, 3)), np.ones((2, 3))), ValueError, "adv"),
    (gate_weights, (np.zeros(2), np.zeros(6), np.ones(6)), ValueError, "delta: expected rank 2"),
    (segment_stats, (np.zeros((2, 3)), np.ones((2, 3), np.complex64)), TypeError, "mask"),
    (repair_loss, (np.zeros(2), np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)), 0), ValueError,
     "sampler_logp"),
    (repair_loss, (np.zeros(2), np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3)), 1.5), TypeError, "step"),
])
def test_bad_inputs_raise_clear_errors(fn, args, err, msg):
    args = tuple(np.asarray(a, np.float32) if isinstance(a, np.ndarray) and a.dtype == np.float64 else a
                 for a in args)
    with pytest.raises(err, match=msg):
        fn(*args)


# ------------------------------------------------------------------------------------------------ properties


@settings(max_examples=40, deadline=None)
@given(batches())
def test_alpha_matches_reference_and_preserves_token_count(batch):
    adv, delta, mask = batch
    alpha = np.asarray(gate_jit(adv, delta, mask, CFG8))
    np.testing.assert_allclose(alpha, ref_alpha(adv, delta, mask, CFG8), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose((alpha * mask).sum(1), mask.sum(1), rtol=1e-5)
    assert np.all(alpha[~mask] == 0)


@settings(max_examples=25, deadline=None)
@given(batches(token_adv=True))
def test_alpha_token_level_adv_matches_reference(batch):
    adv, delta, mask = batch
    np.testing.assert_allclose(gate_jit(adv, delta, mask, CFG8), ref_alpha(adv, delta, mask, CFG8), rtol=2e-5,
                               atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(batches())
def test_only_amplifying_tokens_change_weight_and_weights_in_range(batch):
    adv, delta, mask = batch
    alpha = np.asarray(gate_jit(adv, delta, mask, CFG8), np.float64)
    amplifying = mask & (adv[:, None] < 0) & (delta < 0)
    for i in range(N):
        if not mask[i].any():
            continue
        if not amplifying[i].any():  # includes every response with A >= 0
            np.testing.assert_array_equal(alpha[i, mask[i]], 1.0)
            continue
        # Untouched tokens share alpha = 1 / wbar, so the raw weight of a gated token is alpha / that.
        rest = mask[i] & ~amplifying[i]
        if rest.any():
            base = alpha[i, rest]
            np.testing.assert_allclose(base, base[0], rtol=1e-6)
            w = alpha[i, amplifying[i]] / base[0]
            assert np.all(w >= CFG8.w_min - 1e-6) and np.all(w <= 1 + 1e-6)


@settings(max_examples=50, deadline=None)
@given(st.floats(-2, 2), st.floats(0, 1))
def test_segment_weight_in_range_and_monotone(dbar, f):
    stats = segment_stats(np.zeros((1, 4), np.float32), np.ones((1, 4)), CFG4)._replace(
        dbar=jnp.asarray([[dbar, dbar - 0.01]], jnp.float32), f=jnp.asarray([[f, min(f + 0.01, 1.0)]], jnp.float32))
    w = np.asarray(segment_weights(stats, CFG4))[0]
    assert CFG4.w_min - 1e-7 <= w[0] <= 1.0 and CFG4.w_min - 1e-7 <= w[1] <= 1.0
    assert w[1] <= w[0] + 1e-7  # riskier segment, no larger weight


@settings(max_examples=25, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_alpha_invariant_to_padding_and_permutation(batch, rnd):
    adv, delta, mask = batch
    alpha = np.asarray(gate_jit(adv, delta, mask, CFG8))
    # Extra padding columns and a padding response, holding garbage: nothing real changes.
    garbage = np.float32(rnd.choice([np.nan, np.inf, -1e30, 3.0]))
    delta_p = np.concatenate([np.where(mask, delta, garbage), np.full((N, 5), garbage, np.float32)], 1)
    delta_p = np.concatenate([delta_p, np.full((1, T + 5), -3.0, np.float32)], 0)
    mask_p = np.concatenate([np.pad(mask, ((0, 0), (0, 5))), np.zeros((1, T + 5), bool)], 0)
    adv_p = np.concatenate([adv, [-1.0]]).astype(np.float32)
    alpha_p = np.asarray(gate_jit(adv_p, delta_p, mask_p, CFG8))
    np.testing.assert_array_equal(alpha_p[:N, :T], alpha)
    assert np.all(alpha_p[N:] == 0) and np.all(alpha_p[:, T:] == 0)
    perm = np.array(rnd.sample(range(N), N))
    np.testing.assert_array_equal(gate_jit(adv[perm], delta[perm], mask[perm], CFG8), alpha[perm])


@settings(max_examples=30, deadline=None)
@given(batches(), st.integers(0, 200), st.floats(-0.5, 0.5))
def test_repair_zero_before_k_rep_and_when_gaps_above_tau(batch, step, tau_rep):
    adv, delta, mask = batch
    cfg = dataclasses.replace(CFG8, tau_rep=float(np.float32(tau_rep)))
    sampler = np.zeros_like(delta)
    value = float(repair_jit(adv, delta, sampler, mask, step, cfg))  # logp - sampler_logp = delta
    assert value >= 0.0
    if step < cfg.k_rep:
        assert value == 0.0
    gaps = np.array([delta[i, mask[i]].astype(np.float64).mean() for i in range(N) if mask[i].any()
                     and adv[i] > 0])
    if gaps.size == 0 or np.all(gaps >= cfg.tau_rep + 1e-6):
        assert value == 0.0
    elif step >= cfg.k_rep and np.any(gaps < cfg.tau_rep - 1e-3):
        assert value > 0.0


@settings(max_examples=15, deadline=None)
@given(batches())
def test_repair_gradient_matches_finite_differences(batch):
    adv, delta, mask = batch
    sampler = np.full_like(delta, -1.0)
    logp = (sampler + delta).astype(np.float32)
    check_grads(lambda lp: repair_jit(adv, lp, sampler, mask, 100, CFG8), (jnp.asarray(logp),), order=1,
                modes=["rev"], eps=1e-2, atol=2e-3, rtol=2e-2)


def test_jit_vmap_grad():
    rng = np.random.default_rng(0)
    adv = rng.choice([-1.0, 1.0], (3, N)).astype(np.float32)
    delta = (0.3 * rng.standard_normal((3, N, T))).astype(np.float32)
    mask = np.arange(T)[None, None, :] < rng.integers(0, T + 1, (3, N, 1))
    batched = jax.vmap(lambda a, d, m: gate_weights(a, d, m, CFG8))(adv, delta, mask)
    for b in range(3):
        np.testing.assert_allclose(batched[b], gate_jit(adv[b], delta[b], mask[b], CFG8), rtol=1e-6)
    with jax.disable_jit():  # the un-jitted path computes the same weights
        np.testing.assert_allclose(gate_weights(adv[0], delta[0], mask[0], CFG8), batched[0], rtol=1e-6)
    # alpha carries no gradient; repair's gradient flows through logp only.
    g = jax.grad(lambda d: jnp.sum(gate_weights(adv[0], d, mask[0], CFG8)))(jnp.asarray(delta[0]))
    assert np.all(np.asarray(g) == 0)
    g_s = jax.grad(lambda s: repair_loss(adv[0], delta[0], s, mask[0], 100, CFG8))(jnp.zeros((N, T)))
    assert np.all(np.asarray(g_s) == 0)
    r = jax.vmap(lambda a, lp, m: repair_loss(a, lp, jnp.zeros_like(lp), m, 100, CFG8))(adv, delta, mask)
    assert r.shape == (3,)
