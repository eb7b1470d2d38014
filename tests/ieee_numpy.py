"""A function's jaxpr evaluated in NumPy as a GPU computes it: IEEE float arithmetic with subnormals kept (XLA:CPU
flushes them: FTZ / DAZ), and the CUDA branch of every `lax.platform_dependent`.

It lets the CPU check the quantizers' GPU branches where the CPU's own arithmetic cannot: an explicit flush missing
there changes nothing under the CPU's FTZ, but changes the bits here (tests/test_quant_ieee.py). A chain of float
converts (f32 -> f8 -> f32, f32 -> bf16 -> f32, ...) is one convert from the chain's first input, as XLA:GPU's
simplify-fp-conversions pass makes it under the default xla_allow_excess_precision (XLA:CPU keeps each rounding).
What it does not model: FMA contraction (tests/test_quant_ieee.py's `cuda_hazards` guards that); float8 / float4
converts round as ml_dtypes does (round to nearest even). NumPy sets no FTZ / DAZ, so its float32 and float64 operations
are IEEE's (checked by `_check_numpy_keeps_subnormals`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core

PLATFORM = "cuda"


def _shift(x, s, op):
    """XLA's shifts: a count at or past the width gives 0 (logical) or the sign fill (arithmetic)."""
    x, s = np.broadcast_arrays(x, s)
    width = x.dtype.itemsize * 8
    ok = (s >= 0) & (s < width)
    s_ok = np.where(ok, s, 0).astype(x.dtype)
    if op == "left":
        return np.where(ok, x << s_ok, 0).astype(x.dtype)
    if op == "right_logical":
        u = x.view(np.dtype(f"u{x.dtype.itemsize}"))
        return np.where(ok, u >> s_ok.view(u.dtype), 0).astype(u.dtype).view(x.dtype)
    return np.where(ok, x >> s_ok, np.where(x < 0, -1, 0)).astype(x.dtype)


def _round(x, method):
    if int(method) == 1:  # TO_NEAREST_EVEN
        return np.rint(x)
    t = np.trunc(x)  # AWAY_FROM_ZERO; x - trunc(x) is exact
    return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t).astype(x.dtype)


def _convert(x, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu" and x.dtype.kind == "f":
        info = np.iinfo(dtype)
        finite = x[np.isfinite(x)]
        if finite.size and (finite.min() < info.min or finite.max() > info.max) or not np.isfinite(x).all():
            raise NotImplementedError(f"float -> {dtype} convert out of range (XLA saturates, NumPy wraps)")
    if dtype == np.bool_:
        return x != 0
    return x.astype(dtype)


_UNARY = {"abs": np.abs, "neg": np.negative, "sign": np.sign, "floor": np.floor, "ceil": np.ceil,
          "not": lambda x: np.logical_not(x) if x.dtype == np.bool_ else np.invert(x),
          "is_finite": np.isfinite, "sqrt": np.sqrt, "copy": np.copy, "copy_p": np.copy}
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
           "and": lambda a, b: np.logical_and(a, b) if a.dtype == np.bool_ else a & b,
           "or": lambda a, b: np.logical_or(a, b) if a.dtype == np.bool_ else a | b,
           "xor": lambda a, b: np.logical_xor(a, b) if a.dtype == np.bool_ else a ^ b,
           "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
           "ge": np.greater_equal, "nextafter": np.nextafter,
           "shift_left": lambda a, b: _shift(a, b, "left"),
           "shift_right_logical": lambda a, b: _shift(a, b, "right_logical"),
           "shift_right_arithmetic": lambda a, b: _shift(a, b, "right_arithmetic")}


def _along_chain(x, fn):
    """fn(x), and where x ends a float convert chain, fn of the chain's source as the output's source."""
    out = fn(x)
    if id(x) in _CHAIN:
        _CHAIN[id(out)] = (out, fn(_CHAIN[id(x)][1]))
    return out


def _div(a, b):
    if a.dtype.kind == "f":
        return np.divide(a, b)
    if (b == 0).any():
        raise NotImplementedError("integer division by zero")
    q = np.abs(a) // np.abs(b)  # XLA's integer division truncates toward zero
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype) if a.dtype.kind == "i" else q.astype(a.dtype)


def _platform_branch(platforms) -> int:
    default = None
    for i, names in enumerate(platforms):
        if names is None:
            default = i
        elif PLATFORM in names:
            return i
    if default is None:
        raise NotImplementedError(f"no {PLATFORM} branch among {platforms}")
    return default


