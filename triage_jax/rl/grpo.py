"""GRPO / DAPO math (docs/rl_math.md): group advantages, the clipped surrogate, loss aggregation, dynamic-sampling
filter, overlong shaping, k3 KL and entropy. Pure jax.numpy; shapes N responses x T positions.

Losses return `(unreduced sum, denominator)`: summing both over micro-batches and dividing once gives exactly the
full-batch value, whatever the aggregation mode.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from triage_jax.rl._checks import F32, check_adv, check_float, check_mask, check_same_shape, safe_div

LOG_RATIO_CLIP = 20.0


# ----------------------------------------------------------------------------------------------------- advantages


@functools.partial(jax.jit, static_argnames=("group_size", "std_normalize", "eps"))
def group_advantages(rewards, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6) -> jax.Array:
    """A_i = (r_i - mean_g r) / (std_g r + eps) over consecutive groups of `group_size` (Bessel std).

    `std_normalize=False` drops the division (Dr. GRPO). rewards [N] with N a multiple of group_size -> [N] f32.
    """
    r = _check_rewards(rewards, group_size)
    if std_normalize and group_size < 2:
        raise ValueError(f"group_size={group_size}: the Bessel-corrected std needs group_size >= 2")
    r_gk = r.reshape(-1, group_size)
    centered = r_gk - jnp.mean(r_gk, axis=1, keepdims=True)
    if std_normalize:
        centered = centered / (jnp.std(r_gk, axis=1, keepdims=True, ddof=1) + eps)
    return centered.reshape(-1)


@functools.partial(jax.jit, static_argnames=("group_size",))
def dynamic_sampling_keep(correct, group_size: int) -> jax.Array:
    """bool[N // group_size]: DAPO dynamic sampling keeps a group when 0 < (number correct) < G.

    `correct` [N] is each response's 0/1 correctness, not its shaped reward: with overlong shaping an all-wrong
    group whose responses differ in length would otherwise survive (and its shorter wrong answers get A > 0).
    """
    correct = jnp.asarray(correct)
    c_gk = _check_rewards(correct.astype(F32) if correct.dtype == jnp.bool_ else correct,
                          group_size).reshape(-1, group_size)
    n_correct = jnp.sum(c_gk > 0, axis=1)
    return (n_correct > 0) & (n_correct < group_size)


@functools.partial(jax.jit, static_argnames=("max_len", "buffer"))
def overlong_penalty(lengths, max_len: int, buffer: int, factor: float = 1.0) -> jax.Array:
    """DAPO soft overlong punishment in tokens: `min(-(len - (L - B)) / B, 0) * factor`, floored at `-factor`.

    The floor only matters for len > L (impossible when generation stops at L) and matches DAPO's -1 there.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer={buffer} must satisfy 0 < buffer <= max_len={max_len}")
    lens = jnp.asarray(lengths)
    if not (jnp.issubdtype(lens.dtype, jnp.integer) or jnp.issubdtype(lens.dtype, jnp.floating)):
        raise TypeError(f"lengths: expected an integer or floating dtype, got {lens.dtype}")
    excess = lens.astype(F32) - (max_len - buffer)
    return jnp.maximum(jnp.minimum(-excess / buffer, 0.0), -1.0) * factor


def _check_rewards(rewards, group_size: int) -> jax.Array:
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    r = jnp.asarray(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards: expected shape [N], got {r.shape}")
    if not (jnp.issubdtype(r.dtype, jnp.floating) or jnp.issubdtype(r.dtype, jnp.integer)):
        raise TypeError(f"rewards: expected a floating or integer dtype, got {r.dtype}")
    if r.shape[0] % group_size:
        raise ValueError(f"rewards: N={r.shape[0]} is not a multiple of group_size={group_size}")
    return r.astype(F32)


# ---------------------------------------------------------------------------------------------------- aggregation

AggFn = Callable[..., tuple[jax.Array, jax.Array]]


def _n_seqs(mask_nt: jax.Array) -> jax.Array:
    # Rows without a real token are padding rows: they count in no denominator.
    return jnp.sum(jnp.any(mask_nt > 0, axis=1).astype(F32))


def _token_mean(loss_nt, mask_nt, max_len):
    return jnp.sum(loss_nt * mask_nt), jnp.sum(mask_nt)


def _seq_mean_token_mean(loss_nt, mask_nt, max_len):
    n_i = jnp.sum(mask_nt, axis=1)
    per_seq = jnp.sum(loss_nt * mask_nt, axis=1) / jnp.maximum(n_i, 1.0)
    return jnp.sum(per_seq), _n_seqs(mask_nt)


def _seq_mean_token_sum(loss_nt, mask_nt, max_len):
    return jnp.sum(loss_nt * mask_nt), _n_seqs(mask_nt)


def _seq_mean_token_sum_norm(loss_nt, mask_nt, max_len):
    if max_len is None or max_len <= 0:
        raise ValueError(f"agg='seq-mean-token-sum-norm' needs a fixed max_len > 0 (the run's max response length), "
                         f"got max_len={max_len!r}")
    return jnp.sum(loss_nt * mask_nt) / max_len, _n_seqs(mask_nt)


AGGREGATIONS: dict[str, AggFn] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


@functools.partial(jax.jit, static_argnames=("agg", "max_len"))
def aggregate(loss_nt, mask, agg: str = "token-mean", *, max_len: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-token loss [N,T] -> (unreduced sum, denominator) under aggregation mode `agg` (see AGGREGATIONS).

    token-mean: (sum m*l, sum m). seq-mean-*: denominator = number of responses holding a real token, numerator
    the sum over responses of their token mean / token sum / token sum divided by the fixed `max_len`.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {sorted(AGGREGATIONS)}")
    loss_nt = check_float("loss_nt", loss_nt, 2)
    mask_nt = check_mask("mask", mask, loss_nt.shape)
    return AGGREGATIONS[agg](loss_nt, mask_nt, max_len)


# ------------------------------------------------------------------------------------------------------ surrogate


@functools.partial(jax.jit, static_argnames=("eps_low", "eps_high", "dual_clip", "agg", "max_len"))
def policy_loss(
    logp,
    old_logp,
    adv,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    weights=None,
    agg: str = "token-mean",
    max_len: int | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, r = exp(clip(logp - old_logp, +-20)).

    `dual_clip=c` caps the loss of A < 0 tokens at `c*|A|`. `weights` [N,T] (e.g. TRIAGE alpha, TIS weights)
    multiply the per-token loss with no gradient. Returns (loss_sum, denom, metric_sums): masked sums over real
    tokens of clipfrac, clipfrac_low, clipfrac_high, dual_clipfrac, ratio_mean, ppo_kl (old_logp - logp), and
    their count `tokens`; `metric_means` turns (accumulated) sums into token means.
    """
    logp = check_float("logp", logp, 2)
    old_logp = check_float("old_logp", old_logp, 2)
    check_same_shape("old_logp", old_logp, "logp", logp)
    mask_nt = check_mask("mask", mask, logp.shape)
    a_nt = jax.lax.stop_gradient(check_adv(adv, logp.shape))
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, "
                         f"eps_high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")

    log_ratio = jnp.clip(logp - jax.lax.stop_gradient(old_logp), -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss_unclipped = -ratio * a_nt
    loss_clipped = -clipped_ratio * a_nt
    loss_nt = jnp.maximum(loss_unclipped, loss_clipped)
    dual_hit = jnp.zeros_like(loss_nt, dtype=bool)
    if dual_clip is not None:
        cap = -dual_clip * a_nt
        dual_hit = (a_nt < 0) & (loss_nt > cap)
        loss_nt = jnp.where(a_nt < 0, jnp.minimum(loss_nt, cap), loss_nt)
    if weights is not None:
        w = check_float("weights", weights, 2)
        check_same_shape("weights", w, "logp", logp)
        loss_nt = loss_nt * jax.lax.stop_gradient(w)
    # Padding may hold any value: keep it out of the sums (0 * inf would be NaN).
    loss_nt = jnp.where(mask_nt > 0, loss_nt, 0.0)
    loss_sum, denom = aggregate(loss_nt, mask_nt, agg, max_len=max_len)

    def total(x):
        return jax.lax.stop_gradient(jnp.sum(jnp.where(mask_nt > 0, x.astype(F32), 0.0)))

    clipped = loss_clipped > loss_unclipped
    # Masked sums over real tokens with their count: accumulated over micro-batches and divided once
    # (`metric_means`), a micro-batch without a token adds zeros instead of turning the mean NaN.
    metrics = {
        "clipfrac": total(clipped),
        "clipfrac_low": total(clipped & (ratio < 1.0 - eps_low)),
        "clipfrac_high": total(clipped & (ratio > 1.0 + eps_high)),
        "dual_clipfrac": total(dual_hit),
        "ratio_mean": total(ratio),
        "ppo_kl": total(-log_ratio),
        "tokens": jax.lax.stop_gradient(jnp.sum(mask_nt)),
    }
    return loss_sum, denom, metrics


def metric_means(metric_sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Token means of `policy_loss`'s metric sums (summed over micro-batches first); NaN where no token counted."""
    count = metric_sums["tokens"]
    return {k: safe_div(v, count) for k, v in metric_sums.items() if k != "tokens"}


# ---------------------------------------------------------------------------------------------- KL and entropy


@jax.jit
def k3_kl(logp, ref_logp, mask) -> jax.Array:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): `exp(ref - logp) - (ref - logp) - 1`, 0 on padding.

    Add `kl_coef * k3_kl(...)` through `aggregate` with the policy loss's mode: same mask, same denominator.
    """
    logp = check_float("logp", logp, 2)
    ref_logp = check_float("ref_logp", ref_logp, 2)
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    mask_nt = check_mask("mask", mask, logp.shape)
    d = jnp.clip(jax.lax.stop_gradient(ref_logp) - logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return jnp.where(mask_nt > 0, jnp.exp(d) - d - 1.0, 0.0)


@jax.jit
def entropy_from_logits(logits) -> jax.Array:
    """Entropy of softmax(logits) over the last (vocabulary) axis: [..., V] -> [...], float32."""
    x = check_float("logits", logits, tuple(range(1, 8)))
    logp = jax.nn.log_softmax(x, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@jax.jit
def masked_entropy(logits_ntv, mask) -> tuple[jax.Array, jax.Array]:
    """(sum of per-token entropy over real tokens, token count) for logits [N,T,V] — a token-mean to log."""
    x = check_float("logits_ntv", logits_ntv, 3)
    mask_nt = check_mask("mask", mask, x.shape[:2])
    ent_nt = entropy_from_logits(x)
    return jnp.sum(jnp.where(mask_nt > 0, ent_nt, 0.0)), jnp.sum(mask_nt)
