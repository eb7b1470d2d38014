"""Stale-policy overlap: how much of the rollout hides behind the update, on a 2-device CPU mesh split into a
sampler half and a learner half.

    python experiments/bench_staleness.py [--config=tiny] [--steps=5] [--warmup]

Three arms of the same config (random init unless --warmup: timing does not need a trained policy):
`sync` (rl.staleness=0, one device), `stale-1dev` (rl.staleness=1, the background thread on the learner's device)
and `stale-split` (rl.staleness=1, mesh.sampler_devices=1: the engine on device 1, the learner on device 0). The
first step (compilation, and the stale arms' queue fill) is dropped and the median of the rest reported. Prints a
table and a final JSON line (with the load average: the overlap needs a free core).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # before jax is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402
from triage_jax.trainer import Trainer  # noqa: E402

ARMS = {"sync": (0, 0), "stale-1dev": (1, 0), "stale-split": (1, 1)}  # name -> (rl.staleness, sampler_devices)
KEYS = ("time/step", "time/rollout", "time/learner", "time/rollout_wait", "time/overlap_hidden", "time/overlap_frac")


def run_arm(config: str, staleness: int, sampler_devices: int, steps: int, warmup: bool, root: str) -> dict:
    c = common.load_config(config)
    c.run_dir = os.path.join(root, f"s{staleness}_d{sampler_devices}")
    c.warmup.cache_dir = os.path.abspath(c.warmup.cache_dir)
    c.warmup.enabled = warmup
    c.rl.staleness = staleness
    c.mesh.sampler_devices = sampler_devices
    c.train.steps = steps
    c.train.ckpt_every = steps
    c.train.energy_every = 0
    c.train.progress = False
    rest = Trainer(c).run()[1:]
    return {k: statistics.median(m[k] for m in rest) for k in KEYS if k in rest[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", action="store_true", help="start from the config's (cached) warm-up")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step compiles and is dropped)")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        arms = {name: run_arm(args.config, s, d, args.steps, args.warmup, root) for name, (s, d) in ARMS.items()}
    print(f"{'arm':<12}" + "".join(f"{k[5:]:>16}" for k in KEYS))
    for name, r in arms.items():
        print(f"{name:<12}" + "".join(f"{r[k]:>16.3f}" if k in r else f"{'-':>16}" for k in KEYS))
    print(json.dumps({"config": args.config, "steps": args.steps, "load_avg_start": [round(x, 2) for x in load],
                      "load_avg_end": [round(x, 2) for x in os.getloadavg()], "arms": arms}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
