"""The sweep for an NVFP4-specific instability on the model organism (configs/organism.py): cells x arms x seeds.

    python experiments/organism_sweep.py [--cells base,lr1e-4,...] [--arms bf16,nvfp4] [--seeds 0,1,2]
        [--steps 80] [--quick] [--results experiments/results] [--tag organism_sweep]
        [--merge results/<earlier sweep or study>.json ...] [--replot]

Each cell is one setting of the levers the paper's collapse could depend on (CELLS: learning rate, updates per rollout
batch, temperature, response budget, model size, the 4-bit format, the LM head's and the activations' quantization);
each (cell, arm, seed) is one GRPO run from the config's cached warm-up, trained by `experiments/stability.py`'s
`run_one` (the study's own code path). The collapse rule is fixed before any run and computed by code:
`triage_jax.rl.monitor.collapsed` (rollout accuracy below half its running peak for 20 consecutive steps, or delta_q05
below -10). A cell shows the phenomenon when its NVFP4 arm collapses in more seeds than its BF16 arm; the table also
shows how each precursor moved (first -> last window, pooled over seeds) so a cell that drifts without collapsing within
its steps reads as such.

Writes <results>/<tag>.json (per cell, arm and seed: collapsed, collapse_step, first_alarm_step, first -> last
window of the watched metrics, final metrics, avg@n) and <tag>.md (the table). `--merge` joins earlier reports of
the same steps: other sweeps' cells, and a study's (experiments/organism.py) runs of this sweep's arms as its cell's
(the same runs: a study trains its BF16 and NVFP4 arms exactly as a sweep does), so several sweep processes, run side
by side, end in one table (`--replot --merge ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common, stability  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Cell:
    """One setting of the levers: overrides for every arm, the quantized arms' 4-bit preset, overrides for the
    quantized arms only (a BF16 arm stays the mismatch-free reference)."""

    description: str
    overrides: dict = dataclasses.field(default_factory=dict)
    fp4: str = "w4a4"
    quantized: dict = dataclasses.field(default_factory=dict)


CELLS: dict[str, Cell] = {
    "base": Cell("configs/organism.py as set: lr 2e-5, one update per rollout batch, T = 1, NVFP4"),
    "lr5e-5": Cell("learning rate 5e-5", {"optim.lr": 5e-5}),
    "lr1e-4": Cell("learning rate 1e-4 (the base config's)", {"optim.lr": 1e-4}),
    "lr1e-4_seqmean": Cell("lr 1e-4 with the loss averaged per response first (rl.agg=seq-mean-token-mean): no "
                           "token-count weighting of long (often wrong) responses",
                           {"optim.lr": 1e-4, "rl.agg": "seq-mean-token-mean"}),
    "updates4": Cell("4 updates per rollout batch (mini-batch 8 of 32 responses)",
                     {"rl.mini_batch": 8, "rl.micro_batch": 8}),
    "updates4_lr5e-5": Cell("4 updates per rollout batch at lr 5e-5",
                            {"rl.mini_batch": 8, "rl.micro_batch": 8, "optim.lr": 5e-5}),
    "temp1.2": Cell("sampling temperature 1.2", {"sampler.temperature": 1.2}),
    "mxfp4": Cell("MXFP4 (E8M0 scale per 32) instead of NVFP4: a larger mismatch dial", fp4="w4a4_mx"),
    "mxfp4_lr5e-5": Cell("MXFP4 at lr 5e-5", {"optim.lr": 5e-5}, fp4="w4a4_mx"),
    "temp1.2_lr5e-5": Cell("sampling temperature 1.2 at lr 5e-5", {"sampler.temperature": 1.2, "optim.lr": 5e-5}),
    "len256_lr5e-5": Cell("a 256-token response budget (reference chains are 64-138 tokens: wrong answers may run on) "
                          "at lr 5e-5", {"sampler.max_new_tokens": 256, "optim.lr": 5e-5}),
    "small_lr5e-5": Cell("a 2.6M model (preset organism_small: 4 layers of width 192, half the organism's 5.2M) "
                         "with its own warm-up, at lr 5e-5", {"model.preset": "organism_small", "optim.lr": 5e-5}),
    "act_tensor_lr5e-5": Cell("the sampler's NVFP4 activations scaled per tensor (one float32 scale per matmul input, "
                              "shared by the batch) instead of per token, at lr 5e-5", {"optim.lr": 5e-5},
                              quantized={"sampler.act_scaling": "tensor"}),
    "lm_head_fp4": Cell("the sampler's LM head in W4A4 too (the learner's stays BF16)",
                        quantized={"sampler.rules": ("lm_head$=w4a4",)}),
    "lm_head_fp4_lr5e-5": Cell("the sampler's LM head in W4A4 too, lr 5e-5 (the head is tied: the embedding "
                               "matrix is quantized as the head's weight; the lookup stays BF16)", {"optim.lr": 5e-5},
                               quantized={"sampler.rules": ("lm_head$=w4a4",)}),
}

WATCHED = (("reward/accuracy", "rollout acc.", 3), ("mismatch/mean_abs_delta", "mean abs delta", 4),
           ("mismatch/rho_asym", "rho_asym", 2), ("mismatch/delta_q05", "delta q05", 3),
           ("mismatch/tail_persistence", "tail persist.", 2), ("entropy", "entropy", 3))

DEFAULTS = dict(steps=80, seeds="0,1,2", eval_problems=32, eval_n=4)
QUICK = dict(steps=3, seeds="0", eval_problems=2, eval_n=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    p.add_argument("--config", default="organism", help="base config (configs/NAME.py or a path)")
    p.add_argument("--cells", default="base", help=f"comma-separated subset of {list(CELLS)}")
    p.add_argument("--arms", default="bf16,nvfp4", help=f"comma-separated subset of {list(stability.ARMS)}")
    p.add_argument("--steps", type=int, default=None, help=f"GRPO steps per run (default {DEFAULTS['steps']})")
    p.add_argument("--seeds", default=None, help=f"comma-separated RL seeds (default {DEFAULTS['seeds']})")
    p.add_argument("--eval_problems", type=int, default=None, help="held-out problems of each run's final avg@n")
    p.add_argument("--eval_n", type=int, default=None, help="samples per held-out problem")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every run (repeatable), after the cell's")
    p.add_argument("--out_dir", default=None, help="where the runs go (default runs/<tag>/<cell>)")
    p.add_argument("--extend", default=None, metavar="DIR",
                   help="continue an earlier sweep's finished runs (DIR/<cell>/<arm>/seed<k>, fewer steps, the same "
                        "settings) to --steps instead of training from step 0")
    p.add_argument("--results", default=os.path.join(common.ROOT, "experiments", "results"))
    p.add_argument("--compile_cache", default=os.path.join(common.ROOT, "runs", "jax_cache"),
                   help="JAX persistent compilation cache folder ('' to disable)")
    p.add_argument("--replot", action="store_true",
                   help="rebuild the table and JSON from the runs' history.json under --out_dir (no training): the "
                        "finished runs of an interrupted sweep; avg@n from an earlier <tag>.json where it has them")
    p.add_argument("--tag", default=None, help="file name stem of the outputs (default organism_sweep[_quick])")
    p.add_argument("--merge", nargs="*", default=[],
                   help="earlier reports of the same --steps: sweeps (<tag>.json) and organism.py studies, whose "
                        "(cell, arm) runs join this report where it has none")
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.cells = [x for x in args.cells.split(",") if x]
    unknown = [x for x in args.cells if x not in CELLS]
    if unknown or not args.cells:
        p.error(f"--cells: unknown or empty {unknown}; choose from {list(CELLS)}")
    args.tag = args.tag or ("organism_sweep_quick" if args.quick else "organism_sweep")
    args.out_dir = args.out_dir or os.path.join(common.ROOT, "runs", args.tag)
    for path in args.merge:
        if not os.path.exists(path):
            p.error(f"--merge: {path} does not exist")
        with open(path) as f:
            earlier = json.load(f)
        if "cells" not in earlier and "regime" not in earlier:
            p.error(f"--merge: {path} is neither a sweep report (no 'cells') nor a study report (no 'regime')")
        if earlier["args"]["steps"] != args.steps:
            p.error(f"--merge: {path} ran --steps {earlier['args']['steps']}, this report --steps {args.steps}")
    # Every per-run argument goes through the study's own parser, so the two validate alike.
    for cell in args.cells:
        study_args(args, cell)
    return args


def study_args(args, cell: str):
    """The stability study's arguments for one cell (its arms, seeds, steps, the cell's overrides)."""
    return stability.parse_args(study_argv(args, cell))


def study_argv(args, cell: str) -> list[str]:
    """`study_args`'s command line (also what a worker process of experiments/organism.py is given)."""
    spec = CELLS[cell]
    argv = ["--config", args.config, "--arms", args.arms, "--steps", str(args.steps), "--seeds", str(args.seeds),
            "--eval_problems", str(args.eval_problems), "--eval_n", str(args.eval_n), "--ks", "1",
            "--eval_reward", "dapo", "--fp4", spec.fp4, "--out_dir", os.path.join(args.out_dir, cell)]
    if args.extend:
        argv += ["--extend", os.path.join(args.extend, cell)]
    # The config's own batch (num_prompts x group_size) unless overridden: the study's flags default to its preset.
    c = common.load_config(args.config)
    argv += ["--num_prompts", str(c.rl.num_prompts), "--group_size", str(c.rl.group_size)]
    for k, v in spec.overrides.items():
        argv += ["--set", f"{k}={v!r}"]
    for k, v in spec.quantized.items():
        argv += ["--qset", f"{k}={v!r}"]
    for item in args.overrides:
        argv += ["--set", item]
    return argv


