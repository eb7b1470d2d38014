"""Mismatch diagnostics (docs/rl_math.md#diagnostics), cheap enough to log every step; one jit-able function of (adv, delta, mask).

`mismatch_metrics` returns float32 scalars under these names (N responses, T positions, masked to real tokens):

- `mean_abs_delta`, `frac_small` (|delta| < 0.05), `delta_q05`, `delta_q50`, `delta_q95` (exact masked quantiles,
  numpy's 'linear' interpolation, by a two-pass radix select; delta must be finite on real tokens),
  `kl_k1` = mean(-delta), `kl_k3` = mean(rho - 1 - delta), `chi2_token` = mean(rho^2) - 1 with rho = exp(delta)
  (evaluated through expm1(delta) so that small mismatches keep their precision).
- Quadrants, strict signs (a token with A == 0 or delta == 0 is in none): token fractions
  `quad_tok_Apos_dpos`, `quad_tok_Apos_dneg`, `quad_tok_Aneg_dpos`, `quad_tok_Aneg_dneg` and |A|-weighted mass
  shares `quad_mass_Apos_dpos`, `quad_mass_Apos_dneg`, `quad_mass_Aneg_dpos`, `quad_mass_Aneg_dneg`.
- `rho_asym` = |A|-mass of A-d- / that of A+d+.
- `tail_freq` (delta < -tau_tail), `tail_top5_share`, `tail_concentration` (= share / 0.05), `tail_persistence`,
  `hidden_by_mean`.
- `energy` = 1/2 sum m*delta^2, `b_amp`, `b_con` with g = weights * A (weights default: TRIAGE alpha of `cfg`).
- The peers' diagnostics (docs/rl_math.md#peer-diagnostics): `chi2_seq` = mean_i(rho_i^2) - 1 over responses with
  rho_i = exp(clip(sum_t delta, +-20)) (the sequence IS weight the seq corrections see, before their clamp),
  `rho_seq_q05`, `rho_seq_q50`, `rho_seq_q95` (its quantiles), `ess_token` and `ess_seq` (Kish effective sample
  size (sum w)^2 / (n sum w^2) of the raw token weights exp(delta) and sequence weights exp(sum_t delta), computed
  shifted by their max so that no weight overflows), `token_mult_prob_error` = mean exp(|delta|) (NeMo-RL), and for
  every registered correction but `none` `frac_corrected_<name>`: the fraction of real tokens that rule clips,
  zeroes or drops on this batch at its default settings (TRIAGE at `cfg`).
- `n_tokens`, `n_segments` (segments holding a real token), for reference.
- With `null_key` (response-level advantages): the permutation nulls of the direction signals
  (docs/rl_math.md#nulls). `rho_asym_null` is the median of rho_asym over `NULL_PERMUTATIONS` shuffles of the
  advantages across the batch's responses (each keeps its tokens, so its length and its count of d+ / d- tokens),
  `rho_asym_excess` = rho_asym / rho_asym_null, `rho_asym_null_p` the one-sided permutation p-value
  (1 + #{shuffles >= observed}) / (1 + shuffles); `tail_persistence_null` / `_excess` / `_null_p` the same with the
  segments of each response shuffled (adjacency broken, each response's count of dense segments kept).
  `rho_asym_direction` (no key needed): rho_asym = M x (d- share among A < 0) /
  (d+ share among A > 0), M the |A|-mass ratio of the A- and A+ tokens, which counts lengths (wrong answers run
  longer) and is kept by the advantage shuffle. The direction part alone is the odds ratio
  [d- / d+ among A < 0] / [d- / d+ among A > 0] (tokens |A|-weighted): 1 when a token's sign does not depend on
  its response's advantage, whatever the lengths and the overall balance of d- and d+.

A metric whose denominator is empty is NaN. A segment is tail-dense when f_S >= 2 * tail_freq and it holds at
least one tail token (so a batch without tail tokens has no dense segment rather than only dense ones).
`delta_energy` and `delta_histogram` are the trainer's helpers for `delta_energy_realized` and histogram logging.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from triage_jax.rl._checks import F32, check_adv_any, check_float, check_mask, safe_div
from triage_jax.rl.corrections import CORRECTIONS, SEQ_LOG_RATIO_CLIP
from triage_jax.rl.triage import TriageConfig, core_sums, gate, segment_counts, segment_weights, stats_from_sums

SMALL_DELTA = 0.05
TOP_SEGMENT_FRACTION = 0.05
QUANTILES = (0.05, 0.50, 0.95)
QUADRANTS = ("Apos_dpos", "Apos_dneg", "Aneg_dpos", "Aneg_dneg")
NULL_PERMUTATIONS = 64  # shuffles per batch for the direction nulls: a p-value resolution of 1/65
NULL_METRICS = ("rho_asym_null", "rho_asym_excess", "rho_asym_null_p", "tail_persistence_null",
                "tail_persistence_excess", "tail_persistence_null_p")

# Default histogram edges for delta: 0 and +-10^k for k in [-4, 2] at 4 edges per decade.
DELTA_HIST_EDGES = np.concatenate(
    [-np.logspace(2, -4, 25), [0.0], np.logspace(-4, 2, 25)]).astype(np.float32)


# -------------------------------------------------------------------------------------------- masked quantiles

_RADIX = 16
_BINS = 1 << _RADIX


def _sortable_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is the float order (negatives flipped, positives get the top bit)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _key_to_float(k: jax.Array) -> jax.Array:
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(bits, F32)


def _select_bin(hist: jax.Array, rank: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For hist [B] (B = 2^16) and 0-based ranks [R]: the bin holding each rank and the rank inside that bin.

    Two-level search (256 coarse bins of 256) instead of a 65536-long cumsum, which is slow on CPU.
    """
    h2 = hist.reshape(256, 256)
    coarse = h2.sum(axis=1)
    ccum = jnp.cumsum(coarse)
    c = jnp.sum(ccum[None, :] <= rank[:, None], axis=1)
    r1 = rank - (ccum[c] - coarse[c])
    rows = h2[c]  # [R, 256]
    fcum = jnp.cumsum(rows, axis=1)
    f = jnp.sum(fcum <= r1[:, None], axis=1)
    below = jnp.take_along_axis(fcum - rows, f[:, None], axis=1)[:, 0]
    return c * 256 + f, r1 - below


