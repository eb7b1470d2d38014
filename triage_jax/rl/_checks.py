"""Shape and dtype validation shared by the rl modules: fail at trace time with the argument's name and shape.

The public rl functions are jitted (configs and mode strings static), so these checks run once per shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> np.dtype:
    return jnp.result_type(x) if not hasattr(x, "dtype") else np.dtype(x.dtype)


def check_float(name: str, x: Any, ndim: int | tuple[int, ...]) -> jax.Array:
    """`x` must be a floating array of the given rank(s); returned as float32."""
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if len(_shape(x)) not in dims:
        want = " or ".join(f"rank {d}" for d in dims)
        raise ValueError(f"{name}: expected {want}, got shape {_shape(x)}")
    if not jnp.issubdtype(_dtype(x), jnp.floating):
        raise TypeError(f"{name}: expected a floating dtype (float32/bfloat16/float16), got {_dtype(x)}")
    return jnp.asarray(x, F32)


def check_mask(name: str, x: Any, shape: tuple[int, ...]) -> jax.Array:
    """`x` must be a bool/int/float array of `shape`; returned as float32 0/1 (nonzero means a real token)."""
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    if _shape(x) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {_shape(x)}")
    dt = _dtype(x)
    if not (dt == np.bool_ or jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.floating)):
        raise TypeError(f"{name}: expected a bool, integer or floating dtype, got {dt}")
    return (jnp.asarray(x) != 0).astype(F32)


def check_same_shape(name: str, x: jax.Array, ref_name: str, ref: jax.Array) -> None:
    if _shape(x) != _shape(ref):
        raise ValueError(f"{name}: shape {_shape(x)} does not match {ref_name} shape {_shape(ref)}")


def check_adv(adv: Any, shape_nt: tuple[int, int], name: str = "adv") -> jax.Array:
    """Advantages [N] (per response) or [N,T] (per token); returned as float32 [N,T] broadcast."""
    a = check_float(name, adv, (1, 2))
    n, t = shape_nt
    if a.ndim == 1:
        if a.shape[0] != n:
            raise ValueError(f"{name}: shape {a.shape} does not match N={n} of the [N,T]={shape_nt} token arrays")
        return jnp.broadcast_to(a[:, None], (n, t))
    if a.shape != (n, t):
        raise ValueError(f"{name}: shape {a.shape} does not match the [N,T]={shape_nt} token arrays")
    return a


def check_adv_any(adv: Any, shape_nt: tuple[int, int], name: str = "adv") -> jax.Array:
    """Validated float32 advantages kept as given, [N] or [N,T] (response-level ones take cheaper paths)."""
    check_adv(adv, shape_nt, name)
    return jnp.asarray(adv, F32)


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, NaN where den == 0 (an empty denominator is reported, never hidden as 0)."""
    return jnp.where(den != 0, num / jnp.where(den != 0, den, 1.0), jnp.nan)


def config_with(cls, overrides: Mapping[str, Any] | None, *, owner: str):
    """`cls`'s defaults (a frozen config dataclass) updated by `overrides`; an unknown key raises naming it and
    the valid ones, prefixed by `owner` (what the config belongs to)."""
    overrides = dict(overrides or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{owner}: unknown config key(s) {unknown}; valid keys are {sorted(known)}")
    return cls(**overrides)
