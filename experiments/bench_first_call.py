"""The rollout engine's first generate in a fresh process (compile included), by how its programs compile:
`serial` (each as it is first called), `parallel` (the first round's prefill, insert and decode side by side on
threads: EngineConfig.parallel_compile, the default) and `ahead` (parallel, and the decode round at the larger
KV-capacity buckets compiled in the background while the rollout runs: EngineConfig.compile_ahead, the trainer's
default).

    python experiments/bench_first_call.py [--layers 36] [--processes 3] [--prompt 8] [--new 200]
        [--modes serial,parallel,ahead] [--sampler bf16]

bench_scan's model (Qwen3-4B's depth at width 256, bf16, unrolled; no persistent cache) sampled with --sampler (a
sampler preset, e.g. w4a4, the paper configs'; its weights quantized before the clock starts), 8 prompts; the default
workload (8-token prompts, 200 new tokens, no stop) grows through the capacity buckets 64, 128 and 256, as a
rollout's responses do. The modes alternate over --processes fresh processes each; the table reports the best and
the median. Greedy tokens of every mode are compared. Prints a table and one JSON line (`"bench": "first_call"`).
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

from experiments.bench_scan import SLOTS, WIDTH, run_form  # noqa: E402
from experiments.loadavg import machine_load  # noqa: E402

MODES = ("serial", "parallel", "ahead")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--sampler", default="bf16", help="the sampler's preset (quant.PRESETS)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes) or modes[0] != "serial":
        ap.error(f"--modes: a list of {MODES} starting with serial (the baseline), got {args.modes!r}")
    from triage_jax.quant import PRESETS

    if args.sampler not in PRESETS:
        ap.error(f"--sampler: one of {sorted(PRESETS)}, got {args.sampler!r}")
    from flax import nnx

    from triage_jax import models

    load = machine_load()
    print(load.line())
    cfg = models.get_model_config("qwen3_4b", num_hidden_layers=args.layers, **WIDTH)
    runs = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        models.save_pretrained(models.Qwen3(cfg, rngs=nnx.Rngs(0)), d)
        for _ in range(args.processes):
            for mode in runs:
                runs[mode].append(run_form(d, "unrolled", 1, mode, prompt=args.prompt, new=args.new,
                                             sampler=args.sampler))
    tokens = [r["tokens"] for rs in runs.values() for r in rs]
    first = {mode: [r["first_s"] for r in rs] for mode, rs in runs.items()}
    base = statistics.median(first["serial"])
    print(f"\n{args.layers} layers, width {WIDTH['hidden_size']}, bf16, {args.sampler} sampler; {SLOTS} prompts x "
          f"{args.prompt} tokens, {args.new} new; {args.processes} fresh processes per mode{load.tag()}")
    print(f"{'compile':>9} {'best s':>8} {'median s':>9} {'x serial':>9}  all")
    for mode, xs in first.items():
        print(f"{mode:>9} {min(xs):>8.2f} {statistics.median(xs):>9.2f} {statistics.median(xs) / base:>9.3f}  "
              f"{' '.join(f'{x:.2f}' for x in xs)}")
    out = {"bench": "first_call", "sampler": args.sampler, "layers": args.layers, "processes": args.processes,
           "prompt": args.prompt, "new": args.new, **{f"{m}_first_s": xs for m, xs in first.items()},
           **{f"ratio_{m}_vs_serial_median": round(statistics.median(xs) / base, 3) for m, xs in first.items()},
           "greedy_tokens_equal": all(t == tokens[0] for t in tokens), **load.fields()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
