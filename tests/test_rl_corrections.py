"""Correction baselines behind one interface (docs/rl_math.md#corrections): hand-computed weights and masks per rule, metrics,
config handling, no gradient, padding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triage_jax.rl.corrections import CORRECTIONS, apply_correction, make_config
from triage_jax.rl.triage import TriageConfig, gate_weights

LN = np.log


def run(name, delta, mask, adv=None, cfg=None):
    delta = np.asarray(delta, np.float32)
    adv = np.zeros(delta.shape[0], np.float32) if adv is None else np.asarray(adv, np.float32)
    out = apply_correction(name, adv=adv, delta=delta, mask=mask, cfg=cfg)
    return np.asarray(out.weights), np.asarray(out.mask), {k: float(v) for k, v in out.metrics.items()}


def test_registry_and_defaults():
    assert set(CORRECTIONS) == {"none", "token_tis", "seq_tis", "seq_mis", "seq_mis_reject", "icepop", "geo_rs",
                                "opsm", "triage"}
    assert make_config("opsm").delta == 1e-4 and make_config("opsm", {"delta": 0.01}).delta == 0.01
    assert make_config("token_tis").C == 2.0 and make_config("seq_tis").C == 2.0
    assert (make_config("seq_mis").lo, make_config("seq_mis").C) == (0.5, 2.0)
    assert (make_config("icepop").a, make_config("icepop").b) == (0.5, 5.0)
    assert (make_config("geo_rs").lo, make_config("geo_rs").hi) == (0.999, 1.001)
    assert make_config("triage", {"w_min": 0.5}) == TriageConfig(w_min=0.5)
    assert make_config("icepop", {"b": 4.0}).b == 4.0


def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown correction 'tis'.*token_tis"):
        make_config("tis")
    with pytest.raises(ValueError, match=r"correction 'icepop': unknown config key\(s\) \['c'\]"):
        make_config("icepop", {"c": 1.0})
    with pytest.raises(ValueError, match="icepop: need 0 <= a < b"):
        make_config("icepop", {"a": 5.0, "b": 1.0})
    with pytest.raises(ValueError, match="seq_mis"):
        make_config("seq_mis", {"lo": 3.0})
    with pytest.raises(ValueError, match="opsm: delta must be a finite number >= 0"):
        make_config("opsm", {"delta": -0.1})
    with pytest.raises(TypeError, match="takes a TokenTISConfig, got IcePopConfig"):
        run("token_tis", np.zeros((1, 2)), np.ones((1, 2)), cfg=make_config("icepop"))
    with pytest.raises(ValueError, match=r"mask: expected shape \(1, 2\)"):
        run("none", np.zeros((1, 2)), np.ones((1, 3)))
    with pytest.raises(TypeError, match="delta"):
        apply_correction("none", adv=np.zeros(1, np.float32), delta=np.zeros((1, 2), np.int32), mask=np.ones((1, 2)))


def test_none():
    w, m, met = run("none", [[0.3, -5.0, 0.0]], np.array([[1, 1, 0]], bool))
    np.testing.assert_array_equal(w, [[1, 1, 0]])
    np.testing.assert_array_equal(m, [[True, True, False]])
    assert met == {"frac_clipped": 0.0, "frac_masked": 0.0, "ess": 1.0, "weight_mean": 1.0, "weight_max": 1.0}


def test_token_tis():
    w, m, met = run("token_tis", LN([[3.0, 0.5, 1.0, 7.0]]), np.array([[1, 1, 1, 0]]))
    np.testing.assert_allclose(w, [[2.0, 0.5, 1.0, 0.0]], rtol=1e-6)
    assert met["frac_clipped"] == pytest.approx(1 / 3) and met["frac_masked"] == 0.0
    # Kish ESS: (2 + 0.5 + 1)^2 / (4 + 0.25 + 1) over 3 tokens.
    assert met["ess"] == pytest.approx(3.5**2 / 5.25 / 3, rel=1e-6)
    assert met["weight_mean"] == pytest.approx(3.5 / 3) and met["weight_max"] == pytest.approx(2.0)


def test_seq_tis():
    # Row sums of delta: ln 3 -> min(3, 2) = 2; ln 0.25 -> 0.25; 50 (clipped to 20) -> 2; padding excluded.
    delta = np.array([[LN(3.0), 0.0, 9.0], [LN(0.5), LN(0.5), 0.0], [25.0, 25.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    w, m, met = run("seq_tis", delta, mask)
    np.testing.assert_allclose(w, [[2, 2, 0], [0.25, 0.25, 0.25], [2, 2, 2]], rtol=1e-5)
    assert met["frac_clipped"] == pytest.approx(5 / 8)


def test_seq_mis_is_masked_importance_sampling():
    # exp(row sum): 3 (> C = 2, dropped), 0.8 (kept, weight 0.8), 0.4 (< 0.5, dropped), 1.5 (kept, weight 1.5).
    delta = np.array([[LN(3.0), 0.0], [LN(0.8), 0.0], [LN(0.4), 0.0], [LN(0.5), LN(3.0)]], np.float32)
    w, m, met = run("seq_mis", delta, np.ones((4, 2), bool))
    np.testing.assert_array_equal(m, [[False, False], [True, True], [False, False], [True, True]])
    np.testing.assert_allclose(w, [[0, 0], [0.8, 0.8], [0, 0], [1.5, 1.5]], rtol=1e-6)
    assert met["frac_masked"] == pytest.approx(1 / 2) and met["frac_clipped"] == 0.0
    assert met["weight_mean"] == pytest.approx(1.15) and met["weight_max"] == pytest.approx(1.5)
    assert met["ess"] == pytest.approx((2 * 2.3) ** 2 / (2 * (0.64 + 2.25)) / 8, rel=1e-5)


def test_seq_mis_reject_keeps_weight_one():
    delta = np.array([[LN(3.0), 0.0], [LN(0.8), 0.0], [LN(0.4), 0.0]], np.float32)
    w, m, met = run("seq_mis_reject", delta, np.ones((3, 2), bool))
    np.testing.assert_array_equal(m, [[False, False], [True, True], [False, False]])
    np.testing.assert_array_equal(w, [[0, 0], [1, 1], [0, 0]])
    assert met["frac_masked"] == pytest.approx(2 / 3) and met["frac_clipped"] == 0.0
    assert met["ess"] == pytest.approx(1 / 3) and met["weight_mean"] == 1.0


def test_icepop():
    # rho inside [0.5, 5] keeps rho, outside -> weight 0 (the token stays in the mask: its denominator counts).
    w, m, met = run("icepop", LN([[6.0, 0.4, 2.0, 0.5, 5.0]]), np.ones((1, 5)))
    np.testing.assert_allclose(w, [[0.0, 0.0, 2.0, 0.5, 5.0]], rtol=1e-5)
    np.testing.assert_array_equal(m, np.ones((1, 5)))
    assert met["frac_clipped"] == pytest.approx(0.4) and met["frac_masked"] == 0.0


def test_geo_rs():
    # exp(mean delta over real tokens): 0.0005 -> kept; 0.01 -> dropped; -0.002 -> dropped; padding ignored.
    delta = np.array([[0.001, 0.0, 5.0], [0.01, 0.01, 0.01], [-0.002, -0.002, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0]], bool)
    w, m, met = run("geo_rs", delta, mask)
    np.testing.assert_array_equal(m, [[True, True, False], [False, False, False], [False, False, False]])
    assert met["frac_masked"] == pytest.approx(5 / 7)
    w, m, _ = run("geo_rs", delta, mask, cfg=make_config("geo_rs", {"lo": 0.99, "hi": 1.02}))
    np.testing.assert_array_equal(m, mask)


def test_opsm_drops_negative_advantage_responses_past_the_threshold():
    # mean(-delta) over real tokens (DeepSeek-V3.2's mean log(pi_sampler / pi_learner)): 0.02, 0.02, 0.005, -0.05,
    # 0.02 (padding excluded, a 9 there must not count). Only A < 0 responses above delta = 0.01 are dropped: the
    # second row is A > 0 (kept whatever its mismatch), the third is under the threshold, the fourth negative.
    delta = np.array([[-0.02, -0.02, 9.0], [-0.02, -0.02, -0.02], [-0.005, -0.005, 0.0], [0.05, 0.05, 0.0],
                      [-0.04, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]], bool)
    adv = np.array([-1.0, 1.0, -1.0, -1.0, 0.0], np.float32)
    cfg = make_config("opsm", {"delta": 0.01})
    w, m, met = run("opsm", delta, mask, adv, cfg)
    np.testing.assert_array_equal(m, mask & np.array([[False], [True], [True], [True], [True]]))
    np.testing.assert_array_equal(w, m.astype(np.float32))  # a pure mask: accepted tokens keep weight 1
    assert met["frac_masked"] == pytest.approx(2 / 11) and met["frac_clipped"] == 0.0
    # the threshold is strict; at 0 every A < 0 response with mean(-delta) > 0 goes
    _, m0, _ = run("opsm", delta, mask, adv, make_config("opsm", {"delta": 0.02}))
    assert m0[0].sum() == 2  # mean(-delta) == 0.02 (float32 rounding aside) is not > 0.02
    _, m0, _ = run("opsm", delta, mask, adv, make_config("opsm", {"delta": 0.0}))
    np.testing.assert_array_equal(m0.any(1), [False, True, False, True, True])
    # token-level advantages: only the tokens with A < 0 of a mismatched response are dropped
    adv_t = np.array([[-1.0, 1.0, 0.0]] * 5, np.float32)
    _, mt, _ = run("opsm", delta, mask, adv_t, cfg)
    np.testing.assert_array_equal(mt, mask & np.array([[False, True, True], [False, True, True], [True] * 3,
                                                        [True] * 3, [False, True, True]]))


def test_triage_matches_gate_weights():
    rng = np.random.default_rng(0)
    delta = (0.2 * rng.standard_normal((4, 70)) - 0.1).astype(np.float32)
    mask = np.arange(70)[None] < np.array([[70], [64], [3], [0]])
    adv = np.array([-1.0, -0.5, 1.0, -1.0], np.float32)
    w, m, met = run("triage", delta, mask, adv)
    np.testing.assert_array_equal(w, gate_weights(adv, delta, mask, TriageConfig()))
    np.testing.assert_array_equal(m, mask)
    assert 0 < met["frac_clipped"] < 1 and met["frac_masked"] == 0.0 and met["ess"] < 1.0
    assert met["weight_mean"] == pytest.approx(1.0, rel=1e-6)  # mass preserved per response


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-3, 3, width=32), min_size=24, max_size=24),
       st.lists(st.integers(0, 6), min_size=4, max_size=4), st.sampled_from(sorted(CORRECTIONS)))
def test_weights_bounded_zero_outside_mask_and_no_gradient(vals, lens, name):
    delta = np.array(vals, np.float32).reshape(4, 6)
    mask = np.arange(6)[None] < np.array(lens)[:, None]
    adv = np.array([-1.0, 1.0, -0.5, 0.0], np.float32)
    out = apply_correction(name, adv=adv, delta=delta, mask=mask)
    w, m = np.asarray(out.weights), np.asarray(out.mask)
    assert m.dtype == mask.dtype and np.all(m <= mask)
    assert np.all(w[~m] == 0) and np.all(np.isfinite(w)) and np.all(w >= 0)
    bound = {"token_tis": 2.0, "seq_tis": 2.0, "icepop": 5.0 * (1 + 1e-6), "none": 1.0, "seq_mis": 2.0 * (1 + 1e-6),
             "seq_mis_reject": 1.0, "geo_rs": 1.0, "opsm": 1.0}
    if name in bound:
        assert np.all(w <= bound[name])
    for k in ("frac_clipped", "frac_masked", "ess"):
        v = float(out.metrics[k])
        assert (0.0 <= v <= 1.0 + 1e-6) or (math.isnan(v) and not mask.any()), k
    g = jax.grad(lambda d: jnp.sum(apply_correction(name, adv=adv, delta=d, mask=mask).weights))(jnp.asarray(delta))
    assert np.all(np.asarray(g) == 0)


def test_vmap_over_batches():
    delta = jnp.log(jnp.array([[[3.0, 0.5]], [[1.0, 6.0]]]))
    w = jax.vmap(lambda d: apply_correction("token_tis", adv=jnp.zeros(1), delta=d, mask=jnp.ones((1, 2))).weights)(
        delta)
    np.testing.assert_allclose(w, [[[2.0, 0.5]], [[1.0, 2.0]]], rtol=1e-6)


def test_jit_with_config_static():
    f = jax.jit(lambda d, m: apply_correction("icepop", adv=jnp.zeros(1), delta=d, mask=m,
                                              cfg=make_config("icepop", {"b": 3.0})).weights)
    np.testing.assert_allclose(f(jnp.log(jnp.array([[2.0, 4.0]])), jnp.ones((1, 2))), [[2.0, 0.0]], rtol=1e-6)
