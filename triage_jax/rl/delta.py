"""The mismatch delta (docs/rl_math.md): delta = log pi_learner - log pi_sampler per response token.

The one place the project computes it: the learner, the trainer, the mismatch probe and the studies all call
`token_delta`, so its sign and its padding convention cannot drift apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_delta(learner_logp_nt, sampler_logp_nt, mask_nt) -> jax.Array:
    """delta [N, T] = learner - sampler log-prob on real tokens (mask > 0), exactly 0 on padding (float32)."""
    learner_logp_nt = jnp.asarray(learner_logp_nt, jnp.float32)
    sampler_logp_nt = jnp.asarray(sampler_logp_nt, jnp.float32)
    if learner_logp_nt.shape != sampler_logp_nt.shape or learner_logp_nt.shape != jnp.shape(mask_nt):
        raise ValueError(f"token_delta: learner log-probs {learner_logp_nt.shape}, sampler log-probs "
                         f"{sampler_logp_nt.shape} and mask {jnp.shape(mask_nt)} must share one [N, T] shape")
    return jnp.where(jnp.asarray(mask_nt) > 0, learner_logp_nt - sampler_logp_nt, 0.0)
