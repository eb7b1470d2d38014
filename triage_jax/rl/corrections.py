"""Mismatch corrections behind one interface (docs/rl_math.md#corrections): per-token weights and an updated mask from
(adv, delta, mask), delta = old_logp - sampler_logp, rho = exp(delta).

    out = apply_correction("icepop", adv=adv, delta=delta, mask=mask, cfg=make_config("icepop", {"b": 4.0}))
    loss_sum, denom, _ = policy_loss(logp, old_logp, adv, out.mask, weights=out.weights)

Weights carry no gradient and are 0 outside the returned mask. Every correction reports the same metrics:
`frac_clipped` (real tokens whose weight its rule clipped or zeroed; for triage: gated), `frac_masked` (real
tokens dropped from the mask), `ess` (Kish effective sample size (sum w)^2 / sum w^2 over the input's real tokens,
as a fraction of them), `weight_mean` and `weight_max` over the kept tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from triage_jax.rl._checks import F32, check_adv_any, check_float, check_mask, config_with, safe_div
from triage_jax.rl.triage import TriageConfig, gate

SEQ_LOG_RATIO_CLIP = 20.0


class CorrectionOut(NamedTuple):
    weights: jax.Array  # [N,T] float32, no gradient, 0 outside `mask`
    mask: jax.Array  # [N,T] the input mask with dropped tokens zeroed, same dtype as the input
    metrics: dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class NoneConfig:
    pass


@dataclasses.dataclass(frozen=True)
class TokenTISConfig:
    C: float = 2.0

    def __post_init__(self):
        if not self.C > 0:
            raise ValueError(f"token_tis: C must be > 0, got {self.C}")


@dataclasses.dataclass(frozen=True)
class SeqTISConfig:
    C: float = 2.0

    def __post_init__(self):
        if not self.C > 0:
            raise ValueError(f"seq_tis: C must be > 0, got {self.C}")


@dataclasses.dataclass(frozen=True)
class SeqMISConfig:
    lo: float = 0.5
    C: float = 2.0

    def __post_init__(self):
        if not 0 < self.lo < self.C:
            raise ValueError(f"seq_mis: need 0 < lo < C, got lo={self.lo}, C={self.C}")


@dataclasses.dataclass(frozen=True)
class IcePopConfig:
    a: float = 0.5
    b: float = 5.0

    def __post_init__(self):
        if not 0 <= self.a < self.b:
            raise ValueError(f"icepop: need 0 <= a < b, got a={self.a}, b={self.b}")


@dataclasses.dataclass(frozen=True)
class OPSMConfig:
    """Off-policy sequence masking (DeepSeek-V3.2): drop A < 0 responses whose mean(-delta) exceeds `delta`.

    Default 1e-4: slime's `--opsm-delta` default (DeepSeek-V3.2 does not publish its value)."""

    delta: float = 1e-4

    def __post_init__(self):
        if not (isinstance(self.delta, (int, float)) and not isinstance(self.delta, bool) and self.delta >= 0
                and self.delta < float("inf")):
            raise ValueError(f"opsm: delta must be a finite number >= 0, got {self.delta!r}")


@dataclasses.dataclass(frozen=True)
class GeoRSConfig:
    lo: float = 0.999
    hi: float = 1.001

    def __post_init__(self):
        if not 0 < self.lo < self.hi:
            raise ValueError(f"geo_rs: need 0 < lo < hi, got lo={self.lo}, hi={self.hi}")


# Each rule: (adv [N] or [N,T], delta_nt, mask_nt f32, cfg) -> (weights [N,T], keep [N,T] f32, clipped [N,T] bool).
Rule = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, jax.Array, jax.Array]]


def _none(a, d, m, cfg):
    return jnp.ones_like(d), m, jnp.zeros(d.shape, bool)


def _token_tis(a, d, m, cfg: TokenTISConfig):
    rho = jnp.exp(d)
    return jnp.minimum(rho, cfg.C), m, rho > cfg.C


def _seq_log_ratio(d, m):
    return jnp.clip(jnp.sum(jnp.where(m > 0, d, 0.0), axis=1, keepdims=True), -SEQ_LOG_RATIO_CLIP,
                    SEQ_LOG_RATIO_CLIP)


def _seq_tis(a, d, m, cfg: SeqTISConfig):
    rho_seq = jnp.exp(_seq_log_ratio(d, m))
    w = jnp.broadcast_to(jnp.minimum(rho_seq, cfg.C), d.shape)
    return w, m, jnp.broadcast_to(rho_seq > cfg.C, d.shape)


def _seq_mis(a, d, m, cfg: SeqMISConfig):
    # Masked importance sampling (Liu et al.; verl's sequence-level MIS): an accepted response keeps its sequence
    # IS weight rho_seq, a response with rho_seq outside [lo, C] is dropped whole.
    rho_seq = jnp.exp(_seq_log_ratio(d, m))
    keep = (rho_seq >= cfg.lo) & (rho_seq <= cfg.C)
    return jnp.broadcast_to(rho_seq, d.shape), m * keep, jnp.zeros(d.shape, bool)


