"""Alignment check: every available quantization backend against the jax.numpy reference.

    python -m triage_jax.tools.align [--small] [--backends xla,pallas] [--repeats 3]

Runs the quantizers (NVFP4 tensor/row/tile2d, MXFP8), the quantized dot (fp8, w4a16, w4a8, w4a4) and the grouped
per-expert dot (w4a8, w4a4) over a set of shapes on each backend and prints, per backend and op: bit-exact or not,
max abs and relative error against the reference, and the median time. The quantizers' reference is formats.py;
the dots' reference is rebuilt from the packed reference quantizers (so the xla rows check the xla backend's
fused path too). Quantizers must be bit-exact; a dot may differ from the reference only by float32 accumulation
order (relative error <= --dot-rtol). Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from triage_jax import compile_cache
from triage_jax.quant import PRESETS, backends, qdot, qragged_dot

SMALL = {"quantize": [(16, 64), (2, 16, 128)], "dot": [(16, 64, 32)]}
FULL = {"quantize": [(256, 1024), (4, 64, 2048)], "dot": [(128, 1024, 512), (64, 2048, 256)]}
QUANT_OPS = ("nvfp4:tensor", "nvfp4:row", "nvfp4:tile2d", "mxfp8")
DOT_OPS = ("fp8", "w4a16", "w4a8", "w4a4")
GROUPED_OPS = ("w4a8", "w4a4")  # qragged_dot over 3 experts


def _median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _quantize_fn(backend: str, op: str):
    name, _, scaling = op.partition(":")
    quant = backends.get_backend(backend).op("quantize")  # BackendUnsupportedError (NotImplementedError) if absent
    return jax.jit(lambda x: quant(x, name, scaling or "tensor"))


def _bytes(q) -> list[np.ndarray]:
    """Every stored bit of a quantized tensor, as integer arrays."""
    out = []
    for leaf in jax.tree.leaves(q):
        a = jnp.asarray(leaf)
        if a.dtype.itemsize == 1:
            a = jax.lax.bitcast_convert_type(a, jnp.uint8)
        elif a.dtype == jnp.float32:
            a = jax.lax.bitcast_convert_type(a, jnp.uint32)
        out.append(np.asarray(a))
    return out


def storage_reference_dot(x_mk, w_kn, prec, gs=None) -> jax.Array:
    """The quantized dot rebuilt from the packed reference quantizers (quantize, decode, float32-accumulated dot):
    an independent formulation of what every backend's qdot computes, the xla backend's fused path included."""
    qx = backends.reference_quantize(x_mk, prec.act, prec.act_scaling) if prec.act != "none" else x_mk
    w_nk = jnp.swapaxes(w_kn, -1, -2)
    if prec.weight == "none":
        qw = w_nk
    elif w_nk.ndim == 3:
        qw = jax.vmap(lambda m: backends.reference_quantize(m, prec.weight, prec.weight_scaling))(w_nk)
    else:
        qw = backends.reference_quantize(w_nk, prec.weight, prec.weight_scaling)
    if gs is None:
        return backends.reference_matmul(qx, qw)
    return backends.reference_grouped_matmul(qx, qw, gs)


def _errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    abs_err = float(np.max(np.abs(got - ref))) if got.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return abs_err, abs_err / scale if scale else abs_err


def check_backend(backend: str, shapes: dict, repeats: int, dot_rtol: float, key: jax.Array) -> list[dict]:
    """Rows of results for one backend."""
    rows = []
    for shape in shapes["quantize"]:
        key, kx, ks = jax.random.split(key, 3)
        x = jax.random.normal(kx, shape, jnp.float32) * jnp.exp(2 * jax.random.normal(ks, shape[:-1] + (1,)))
        for op in QUANT_OPS:
            try:
                fn = _quantize_fn(backend, op)
                got, ref = fn(x), _quantize_fn("xla", op)(x)
                exact = all(np.array_equal(a, b) for a, b in zip(_bytes(got), _bytes(ref), strict=True))
                abs_err, rel_err = _errors(got.dequantize(), ref.dequantize())
                rows.append(dict(backend=backend, op=f"quantize {op}", shape=shape, exact=exact, abs_err=abs_err,
                                 rel_err=rel_err, ok=exact, time_s=_median_time(fn, x, repeats=repeats)))
            except NotImplementedError as e:
                rows.append(dict(backend=backend, op=f"quantize {op}", shape=shape, unsupported=str(e)))
    for m, k, n in shapes["dot"]:
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, (m, k), jnp.float32)
        w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
        for op in DOT_OPS:
            prec = PRESETS[op]
            try:
                fn = jax.jit(lambda a, b, p=prec: qdot(a, b, p, backend=backend))
                got = fn(x, w)
                ref = jax.jit(lambda a, b, p=prec: storage_reference_dot(a, b, p))(x, w)
                abs_err, rel_err = _errors(got, ref)
                exact = bool(np.array_equal(np.asarray(got), np.asarray(ref)))
                rows.append(dict(backend=backend, op=f"qdot {op}", shape=(m, k, n), exact=exact, abs_err=abs_err,
                                 rel_err=rel_err, ok=rel_err <= dot_rtol, time_s=_median_time(fn, x, w, repeats=repeats)))
            except NotImplementedError as e:
                rows.append(dict(backend=backend, op=f"qdot {op}", shape=(m, k, n), unsupported=str(e)))
        key, kg = jax.random.split(key)
        we = jax.random.normal(kg, (3, k, n), jnp.float32) / np.sqrt(k)
        gs = jnp.asarray([m // 4, m // 2, m - m // 4 - m // 2], jnp.int32)
        for op in GROUPED_OPS:
            prec = PRESETS[op]
            try:
                fn = jax.jit(lambda a, b, g, p=prec: qragged_dot(a, b, g, p, backend=backend))
                got = fn(x, we, gs)
                ref = jax.jit(lambda a, b, g, p=prec: storage_reference_dot(a, b, p, g))(x, we, gs)
                abs_err, rel_err = _errors(got, ref)
                exact = bool(np.array_equal(np.asarray(got), np.asarray(ref)))
                rows.append(dict(backend=backend, op=f"qragged {op}", shape=(m, k, n), exact=exact, abs_err=abs_err,
                                 rel_err=rel_err, ok=rel_err <= dot_rtol,
                                 time_s=_median_time(fn, x, we, gs, repeats=repeats)))
            except NotImplementedError as e:
                rows.append(dict(backend=backend, op=f"qragged {op}", shape=(m, k, n), unsupported=str(e)))
    return rows


def _print(rows: list[dict]) -> None:
    head = f"{'backend':8} {'op':22} {'shape':18} {'bit-exact':9} {'max abs err':>12} {'max rel err':>12} {'time ms':>9}  status"
    print(head)
    print("-" * len(head))
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "unsupported" in r:
            print(f"{r['backend']:8} {r['op']:22} {shape:18} {'-':9} {'-':>12} {'-':>12} {'-':>9}  unsupported: "
                  f"{r['unsupported']}")
            continue
        print(f"{r['backend']:8} {r['op']:22} {shape:18} {'yes' if r['exact'] else 'no':9} {r['abs_err']:12.3e} "
              f"{r['rel_err']:12.3e} {1e3 * r['time_s']:9.2f}  {'ok' if r['ok'] else 'MISMATCH'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small shapes (fast; what the test runs)")
    ap.add_argument("--backends", default="", help="comma-separated subset (default: every available backend)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dot-rtol", type=float, default=1e-5, help="allowed dot error relative to max |reference|")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    compile_cache.enable()

    avail = backends.available_backends()
    wanted = [b for b in args.backends.split(",") if b] or list(avail)
    print(f"jax {jax.__version__} on {jax.default_backend()}; backends:")
    for name, (ok, reason) in avail.items():
        print(f"  {name:7} {'available' if ok else 'unavailable'}: {reason}")
    unknown = [b for b in wanted if b not in avail]
    if unknown:
        print(f"unknown backends {unknown}; registered: {sorted(avail)}", file=sys.stderr)
        return 2
    run = [b for b in wanted if avail[b][0]]
    skipped = [b for b in wanted if not avail[b][0]]
    if args.backends and skipped:
        print(f"asked for unavailable backends {skipped}", file=sys.stderr)
        return 2
    rows = []
    for b in run:
        rows += check_backend(b, SMALL if args.small else FULL, args.repeats, args.dot_rtol, jax.random.key(args.seed))
    print()
    _print(rows)
    bad = [r for r in rows if not r.get("ok", True)]
    print(f"\n{len(rows)} checks on {len(run)} backends: {len(bad)} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
