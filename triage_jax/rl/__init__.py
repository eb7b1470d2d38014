"""RL math as pure jax.numpy functions (docs/rl_math.md): GRPO/DAPO losses, mismatch corrections, TRIAGE and the
mismatch diagnostics. No model, no I/O."""

from triage_jax.rl.delta import token_delta
from triage_jax.rl.corrections import CORRECTIONS, CorrectionOut, apply_correction, make_config
from triage_jax.rl.diagnostics import (delta_energy, delta_energy_realized, delta_histogram, masked_quantiles,
                                       mismatch_metrics)
from triage_jax.rl.grpo import (AGGREGATIONS, aggregate, dynamic_sampling_keep, entropy_from_logits,
                                group_advantages, k3_kl, masked_entropy, metric_means, overlong_penalty, policy_loss)
from triage_jax.rl.triage import (SegmentStats, TriageConfig, gate_weights, propose_thresholds, repair_loss,
                                  repair_loss_sum, segment_stats)

__all__ = [
    "AGGREGATIONS", "CORRECTIONS", "CorrectionOut", "SegmentStats", "TriageConfig", "aggregate", "apply_correction",
    "delta_energy", "delta_energy_realized", "delta_histogram", "dynamic_sampling_keep", "entropy_from_logits",
    "gate_weights", "group_advantages", "k3_kl", "make_config", "masked_entropy", "masked_quantiles",
    "metric_means", "mismatch_metrics", "overlong_penalty", "policy_loss", "propose_thresholds", "repair_loss", "repair_loss_sum",
    "segment_stats", "token_delta",
]
