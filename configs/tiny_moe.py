"""Tiny MoE model (8 experts, top-2) on the synthetic math task."""

from triage_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/tiny_moe"
    c.model.preset = "tiny_moe"
    c.warmup.cache_dir = "runs/warmup_cache_moe"
    c.data.levels = (1, 3)
    c.warmup.steps = 120
    c.rl.triage.k_rep = 20
    c.rl.triage.segment_len = 8
    return c