def _seq_mis_reject(a, d, m, cfg: SeqMISConfig):
    # Pure rejection: the same acceptance test as seq_mis, accepted responses keep weight 1.
    rho_seq = jnp.exp(_seq_log_ratio(d, m))
    keep = (rho_seq >= cfg.lo) & (rho_seq <= cfg.C)
    return jnp.ones_like(d), m * keep, jnp.zeros(d.shape, bool)


def _icepop(a, d, m, cfg: IcePopConfig):
    rho = jnp.exp(d)
    inside = (rho >= cfg.a) & (rho <= cfg.b)
    return jnp.where(inside, rho, 0.0), m, ~inside


def _geo_rs(a, d, m, cfg: GeoRSConfig):
    n_i = jnp.sum(m, axis=1, keepdims=True)
    geo = jnp.exp(jnp.sum(jnp.where(m > 0, d, 0.0), axis=1, keepdims=True) / jnp.maximum(n_i, 1.0))
    keep = (geo >= cfg.lo) & (geo <= cfg.hi)
    return jnp.ones_like(d), m * keep, jnp.zeros(d.shape, bool)


def _opsm(a, d, m, cfg: OPSMConfig):
    # DeepSeek-V3.2's M_i,t = 0 iff A_i,t < 0 and (1/|o_i|) sum_t log(pi_sampler / pi_learner) > delta; that log
    # ratio is -delta per token, so the statistic is the response's mean(-delta) (its k1 KL estimate).
    n_i = jnp.sum(m, axis=1, keepdims=True)
    seq_kl = -jnp.sum(jnp.where(m > 0, d, 0.0), axis=1, keepdims=True) / jnp.maximum(n_i, 1.0)
    a_nt = a[:, None] if a.ndim == 1 else a
    drop = (a_nt < 0) & (seq_kl > cfg.delta)
    return jnp.ones_like(d), m * ~drop, jnp.zeros(d.shape, bool)


def _triage(a, d, m, cfg: TriageConfig):
    alpha, w_raw, _ = gate(a, d, m, cfg)
    return alpha, m, w_raw < 1.0


@dataclasses.dataclass(frozen=True)
class Correction:
    config_cls: type
    rule: Rule


CORRECTIONS: dict[str, Correction] = {
    "none": Correction(NoneConfig, _none),
    "token_tis": Correction(TokenTISConfig, _token_tis),
    "seq_tis": Correction(SeqTISConfig, _seq_tis),
    "seq_mis": Correction(SeqMISConfig, _seq_mis),
    "seq_mis_reject": Correction(SeqMISConfig, _seq_mis_reject),
    "icepop": Correction(IcePopConfig, _icepop),
    "geo_rs": Correction(GeoRSConfig, _geo_rs),
    "opsm": Correction(OPSMConfig, _opsm),
    "triage": Correction(TriageConfig, _triage),
}


def _lookup(name: str) -> Correction:
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r}; expected one of {sorted(CORRECTIONS)}")
    return CORRECTIONS[name]


def make_config(name: str, overrides: Mapping[str, Any] | None = None):
    """The config dataclass of correction `name`: its defaults updated by `overrides`; unknown keys fail."""
    return config_with(_lookup(name).config_cls, overrides, owner=f"correction {name!r}")


@functools.partial(jax.jit, static_argnames=("name", "cfg"))
def apply_correction(name: str, *, adv, delta, mask, cfg=None) -> CorrectionOut:
    """Weights, updated mask and metrics of correction `name` (a key of CORRECTIONS); cfg None -> defaults."""
    corr = _lookup(name)
    if cfg is None:
        cfg = corr.config_cls()
    elif not isinstance(cfg, corr.config_cls):
        raise TypeError(f"correction {name!r} takes a {corr.config_cls.__name__}, got {type(cfg).__name__}")
    delta_nt = jax.lax.stop_gradient(check_float("delta", delta, 2))
    mask_in = jnp.asarray(mask)
    m = check_mask("mask", mask_in, delta_nt.shape)
    a = jax.lax.stop_gradient(check_adv_any(adv, delta_nt.shape))
    w, keep, clipped = corr.rule(a, delta_nt, m, cfg)
    kept = keep > 0
    w = jax.lax.stop_gradient(jnp.where(kept, w, 0.0).astype(F32))

    n_in = jnp.sum(m)
    n_kept = jnp.sum(keep)
    sum_w = jnp.sum(w)
    sum_w2 = jnp.sum(w * w)
    metrics = {
        "frac_clipped": safe_div(jnp.sum((clipped & (m > 0)).astype(F32)), n_in),
        "frac_masked": safe_div(n_in - n_kept, n_in),
        "ess": safe_div(jnp.where(sum_w2 > 0, sum_w * sum_w / jnp.where(sum_w2 > 0, sum_w2, 1.0), 0.0), n_in),
        "weight_mean": safe_div(sum_w, n_kept),
        "weight_max": jnp.where(n_kept > 0, jnp.max(jnp.where(kept, w, -jnp.inf)), jnp.nan),
    }
    new_mask = jnp.where(kept, mask_in, jnp.zeros_like(mask_in))
    return CorrectionOut(weights=w, mask=new_mask, metrics=metrics)
