"""Tiny dense model on the synthetic math task: the CPU default (W4A4 NVFP4 sampler, BF16 learner, TRIAGE).

Levels 1 (one-digit a+b) and 3 (a*b, operands 2..12): a 200-step supervised warm-up leaves the policy right about
half the time, so GRPO groups carry signal from the first step and the reward has room to rise.
"""

from triage_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/tiny"
    c.model.preset = "tiny"
    c.data.levels = (1, 3)
    c.warmup.steps = 200
    c.rl.triage.k_rep = 20  # ~100 updates in a 50-step run: switch the repair term on early enough to matter
    return c
