"""Mismatch diagnostics (docs/rl_math.md#diagnostics): hand-computed batches, a loop-based numpy reference, NaN on empty
denominators, exact masked quantiles, invariances."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from triage_jax.rl import diagnostics
from triage_jax.rl.diagnostics import (DELTA_HIST_EDGES, NULL_METRICS, QUADRANTS, delta_energy,
                                       delta_energy_realized, delta_histogram, masked_quantiles, mismatch_metrics)
from triage_jax.rl.corrections import CORRECTIONS, apply_correction, make_config
from triage_jax.rl.triage import TriageConfig, gate_weights

SPEC_NAMES = {"mean_abs_delta", "frac_small", "delta_q05", "delta_q50", "delta_q95", "kl_k1", "kl_k3", "chi2_token",
              "rho_asym", "rho_asym_direction", "tail_freq", "tail_top5_share", "tail_concentration", "tail_persistence", "hidden_by_mean",
              "energy", "b_amp", "b_con"} | {f"quad_{k}_{q}" for k in ("tok", "mass") for q in QUADRANTS}
PEER_NAMES = {"chi2_seq", "rho_seq_q05", "rho_seq_q50", "rho_seq_q95", "ess_token", "ess_seq",
              "token_mult_prob_error"} | {f"frac_corrected_{c}" for c in CORRECTIONS if c != "none"}
N, T = 6, 20
CFG = TriageConfig(segment_len=4)


LN2 = math.log(2.0)


def f(x):
    return {k: float(v) for k, v in x.items()}


# ------------------------------------------------------------------------------------------- numpy reference


def ref_metrics(adv, delta, mask, cfg, weights):
    """The docs/rl_math.md#diagnostics table with loops (float64 sums, float32 threshold tests)."""
    d32, m = np.asarray(delta, np.float32), np.asarray(mask) != 0
    d = d32.astype(np.float64)
    n_rows, t = d.shape
    a = np.asarray(adv, np.float64)
    a = a if a.ndim == 2 else np.broadcast_to(a[:, None], (n_rows, t))
    w = np.asarray(weights, np.float64)
    n = m.sum()
    out = {"mean_abs_delta": np.abs(d[m]).mean(), "frac_small": np.mean(np.abs(d32[m]) < np.float32(0.05))}
    out["delta_q05"], out["delta_q50"], out["delta_q95"] = np.quantile(d[m], [0.05, 0.5, 0.95])
    out["kl_k1"] = np.mean(-d[m])
    out["kl_k3"] = np.mean(np.exp(d[m]) - 1 - d[m])
    out["chi2_token"] = np.mean(np.exp(d[m]) ** 2) - 1
    sel = {"Apos_dpos": (a > 0) & (d > 0), "Apos_dneg": (a > 0) & (d < 0), "Aneg_dpos": (a < 0) & (d > 0),
           "Aneg_dneg": (a < 0) & (d < 0)}
    mass_total = np.abs(a[m]).sum()
    for q, s in sel.items():
        out[f"quad_tok_{q}"] = np.sum(s & m) / n
        out[f"quad_mass_{q}"] = np.abs(a[s & m]).sum() / mass_total if mass_total else np.nan
    pp = np.abs(a[sel["Apos_dpos"] & m]).sum()
    out["rho_asym"] = np.abs(a[sel["Aneg_dneg"] & m]).sum() / pp if pp else np.nan
    mass = {q: np.abs(a[s & m]).sum() for q, s in sel.items()}
    odds_neg = mass["Aneg_dneg"] / mass["Aneg_dpos"] if mass["Aneg_dpos"] else np.nan
    odds_pos = mass["Apos_dneg"] / mass["Apos_dpos"] if mass["Apos_dpos"] else np.nan
    out["rho_asym_direction"] = odds_neg / odds_pos if odds_pos and np.isfinite(odds_neg) else np.nan
    tail = m & (d32 < -np.float32(cfg.tau_tail))
    tail_freq = tail.sum() / n
    out["tail_freq"] = tail_freq
    segs = []  # per response: list of (valid, n, n_tail, n_amp_tail)
    for i in range(n_rows):
        row = []
        for s0 in range(0, t, cfg.segment_len):
            sl = slice(s0, min(s0 + cfg.segment_len, t))
            row.append((m[i, sl].any(), m[i, sl].sum(), tail[i, sl].sum(), (tail[i, sl] & (a[i, sl] < 0)).sum()))
        segs.append(row)
    counts = sorted([s[3] for row in segs for s in row if s[0]], reverse=True)
    k = math.ceil(0.05 * len(counts))
    share = sum(counts[:k]) / sum(counts) if sum(counts) else np.nan
    out["tail_top5_share"], out["tail_concentration"] = share, share / 0.05
    dense = [[s[0] and s[2] > 0 and s[2] / s[1] >= 2 * tail_freq for s in row] for row in segs]
    n_valid = sum(s[0] for row in segs for s in row)
    p_dense = sum(map(sum, dense)) / n_valid
    first = both = 0
    for row, drow in zip(segs, dense):
        for j in range(len(row) - 1):
            if row[j][0] and row[j + 1][0] and drow[j]:
                first += 1
                both += drow[j + 1]
    out["tail_persistence"] = (both / first) / p_dense if first and p_dense else np.nan
    with_dense = [i for i in range(n_rows) if any(dense[i])]
    out["hidden_by_mean"] = (np.mean([abs(d[i, m[i]].mean()) < 0.05 for i in with_dense]) if with_dense
                             else np.nan)
    out["energy"] = 0.5 * np.sum(d[m] ** 2)
    dg = np.where(m, d * w * a, 0.0)
    out["b_amp"], out["b_con"] = dg[dg > 0].sum(), -dg[dg < 0].sum()
    # the peers' diagnostics
    rows = [i for i in range(n_rows) if m[i].any()]
    s_i = np.array([d[i, m[i]].sum() for i in rows])
    rho = np.exp(np.clip(s_i, -20, 20))
    out["chi2_seq"] = np.mean(rho ** 2) - 1
    out["rho_seq_q05"], out["rho_seq_q50"], out["rho_seq_q95"] = np.quantile(rho, [0.05, 0.5, 0.95])
    wt, ws = np.exp(d[m]), np.exp(s_i)
    out["ess_token"] = wt.sum() ** 2 / (n * (wt ** 2).sum())
    out["ess_seq"] = ws.sum() ** 2 / (len(rows) * (ws ** 2).sum())
    out["token_mult_prob_error"] = np.mean(np.exp(np.abs(d[m])))
    return out


