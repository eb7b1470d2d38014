"""Exact mode's cost: the trainer's learner step (and rollout) with learner.exact on vs off, side by side.

    python experiments/bench_exact.py [--config=tiny] [--steps=4]

Both arms train the same config with one precision on both sides (the config's sampler preset), so the only
difference is the numerics path; the first step (compilation) is dropped and the median of the rest reported.
Prints a table and a final JSON line with the ratios exact / default (the target is a learner-step ratio <= 1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402
from triage_jax.trainer import Trainer  # noqa: E402


def run_arm(config: str, exact: bool, steps: int, root: str) -> dict:
    c = common.load_config(config)
    c.run_dir = os.path.join(root, f"exact_{exact}")
    c.warmup.cache_dir = os.path.abspath(c.warmup.cache_dir)  # the shared cached warm-up (trained if absent)
    c.learner.precision = c.sampler.precision
    c.learner.exact = exact
    c.train.steps = steps
    c.train.ckpt_every = steps
    c.train.progress = False
    hist = Trainer(c).run()
    rest = hist[1:]
    return {"learner_s": statistics.median(m["time/learner"] for m in rest),
            "rollout_s": statistics.median(m["time/rollout"] for m in rest),
            "mean_abs_delta": statistics.mean(m["mismatch/mean_abs_delta"] for m in hist)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step compiles and is dropped)")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        arms = {exact: run_arm(args.config, exact, args.steps, root) for exact in (False, True)}
    print(f"{'arm':<8} {'learner s':>10} {'rollout s':>10} {'mean|delta|':>12}")
    for exact, r in arms.items():
        print(f"{'exact' if exact else 'default':<8} {r['learner_s']:>10.3f} {r['rollout_s']:>10.3f} "
              f"{r['mean_abs_delta']:>12.3g}")
    result = {"config": args.config, "steps": args.steps, "load_avg": [round(x, 2) for x in load],
              "default": arms[False], "exact": arms[True],
              "learner_ratio": arms[True]["learner_s"] / arms[False]["learner_s"],
              "rollout_ratio": arms[True]["rollout_s"] / arms[False]["rollout_s"]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
