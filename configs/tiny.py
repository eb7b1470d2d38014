"""Tiny dense model on the synthetic math task: the CPU default (W4A4 NVFP4 sampler, BF16 learner, TRIAGE)."""

from triage_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/tiny"
    c.model.preset = "tiny"
    return c
