"""Quantizer throughput and quantized-dot overhead on this machine (a script, not a timed test).

    python experiments/bench_quant.py [--m 4096 --k 4096] [--dot 2048,4096,4096] [--repeats 5]

Prints the machine's load average first (experiments/loadavg.py; the table header and the JSON line say
"measured under load" when the 1-minute load is above 0.5 per core), then a table and one JSON line: NVFP4
(tensor, row) and MXFP8 quantize throughput in GB/s of float32 input against two baselines measured in the same run
on the same array: a true memory copy (`np.copyto` into a preallocated buffer: read + write, the target) and the
read bandwidth (`np.sum` over the input: read only), plus the jitted `x + 0` for reference (XLA:CPU runs it well
below a real copy, so it is no baseline); and the w4a4 quantized-dot forward time over the plain dot's in the same
compute dtype (bf16 operands, f32 accumulation). Every GB/s figure is input bytes / time.
Targets on a CPU: quantize >= 25% of the real copy bandwidth; w4a4 forward <= 2x the plain dot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.loadavg import machine_load  # noqa: E402
from triage_jax.quant import PRESETS, prequantize, qdot, quantize_mxfp8, quantize_nvfp4  # noqa: E402

BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def round_robin_medians(fns: dict, args: dict, repeats: int) -> dict[str, float]:
    """Median seconds per function, timed in alternation (one call of each per round) so that load from other
    processes on a shared machine hits every op alike."""
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))  # compile + warm up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--dot", default="2048,4096,4096", help="M,K,N of the dot")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    load = machine_load()
    print(load.line())
    blas_env = {k: os.environ[k] for k in BLAS_ENV if k in os.environ}
    if blas_env:  # np.copyto and np.sum do not call BLAS; printed so a reader can rule it out
        print(f"BLAS environment (not used by np.copyto / np.sum): {blas_env}")

    x = jax.random.normal(jax.random.key(0), (args.m, args.k), jnp.float32)
    x_np = np.array(x)  # its own host copy
    dst = np.empty_like(x_np)
    gb = x.nbytes / 1e9
    res = {"bench": "quant", "device": jax.devices()[0].device_kind, "quantize_shape": [args.m, args.k], **load.fields()}
    ops = {
        "nvfp4_tensor": lambda a: quantize_nvfp4(a),
        "nvfp4_row": lambda a: quantize_nvfp4(a, scaling="row"),
        "mxfp8": lambda a: quantize_mxfp8(a),
    }
    fns = {"copy": lambda a: np.copyto(dst, a), "read": lambda a: np.sum(a), "jax_x_plus_0": jax.jit(lambda a: a + 0),
           **{name: jax.jit(fn) for name, fn in ops.items()}}
    fn_args = {name: (x_np,) if name in ("copy", "read") else (x,) for name in fns}
    t = round_robin_medians(fns, fn_args, args.repeats)
    res["copy_gbps"] = gb / t["copy"]
    res["read_gbps"] = gb / t["read"]
    res["jax_x_plus_0_gbps"] = gb / t["jax_x_plus_0"]
    for name in ops:
        res[f"{name}_gbps"] = gb / t[name]
        res[f"{name}_frac_of_copy"] = res[f"{name}_gbps"] / res["copy_gbps"]
        res[f"{name}_frac_of_read"] = res[f"{name}_gbps"] / res["read_gbps"]

    m, k, n = map(int, args.dot.split(","))
    kx, kw = jax.random.split(jax.random.key(1))
    xd = jax.random.normal(kx, (m, k), jnp.bfloat16)
    wd = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    prec = PRESETS["w4a4"]
    w4a4 = jax.jit(lambda a, b: qdot(a, b, prec))
    fns = {
        "plain": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)),
        "w4a4": w4a4,
        "w4a4_pre": w4a4,
    }
    t = round_robin_medians(fns, {"plain": (xd, wd), "w4a4": (xd, wd), "w4a4_pre": (xd, prequantize(wd, prec))},
                            args.repeats)
    res["dot_shape"] = [m, k, n]
    res["plain_dot_s"], res["w4a4_dot_s"], res["w4a4_prequantized_dot_s"] = t["plain"], t["w4a4"], t["w4a4_pre"]
    res["w4a4_over_plain"] = res["w4a4_dot_s"] / res["plain_dot_s"]
    res["w4a4_prequantized_over_plain"] = res["w4a4_prequantized_dot_s"] / res["plain_dot_s"]
    res["targets_met"] = bool(
        min(res[f"{o}_frac_of_copy"] for o in ops) >= 0.25 and res["w4a4_over_plain"] <= 2.0
    )

    print(f"device {res['device']}, quantize input {args.m}x{args.k} float32 ({gb * 1e3:.0f} MB), "
          f"median of {args.repeats}{load.tag()}")
    print(f"{'op':28} {'GB/s':>8} {'of copy':>8} {'of read':>8}")
    print(f"{'memory copy (np.copyto)':28} {res['copy_gbps']:8.2f} {1.0:8.0%} {res['copy_gbps'] / res['read_gbps']:8.0%}")
    print(f"{'memory read (np.sum)':28} {res['read_gbps']:8.2f} {res['read_gbps'] / res['copy_gbps']:8.0%} {1.0:8.0%}")
    print(f"{'jitted x + 0 (no baseline)':28} {res['jax_x_plus_0_gbps']:8.2f} "
          f"{res['jax_x_plus_0_gbps'] / res['copy_gbps']:8.0%} {res['jax_x_plus_0_gbps'] / res['read_gbps']:8.0%}")
    for name in ops:
        print(f"{'quantize ' + name:28} {res[name + '_gbps']:8.2f} {res[name + '_frac_of_copy']:8.0%} "
              f"{res[name + '_frac_of_read']:8.0%}")
    print(f"\ndot {m}x{k} @ {k}x{n}, bf16 operands, f32 accumulation{load.tag()}")
    print(f"{'op':28} {'ms':>8} {'vs plain':>8}")
    print(f"{'plain dot':28} {1e3 * res['plain_dot_s']:8.1f} {1.0:8.2f}")
    print(f"{'w4a4 qdot forward':28} {1e3 * res['w4a4_dot_s']:8.1f} {res['w4a4_over_plain']:8.2f}")
    print(f"{'w4a4 qdot, prequantized W':28} {1e3 * res['w4a4_prequantized_dot_s']:8.1f} "
          f"{res['w4a4_prequantized_over_plain']:8.2f}")
    print(f"targets (quantize >= 25% of the np.copyto bandwidth, w4a4 forward <= 2x the plain dot): "
          f"{'met' if res['targets_met'] else 'NOT met'}{load.tag()}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