def assert_metrics_close(got, want, rtol=2e-5, atol=1e-6):
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=rtol, abs=atol, nan_ok=True), k


finite = st.floats(-1.0, 1.0, width=32, allow_subnormal=False)
delta_el = st.one_of(finite, st.sampled_from([0.0, -0.0, -0.3, -0.31, -0.05, 0.05, -2.0, -5.0]))


@st.composite
def batches(draw, token_adv=False):
    delta = np.array(draw(st.lists(delta_el, min_size=N * T, max_size=N * T)), np.float32).reshape(N, T)
    lens = np.array(draw(st.lists(st.integers(0, T), min_size=N, max_size=N)))
    lens[0] = max(lens[0], 1)  # at least one real token
    mask = np.arange(T)[None, :] < lens[:, None]
    if token_adv:
        adv = np.array(draw(st.lists(st.sampled_from([-1.5, -0.5, 0.0, 0.5, 1.0]), min_size=N * T, max_size=N * T)),
                       np.float32).reshape(N, T)
    else:
        adv = np.array(draw(st.lists(st.sampled_from([-1.5, -1.0, 0.0, 0.5, 2.0]), min_size=N, max_size=N)),
                       np.float32)
    return adv, delta, mask


# ------------------------------------------------------------------------------------------------ hand cases


