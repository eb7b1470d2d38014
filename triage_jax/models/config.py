"""Qwen3 / Qwen3-MoE hyperparameters: one validated, hashable schema, named presets, and HF config.json I/O.

Field names follow HF's config.json where they exist, so `from_hf_config` / `to_hf_config` are mostly renames.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import numpy as np

ARCH_DENSE = "Qwen3ForCausalLM"
ARCH_MOE = "Qwen3MoeForCausalLM"
ARCHITECTURES = (ARCH_DENSE, ARCH_MOE)
REMAT_MODES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16", "float16")


# The ModelConfig fields that say how a model runs, not what it is (an HF config.json has none of them).
EXECUTION_FIELDS = ("dtype", "param_dtype", "remat", "scan_layers", "attn_chunk", "moe_row_chunk")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3 / Qwen3-MoE hyperparameters (HF names). num_experts == 0 means a dense model."""

    vocab_size: int = 128
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    # MoE (num_experts == 0: dense). A layer is MoE unless listed in mlp_only_layers or (i+1) % decoder_sparse_step.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    initializer_range: float = 0.02
    # Execution (not part of the checkpoint).
    dtype: str = "float32"  # activation / compute dtype
    param_dtype: str = "float32"
    remat: str = "none"  # none | full | save_dots (per decoder layer)
    scan_layers: bool = False
    attn_chunk: int = 0  # > 0: flash-style chunked attention (q chunks of this size) for sequences longer than it
    # > 0: the MoE expert FFN runs over this many sorted assignment rows at a time (bounded memory; models/moe.py)
    moe_row_chunk: int = 0

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        for key in ("dtype", "param_dtype"):  # accept jnp.bfloat16 / np.dtype too; store the name (hashable)
            v = getattr(self, key)
            if not isinstance(v, str):
                try:
                    object.__setattr__(self, key, np.dtype(v).name)
                except TypeError:
                    pass
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "max_position_embeddings", "decoder_sparse_step")
        for key in positive:
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{key}={v!r}: expected a positive int")
        for key in ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"ModelConfig.{key}={v!r}: expected a non-negative int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim}: rotate-half RoPE needs an even head_dim")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps!r}: expected > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta={self.rope_theta!r}: expected > 0")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok}: expected 1..num_experts "
                    f"({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size}: expected > 0")
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)) and self.intermediate_size <= 0:
            raise ValueError(f"ModelConfig.intermediate_size={self.intermediate_size}: dense layers need > 0")
        for i in self.mlp_only_layers:
            if not 0 <= i < self.num_hidden_layers:
                raise ValueError(f"ModelConfig.mlp_only_layers contains {i}, outside 0..{self.num_hidden_layers - 1}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"ModelConfig.{key}={getattr(self, key)!r}; expected one of {DTYPES}")
        if self.attn_chunk < 0:
            raise ValueError(f"ModelConfig.attn_chunk={self.attn_chunk}; expected 0 (off) or a chunk size > 0")
        if not isinstance(self.moe_row_chunk, int) or isinstance(self.moe_row_chunk, bool) or self.moe_row_chunk < 0:
            raise ValueError(f"ModelConfig.moe_row_chunk={self.moe_row_chunk!r}; expected 0 (off) or a row count > 0")
        if self.remat not in REMAT_MODES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; expected one of {REMAT_MODES}")
        if self.scan_layers and len({self.is_moe_layer(i) for i in range(self.num_hidden_layers)}) > 1:
            raise ValueError(
                "ModelConfig.scan_layers=True needs identical layers; mlp_only_layers / decoder_sparse_step mix "
                "dense and MoE layers"
            )

    def execution(self) -> dict:
        """The execution settings (not part of a checkpoint), as keywords for from_pretrained / replace: a model
        loaded from HF files runs as this one does."""
        return {k: getattr(self, k) for k in EXECUTION_FIELDS}

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """HF Qwen3MoeDecoderLayer's rule for which layers get the sparse MoE block."""
        return (
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def architecture(self) -> str:
        return ARCH_MOE if self.is_moe else ARCH_DENSE

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, h, n, kvh = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = d * n * h * 2 + d * kvh * h * 2 + 2 * h
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                ffn = d * self.num_experts + 3 * self.num_experts * d * self.moe_intermediate_size
            else:
                ffn = 3 * d * self.intermediate_size
            total += attn + ffn + 2 * d
        return total

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any] | str | os.PathLike, **overrides) -> "ModelConfig":
        """Build from a Qwen3 / Qwen3-MoE config.json (a dict, the file, or its directory)."""
        if not isinstance(cfg, Mapping):
            path = os.fspath(cfg)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                cfg = json.load(f)
        return cls(**{**_from_hf_dict(cfg), **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """An HF-compatible config.json dict (transformers loads it as Qwen3 / Qwen3-MoE)."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "initializer_range": self.initializer_range,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
        }
        if self.is_moe:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
            )
        return out


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _from_hf_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    archs = cfg.get("architectures") or []
    if not archs:
        model_type = cfg.get("model_type")
        archs = {"qwen3": [ARCH_DENSE], "qwen3_moe": [ARCH_MOE]}.get(model_type)
        if archs is None:
            raise ValueError(f"config.json: no 'architectures' and unknown model_type={model_type!r}")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"config.json: unsupported architecture {arch!r} (key 'architectures'); "
                         f"expected one of {ARCHITECTURES}")
    for key in _REQUIRED:
        if key not in cfg:
            raise ValueError(f"config.json: missing required key {key!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported (key 'hidden_act')")
    if cfg.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported (key 'attention_bias')")
    if cfg.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window=true is not supported (key 'use_sliding_window')")
    rope_theta = cfg.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rp = cfg.get(key)
        if rp:
            rtype = rp.get("rope_type", rp.get("type", "default"))
            if rtype != "default":
                raise ValueError(f"config.json: {key}.rope_type={rtype!r} is not supported (only 'default')")
            rope_theta = rp.get("rope_theta", rope_theta)
    n_heads = int(cfg["num_attention_heads"])
    out = dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=n_heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )
    if arch == ARCH_MOE:
        n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
        for key, v in (("num_experts", n_exp), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                       ("moe_intermediate_size", cfg.get("moe_intermediate_size"))):
            if v is None:
                raise ValueError(f"config.json: {ARCH_MOE} needs key {key!r}")
        out.update(
            num_experts=int(n_exp),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    return out


# ---------------------------------------------------------------- presets
_QWEN3_COMMON = dict(
    vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
    dtype="bfloat16", param_dtype="bfloat16",
)

PRESETS: dict[str, ModelConfig] = {
    # CPU-friendly: ~3.2M (tiny) and ~8.6M (tiny_moe) parameters; vocab 128 fits the character tokenizer.
    "tiny": ModelConfig(),
    "tiny_moe": ModelConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    # ~5.2M parameters for the model organism's long chains (configs/organism.py): vocab 1024 for its task BPE.
    "organism": ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=5),
    # ~2.6M: the organism at half the size (its sweep's model-size lever; the paper's smaller model collapses sooner).
    "organism_small": ModelConfig(vocab_size=1024, hidden_size=192, intermediate_size=768, num_hidden_layers=4),
    # Real HF values (Qwen/Qwen3-*/config.json).
    "qwen3_0_6b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "qwen3_1_7b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "qwen3_4b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "qwen3_4b_base": ModelConfig(
        **{**_QWEN3_COMMON, "max_position_embeddings": 32768}, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "qwen3_30b_a3b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001,
    ),
    "qwen3_30b_a3b_base": ModelConfig(
        **{**_QWEN3_COMMON, "max_position_embeddings": 32768}, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),
}


def get_model_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with optional field overrides (e.g. dtype="bfloat16", vocab_size=131)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model config {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
