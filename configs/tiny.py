"""Tiny dense model on the synthetic math task: the CPU default (W4A4 NVFP4 sampler, BF16 learner, TRIAGE).

Levels 1 (one-digit a+b) and 3 (a*b, operands 2..12). A 120-step supervised warm-up leaves the policy right about
40% of the time at temperature 1 (60 steps: 5%, 90: 10%, 200: 97%), so GRPO groups carry signal from the first
step and the reward has room to rise.
"""

from triage_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/tiny"
    c.model.preset = "tiny"
    c.data.levels = (1, 3)
    c.warmup.steps = 120
    c.rl.triage.k_rep = 20  # ~100 updates in a 50-step run: switch the repair term on early enough to matter
    c.rl.triage.segment_len = 8  # responses are ~20 tokens here: several segments per response, as 64 is at 20k
    return c
