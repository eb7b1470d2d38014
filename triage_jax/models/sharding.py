"""Logical axis names of the model's parameters and activations.

Parameters carry their logical names as `out_sharding` metadata (read them with `nnx.get_partition_spec`; stacked
layers add a leading "layers" axis); the one logical -> mesh table lives in `triage_jax.sharding`. Activations
go through `constrain`, a no-op unless flax logical-axis rules and a mesh are active.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax

BATCH, LENGTH = "batch", "length"
EMBED = "embed"
HEADS = "heads"  # attention heads (query heads, and kv heads in k/v projections)
KV = "kv"  # the per-head dimension (head_dim), as in MaxText's ("embed", "heads", "kv") kernels
MLP, EXPERT, VOCAB = "mlp", "expert", "vocab"
LAYERS = "layers"  # the stacked-layer axis of scan_layers=True
# A quantized-once kernel (`layers.QuantizedKernel`) carries its logical names under this metadata key, one per
# dimension of its stored [..., N, K] layout (a QuantizedWeight holds the kernel transposed).
QUANTIZED_NAMES = "quantized_names"


def batch_split() -> int:
    """Over how many devices the active mesh (`jax.set_mesh`) and logical-axis rules (`sharding.activate`) split a
    batch: 1 outside them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    target = dict(nn.get_logical_axis_rules()).get(BATCH)
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    return math.prod(dict(mesh.shape).get(a, 1) for a in axes)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Annotate an activation with logical axis names (no-op without active rules and mesh)."""
    return nn.with_logical_constraint(x, names)