def masked_order_stats(x: jax.Array, mask: jax.Array, ranks: jax.Array) -> jax.Array:
    """Exact order statistics x_(r) (0-based, ascending) over the masked elements, by a two-pass 16-bit radix
    select: two scatter-add histograms instead of a full sort. Ranks [R] must lie in [0, count)."""
    key = _sortable_key(x.reshape(-1))
    real = mask.reshape(-1) > 0
    hi = (key >> _RADIX).astype(jnp.int32)
    lo = (key & jnp.uint32(_BINS - 1)).astype(jnp.int32)
    r = ranks.astype(jnp.int32)
    n_r = r.shape[0]
    # Padding gets an out-of-range index that the scatter drops.
    b_hi, r_in = _select_bin(jnp.zeros(_BINS, jnp.int32).at[jnp.where(real, hi, _BINS)].add(1, mode="drop"), r)
    # Second pass: each element feeds the low-bit histogram of the first target sharing its high bin (a short
    # compare chain over the R targets); elements of no target are dropped.
    slot = jnp.full(hi.shape, n_r, jnp.int32)
    for j in reversed(range(n_r)):
        slot = jnp.where(hi == b_hi[j], j, slot)
    idx = jnp.where(real, slot * _BINS + lo, n_r * _BINS)
    hist_lo = jnp.zeros(n_r * _BINS, jnp.int32).at[idx].add(1, mode="drop").reshape(n_r, _BINS)
    first_slot = jnp.argmax(b_hi[None, :] == b_hi[:, None], axis=1)  # first target with the same high bin
    b_lo = jax.vmap(lambda h, rr: _select_bin(h, rr[None])[0][0])(hist_lo[first_slot], r_in)
    return _key_to_float((b_hi.astype(jnp.uint32) << _RADIX) | b_lo.astype(jnp.uint32))


