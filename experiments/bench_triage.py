"""Cost of TRIAGE on this CPU: gate weights + repair (value and gradient) + every mismatch diagnostic, in one jit,
timed per million token positions next to a plain masked mean over the same arrays (a memory-pass baseline).

    python experiments/bench_triage.py [--n 512] [--t 2048] [--reps 40]

All parts are sampled round-robin in one process, so they share the machine's background load; the minimum over
reps is the least load-sensitive figure (the median is printed too). Prints the load average first (the table and
the JSON line say "measured under load" above 0.5 per core, experiments/loadavg.py), a table and one JSON line.
Target: triage_all <= 10x the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.loadavg import machine_load  # noqa: E402
from triage_jax.rl.diagnostics import mismatch_metrics  # noqa: E402
from triage_jax.rl.triage import TriageConfig, gate_weights, repair_loss  # noqa: E402


def make_batch(n: int, t: int, seed: int = 0):
    """A realistic-looking batch: heavy-tailed negative delta, ragged lengths, group advantages of both signs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(t // 8, t + 1, size=n)
    mask = np.arange(t)[None, :] < lengths[:, None]
    delta = (0.02 * rng.standard_normal((n, t)) - 0.3 * (rng.random((n, t)) < 0.05) * rng.exponential(1.0, (n, t)))
    sampler_logp = -rng.exponential(1.0, (n, t))
    logp = sampler_logp + delta + 0.01 * rng.standard_normal((n, t))
    adv = rng.standard_normal(n)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return f32(adv), f32(delta), jnp.asarray(mask), f32(logp), f32(sampler_logp)


def time_interleaved(fns: dict, args, reps: int) -> dict[str, dict[str, float]]:
    """Seconds per call of each compiled fn (outputs blocked on), sampled round-robin so that every fn sees the
    same background load: min and median of wall time and of this process's CPU time (all threads)."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return {k: {"wall_min": min(wall[k]), "wall_median": statistics.median(wall[k]), "cpu_min": min(cpu[k]),
                "cpu_median": statistics.median(cpu[k])} for k in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    load = machine_load()
    print(load.line())
    cfg = TriageConfig()
    adv, delta, mask, logp, sampler_logp = make_batch(args.n, args.t)
    step = jnp.asarray(cfg.k_rep, jnp.int32)

    @jax.jit
    def baseline(adv, delta, mask, logp, sampler_logp):
        return jnp.sum(jnp.where(mask, delta, 0.0)) / jnp.sum(mask)

    @jax.jit
    def weights_only(adv, delta, mask, logp, sampler_logp):
        return gate_weights(adv, delta, mask, cfg)

    @jax.jit
    def repair_only(adv, delta, mask, logp, sampler_logp):
        return jax.value_and_grad(lambda lp: repair_loss(adv, lp, sampler_logp, mask, step, cfg))(logp)

    @jax.jit
    def diagnostics_only(adv, delta, mask, logp, sampler_logp):
        return mismatch_metrics(adv, delta, mask, cfg)

    @jax.jit
    def triage_all(adv, delta, mask, logp, sampler_logp):
        alpha = gate_weights(adv, delta, mask, cfg)
        rep, g = jax.value_and_grad(lambda lp: repair_loss(adv, lp, sampler_logp, mask, step, cfg))(logp)
        return alpha, rep, g, mismatch_metrics(adv, delta, mask, cfg)

    arrays = (adv, delta, mask, logp, sampler_logp)
    mtok = args.n * args.t / 1e6
    rows = time_interleaved({"baseline_masked_mean": baseline, "gate_weights": weights_only,
                             "repair_value_and_grad": repair_only, "mismatch_metrics": diagnostics_only,
                             "triage_all": triage_all}, arrays, args.reps)
    base = rows["baseline_masked_mean"]
    print(f"N={args.n} T={args.t} ({mtok:.3f} M positions, {int(np.asarray(mask).sum())} real tokens), "
          f"backend={jax.default_backend()}, {args.reps} interleaved reps; ms per million positions{load.tag()}")
    cols = ("wall_min", "wall_median", "cpu_min", "cpu_median")
    print(f"{'part':<24}" + "".join(f"{c:>13}" for c in cols) + f"{'x base (wall_min)':>20}")
    for name, r in rows.items():
        print(f"{name:<24}" + "".join(f"{r[c] * 1e3 / mtok:>13.3f}" for c in cols)
              + f"{r['wall_min'] / base['wall_min']:>20.2f}")
    ratios = {c: rows["triage_all"][c] / base[c] for c in cols}
    print("triage_all / baseline: " + ", ".join(f"{c} {v:.2f}x" for c, v in ratios.items())
          + f" (target <= 10x: {'OK' if ratios['wall_min'] <= 10 else 'OVER'} on wall_min)")
    print(json.dumps({"bench": "triage", "n": args.n, "t": args.t, "reps": args.reps, **load.fields(),
                      **{f"{k}_ms_per_mtok": round(v["wall_min"] * 1e3 / mtok, 4) for k, v in rows.items()},
                      **{f"triage_over_baseline_{c}": round(v, 3) for c, v in ratios.items()}}))


if __name__ == "__main__":
    main()
