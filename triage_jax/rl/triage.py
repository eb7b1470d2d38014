"""TRIAGE (docs/rl_math.md#triage): segment-level, direction-selective gating of the amplifying region (A < 0, delta < 0),
normalized per response so no update mass is removed, plus a bounded pseudo-Huber repair on A > 0 responses.

Vectorized over segments: T is padded to a multiple of `segment_len` and viewed as [N, S, L].
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from triage_jax.rl._checks import (F32, check_adv, check_adv_any, check_float, check_mask, check_same_shape,
                                   config_with)


@dataclasses.dataclass(frozen=True)
class TriageConfig:
    """TRIAGE thresholds (defaults: docs/rl_math.md#thresholds); hashable, so it can be a static jit argument."""

    segment_len: int = 64
    tau_tail: float = 0.3
    g_lo: float = 0.02
    g_hi: float = 0.10
    f_lo: float = 0.10
    f_hi: float = 0.30
    w_min: float = 0.2
    tau_rep: float = 0.0
    beta: float = 0.1
    lambda_rep: float = 0.5
    k_rep: int = 100

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"TriageConfig: {msg}")

        if not isinstance(self.segment_len, (int, np.integer)) or isinstance(self.segment_len, bool) \
                or self.segment_len <= 0:
            bad(f"segment_len must be a positive int, got {self.segment_len!r}")
        if not isinstance(self.k_rep, (int, np.integer)) or isinstance(self.k_rep, bool) or self.k_rep < 0:
            bad(f"k_rep must be an int >= 0, got {self.k_rep!r}")
        for name in ("tau_tail", "g_lo", "g_hi", "f_lo", "f_hi", "w_min", "tau_rep", "beta", "lambda_rep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.tau_tail < 0:
            bad(f"tau_tail must be >= 0, got {self.tau_tail}")
        if not self.g_hi > self.g_lo:
            bad(f"need g_hi > g_lo, got g_lo={self.g_lo}, g_hi={self.g_hi}")
        if not self.f_hi > self.f_lo:
            bad(f"need f_hi > f_lo, got f_lo={self.f_lo}, f_hi={self.f_hi}")
        if not 0.0 < self.w_min <= 1.0:
            bad(f"need 0 < w_min <= 1, got w_min={self.w_min}")
        if not self.beta > 0:
            bad(f"beta must be > 0, got {self.beta}")
        if self.lambda_rep < 0:
            bad(f"lambda_rep must be >= 0, got {self.lambda_rep}")

    @classmethod
    def from_dict(cls, overrides: Mapping[str, Any] | None = None) -> "TriageConfig":
        """Defaults updated by `overrides` (e.g. the trainer's config values); unknown keys are an error."""
        return config_with(cls, overrides, owner="TriageConfig")


class SegmentStats(NamedTuple):
    """Per-segment statistics, each [N, S] with S = ceil(T / segment_len); dbar and f are 0 where n == 0."""

    n: jax.Array  # real tokens in the segment
    dbar: jax.Array  # masked mean delta
    f: jax.Array  # fraction of real tokens with delta < -tau_tail
    valid: jax.Array  # bool: the segment holds a real token (others are ignored)


def to_segments(x_nt: jax.Array, segment_len: int) -> jax.Array:
    """[N, T] -> [N, S, L], zero-padding T up to S * L."""
    n, t = x_nt.shape
    s = -(-t // segment_len)
    x_nt = jnp.pad(x_nt, ((0, 0), (0, s * segment_len - t)))
    return x_nt.reshape(n, s, segment_len)


def from_segments(x_ns: jax.Array, segment_len: int, t: int) -> jax.Array:
    """Broadcast a per-segment value [N, S] back over its positions: [N, T]."""
    n, s = x_ns.shape
    return jnp.broadcast_to(x_ns[:, :, None], (n, s, segment_len)).reshape(n, s * segment_len)[:, :t]


def segment_counts(indicators: Sequence[jax.Array], segment_len: int) -> list[jax.Array]:
    """Per-segment counts [N,S] (int32) of boolean [N,T] indicators, several per pass: each count needs
    bit_length(segment_len) bits, so the indicators are packed into int32 fields and summed together."""
    bits = int(segment_len).bit_length()
    per_pass = 31 // bits
    field = (1 << bits) - 1
    out = []
    for start in range(0, len(indicators), per_pass):
        group = indicators[start:start + per_pass]
        packed = sum(g.astype(jnp.int32) << (bits * j) for j, g in enumerate(group))
        total = to_segments(packed, segment_len).sum(-1)
        out += [(total >> (bits * j)) & field for j in range(len(group))]
    return out


def segment_sums(x_nt: jax.Array, segment_len: int) -> jax.Array:
    """Per-segment sums [N,S] of a float [N,T] array (padding of T counts as 0)."""
    return to_segments(x_nt, segment_len).sum(-1)


def stats_from_sums(n, sum_d, n_tail) -> SegmentStats:
    """SegmentStats from per-segment token counts, delta sums and tail counts (dbar, f are 0 where n == 0)."""
    valid = n > 0
    n_f = n.astype(F32)
    safe_n = jnp.where(valid, n_f, 1.0)
    return SegmentStats(n=n_f, dbar=jnp.where(valid, sum_d / safe_n, 0.0),
                        f=jnp.where(valid, n_tail.astype(F32) / safe_n, 0.0), valid=valid)


class CoreSums(NamedTuple):
    """The per-segment sums [N,S] that TRIAGE and the diagnostics share (one computation, CSE'd under jit)."""

    n: jax.Array  # int32 real tokens
    tail: jax.Array  # int32 real tokens with delta < -tau_tail
    pos: jax.Array  # int32 real tokens with delta > 0
    neg: jax.Array  # int32 real tokens with delta < 0
    sum_d: jax.Array  # f32 sum of delta
    sneg: jax.Array  # f32 sum of negative delta


def core_sums(delta_nt: jax.Array, mask_nt: jax.Array, cfg: TriageConfig) -> CoreSums:
    real = mask_nt > 0
    d = jnp.where(real, delta_nt, 0.0)
    n, tail, pos, neg = segment_counts([real, real & (d < -cfg.tau_tail), d > 0, d < 0], cfg.segment_len)
    return CoreSums(n, tail, pos, neg, segment_sums(d, cfg.segment_len),
                    segment_sums(jnp.where(d < 0, d, 0.0), cfg.segment_len))


def _stats(delta_nt: jax.Array, mask_nt: jax.Array, cfg: TriageConfig) -> SegmentStats:
    c = core_sums(delta_nt, mask_nt, cfg)
    return stats_from_sums(c.n, c.sum_d, c.tail)


def _check_nt(delta, mask) -> tuple[jax.Array, jax.Array]:
    delta_nt = check_float("delta", delta, 2)
    return delta_nt, check_mask("mask", mask, delta_nt.shape)


@functools.partial(jax.jit, static_argnames=("cfg",))
def segment_stats(delta, mask, cfg: TriageConfig = TriageConfig()) -> SegmentStats:
    """Segment statistics n_S, dbar_S, f_S over positions [sL, (s+1)L) of each response; padding never counts."""
    delta_nt, mask_nt = _check_nt(delta, mask)
    return _stats(jax.lax.stop_gradient(delta_nt), mask_nt, cfg)


def segment_weights(stats: SegmentStats, cfg: TriageConfig) -> jax.Array:
    """w_S = 1 - (1 - w_min) * clip(max((-dbar - g_lo)/(g_hi - g_lo), (f - f_lo)/(f_hi - f_lo)), 0, 1)."""
    risk = jnp.clip(jnp.maximum((-stats.dbar - cfg.g_lo) / (cfg.g_hi - cfg.g_lo),
                                (stats.f - cfg.f_lo) / (cfg.f_hi - cfg.f_lo)), 0.0, 1.0)
    return 1.0 - (1.0 - cfg.w_min) * risk


def gate(adv, delta_nt, mask_nt, cfg: TriageConfig):
    """(alpha [N,T], raw token weight w [N,T], stats) for validated float32 adv [N] or [N,T], delta [N,T] and a
    0/1 mask; alpha is 0 on padding. The unjitted core that `gate_weights`, the corrections and the diagnostics
    share."""
    real = mask_nt > 0
    c = core_sums(delta_nt, mask_nt, cfg)
    stats = stats_from_sums(c.n, c.sum_d, c.tail)
    w_ns = segment_weights(stats, cfg)
    if adv.ndim == 1:
        a_nt = adv[:, None]
        n_amp = jnp.where(a_nt < 0, c.neg, 0)
    else:
        a_nt = adv
        (n_amp,) = segment_counts([real & (adv < 0) & (delta_nt < 0)], cfg.segment_len)
    amplifying = real & (a_nt < 0) & (delta_nt < 0)
    w_nt = jnp.where(amplifying, from_segments(w_ns, cfg.segment_len, delta_nt.shape[1]), 1.0)
    n_i = jnp.sum(stats.n, axis=1, keepdims=True)
    # sum_t m*w = n_i - sum_S n_amp_S * (1 - w_S): the mean weight from segment sums, without another token pass.
    wbar = (n_i - jnp.sum(n_amp * (1.0 - w_ns), axis=1, keepdims=True)) / jnp.maximum(n_i, 1.0)
    alpha = jnp.where(real, w_nt / jnp.where(n_i > 0, wbar, 1.0), 0.0)
    return alpha, w_nt, stats


@functools.partial(jax.jit, static_argnames=("cfg",))
def gate_weights(adv, delta, mask, cfg: TriageConfig = TriageConfig()) -> jax.Array:
    """alpha [N,T] (no gradient): segment weight on A<0 & delta<0 tokens, 1 elsewhere, renormalized per response
    so that sum_t m*alpha = sum_t m. Zero on padding."""
    delta_nt, mask_nt = _check_nt(delta, mask)
    a = jax.lax.stop_gradient(check_adv_any(adv, delta_nt.shape))
    alpha, _, _ = gate(a, jax.lax.stop_gradient(delta_nt), mask_nt, cfg)
    return jax.lax.stop_gradient(alpha)


def response_adv(a_nt: jax.Array, mask_nt: jax.Array) -> jax.Array:
    """A_i of each response: its mean token advantage over real tokens ([N]; 0 for an empty response)."""
    n_i = jnp.sum(mask_nt, axis=1)
    return jnp.sum(jnp.where(mask_nt > 0, a_nt, 0.0), axis=1) / jnp.maximum(n_i, 1.0)


@functools.partial(jax.jit, static_argnames=("cfg",))
def repair_loss_sum(adv, logp, sampler_logp, mask, step, cfg: TriageConfig = TriageConfig()
                    ) -> tuple[jax.Array, jax.Array]:
    """(lambda_k * sum of phi(q_i), count) over responses with A_i > 0 and a real token; see `repair_loss`.

    Summing both over micro-batches and dividing (count >= 1) gives the full-batch repair exactly.
    """
    logp = check_float("logp", logp, 2)
    sampler_logp = check_float("sampler_logp", sampler_logp, 2)
    check_same_shape("sampler_logp", sampler_logp, "logp", logp)
    mask_nt = check_mask("mask", mask, logp.shape)
    a_nt = jax.lax.stop_gradient(check_adv(adv, logp.shape))
    step = jnp.asarray(step)
    if step.ndim != 0 or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"step: expected an integer scalar, got shape {step.shape} dtype {step.dtype}")

    real = mask_nt > 0
    n_i = jnp.sum(mask_nt, axis=1)
    gap = jnp.where(real, logp - jax.lax.stop_gradient(sampler_logp), 0.0)
    dbar_i = jnp.sum(gap, axis=1) / jnp.maximum(n_i, 1.0)
    q = jnp.maximum(0.0, cfg.tau_rep - dbar_i)
    phi = cfg.beta**2 * (jnp.sqrt(1.0 + (q / cfg.beta) ** 2) - 1.0)
    chosen = (response_adv(a_nt, mask_nt) > 0) & (n_i > 0)
    lam = jnp.where(step >= cfg.k_rep, cfg.lambda_rep, 0.0)
    return lam * jnp.sum(jnp.where(chosen, phi, 0.0)), jnp.sum(chosen.astype(F32))


@functools.partial(jax.jit, static_argnames=("cfg",))
def repair_loss(adv, logp, sampler_logp, mask, step, cfg: TriageConfig = TriageConfig()) -> jax.Array:
    """L_rep = lambda_k * mean_{i: A_i > 0, n_i > 0} phi(max(0, tau_rep - dbar_i)), dbar_i the masked mean of
    logp - sampler_logp; phi pseudo-Huber with scale beta; lambda_k = lambda_rep once step >= k_rep, else 0.
    The gradient flows through `logp` only. 0 when no response qualifies."""
    total, count = repair_loss_sum(adv, logp, sampler_logp, mask, step, cfg)
    return total / jnp.maximum(count, 1.0)


def propose_thresholds(delta, mask, base: TriageConfig | None = None, *, tail_quantile: float = 0.05,
                       g_quantiles: tuple[float, float] = (0.90, 0.99)) -> TriageConfig:
    """Read TRIAGE thresholds off a pilot run's delta [N,T] (host-side, numpy). Heuristic:

    - tau_tail = -(tail_quantile quantile of delta) (the example in docs/rl_math.md#thresholds), kept from `base` if that is <= 0;
    - f_lo, f_hi = 2x and 6x the resulting tail frequency (the defaults 0.10 / 0.30 at a 5% tail), capped below 1;
    - g_lo, g_hi = the `g_quantiles` quantiles of the segment mean -dbar_S (floored at 0): segments more negative
      than 90% of the pilot's start to be gated and the worst 1% are fully gated.
    Everything else (segment_len, w_min, repair) comes from `base` (default TriageConfig()).
    """
    base = base or TriageConfig()
    d = np.asarray(delta, np.float64)
    m = np.asarray(mask) != 0
    if d.ndim != 2 or m.shape != d.shape:
        raise ValueError(f"propose_thresholds: need delta [N,T] and mask of the same shape, got {d.shape}, {m.shape}")
    if not m.any():
        raise ValueError("propose_thresholds: the pilot mask holds no real token")
    if not (0.0 < tail_quantile < 0.5 and 0.0 <= g_quantiles[0] < g_quantiles[1] <= 1.0):
        raise ValueError(f"bad quantiles tail_quantile={tail_quantile}, g_quantiles={g_quantiles}")
    real = d[m]
    tau = float(-np.quantile(real, tail_quantile))
    tau = tau if tau > 0 else base.tau_tail
    tail_freq = float(np.mean(real < -tau))
    f_lo = min(2.0 * tail_freq, 0.5)
    f_hi = min(max(6.0 * tail_freq, f_lo + 1e-3), 1.0)
    stats = _stats(jnp.asarray(d, F32), jnp.asarray(m, F32), dataclasses.replace(base, tau_tail=tau))
    neg_dbar = -np.asarray(stats.dbar)[np.asarray(stats.valid)]
    g_lo = max(float(np.quantile(neg_dbar, g_quantiles[0])), 0.0)
    g_hi = max(float(np.quantile(neg_dbar, g_quantiles[1])), g_lo + 1e-4)
    return dataclasses.replace(base, tau_tail=tau, f_lo=f_lo, f_hi=f_hi, g_lo=g_lo, g_hi=g_hi)