@functools.partial(jax.jit, static_argnames=("qs",))
def masked_quantiles(x, mask, qs=QUANTILES) -> jax.Array:
    """Quantiles of the masked elements of x (numpy 'linear' method); NaN for an empty mask. Returns [len(qs)]."""
    x = check_float("x", x, tuple(range(1, 8)))
    m = check_mask("mask", mask, x.shape)
    return _quantiles(x, m, qs, jnp.sum(m > 0, dtype=jnp.int32))


def _quantiles(x, m, qs, count):
    t, i0 = _positions(qs, count)
    i0 = jnp.clip(i0, 0, jnp.maximum(count - 1, 0))
    i1 = jnp.minimum(i0 + 1, jnp.maximum(count - 1, 0))
    v = masked_order_stats(x, m, jnp.concatenate([i0, i1]))
    v0, v1 = v[: len(qs)], v[len(qs):]
    out = jnp.where(t >= 0.5, v1 - (v1 - v0) * (1.0 - t), v0 + (v1 - v0) * t)
    return jnp.where(count > 0, out, jnp.nan)


def _positions(qs, count):
    """numpy's virtual index q * (count - 1) as (fraction in [0, 1), int32 floor), the fraction to float32 rounding.

    A float32 product rounds the index itself (at q=0.95 of 20 values, 18.05 becomes 18.0499992: the quantile
    moves by up to ~6e-8 x count of its neighbours' gap, 0.249996 for numpy's 0.25 between 0 and 5), so the product
    is taken exactly (Veltkamp-Dekker two-product) and the static qs' own float32 rounding added back."""
    q64 = np.asarray(qs, np.float64)
    q32 = q64.astype(np.float32)
    q_err = jnp.asarray((q64 - q32.astype(np.float64)).astype(np.float32))
    c = jnp.asarray(count - 1).astype(F32)  # exact below 2**24 tokens; beyond, off by <= count * 2**-24 positions
    p, e = _two_product(jnp.asarray(q32), c)
    i0 = jnp.floor(p)
    t = (p - i0) + (e + q_err * c)  # p - i0 is exact; the rest is a few ulps of p
    i0 = jnp.where(t < 0, i0 - 1, jnp.where(t >= 1, i0 + 1, i0))
    t = jnp.where(t < 0, t + 1, jnp.where(t >= 1, t - 1, t))
    return t, i0.astype(jnp.int32)


def _two_product(a, b):
    """(p, e) with p = fl(a * b) and p + e = a * b exactly (float32 operands; Veltkamp's split, no FMA)."""
    def split(v):
        big = v * F32(4097.0)  # 2**12 + 1: the high half keeps 12 of the 24 significand bits
        hi = big - (big - v)
        return hi, v - hi

    p = a * b
    (ah, al), (bh, bl) = split(a), split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _top_share(counts_seg: jax.Array, k: jax.Array, max_count: int) -> jax.Array:
    """Sum of the k largest integer counts in [0, max_count], via a histogram of counts instead of a sort."""
    c = counts_seg.reshape(-1).astype(jnp.int32)
    hist = jnp.zeros(max_count + 1, jnp.int32).at[c].add(1, mode="drop")
    values = jnp.arange(max_count, -1, -1)  # descending
    h_desc = hist[::-1]
    above = jnp.cumsum(h_desc) - h_desc  # segments with a larger count
    take = jnp.clip(k - above, 0, h_desc)
    return jnp.sum(take * values).astype(F32)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(F32)


def _sums(xs, axis) -> jax.Array:
    """Sums of same-shaped arrays along `axis`, stacked: one reduction instead of len(xs) (each op costs a
    dispatch, which dominates on arrays this small)."""
    return jnp.stack([_f32(x) for x in xs]).sum(axis=axis)


