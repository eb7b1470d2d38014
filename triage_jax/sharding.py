"""Device mesh and the one table mapping logical axis names to mesh axes (as MaxText does).

Parameters carry logical names (embed, heads, kv, mlp, expert, vocab) and activations (batch, length); the
table `DEFAULT_RULES` below maps each to mesh axes (data, fsdp, tensor, expert); a different table is passed as
`Learner(rules=...)`. Nothing else in the code names a mesh axis.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from triage_jax.models.sharding import QUANTIZED_NAMES
from triage_jax.quant.qdot import QuantizedWeight

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axes (None: replicated). The batch is split over every data-parallel axis.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
)


def make_mesh(shape: dict[str, int] | Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor, expert) mesh; `shape` maps axis -> size (missing axes are 1)."""
    sizes = tuple(int(shape.get(a, 1) if isinstance(shape, dict) else getattr(shape, a, 1)) for a in MESH_AXES)
    devices = list(devices if devices is not None else jax.devices())
    need = int(np.prod(sizes))
    if need > len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {need} devices, but {len(devices)} are available "
            f"(on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count={need})"
        )
    return Mesh(np.asarray(devices[:need]).reshape(sizes), MESH_AXES)


def logical_to_mesh(names: Sequence[str | None] | None, rules=DEFAULT_RULES, mesh: Mesh | None = None) -> P:
    """PartitionSpec over mesh axes for a tuple of logical names; a mesh axis is used at most once per array
    and axes of size 1 are dropped, so the spec is valid for any mesh shape."""
    if names is None:
        return P()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in names:
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(
            a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1)
        )
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """NamedShardings for an nnx.State (or any pytree of nnx variables) from its logical axis metadata."""
    specs = nnx.get_partition_spec(state)

    def to_sharding(spec):
        names = tuple(spec) if isinstance(spec, P) else None
        return NamedSharding(mesh, logical_to_mesh(names, rules, mesh))

    return jax.tree.map(to_sharding, specs, is_leaf=lambda x: isinstance(x, P))


# The mesh axes the sampler's weights are replicated over: a decode step reads every weight once per token, so
# FSDP's per-step all-gathers would cost more than the memory they save; tensor and expert still split them.
SAMPLER_REPLICATED = ("data", "fsdp")


def sampler_rules(rules=DEFAULT_RULES) -> tuple[tuple[str, Any], ...]:
    """The sampler's table: the learner's with SAMPLER_REPLICATED dropped from every name but the batch (the
    slots still split over every data-parallel axis; weights split over tensor and expert only)."""
    out = []
    for name, target in rules:
        if name != "batch":
            axes = (target,) if isinstance(target, str) else tuple(target or ())
            target = tuple(a for a in axes if a not in SAMPLER_REPLICATED) or None
        out.append((name, target))
    return tuple(out)


def quantized_spec(shape: tuple[int, ...], names: Sequence[str | None], k: int, rules, mesh: Mesh) -> P:
    """PartitionSpec of one array of a QuantizedWeight of contraction length k stored as [..., N, K'] (codes:
    K' = K/2, block scales K/16 or K/32, FP8 data K): leading and N dimensions by their names, K' too when every
    shard holds whole 32-value blocks; the scalar and per-matrix scales (amax) replicated."""
    if len(shape) != len(names):
        return P()
    spec = list(logical_to_mesh(names, rules, mesh))
    for i, a in enumerate(spec):
        n = split_count(mesh, a)
        if shape[i] % n or (i == len(shape) - 1 and k % (32 * n)):
            spec[i] = None
    return P(*spec)


def split_count(mesh: Mesh, entry) -> int:
    """Into how many parts one PartitionSpec entry (None, an axis, or a tuple of axes) splits its dimension."""
    return int(np.prod([mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry or ())]))


def sampler_state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """Shardings of the sampler's (prepared) state on `mesh` by `sampler_rules(rules)`: parameters by their
    logical names, a quantized kernel's arrays by `quantized_spec` (each array replicated for a merged kernel,
    which has no names, and where its tensor says MESH_REPLICATED: a custom kernel's layout, kernels/fp4_gemm.py)."""
    rules = sampler_rules(rules)
    base = state_shardings(state, mesh, rules)

    def one(var, sharding):
        if not isinstance(var, nnx.Variable):
            return sharding
        names, value = var.get_metadata().get(QUANTIZED_NAMES), var.get_value()
        if not isinstance(value, QuantizedWeight):
            return sharding
        # A merged kernel (layers.MergedLinear: no names) or a custom kernel's own layout: every array replicated.
        if names is None or value.mesh_replicated:
            return jax.tree.map(lambda _: replicated(mesh), var)
        k = value.shape[-2]  # QuantizedWeight.shape is [..., K, N]
        return jax.tree.map(lambda x: NamedSharding(mesh, quantized_spec(x.shape, names, k, rules, mesh)), var)

    return jax.tree.map(one, state, base, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of a [batch, ...] array: batch over the data-parallel axes, the rest replicated."""
    return NamedSharding(mesh, logical_to_mesh(("batch",) + (None,) * (ndim - 1), rules, mesh))


def optimizer_shardings(opt_state: Any, params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of an optimizer state: every sub-tree shaped like the parameters (Adam's moments, ...) takes
    the parameters' shardings, the rest (step counts, flags) is replicated."""
    params_def = jax.tree.structure(params)
    replicated = NamedSharding(mesh, P())

    def like_params(x) -> bool:
        return not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jax.tree.structure(x) == params_def

    return jax.tree.map(lambda x: param_shardings if like_params(x) else replicated, opt_state, is_leaf=like_params)


def batch_axes(rules=DEFAULT_RULES) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over (per the rules table)."""
    target = dict(rules).get("batch")
    return (target,) if isinstance(target, str) else tuple(target or ())


@contextlib.contextmanager
def activate(mesh: Mesh, rules=DEFAULT_RULES) -> Iterator[None]:
    """Trace under this: the mesh is the active one (mesh-aware layers such as MoE expert parallelism see it) and
    the model's activation annotations (`models.sharding.constrain`) become sharding constraints by the rules.

    Without the constraints GSPMD is free to all-gather an FSDP batch to meet the embed-sharded weights, i.e.
    every device would hold the whole micro-batch's activations."""
    import flax.linen as nn

    table = []
    for name, target in rules:
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
        table.append((name, None if not keep else keep[0] if len(keep) == 1 else keep))
    with jax.set_mesh(mesh), nn.logical_axis_rules(table):
        yield


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, P())