def _eval_eqn(eqn, ins):
    name, p = eqn.primitive.name, eqn.params
    if name in _UNARY:
        return [_UNARY[name](ins[0])]
    if name in _BINARY:
        a, b = ins
        return [np.asarray(_BINARY[name](a, b)).astype(eqn.outvars[0].aval.dtype)]
    if name == "div":
        return [_div(*ins)]
    if name == "rem":
        return [np.fmod(*ins)]
    if name == "select_n":
        which, *cases = ins
        return [np.choose(which.astype(np.int64), np.broadcast_arrays(*cases))]
    if name == "clamp":
        lo, x, hi = ins
        return [np.minimum(np.maximum(x, lo), hi)]
    if name == "round":
        return [_round(ins[0], p["rounding_method"])]
    if name == "convert_element_type":
        x, dtype = ins[0], np.dtype(p["new_dtype"])
        if not (_is_float_dtype(x.dtype) and _is_float_dtype(dtype)):
            return [_convert(x, dtype)]
        # XLA:GPU's simplify-fp-conversions (under its default xla_allow_excess_precision): a chain of float
        # converts is one convert of the chain's first input, whatever the types in between round to.
        source = _CHAIN.get(id(x), (None, x))[1]
        out = _convert(source, dtype)
        _CHAIN[id(out)] = (out, source)  # the output held too: its id is not reused while the entry lives
        return [out]
    if name == "bitcast_convert_type":
        return [ins[0].view(np.dtype(p["new_dtype"]))]
    if name == "broadcast_in_dim":
        x, shape, dims = ins[0], p["shape"], p["broadcast_dimensions"]
        expanded = np.reshape(x, [x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
        return [np.broadcast_to(expanded, shape)]
    if name == "reshape":  # a layout change XLA moves converts across: a convert chain's source goes along
        return [_along_chain(ins[0], lambda a: np.reshape(a, p["new_sizes"]))]
    if name == "squeeze":
        return [np.squeeze(ins[0], axis=tuple(p["dimensions"]))]
    if name == "expand_dims":
        return [np.expand_dims(ins[0], p["dimensions"])]
    if name == "transpose":
        return [_along_chain(ins[0], lambda a: np.transpose(a, p["permutation"]))]
    if name == "slice":
        strides = p["strides"] or (1,) * ins[0].ndim
        return [ins[0][tuple(slice(a, b, s) for a, b, s in zip(p["start_indices"], p["limit_indices"], strides))]]
    if name == "stack":
        return [np.stack(ins, axis=p["axis"])]
    if name == "concatenate":
        return [np.concatenate(ins, axis=p["dimension"])]
    if name in ("reduce_max", "reduce_min", "reduce_sum", "reduce_and", "reduce_or"):
        fn = {"reduce_max": np.max, "reduce_min": np.min, "reduce_sum": np.sum, "reduce_and": np.all,
              "reduce_or": np.any}[name]
        return [np.asarray(fn(ins[0], axis=tuple(p["axes"]))).astype(eqn.outvars[0].aval.dtype)]
    if name == "iota":
        shape, dim = p["shape"], p["dimension"]
        ar = np.arange(shape[dim], dtype=p["dtype"]).reshape([-1 if d == dim else 1 for d in range(len(shape))])
        return [np.broadcast_to(ar, shape)]
    if name == "platform_index":
        return [np.int32(_platform_branch(p["platforms"]))]
    if name == "cond":
        index, *ops = ins
        return evaluate(p["branches"][int(index)], *ops)
    if name in ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"):
        inner = p.get("jaxpr") or p.get("call_jaxpr") or p.get("fun_jaxpr")
        return evaluate(inner, *ins)
    if not any(_is_float(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        # Integer and key operations (the random bits of stochastic rounding) are exact on every backend: jax's own.
        outs = eqn.primitive.bind(*ins, **p)
        return [np.asarray(o) if not _is_key(o) else o for o in (outs if eqn.primitive.multiple_results else [outs])]
    raise NotImplementedError(f"ieee_numpy: no NumPy rule for {name!r}")


def _is_float_dtype(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, np.floating)  # ml_dtypes' bfloat16 / float8 / float4 included


def _is_float(aval) -> bool:
    return np.issubdtype(getattr(aval, "dtype", np.int32), np.inexact) if not _is_key(aval) else False


def _is_key(a) -> bool:
    return jax.dtypes.issubdtype(getattr(a, "dtype", np.int32), jax.dtypes.prng_key)


def evaluate(closed, *args) -> list[np.ndarray]:
    """Run a (closed) jaxpr on host arrays with NumPy's IEEE arithmetic."""
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = getattr(closed, "consts", ())
    env = {}

    def read(v):
        return (v.val if _is_key(v.val) else np.asarray(v.val)) if isinstance(v, core.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = np.asarray(val)
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val if _is_key(val) else np.asarray(val)
    with np.errstate(all="ignore"):
        for eqn in jaxpr.eqns:
            outs = _eval_eqn(eqn, [read(v) for v in eqn.invars])
            for var, out in zip(eqn.outvars, outs, strict=True):
                if isinstance(var, core.DropVar):
                    continue
                if not _is_key(out) and np.asarray(out).dtype != var.aval.dtype:
                    out = np.asarray(out).astype(var.aval.dtype)
                env[var] = out
    return [read(v) for v in jaxpr.outvars]


def _check_numpy_keeps_subnormals() -> None:
    tiny = np.finfo(np.float32).tiny
    if not np.float32(tiny) * np.float32(0.5) > 0 or not np.float64(2.0**-1022) * 0.5 > 0:
        raise RuntimeError("NumPy flushes subnormals in this process (FTZ / DAZ set): the GPU model would be wrong")


_CHAIN: dict[int, tuple] = {}  # id(a float convert's output) -> (that output, the first input of its convert chain)


def run(fn, *args) -> list[np.ndarray]:
    """fn's outputs (flattened) on host arrays, computed as a GPU computes its CUDA branch (see the module)."""
    _check_numpy_keeps_subnormals()
    try:
        return evaluate(jax.make_jaxpr(fn)(*args), *args)
    finally:
        _CHAIN.clear()