@functools.partial(jax.jit, static_argnames=("cfg",))
def mismatch_metrics(adv, delta, mask, cfg: TriageConfig = TriageConfig(), *, weights=None,
                     null_key: jax.Array | None = None) -> dict[str, jax.Array]:
    """Every mismatch metric of docs/rl_math.md#diagnostics (names in the module docstring) for one batch; jit-able (cfg static).

    `weights` [N,T] are the per-token weights applied to the loss, for b_amp / b_con; default TRIAGE's alpha.
    `null_key` (a PRNG key) adds the permutation nulls of rho_asym and tail persistence (NULL_METRICS); they need
    response-level advantages [N].
    Structure: a few passes over the tokens yield per-segment sums [N,S] and totals; everything else is computed
    on those. Response-level adv [N] never needs a token-level A: each A-dependent sum is a per-response sum
    times A_i, and TRIAGE's alpha follows from the segment sums.
    """
    delta_nt = jax.lax.stop_gradient(check_float("delta", delta, 2))
    mask_nt = check_mask("mask", mask, delta_nt.shape)
    adv = jax.lax.stop_gradient(check_adv_any(adv, delta_nt.shape))
    if weights is not None:
        weights = jax.lax.stop_gradient(check_float("weights", weights, 2))
        if weights.shape != delta_nt.shape:
            raise ValueError(f"weights: shape {weights.shape} does not match delta shape {delta_nt.shape}")
    L = cfg.segment_len
    real = mask_nt > 0
    d = jnp.where(real, delta_nt, 0.0)
    row_adv = adv.ndim == 1

    # Token passes. The core segment sums are the ones TRIAGE's gate computes (shared under one jit).
    n_s, tail_s, pos_s, neg_s, sum_d_s, sneg_s = core_sums(delta_nt, mask_nt, cfg)
    # rho - 1 = expm1(delta): kl_k3 = mean(rho - 1) - mean(delta) and chi2 = mean(2(rho - 1) + (rho - 1)^2) keep
    # their precision for small delta; squares are dot products, so no squared array is written out.
    em1 = jnp.expm1(d).reshape(-1)
    flat_d = d.reshape(-1)
    sum_em1, sum_em1_sq, d2 = jnp.sum(em1), jnp.dot(em1, em1), jnp.dot(flat_d, flat_d)
    n_small = jnp.sum((real & (jnp.abs(d) < SMALL_DELTA)).astype(F32))
    if row_adv:
        a_i = adv
        aneg_s = (a_i < 0)[:, None]
        amp_tail_s = jnp.where(aneg_s, tail_s, 0)
    else:
        a = jnp.where(real, adv, 0.0)
        abs_a = jnp.abs(a)
        sel = [(a > 0) & (d > 0), (a > 0) & (d < 0), (a < 0) & (d > 0), (a < 0) & (d < 0)]
        q_tot = _sums(sel + [jnp.where(s_, abs_a, 0.0) for s_ in sel] + [abs_a], axis=(1, 2))
        (amp_tail_s,) = segment_counts([real & (d < -cfg.tau_tail) & (a < 0)], L)
    if weights is not None or not row_adv:
        w_nt = gate(adv, delta_nt, mask_nt, cfg)[0] if weights is None else weights
        dg = d * jnp.where(real, w_nt * (adv[:, None] if row_adv else adv), 0.0)
        b_tot = _sums([jnp.where(dg > 0, dg, 0.0), jnp.where(dg < 0, -dg, 0.0)], axis=(1, 2))

    # Segment level [N,S] -> per response [K,N].
    stats = stats_from_sums(n_s, sum_d_s, tail_s)  # as in gate
    w_s = segment_weights(stats, cfg)
    valid = n_s > 0
    rows = _sums([n_s, tail_s, pos_s, neg_s, sum_d_s, sneg_s, w_s * sneg_s, neg_s * (1.0 - w_s), valid,
                  amp_tail_s], axis=2)
    n_i, tail_i, pos_i, neg_i, sum_d_i, sneg_i, wsneg_i, nw_i, valid_i, amp_tail_i = rows
    n_tok = jnp.sum(n_i)
    tail_freq = safe_div(jnp.sum(tail_i), n_tok)
    dense = valid & (tail_s > 0) & (_f32(tail_s) / jnp.maximum(_f32(n_s), 1.0) >= 2.0 * tail_freq)
    pair = valid[:, :-1] & valid[:, 1:]
    drows = _sums([dense[:, :-1] & pair, dense[:, :-1] & pair & dense[:, 1:]], axis=2) if dense.shape[1] > 1 \
        else jnp.zeros((2, dense.shape[0]), F32)
    dense_i = jnp.sum(_f32(dense), axis=1)

    # Per response -> totals, in one reduction.
    has_dense = dense_i > 0
    hidden_i = has_dense & (jnp.abs(sum_d_i / jnp.maximum(n_i, 1.0)) < SMALL_DELTA)
    per_row = [amp_tail_i, valid_i, dense_i, drows[0], drows[1], has_dense, hidden_i]
    if row_adv:
        apos, aneg, abs_ai = a_i > 0, a_i < 0, jnp.abs(a_i)
        cnt = [jnp.where(apos, pos_i, 0.0), jnp.where(apos, neg_i, 0.0), jnp.where(aneg, pos_i, 0.0),
               jnp.where(aneg, neg_i, 0.0)]
        per_row += cnt + [abs_ai * c for c in cnt] + [abs_ai * n_i]
        if weights is None:
            # alpha = w / wbar_i with wbar_i = (n_i - sum_S n_amp_S (1 - w_S)) / n_i; w = 1 off the A-d- region.
            wbar = (n_i - jnp.where(aneg, nw_i, 0.0)) / jnp.maximum(n_i, 1.0)
            inv_wbar = jnp.where(n_i > 0, 1.0 / jnp.where(n_i > 0, wbar, 1.0), 0.0)
            spos_i = sum_d_i - sneg_i
            amp_i = jnp.where(apos, a_i * spos_i, 0.0) + jnp.where(aneg, a_i * wsneg_i, 0.0)
            con_i = jnp.where(apos, -a_i * sneg_i, 0.0) + jnp.where(aneg, -a_i * spos_i, 0.0)
            per_row += [inv_wbar * amp_i, inv_wbar * con_i]
    t = _sums(per_row, axis=1)
    amp_tail_tot, n_valid, n_dense, first_dense, both_dense, n_has_dense, n_hidden = (t[i] for i in range(7))
    if row_adv:
        q_tot = t[7:16]
        if weights is None:
            b_tot = t[16:18]

    out = {"n_tokens": n_tok, "n_segments": n_valid}
    out["mean_abs_delta"] = safe_div(jnp.sum(sum_d_i) - 2.0 * jnp.sum(sneg_i), n_tok)
    out["frac_small"] = safe_div(n_small, n_tok)
    q = _quantiles(delta_nt, mask_nt, QUANTILES, jnp.sum(n_s))
    out["delta_q05"], out["delta_q50"], out["delta_q95"] = q[0], q[1], q[2]
    out["kl_k1"] = safe_div(-jnp.sum(sum_d_i), n_tok)
    out["kl_k3"] = safe_div(sum_em1 - jnp.sum(sum_d_i), n_tok)
    out["chi2_token"] = safe_div(2.0 * sum_em1 + sum_em1_sq, n_tok)
    for j, k in enumerate(QUADRANTS):
        out[f"quad_tok_{k}"] = safe_div(q_tot[j], n_tok)
        out[f"quad_mass_{k}"] = safe_div(q_tot[4 + j], q_tot[8])
    out["rho_asym"] = safe_div(q_tot[7], q_tot[4])
    # q_tot[4:8]: the |A|-mass of A+d+, A+d-, A-d+, A-d-
    out["rho_asym_direction"] = safe_div(safe_div(q_tot[7], q_tot[6]), safe_div(q_tot[5], q_tot[4]))
    out["tail_freq"] = tail_freq
    k_top = (n_valid.astype(jnp.int32) + 19) // 20  # ceil(0.05 * segments), in integers
    share = safe_div(_top_share(amp_tail_s, k_top, L), amp_tail_tot)
    out["tail_top5_share"] = share
    out["tail_concentration"] = share / TOP_SEGMENT_FRACTION
    out["tail_persistence"] = safe_div(safe_div(both_dense, first_dense), safe_div(n_dense, n_valid))
    out["hidden_by_mean"] = safe_div(n_hidden, n_has_dense)
    out["energy"] = 0.5 * d2
    out["b_amp"], out["b_con"] = b_tot[0], b_tot[1]
    out.update(_peer_metrics(adv, d, real, mask_nt, sum_d_i, n_i, n_tok, cfg))
    if null_key is not None:
        if not row_adv:
            raise ValueError(f"mismatch_metrics(null_key=...): the nulls shuffle response-level advantages [N]; "
                             f"got adv of shape {adv.shape}")
        k_rho, k_seg = jax.random.split(null_key)
        null = rho_asym_null(k_rho, a_i, pos_i, neg_i, n_i > 0)
        null.update(tail_persistence_null(k_seg, dense, valid))
        out.update(_null_summaries(out, null))
    return out


