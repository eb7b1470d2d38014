"""The rollout engine's first generate in a fresh process (compile included): the first round's programs compiled
side by side on threads (EngineConfig.parallel_compile, the default) vs one by one as each is first called.

    python experiments/bench_first_call.py [--layers 36] [--processes 3]

bench_scan's model and workload (Qwen3-4B's depth at width 256, bf16, 8 prompts x 32 tokens, 16 new; no persistent
cache), unrolled layers; the two modes alternate over --processes fresh processes each, and the table reports the
best and the median of each. Greedy tokens of the two modes are compared. Prints a table and one JSON line
(`"bench": "first_call"`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.bench_scan import NEW, PROMPT, SLOTS, WIDTH, run_form  # noqa: E402
from experiments.loadavg import machine_load  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--processes", type=int, default=3)
    args = ap.parse_args(argv)
    from flax import nnx

    from triage_jax import models

    load = machine_load()
    print(load.line())
    cfg = models.get_model_config("qwen3_4b", num_hidden_layers=args.layers, **WIDTH)
    runs = {"serial": [], "parallel": []}
    with tempfile.TemporaryDirectory() as d:
        models.save_pretrained(models.Qwen3(cfg, rngs=nnx.Rngs(0)), d)
        for _ in range(args.processes):
            for mode in runs:
                runs[mode].append(run_form(d, "unrolled", 1, mode))
    tokens = [r["tokens"] for rs in runs.values() for r in rs]
    first = {mode: [r["first_s"] for r in rs] for mode, rs in runs.items()}
    print(f"\n{args.layers} layers, width {WIDTH['hidden_size']}, bf16; {SLOTS} prompts x {PROMPT} tokens, {NEW} new; "
          f"{args.processes} fresh processes per mode{load.tag()}")
    print(f"{'compile':>9} {'best s':>8} {'median s':>9}  all")
    for mode, xs in first.items():
        print(f"{mode:>9} {min(xs):>8.2f} {statistics.median(xs):>9.2f}  {' '.join(f'{x:.2f}' for x in xs)}")
    out = {"bench": "first_call", "layers": args.layers, "processes": args.processes,
           **{f"{m}_first_s": xs for m, xs in first.items()},
           "ratio_parallel_vs_serial_median": round(statistics.median(first["parallel"])
                                                   / statistics.median(first["serial"]), 3),
           "greedy_tokens_equal": all(t == tokens[0] for t in tokens), **load.fields()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