def test_hand_computed_batch():
    # Response 0: A = -1, delta [-0.5, -0.4, 0.1, 0.0]; response 1: A = 2, delta [0.2, -0.1, 0.0 | pad].
    # L = 2, tau_tail = 0.3; n = 7 real tokens; sorted: [-0.5, -0.4, -0.1, 0, 0, 0.1, 0.2].
    delta = np.array([[-0.5, -0.4, 0.1, 0.0], [0.2, -0.1, 0.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
    adv = np.array([-1.0, 2.0], np.float32)
    m = f(mismatch_metrics(adv, delta, mask, TriageConfig(segment_len=2)))
    assert SPEC_NAMES <= set(m)
    real = [-0.5, -0.4, 0.1, 0.0, 0.2, -0.1, 0.0]
    want = {
        "n_tokens": 7, "mean_abs_delta": 1.3 / 7, "frac_small": 2 / 7,
        "delta_q05": -0.5 + 0.3 * 0.1, "delta_q50": 0.0, "delta_q95": 0.1 + 0.7 * 0.1,  # positions 0.3, 3, 5.7
        "kl_k1": 0.1, "kl_k3": sum(math.exp(x) - 1 - x for x in real) / 7,
        "chi2_token": sum(math.exp(2 * x) for x in real) / 7 - 1,
        # strict signs: the two zeros are in no quadrant.
        "quad_tok_Apos_dpos": 1 / 7, "quad_tok_Apos_dneg": 1 / 7, "quad_tok_Aneg_dpos": 1 / 7,
        "quad_tok_Aneg_dneg": 2 / 7,
        # |A| mass: 4 tokens x 1 + 3 tokens x 2 = 10.
        "quad_mass_Apos_dpos": 0.2, "quad_mass_Apos_dneg": 0.2, "quad_mass_Aneg_dpos": 0.1, "quad_mass_Aneg_dneg": 0.2,
        "rho_asym": 1.0, "tail_freq": 2 / 7,
        # 4 segments hold a real token -> top ceil(0.2) = 1 segment holds both amplifying tail tokens.
        "tail_top5_share": 1.0, "tail_concentration": 20.0,
        # Dense (f >= 4/7): response 0's first segment only; its successor is not dense.
        "tail_persistence": 0.0, "hidden_by_mean": 0.0,  # |mean delta| of response 0 = 0.2
        "energy": 0.5 * 0.47,
        # alpha: response 0 gates its first segment (dbar -0.45 -> w 0.2): w [0.2, 0.2, 1, 1] / 0.6; response 1: 1.
        # delta * alpha * A: [1/6, 2/15, -1/6, 0] and [0.4, -0.2, 0].
        "b_amp": 1 / 6 + 2 / 15 + 0.4, "b_con": 1 / 6 + 0.2,
    }
    assert_metrics_close(m, want, rtol=1e-5)


def test_hand_computed_peer_diagnostics():
    # Response sums of delta: ln 2, ln 0.5, 30 (clipped to 20 for the sequence weight), and an empty response.
    delta = np.array([[LN2, 0.0, 0.0], [-LN2 / 2, -LN2 / 2, 0.0], [10.0, 10.0, 10.0], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]], bool)
    adv = np.array([1.0, -1.0, -1.0, -1.0], np.float32)
    m = f(mismatch_metrics(adv, delta, mask, CFG))
    assert PEER_NAMES <= set(m)
    rho = np.array([2.0, 0.5, math.exp(20)])
    assert m["chi2_seq"] == pytest.approx(np.mean(rho ** 2) - 1, rel=1e-5)
    assert m["rho_seq_q50"] == pytest.approx(2.0, rel=1e-6)  # numpy 'linear' over the 3 responses
    assert m["rho_seq_q05"] == pytest.approx(0.5 + 0.1 * 1.5, rel=1e-6)
    assert m["rho_seq_q95"] == pytest.approx(2 + 0.9 * (math.exp(20) - 2), rel=1e-5)
    # ESS: the sequence weights are not clipped (exp(30) dominates: ESS -> 1/3), nor the token ones.
    assert m["ess_seq"] == pytest.approx(1 / 3, rel=1e-6)
    wt = np.exp(np.array([LN2, 0, -LN2 / 2, -LN2 / 2, 0, 10, 10, 10]))
    assert m["ess_token"] == pytest.approx(wt.sum() ** 2 / (8 * (wt ** 2).sum()), rel=1e-5)
    assert m["token_mult_prob_error"] == pytest.approx(np.mean(np.exp(np.abs(np.log(wt)))), rel=1e-5)
    # frac_corrected_<name>: what each rule (default settings) clips, zeroes or drops, over the 8 real tokens.
    assert m["frac_corrected_token_tis"] == pytest.approx(3 / 8)  # the three exp(10) > 2
    assert m["frac_corrected_seq_tis"] == pytest.approx(3 / 8)  # response 2 (exp(20) > 2); ln 2 is not > ln 2
    assert m["frac_corrected_opsm"] == pytest.approx(3 / 8)  # response 1: A < 0 and mean(-delta) = ln2/3 > 1e-4
    assert m["frac_corrected_geo_rs"] == 1.0  # every response is outside [0.999, 1.001]


def test_frac_corrected_agrees_with_apply_correction():
    rng = np.random.default_rng(1)
    delta = (0.4 * rng.standard_normal((N, T))).astype(np.float32)
    mask = np.arange(T)[None] < rng.integers(0, T + 1, (N, 1))
    adv = rng.choice([-1.0, 0.5, 1.0], N).astype(np.float32)
    m = f(mismatch_metrics(adv, delta, mask, CFG))
    for name in CORRECTIONS:
        if name == "none":
            continue
        cfg = CFG if name == "triage" else make_config(name)
        met = apply_correction(name, adv=adv, delta=delta, mask=mask, cfg=cfg).metrics
        assert m[f"frac_corrected_{name}"] == pytest.approx(float(met["frac_clipped"] + met["frac_masked"]),
                                                            abs=1e-6), name


def test_hand_computed_persistence_and_hidden_by_mean():
    # Segment length 1: each token is a segment. Both responses A < 0; tail tokens (-1) at r0 {0, 1, 9}, r1 {0};
    # tail_freq = 4/20, so dense = tail segment; P(dense) = 4/20; adjacent pairs with a dense first: r0 (0,1),
    # (1,2), r1 (0,1) -> 3, both dense: 1 -> persistence = (1/3) / 0.2. Response means: -0.3 and 0 -> hidden 1/2.
    delta = np.zeros((2, 10), np.float32)
    delta[0, [0, 1, 9]] = -1.0
    delta[1, 0], delta[1, 1] = -1.0, 1.0
    m = f(mismatch_metrics(np.array([-1.0, -1.0], np.float32), delta, np.ones((2, 10), bool),
                           TriageConfig(segment_len=1)))
    assert m["tail_persistence"] == pytest.approx(5 / 3, rel=1e-6)
    assert m["hidden_by_mean"] == 0.5
    # 20 segments -> top 1 segment holds 1 of the 4 amplifying tail tokens.
    assert m["tail_top5_share"] == 0.25 and m["tail_concentration"] == pytest.approx(5.0)


def test_empty_denominators_are_nan():
    delta = np.array([[-0.5, 0.2, 0.0, -0.01]], np.float32)
    mask = np.ones((1, 4), bool)
    m = f(mismatch_metrics(np.array([-1.0], np.float32), delta, mask, CFG))
    assert math.isnan(m["rho_asym"])  # no A+ token at all
    m = f(mismatch_metrics(np.array([1.0], np.float32), delta, mask, CFG))
    assert math.isnan(m["tail_top5_share"]) and math.isnan(m["tail_concentration"])  # no amplifying tail
    assert m["rho_asym"] == 0.0
    m = f(mismatch_metrics(np.array([-1.0], np.float32), np.abs(delta) * 0.1, mask, CFG))  # no tail token
    assert math.isnan(m["tail_persistence"]) and math.isnan(m["hidden_by_mean"]) and m["tail_freq"] == 0.0
    m = f(mismatch_metrics(np.array([-1.0], np.float32), delta, np.zeros((1, 4), bool), CFG))  # no token at all
    for k in (SPEC_NAMES | PEER_NAMES) - {"energy", "b_amp", "b_con"}:
        assert math.isnan(m[k]), k
    assert m["energy"] == m["b_amp"] == m["b_con"] == 0.0 and m["n_tokens"] == 0.0


def test_all_positive_and_all_negative_batches():
    mask = np.ones((2, 8), bool)
    adv = np.array([1.0, -1.0], np.float32)
    pos = f(mismatch_metrics(adv, np.full((2, 8), 0.5, np.float32), mask, CFG))
    assert pos["quad_tok_Apos_dpos"] == 0.5 and pos["quad_tok_Aneg_dpos"] == 0.5
    assert pos["tail_freq"] == 0.0 and pos["frac_small"] == 0.0 and pos["delta_q05"] == pytest.approx(0.5)
    neg = f(mismatch_metrics(adv, np.full((2, 8), -0.5, np.float32), mask, CFG))
    assert neg["quad_tok_Apos_dneg"] == 0.5 and neg["quad_tok_Aneg_dneg"] == 0.5 and neg["tail_freq"] == 1.0
    # All tokens tail: f_S = 1 >= 2; never dense.
    assert math.isnan(neg["tail_persistence"])
    # Fully gated A- response is renormalized back to alpha = 1: b_amp = 8 * 0.5 = 4, b_con = 8 * 0.5 = 4.
    assert neg["b_amp"] == pytest.approx(4.0) and neg["b_con"] == pytest.approx(4.0)


def test_masked_quantiles_exact_with_ties_and_signed_zero():
    x = np.array([[3.0, -0.0, 0.0, 1.0, 1.0, 1.0, -7.5, 2.0, 1e-30, -1e30]], np.float32)
    m = np.array([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0]], bool)
    qs = (0.0, 0.05, 0.25, 0.5, 0.95, 1.0)
    np.testing.assert_allclose(masked_quantiles(x, m, qs), np.quantile(x[m].astype(np.float64), qs), rtol=1e-6)
    one = masked_quantiles(np.array([4.0, 5.0], np.float32), np.array([0, 1]), (0.05, 0.5))
    np.testing.assert_array_equal(one, [5.0, 5.0])
    assert np.all(np.isnan(masked_quantiles(x, np.zeros_like(m), qs)))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.floats(-1e4, 1e4, width=32), st.sampled_from([0.0, -0.0, 1.0])), min_size=1,
                max_size=64), st.integers(0, 2**32 - 1))
