"""TRIAGE thresholds proposed from a pilot run's token deltas.

  python -m triage_jax.main --config=configs/organism.py --config.rl.correction=none \
      --config.train.save_deltas=1 --config.train.steps=10 --config.run_dir=runs/pilot
  python -m triage_jax.tools.thresholds --run_dir=runs/pilot [--steps=0:10] [--tail_quantile=0.05]

Pools the saved steps' deltas (`triage_jax.deltas`, written by train.save_deltas), applies `propose_thresholds`
(docs/rl_math.md#thresholds) on top of the run's own rl.triage (its config.json), and prints the current and the
proposed value of each threshold, the `--config.rl.triage.*` flags to use them, and a final JSON line.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags


def base_config(run_dir: str):
    """The run's rl.triage (its config.json), or the defaults when the run wrote none."""
    from triage_jax.rl.corrections import make_config

    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return make_config("triage")
    with open(path) as f:
        return make_config("triage", json.load(f).get("rl", {}).get("triage", {}))


def parse_steps(text: str):
    """'a:b' -> range(a, b); '' -> None (every saved step)."""
    if not text:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise app.UsageError(f"--steps: expected FIRST:END (e.g. 0:10), got {text!r}") from None
    return range(lo, hi)


def main(argv) -> None:
    del argv
    from triage_jax import deltas

    run_dir = _RUN_DIR.value
    if not run_dir:
        raise app.UsageError("pass --run_dir=RUN (a run made with train.save_deltas >= 1)")
    base = base_config(run_dir)
    try:
        proposed, pool = deltas.propose(run_dir, base, parse_steps(_STEPS.value), tail_quantile=_TAIL_Q.value)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    n_tok = int(pool.mask.sum())
    print(f"{run_dir}: {len(pool.steps)} steps ({pool.steps[0]}..{pool.steps[-1]}), {pool.delta.shape[0]} responses, "
          f"{n_tok} tokens")
    print(f"{'threshold':<10} {'current':>10} {'proposed':>10}")
    for k in deltas.THRESHOLD_KEYS:
        print(f"{k:<10} {getattr(base, k):>10.4g} {getattr(proposed, k):>10.4g}")
    print(" ".join(f"--config.{k}={v:.6g}" for k, v in deltas.overrides(proposed).items()))
    print(json.dumps({"run_dir": run_dir, "steps": list(pool.steps), "tokens": n_tok,
                      "proposed": {k: getattr(proposed, k) for k in deltas.THRESHOLD_KEYS},
                      "current": {k: getattr(base, k) for k in deltas.THRESHOLD_KEYS}}))


def define_flags() -> None:
    """Register the CLI flags (only when run as a program, so importing this module defines none)."""
    global _RUN_DIR, _STEPS, _TAIL_Q
    _RUN_DIR = flags.DEFINE_string("run_dir", "", "The pilot run's folder (with deltas/ from train.save_deltas).")
    _STEPS = flags.DEFINE_string("steps", "", "FIRST:END of the saved steps to pool (default: all).")
    _TAIL_Q = flags.DEFINE_float("tail_quantile", 0.05, "tau_tail = -(this quantile of delta).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