def _shuffled_rows(key: jax.Array, valid_n: jax.Array, k: int) -> jax.Array:
    """[k, N] row indices: row i of shuffle j takes the values of row perm[j, i], a uniformly random permutation of
    the valid rows among the valid rows' places (invalid rows only trade places with invalid rows)."""
    n = valid_n.shape[0]
    u = jax.random.uniform(key, (k, n))
    src = jnp.argsort(jnp.where(valid_n, u, 2.0), axis=1)  # the valid rows in random order, then the others
    dst = jnp.argsort(jnp.where(valid_n, 0, 1), stable=True)  # the valid rows in index order, then the others
    return jnp.zeros((k, n), jnp.int32).at[:, dst].set(src.astype(jnp.int32))


def rho_asym_null(key: jax.Array, adv_n, pos_n, neg_n, valid_n, k: int = NULL_PERMUTATIONS) -> dict[str, jax.Array]:
    """rho_asym under NULL_PERMUTATIONS shuffles of the response advantages adv_n over the valid responses; pos_n /
    neg_n are each response's counts of tokens with delta > 0 / < 0 (kept with its tokens). {"rho_asym": [k]}."""
    a = adv_n[_shuffled_rows(key, valid_n, k)]  # [k, N]
    num = jnp.sum(jnp.where(a < 0, -a * neg_n, 0.0), axis=1)
    den = jnp.sum(jnp.where(a > 0, a * pos_n, 0.0), axis=1)
    return {"rho_asym": safe_div(num, den)}