@example([0.0] * 19 + [5.0], 0)  # a float32 index q * (n - 1) gave 0.249996 at q=0.95 (numpy: 0.25)
def test_masked_quantiles_match_numpy(values, seed):
    x = np.zeros(64, np.float32)
    m = np.zeros(64, bool)
    pos = np.random.default_rng(seed).permutation(64)[: len(values)]
    x[pos], m[pos] = values, True
    qs = (0.05, 0.5, 0.95)
    want = np.quantile(x[m].astype(np.float64), qs)
    np.testing.assert_allclose(masked_quantiles(x, m, qs), want, rtol=1e-5, atol=1e-6 * (1 + np.abs(want).max()))


def test_delta_histogram_and_energy():
    v = np.array([[-200.0, -1.0, -1e-5, 0.0, 1e-5, 0.5, 3.0, 150.0]], np.float32)
    m = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], bool)
    counts = np.asarray(delta_histogram(v, m))
    assert counts.shape == (DELTA_HIST_EDGES.size + 1,) and counts.sum() == 7
    want = np.bincount(np.searchsorted(DELTA_HIST_EDGES, v[m], side="right"), minlength=counts.size)
    np.testing.assert_array_equal(counts, want)
    assert counts[0] == 1  # -200 below the lowest edge (-100)
    counts = np.asarray(delta_histogram(v, m, edges=[-1.0, 0.0, 1.0]))
    np.testing.assert_array_equal(counts, [1, 2, 3, 1])  # [-200] [-1, -1e-5] [0, 1e-5, 0.5] [3]
    with pytest.raises(ValueError, match="strictly increasing"):
        delta_histogram(v, m, edges=[1.0, 0.0])
    assert float(delta_energy(v, m)) == pytest.approx(0.5 * (200.0**2 + 1 + 1e-10 + 0.25 + 9), rel=1e-6)
    after = v * 0.5
    assert float(delta_energy_realized(v, after, m)) == pytest.approx(-0.75 * float(delta_energy(v, m)), rel=1e-6)


