"""The mismatch delta (docs/rl_math.md): delta = log pi_learner - log pi_sampler per response token.

The one place the project computes it: the learner, the trainer, the mismatch probe and the studies all call
`token_delta`, so its sign and its padding convention cannot drift apart.

With stale rollouts (`rl.staleness` = s >= 1, docs/rl_math.md#stale-rollouts) the rollout of step k was sampled
by the weights of step k - s, and the total mismatch splits token by token into the part precision adds and the
part staleness adds (`delta_parts`); `rl.delta_source` picks the one the correction and TRIAGE act on
(`DELTA_SOURCES`), and `delta_anchor` is the log-prob that chosen delta is measured from.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The deltas a correction can act on (`rl.delta_source`); "total" is the synchronous loop's delta.
DELTA_SOURCES = ("total", "precision", "staleness")


def token_delta(learner_logp_nt, sampler_logp_nt, mask_nt) -> jax.Array:
    """delta [N, T] = learner - sampler log-prob on real tokens (mask > 0), exactly 0 on padding (float32)."""
    learner_logp_nt = jnp.asarray(learner_logp_nt, jnp.float32)
    sampler_logp_nt = jnp.asarray(sampler_logp_nt, jnp.float32)
    if learner_logp_nt.shape != sampler_logp_nt.shape or learner_logp_nt.shape != jnp.shape(mask_nt):
        raise ValueError(f"token_delta: learner log-probs {learner_logp_nt.shape}, sampler log-probs "
                         f"{sampler_logp_nt.shape} and mask {jnp.shape(mask_nt)} must share one [N, T] shape")
    return jnp.where(jnp.asarray(mask_nt) > 0, learner_logp_nt - sampler_logp_nt, 0.0)


class DeltaParts(NamedTuple):
    """The mismatch of a stale rollout, [N, T] each, 0 on padding; total = precision + staleness exactly."""

    total: jax.Array  # learner at the current weights vs the sampler
    precision: jax.Array  # learner at the behaviour weights (those that sampled) vs the sampler
    staleness: jax.Array  # learner at the current weights vs the learner at the behaviour weights


def delta_parts(current_logp_nt, behaviour_logp_nt, sampler_logp_nt, mask_nt) -> DeltaParts:
    """Split the mismatch of a rollout sampled by older (behaviour) weights.

    delta_precision = l_learner(behaviour) - l_sampler: what the two sides' numerics add at the weights that
    sampled (exactly 0 in exact mode with one precision on both sides); delta_staleness = l_learner(current) -
    l_learner(behaviour): what the s updates since then add. total is their sum (not a third subtraction), so the
    split adds up bit for bit; it equals token_delta(current, sampler) up to one float32 rounding.
    """
    precision = token_delta(behaviour_logp_nt, sampler_logp_nt, mask_nt)
    staleness = token_delta(current_logp_nt, behaviour_logp_nt, mask_nt)
    return DeltaParts(total=precision + staleness, precision=precision, staleness=staleness)


def select_delta(parts: DeltaParts, source: str) -> jax.Array:
    """The delta named by `rl.delta_source` (one of DELTA_SOURCES)."""
    if source not in DELTA_SOURCES:
        raise ValueError(f"delta source {source!r} is not one of {list(DELTA_SOURCES)}")
    return getattr(parts, source)


def delta_anchor(source: str, parts: DeltaParts, sampler_logp_nt, behaviour_logp_nt) -> jax.Array:
    """l_ref [N, T] with delta_source = l_old - l_ref at the pre-update weights (l_old = the current learner).

    TRIAGE's repair term measures mean_t(l_th - l_ref) (docs/rl_math.md#repair-term), so it repairs the delta the
    gate acts on: the sampler's log-probs for "total" (the synchronous loop), the learner's at the behaviour
    weights for "staleness", and l_S + delta_staleness for "precision" (l_old - l_S - delta_staleness =
    delta_precision).
    """
    if source == "total":
        return jnp.asarray(sampler_logp_nt, jnp.float32)
    if source == "staleness":
        return jnp.asarray(behaviour_logp_nt, jnp.float32)
    if source == "precision":
        return jnp.asarray(sampler_logp_nt, jnp.float32) + parts.staleness
    raise ValueError(f"delta source {source!r} is not one of {list(DELTA_SOURCES)}")