def window_means(history: list[dict], key: str, k: int) -> tuple[float, float]:
    """Mean of a metric over the first and the last k steps of one run (NaN where never finite)."""
    def mean(rows):
        v = [r.get(key) for r in rows]
        v = [float(x) for x in v if x is not None and math.isfinite(x)]
        return float(np.mean(v)) if v else math.nan

    return mean(history[:k]), mean(history[-k:])


def save(args, cells: dict, total_s: float) -> str:
    """The results so far: <tag>.json and the <tag>.md table."""
    own = f"{total_s / 60:.1f} min" if math.isfinite(total_s) else "no runs of its own"
    text = (f"## {args.tag}: {args.config}, {args.steps} steps, seeds {args.seeds}, arms {args.arms}, {own}"
            f"\n\nCollapse rule: `rl.monitor.collapsed` (rollout accuracy < 1/2 of its "
            "running peak for 20 steps, or delta_q05 < -10); 'first alarm': the first level-1 early-warning alarm per "
            "seed. Metric columns: mean over the first -> the last window of steps, pooled over seeds.\n\n"
            + "".join(f"Joins `{os.path.basename(m)}` ({merged_minutes(m)}).\n" for m in args.merge)
            + ("\n" if args.merge else "")
            + "\n".join(f"- `{c}`: {rec['description']}" for c, rec in cells.items())
            + "\n\n" + table(cells, args.eval_n) + "\n")
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, f"{args.tag}.md"), "w") as f:
        f.write(text)
    common.write_json(os.path.join(args.results, f"{args.tag}.json"),
                      {"args": vars(args), "total_s": total_s, "cells": cells})
    return text