def tail_persistence_null(key: jax.Array, dense_ns, valid_ns, k: int = NULL_PERMUTATIONS) -> dict[str, jax.Array]:
    """tail_persistence with each response's valid segments shuffled (k times): adjacency broken, the response's
    count of tail-dense segments kept. {"tail_persistence": [k]}."""
    n, s = dense_ns.shape
    if s < 2:
        return {"tail_persistence": jnp.full((k,), jnp.nan, F32)}
    u = jax.random.uniform(key, (k, n, s))
    order = jnp.argsort(jnp.where(valid_ns[None], u, 2.0), axis=-1)  # valid segments first, in random order
    dense = jnp.take_along_axis(jnp.broadcast_to(dense_ns[None], (k, n, s)), order, axis=-1)
    valid = jnp.take_along_axis(jnp.broadcast_to(valid_ns[None], (k, n, s)), order, axis=-1)
    pair = valid[..., :-1] & valid[..., 1:]
    first = jnp.sum(_f32(dense[..., :-1] & pair), axis=(1, 2))
    both = jnp.sum(_f32(dense[..., :-1] & pair & dense[..., 1:]), axis=(1, 2))
    chance = safe_div(jnp.sum(_f32(dense_ns)), jnp.sum(_f32(valid_ns)))
    return {"tail_persistence": safe_div(safe_div(both, first), chance)}


