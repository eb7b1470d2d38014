"""SwiGLU MLP: down(silu(gate(x)) * up(x)), every projection through the quantized dot."""

from __future__ import annotations

import jax
from flax import nnx

from triage_jax.models.config import ModelConfig
from triage_jax.models.layers import Linear
from triage_jax.models.sharding import EMBED, MLP as MLP_AXIS
from triage_jax.quant import PrecisionPolicy


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, std=cfg.initializer_range, rngs=rngs)
        p = f"layers.{layer}.mlp"
        self.gate_proj = Linear((d,), (f,), (EMBED, MLP_AXIS), f"{p}.gate_proj", **kw)  # w_df
        self.up_proj = Linear((d,), (f,), (EMBED, MLP_AXIS), f"{p}.up_proj", **kw)  # w_df
        self.down_proj = Linear((f,), (d,), (MLP_AXIS, EMBED), f"{p}.down_proj", **kw)  # w_fd
        self.gate_up_proj = nnx.data(None)  # a MergedLinear of gate / up in a prequantize_model copy (those None)

    def __call__(self, x_btd: jax.Array, policy: PrecisionPolicy | None = None) -> jax.Array:
        if self.gate_up_proj is not None:
            g_btf, u_btf = self.gate_up_proj(x_btd, policy)
        else:
            g_btf, u_btf = self.gate_proj(x_btd, policy), self.up_proj(x_btd, policy)
        h_btf = jax.nn.silu(g_btf) * u_btf
        return self.down_proj(h_btf, policy)