def merged_minutes(path: str) -> str:
    """An earlier report's wall time ("wall time not recorded" for a --replot of an interrupted sweep)."""
    with open(path) as f:
        total = json.load(f).get("total_s")
    return "wall time not recorded" if total is None or not math.isfinite(total) else f"{total / 60:.1f} min"


def record(r: dict, k: int) -> dict:
    """One run's entry of the results: the study's outcome fields plus first -> last window of WATCHED."""
    drift = {key: window_means(r["history"], key, k) for key, _, _ in WATCHED}
    return {x: r.get(x) for x in ("collapsed", "collapse_step", "first_alarm_step", "first_alarms", "final", "eval",
                                  "train_s", "run_dir", "extended")} | {"drift": drift}


def replot(args, log) -> tuple[dict, float]:
    """The records of every finished run under out_dir (a run folder holding history.json; its avg@n and train time
    from the folder's eval.json, else from the earlier <tag>.json), and the earlier invocation's wall time (NaN if
    none was saved)."""
    old, total = {}, math.nan
    path = os.path.join(args.results, f"{args.tag}.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        old, total = saved.get("cells", {}), saved.get("total_s")
        total = math.nan if total is None else total  # a report with no runs of its own saved NaN as null
    cells = {}
    for cell in args.cells:
        sargs = study_args(args, cell)
        k = stability.final_window(sargs)
        arms = {}
        for arm in sargs.arms:
            for seed in sargs.seeds:
                run_dir = stability.arm_config(sargs, arm, seed).run_dir
                if not os.path.exists(os.path.join(run_dir, "history.json")):
                    continue
                history = common.read_history(run_dir)
                cfg = common.config_from_json(os.path.join(run_dir, "config.json"))
                saved = old.get(cell, {}).get("arms", {}).get(arm, {}).get(str(seed), {})
                if os.path.exists(os.path.join(run_dir, "eval.json")):  # the run's own record wins
                    with open(os.path.join(run_dir, "eval.json")) as f:
                        saved = json.load(f)
                r = {"history": history, "run_dir": run_dir,
                     **stability.outcome(history, cfg.monitor.to_dict(), k),
                     **{x: saved.get(x) for x in ("eval", "train_s", "extended")}}
                arms.setdefault(arm, {})[seed] = record(r, k)
        if arms:
            cells[cell] = {**dataclasses.asdict(CELLS[cell]), "window": k, "arms": arms}
        log(f"{cell}: {sum(len(v) for v in arms.values())} finished runs")
    return cells, total


def merged(args, cells: dict) -> dict:
    """`cells` joined by the --merge reports' runs where it has no run of that (cell, arm); a study report's runs
    count for its regime's cell, only its arms in --arms (the sweep's)."""
    out = {c: {**rec, "arms": dict(rec["arms"])} for c, rec in cells.items()}
    arms = args.arms.split(",")
    for path in args.merge:
        with open(path) as f:
            earlier = json.load(f)
        if "cells" in earlier:
            found = earlier["cells"]
        else:
            reg = earlier["regime"]
            spec = CELLS[reg["cell"]]
            found = {reg["cell"]: {**dataclasses.asdict(spec), "window": earlier["final_window"],
                                   "warmup_eval": earlier["warmup_eval"],
                                   "arms": {a: v for a, v in earlier["arms"].items() if a in arms}}}
        for cell, rec in found.items():
            mine = out.setdefault(cell, {**rec, "arms": {}})
            for arm, per_seed in rec["arms"].items():
                for r in per_seed.values():  # JSON stores a never-finite window (NaN) as null
                    r["drift"] = {k: [math.nan if v is None else v for v in w] for k, w in r["drift"].items()}
                mine["arms"].setdefault(arm, per_seed)
    order = list(stability.ARMS)
    return {c: {**rec, "arms": {a: rec["arms"][a] for a in sorted(rec["arms"], key=order.index)}}
            for c, rec in out.items() if rec["arms"]}


def run_sweep(args, log) -> dict:
    t0 = time.perf_counter()
    cells = {}
    for cell in args.cells:
        sargs = study_args(args, cell)
        k = stability.final_window(sargs)
        study = stability.run_study(sargs, log)
        arms = {}
        for arm, per_seed in study["runs"].items():
            arms[arm] = {}
            for seed, r in per_seed.items():
                arms[arm][seed] = record(r, k)
        cells[cell] = {**dataclasses.asdict(CELLS[cell]), "window": k, "warmup_eval": study["warmup_eval"],
                       "arms": arms}
        # After every cell: a crash or kill keeps the finished ones.
        save(args, merged(args, cells), time.perf_counter() - t0)
    return cells


def table(cells: dict, eval_n: int) -> str:
    rows = []
    for cell, rec in cells.items():
        for arm, per_seed in rec["arms"].items():
            runs = list(per_seed.values())
            n_col = sum(r["collapsed"] for r in runs)
            onsets = [str(r["collapse_step"]) for r in runs if r["collapsed"]]
            alarms = ", ".join("-" if r["first_alarm_step"] is None else str(r["first_alarm_step"]) for r in runs)
            row = [cell, arm, f"{n_col}/{len(runs)}" + (f" ({', '.join(onsets)})" if onsets else ""), alarms]
            for key, _, digits in WATCHED:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    first = np.nanmean([r["drift"][key][0] for r in runs])
                    last = np.nanmean([r["drift"][key][1] for r in runs])
                row.append(f"{common.fmt(float(first), digits)} -> {common.fmt(float(last), digits)}")
            evals = [r["eval"][f"avg@{eval_n}"] for r in runs if r.get("eval")]
            row.append(common.fmt(float(np.mean(evals)), 3) if len(evals) == len(runs) else "-")
            rows.append(row)
    header = ["cell", "arm", "collapsed", "first alarm"] + [lb for _, lb, _ in WATCHED] + [f"avg@{eval_n}"]
    return common.markdown_table(header, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[sweep {time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    if args.replot:
        cells, total = replot(args, log)
    else:
        with common.compile_cache(args.compile_cache):
            cells = run_sweep(args, log)
        total = time.perf_counter() - t0
    print(save(args, merged(args, cells), total))
    log(f"table: {os.path.join(args.results, args.tag + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