def _null_summaries(out: dict[str, jax.Array], null: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Median, observed / median and the one-sided permutation p-value of each null (NaN shuffles left out)."""
    res = {}
    for name, draws in null.items():
        obs = out[name]
        ok = jnp.isfinite(draws)
        med = jnp.nanmedian(jnp.where(ok, draws, jnp.nan))
        res[f"{name}_null"] = med
        res[f"{name}_excess"] = safe_div(obs, med)
        above = jnp.sum(_f32(ok & (draws >= obs)))
        p = (1.0 + above) / (1.0 + jnp.sum(_f32(ok)))
        res[f"{name}_null_p"] = jnp.where(jnp.isfinite(obs) & jnp.any(ok), p, jnp.nan)
    return res


def _kish(log_w: jax.Array, keep: jax.Array, n: jax.Array) -> jax.Array:
    """(sum w)^2 / (n sum w^2) of w = exp(log_w) over `keep`, shifted by the max log weight (scale-invariant)."""
    top = jnp.max(jnp.where(keep, log_w, -jnp.inf))
    w = jnp.where(keep, jnp.exp(log_w - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0).reshape(-1)
    s1, s2 = jnp.sum(w), jnp.dot(w, w)
    return safe_div(safe_div(s1 * s1, s2), n)


def _peer_metrics(adv, d, real, mask_nt, sum_d_i, n_i, n_tok, cfg: TriageConfig) -> dict[str, jax.Array]:
    """The diagnostics Verl, NeMo-RL and slime log, next to the paper's (module docstring); d is 0 off `real`."""
    seq = n_i > 0
    n_seq = jnp.sum(seq.astype(F32))
    log_rho = jnp.clip(sum_d_i, -SEQ_LOG_RATIO_CLIP, SEQ_LOG_RATIO_CLIP)
    out = {"chi2_seq": safe_div(jnp.sum(jnp.where(seq, jnp.expm1(2.0 * log_rho), 0.0)), n_seq)}
    q = _quantiles(jnp.exp(log_rho), seq.astype(F32), QUANTILES, jnp.sum(seq, dtype=jnp.int32))
    out["rho_seq_q05"], out["rho_seq_q50"], out["rho_seq_q95"] = q[0], q[1], q[2]
    out["ess_token"] = _kish(d, real, n_tok)
    out["ess_seq"] = _kish(sum_d_i, seq, n_seq)
    out["token_mult_prob_error"] = 1.0 + safe_div(jnp.sum(jnp.where(real, jnp.expm1(jnp.abs(d)), 0.0)), n_tok)
    for name, corr in CORRECTIONS.items():
        if name == "none":
            continue
        c = cfg if corr.config_cls is TriageConfig else corr.config_cls()
        _, keep, clipped = corr.rule(adv, d, mask_nt, c)
        out[f"frac_corrected_{name}"] = safe_div(jnp.sum((real & (clipped | (keep <= 0))).astype(F32)), n_tok)
    return out


@jax.jit
def delta_energy(delta, mask) -> jax.Array:
    """D = 1/2 sum m*delta^2. `delta_energy_realized` = delta_energy(after) - delta_energy(before)."""
    delta_nt = check_float("delta", delta, 2)
    mask_nt = check_mask("mask", mask, delta_nt.shape)
    d = jnp.where(mask_nt > 0, delta_nt, 0.0)
    return 0.5 * jnp.sum(d * d)


@jax.jit
def delta_energy_realized(delta_before, delta_after, mask) -> jax.Array:
    """D after the update minus D before, on the same tokens (delta_after from a second learner forward pass)."""
    return delta_energy(delta_after, mask) - delta_energy(delta_before, mask)


def delta_histogram(values, mask, edges=DELTA_HIST_EDGES) -> jax.Array:
    """Counts of the masked values in the bins cut by sorted `edges` [E]: int32 [E + 1], bin j holding
    edges[j-1] <= v < edges[j] (bin 0 and bin E are the under/overflow bins)."""
    v = check_float("values", values, tuple(range(1, 8)))
    m = check_mask("mask", mask, v.shape)
    e = np.asarray(edges, np.float32)
    if e.ndim != 1 or e.size == 0 or np.any(np.diff(e) <= 0):
        raise ValueError(f"edges: expected a strictly increasing 1-D array, got shape {e.shape}")
    return _histogram(v, m, tuple(float(x) for x in e))


@functools.partial(jax.jit, static_argnames=("edges",))
def _histogram(v, m, edges):
    e = jnp.asarray(edges, F32)
    # An unrolled binary search: about 5 ms per million values on this CPU ("compare_all" is 40x slower).
    idx = jnp.searchsorted(e, v.reshape(-1), side="right", method="scan_unrolled")
    return jnp.zeros(e.size + 1, jnp.int32).at[idx].add((m.reshape(-1) > 0).astype(jnp.int32))