@pytest.mark.parametrize("args, err, msg", [
    ((np.zeros(2), np.zeros((2, 3), np.int32), np.ones((2, 3))), TypeError, "delta"),
    ((np.zeros(2), np.zeros((2, 3)), np.ones((3, 3))), ValueError, r"mask: expected shape \(2, 3\), got \(3, 3\)"),
    ((np.zeros((2, 2)), np.zeros((2, 3)), np.ones((2, 3))), ValueError, r"adv: shape \(2, 2\)"),
    ((np.zeros(2, np.int32), np.zeros((2, 3)), np.ones((2, 3))), TypeError, "adv"),
])
def test_bad_inputs(args, err, msg):
    args = tuple(a.astype(np.float32) if a.dtype == np.float64 else a for a in args)
    with pytest.raises(err, match=msg):
        mismatch_metrics(*args)
    with pytest.raises(ValueError, match="weights"):
        mismatch_metrics(np.zeros(2, np.float32), np.zeros((2, 3), np.float32), np.ones((2, 3)),
                         weights=np.ones((2, 4), np.float32))


# ------------------------------------------------------------------------------------------------ properties


@settings(max_examples=30, deadline=None)
@given(batches())
def test_matches_reference(batch):
    adv, delta, mask = batch
    alpha = np.asarray(gate_weights(adv, delta, mask, CFG))
    got = f(mismatch_metrics(adv, delta, mask, CFG))
    want = ref_metrics(adv, delta, mask, CFG, alpha)
    assert_metrics_close(got, want, rtol=1e-4, atol=1e-5)
    # The response-level fast path, the token-level path and explicit weights agree.
    got_tok = f(mismatch_metrics(np.broadcast_to(adv[:, None], (N, T)), delta, mask, CFG))
    got_w = f(mismatch_metrics(adv, delta, mask, CFG, weights=alpha))
    assert_metrics_close(got_tok, got, rtol=1e-5, atol=1e-5)
    assert_metrics_close(got_w, got, rtol=1e-5, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(batches(token_adv=True))
def test_matches_reference_token_level_adv(batch):
    adv, delta, mask = batch
    alpha = np.asarray(gate_weights(adv, delta, mask, CFG))
    assert_metrics_close(f(mismatch_metrics(adv, delta, mask, CFG)), ref_metrics(adv, delta, mask, CFG, alpha),
                         rtol=1e-4, atol=1e-5)
    ones = np.ones((N, T), np.float32)
    assert_metrics_close(f(mismatch_metrics(adv, delta, mask, CFG, weights=ones)),
                         ref_metrics(adv, delta, mask, CFG, ones), rtol=1e-4, atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_invariant_to_padding_and_permutation(batch, rnd):
    adv, delta, mask = batch
    base = f(mismatch_metrics(adv, delta, mask, CFG))
    garbage = np.float32(rnd.choice([np.nan, np.inf, -1e30, -3.0]))
    delta_p = np.concatenate([np.where(mask, delta, garbage), np.full((N, 4), garbage, np.float32)], 1)
    delta_p = np.concatenate([delta_p, np.full((1, T + 4), -3.0, np.float32)], 0)
    mask_p = np.concatenate([np.pad(mask, ((0, 0), (0, 4))), np.zeros((1, T + 4), bool)], 0)
    adv_p = np.concatenate([adv, [-1.0]]).astype(np.float32)
    padded = f(mismatch_metrics(adv_p, delta_p, mask_p, CFG))
    assert_metrics_close(padded, base, rtol=1e-5, atol=1e-6)
    perm = np.array(rnd.sample(range(N), N))
    assert_metrics_close(f(mismatch_metrics(adv[perm], delta[perm], mask[perm], CFG)), base, rtol=1e-5, atol=1e-6)


def test_jit_and_vmap():
    rng = np.random.default_rng(0)
    adv = rng.choice([-1.0, 1.0], (2, N)).astype(np.float32)
    delta = (0.3 * rng.standard_normal((2, N, T))).astype(np.float32)
    mask = np.arange(T)[None, None, :] < rng.integers(1, T + 1, (2, N, 1))
    batched = jax.vmap(lambda a, d, m: mismatch_metrics(a, d, m, CFG))(adv, delta, mask)
    eager = [f(mismatch_metrics(adv[b], delta[b], mask[b], CFG)) for b in range(2)]
    for b in range(2):
        assert_metrics_close({k: float(v[b]) for k, v in batched.items()}, eager[b], rtol=1e-5, atol=1e-6)
    jitted = jax.jit(lambda a, d, m: mismatch_metrics(a, d, m, CFG)["rho_asym"])
    assert float(jitted(adv[0], delta[0], mask[0])) == pytest.approx(eager[0]["rho_asym"], rel=1e-6)
    g = jax.grad(lambda d: mismatch_metrics(adv[0], d, mask[0], CFG)["energy"])(jnp.asarray(delta[0]))
    assert np.all(np.asarray(g) == 0)  # diagnostics are measurements: no gradient


# ------------------------------------------------------------------------------------------------ nulls


def _lengths_batch(seed=0, n=64, t=96, direction=0.0, seg=8):
    """Groups of 8 responses sharing an advantage; wrong (A < 0) answers run 90 tokens, right ones 40; delta's sign
    is a fair coin, except that with probability `direction` an A < 0 token is made negative."""
    rng = np.random.default_rng(seed)
    adv = np.repeat(rng.standard_normal(n // 8), 8).astype(np.float32)
    adv -= adv.mean()
    mask = np.arange(t)[None] < np.where(adv < 0, 90, 40)[:, None]
    delta = (rng.standard_normal((n, t)) * 0.01).astype(np.float32)
    flip = (adv[:, None] < 0) & (rng.random((n, t)) < direction)
    return adv, np.where(flip, -np.abs(delta), delta), mask, TriageConfig(segment_len=seg)


def test_null_metrics_only_with_a_key_and_deterministic_under_it():
    adv, delta, mask, cfg = _lengths_batch()
    assert not set(NULL_METRICS) & set(mismatch_metrics(adv, delta, mask, cfg))
    a = f(mismatch_metrics(adv, delta, mask, cfg, null_key=jax.random.key(3)))
    b = f(mismatch_metrics(adv, delta, mask, cfg, null_key=jax.random.key(3)))
    assert set(NULL_METRICS) <= set(a) and a == pytest.approx(b, nan_ok=True)
    with pytest.raises(ValueError, match="response-level advantages"):
        mismatch_metrics(np.broadcast_to(adv[:, None], delta.shape), delta, mask, cfg, null_key=jax.random.key(3))


def test_shuffles_permute_the_valid_rows_only():
    valid = np.array([1, 0, 1, 1, 0, 1, 1, 0], bool)
    perm = np.asarray(diagnostics._shuffled_rows(jax.random.key(0), jnp.asarray(valid), 200))
    for p in perm:
        assert sorted(p[valid]) == list(np.flatnonzero(valid)) and sorted(p[~valid]) == list(np.flatnonzero(~valid))
    assert len({tuple(p) for p in perm}) > 50  # 5! = 120 orders of the valid rows: the shuffles vary


def test_rho_asym_null_is_the_statistic_of_the_shuffled_advantages():
    """Recomputed in NumPy from the same shuffles: the median, the ratio and the permutation p-value."""
    adv, delta, mask, cfg = _lengths_batch(seed=1, direction=0.3)
    key = jax.random.key(5)
    got = f(mismatch_metrics(adv, delta, mask, cfg, null_key=key))
    k_rho, _ = jax.random.split(key)
    valid = mask.any(1)
    perm = np.asarray(diagnostics._shuffled_rows(k_rho, jnp.asarray(valid), diagnostics.NULL_PERMUTATIONS))
    pos, neg = (mask & (delta > 0)).sum(1), (mask & (delta < 0)).sum(1)
    a = adv[perm].astype(np.float64)
    draws = np.where(a < 0, -a * neg, 0).sum(1) / np.where(a > 0, a * pos, 0).sum(1)
    assert got["rho_asym_null"] == pytest.approx(np.median(draws), rel=1e-5)
    assert got["rho_asym_excess"] == pytest.approx(got["rho_asym"] / np.median(draws), rel=1e-5)
    p = (1 + np.sum(draws >= got["rho_asym"] * (1 - 1e-6))) / (1 + draws.size)
    assert got["rho_asym_null_p"] == pytest.approx(p)


def test_length_confound_and_direction_are_told_apart():
    """Wrong answers that run longer raise rho_asym and its shuffle excess with no direction effect at all; the
    odds ratio stays at 1. A real direction effect moves the odds ratio."""
    plain = f(mismatch_metrics(*_lengths_batch(seed=2)[:3], _lengths_batch()[3], null_key=jax.random.key(0)))
    assert plain["rho_asym"] > 1.8 and plain["rho_asym_excess"] > 1.6 and plain["rho_asym_null_p"] < 0.05
    assert 0.85 < plain["rho_asym_direction"] < 1.15
    tilted = f(mismatch_metrics(*_lengths_batch(seed=2, direction=0.4)[:3], _lengths_batch()[3],
                                null_key=jax.random.key(0)))
    assert tilted["rho_asym_direction"] > 2.0


def test_tail_persistence_null_separates_clustering_from_adjacency():
    """Tail-dense segments clustered in a few responses (anywhere in them) make raw persistence > 1 at chance
    adjacency; the shuffle null absorbs that. Dense segments that follow each other within a response exceed it."""
    n, s, seg = 48, 12, 8
    rng = np.random.default_rng(0)
    adv = np.where(np.arange(n) % 2, 1.0, -1.0).astype(np.float32)
    mask = np.ones((n, s * seg), bool)

    def batch(runs: bool):
        delta = np.full((n, s, seg), 0.01, np.float32)
        for i in range(0, n, 3):  # every third response holds tail-dense segments
            idx = np.arange(4) + rng.integers(0, s - 4) if runs else rng.choice(s, 4, replace=False)
            delta[i, idx, :4] = -1.0
        return delta.reshape(n, s * seg)

    cfg = TriageConfig(segment_len=seg, tau_tail=0.3)
    scattered = f(mismatch_metrics(adv, batch(False), mask, cfg, null_key=jax.random.key(1)))
    adjacent = f(mismatch_metrics(adv, batch(True), mask, cfg, null_key=jax.random.key(1)))
    assert scattered["tail_persistence"] > 1.5 and 0.6 < scattered["tail_persistence_excess"] < 1.5
    assert adjacent["tail_persistence_excess"] > 2.0 and adjacent["tail_persistence_null_p"] < 0.05
