"""Qwen3 dense / MoE models (Flax NNX): configs, modules, KV cache, HF checkpoint I/O."""

from triage_jax.models.config import PRESETS, ModelConfig, get_model_config
from triage_jax.models.hf_io import from_pretrained, save_pretrained
from triage_jax.models.kv_cache import KVCache, init_kv_cache
from triage_jax.models.moe import RouterStats, load_balancing_loss
from triage_jax.models.qwen3 import Qwen3, prequantize_model, unstack_layers

__all__ = [
    "PRESETS", "ModelConfig", "get_model_config", "from_pretrained", "save_pretrained", "KVCache",
    "init_kv_cache", "RouterStats", "load_balancing_loss", "Qwen3", "prequantize_model", "unstack_layers"
]
