"""The collapse-rate study: does an NVFP4 sampler make GRPO collapse more often than BF16? Many seeds, long runs,
rules fixed before any run, and a test statistic for every claim.

    python experiments/collapse_rate.py regime [--cells lr1e-4,lr3e-4,lr1e-3] [--seeds 0,1,2]
    python experiments/collapse_rate.py main [--cell CELL] [--arms bf16,nvfp4] [--seeds 0-11]
    python experiments/collapse_rate.py report

Several workers may run one phase side by side (start the same command once per core, e.g. under
`taskset -c N nice -n 19`): each run is claimed by a lock file beside its record. `main --wait` waits until the
regime's runs are all finished before it picks the cell.

Every (cell, arm, seed) is one GRPO run of `configs/tiny.py` (the CPU default's task, levels 1 and 3, from its
cached warm-up; 8 prompts x 8 responses per step, one update per step), trained by the project's Trainer with a
checkpoint every 25 steps: a killed or interrupted study resumes where it stopped (rerun the same command; a
finished run is skipped). Each finished run is kept as compact data in the repository,
`experiments/results/collapse_rate/<cell>/<arm>_seed<k>.json` (every step's watched metrics, the held-out eval,
wall time, load), so a later study can extend it; `report` turns them into `results/collapse_rate.{json,md}`.

Rules, fixed before the first run (docs: experiments/README.md, "The collapse-rate study"):

1. Regime, BF16 only. Each candidate cell (CELLS) runs BF16 seeds 0, 1, 2 for STEPS steps. A cell qualifies when
   all three end with held-out avg@8 above the warm-up policy's and none collapses (so one seed that does not
   decides the cell, and its remaining seeds are not run). The study runs in the qualifying cell with the largest
   learning rate (the most stress under which BF16 still learns); `report` picks it from the data.
2. Collapse: `triage_jax.rl.monitor.collapsed` (rollout accuracy below half its running peak for 20 consecutive
   steps, or delta_q05 below -10), unchanged from the earlier studies. Over STEPS = 300 steps an onset at step
   <= 280 can be confirmed (the horizon); a run without a confirmed onset counts as a survival censored at 280.
3. Comparison, BF16 vs NVFP4 (the W4A4 sampler), seeds 0-11 in the chosen cell: the collapse rate of each arm
   with a Wilson 95% interval and Fisher's exact test (two-sided); Kaplan-Meier survival with a log-rank test;
   the final held-out avg@8 per arm with a Mann-Whitney U test (two-sided) and a bootstrap 95% interval of the
   difference of means. The corrections (TIS, TRIAGE with thresholds from a pilot, OPSM in DeepSeek-V3.2's form)
   run only if Fisher's p < 0.05.
4. The monitor as a predictor: for each alarm and threshold, the share of collapsed runs alarmed within H = 50
   steps before their onset (true-positive rate) against false alarms per 100 steps of the runs that did not
   collapse; lead times from collapsed runs only. With no collapse there are no positives to score: the report
   then gives the false-alarm rates alone.
5. The direction signals against their nulls (docs/rl_math.md#nulls): per arm, rho_asym, its shuffle null and
   excess, the length-free odds ratio and tail persistence over its null, first and last 50 steps, with a
   Mann-Whitney test of NVFP4 vs BF16 on the per-run last-50-step means.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common, stability  # noqa: E402
from experiments.loadavg import machine_load  # noqa: E402

STEPS = 300
HORIZON = STEPS - 20  # the last onset the collapse rule can confirm within STEPS
LEAD_H = 50  # steps before an onset within which an alarm counts as a true positive
CKPT_EVERY = 25
RESULTS = os.path.join(common.ROOT, "experiments", "results")
PARTS = os.path.join(RESULTS, "collapse_rate")


@dataclasses.dataclass(frozen=True)
class Cell:
    description: str
    overrides: dict
    lr: float


CELLS = {
    "lr1e-4": Cell("configs/tiny.py as set (lr 1e-4)", {"optim.lr": 1e-4}, 1e-4),
    "lr3e-4": Cell("lr 3e-4", {"optim.lr": 3e-4}, 3e-4),
    "lr1e-3": Cell("lr 1e-3", {"optim.lr": 1e-3}, 1e-3),
}
ARMS = ("bf16", "nvfp4")
MAIN_SEEDS = tuple(range(12))
REGIME_SEEDS = (0, 1, 2)
# The per-step metrics kept in the repository (what the collapse rule, the monitor and the report read).
KEPT = ("reward/mean", "reward/accuracy", "response/length_mean", "entropy", "learner/loss",
        "mismatch/mean_abs_delta", "mismatch/delta_q05", "mismatch/rho_asym", "mismatch/rho_asym_null",
        "mismatch/rho_asym_excess", "mismatch/rho_asym_null_p", "mismatch/rho_asym_direction",
        "mismatch/tail_persistence", "mismatch/tail_persistence_null", "mismatch/tail_persistence_excess",
        "mismatch/tail_persistence_null_p", "mismatch/tail_freq", "time/step")
EVAL = dict(eval_problems=64, eval_n=8, ks=[1, 8], eval_top_p=0.7, eval_reward="math_verify")


@dataclasses.dataclass(frozen=True)
class Study:
    """Where one invocation reads and writes, and its run length (the defaults are the study's; tests shrink them)."""

    out_dir: str = os.path.join(common.ROOT, "runs", "collapse_rate")
    parts: str = PARTS
    steps: int = STEPS
    eval_problems: int = EVAL["eval_problems"]
    extra: tuple = ()  # more config overrides for every run, as (key, value) pairs

    def args(self, cell: str) -> argparse.Namespace:
        """What experiments/stability.py's arm_config and evaluate_model read, for one cell of this study."""
        return argparse.Namespace(
            config="tiny", fp4="w4a4", num_prompts=8, group_size=8, steps=self.steps,
            out_dir=os.path.join(self.out_dir, cell), quantized_overrides={}, warmup_seed=0,
            overrides={**CELLS[cell].overrides, "train.ckpt_every": min(CKPT_EVERY, self.steps), **dict(self.extra)},
            **{**EVAL, "eval_problems": self.eval_problems})

    def part(self, cell: str, arm: str, seed: int) -> str:
        return os.path.join(self.parts, cell, f"{arm}_seed{seed}.json")


def compact(history: list[dict]) -> dict[str, list]:
    """Columns of the KEPT metrics, 6 significant digits (None where absent or not finite)."""
    def v(x):
        return float(f"{x:.6g}") if x is not None and math.isfinite(x) else None

    return {"step": [int(r["step"]) for r in history], **{k: [v(r.get(k)) for r in history] for k in KEPT}}


def rows(columns: dict[str, list]) -> list[dict]:
    """The per-step dicts of a compact record (NaN for a missing value), as the monitor and the rule read them."""
    keys = [k for k in columns if k != "step"]
    return [{"step": s, **{k: (math.nan if columns[k][i] is None else columns[k][i]) for k in keys}}
            for i, s in enumerate(columns["step"])]


def warmup_eval(study: Study, cell: str) -> dict:
    """Held-out avg@8 of the warm-up policy (shared by every run of the study), cached in the parts folder."""
    path = os.path.join(study.parts, "warmup_eval.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    args = study.args(cell)
    c = stability.arm_config(args, "bf16", args.warmup_seed)
    model, tok, _, _ = common.warm_model(c, progress=False)
    ev = stability.evaluate_model(model, tok, c, args)
    common.write_json(path, ev)
    return ev


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(path: str) -> bool:
    """Take the run whose part is `path` for this process (a `.lock` file beside it holding the pid), so that
    several workers started with the same command share the runs; a lock whose process is gone is taken over."""
    lock = path + ".lock"
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            with open(lock) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and _alive(pid):
            return False
        os.remove(lock)
        return claim(path)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def run_one(study: Study, cell: str, arm: str, seed: int, log=print) -> dict | None:
    """Train (or resume) one run to its steps, evaluate it and write its part; a finished part is returned as is,
    and a run another live worker holds is left to it (None)."""
    path = study.part(cell, arm, seed)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if not claim(path):
        return None
    try:
        return _train(study, cell, arm, seed, path, log)
    finally:
        if os.path.exists(path + ".lock"):
            os.remove(path + ".lock")


def _train(study: Study, cell: str, arm: str, seed: int, path: str, log) -> dict:
    from triage_jax.trainer import Trainer

    args = study.args(cell)
    c = stability.arm_config(args, arm, seed)
    common.share_warmup(c, args.warmup_seed)
    os.makedirs(c.run_dir, exist_ok=True)
    load0 = machine_load().fields()
    t0 = time.perf_counter()
    tr = Trainer(c, progress=False)
    history = tr.run(resume=True)
    if tr.step < study.steps:  # stopped by a signal: the checkpoint is saved, the part is not written
        raise SystemExit(f"{cell}/{arm}/seed{seed}: stopped at step {tr.step} of {study.steps}; rerun to resume")
    train_s = time.perf_counter() - t0
    ev = stability.evaluate_model(tr.learner.model(), tr.tok, c, args)
    rec = {"cell": cell, "arm": arm, "seed": seed, "steps": study.steps, "settings": {**CELLS[cell].overrides,
           **stability.ARMS[arm], **dict(study.extra)}, "eval": ev, "train_s_this_process": train_s,
           "load_start": load0, "load_end": machine_load().fields(), "history": compact(history[:study.steps])}
    common.write_json(path, rec)
    log(f"{cell} {arm} seed {seed}: {study.steps} steps, {train_s:.0f}s in this process; avg@8 {ev['avg@8']:.3f}")
    return rec


def parse_seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=("regime", "main", "report"))
    p.add_argument("--cells", default=",".join(CELLS), help="regime: the candidate cells")
    p.add_argument("--cell", default=None, help="main: the cell (default: the one the regime rule picks)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default=None, help="e.g. 0-11 or 0,2,4 (default: regime 0-2, main 0-11)")
    p.add_argument("--out_dir", default=Study.out_dir, help="where the run folders (checkpoints, logs) go")
    p.add_argument("--parts", default=PARTS, help="where each finished run's record goes (the study's data)")
    p.add_argument("--results", default=RESULTS, help="report: where collapse_rate.{json,md} go")
    p.add_argument("--figures", default=common.FIGURES, help="report: where collapse_rate.png goes ('' for none)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (the study's rule: {STEPS})")
    p.add_argument("--eval_problems", type=int, default=EVAL["eval_problems"])
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (smoke tests; the study sets none)")
    p.add_argument("--compile_cache", default=os.path.join(common.ROOT, "runs", "jax_cache"))
    p.add_argument("--wait", action="store_true", help="main: wait for other workers to finish the regime phase")
    args = p.parse_args(argv)
    if args.steps < 21:
        p.error(f"--steps must be > 20 (the collapse rule needs 20 steps to confirm an onset), got {args.steps}")
    study = Study(out_dir=args.out_dir, parts=args.parts, steps=args.steps, eval_problems=args.eval_problems,
                  extra=tuple(common.parse_overrides(p, args.overrides).items()))
    if args.phase == "report":
        from experiments import collapse_report

        collapse_report.write(study.parts, args.results, args.figures)
        return
    with common.compile_cache(args.compile_cache):
        if args.phase == "regime":
            cells = [c for c in args.cells.split(",") if c]
            unknown = [c for c in cells if c not in CELLS]
            if unknown:
                p.error(f"--cells: unknown {unknown}; choose from {list(CELLS)}")
            seeds = parse_seeds(args.seeds) if args.seeds else list(REGIME_SEEDS)
            warmup_eval(study, cells[0])
            from experiments import collapse_report

            for seed in seeds:
                for cell in cells:
                    row = next(r for r in collapse_report.regime(study.parts) if r["cell"] == cell)
                    if row["decided"] and not row["complete"]:
                        continue  # a seed that did not learn already decided the cell: its other seeds add nothing
                    run_one(study, cell, "bf16", seed)
        else:
            from experiments import collapse_report

            cell = args.cell or collapse_report.chosen_cell(study.parts)
            while cell is None and args.wait and not collapse_report.regime_complete(study.parts):
                time.sleep(60)  # another worker is still finishing the regime's runs
                cell = collapse_report.chosen_cell(study.parts)
            if cell is None:
                p.error("no cell qualifies (or the regime phase has not finished) and --cell is not given")
            if cell not in CELLS:
                p.error(f"--cell: unknown {cell!r}; choose from {list(CELLS)}")
            arms = [a for a in args.arms.split(",") if a]
            unknown = [a for a in arms if a not in stability.ARMS or a in stability.BRANCH_PARENT]
            if unknown:
                p.error(f"--arms: {unknown} cannot run here; choose from {list(ARMS)} or the study's corrections")
            seeds = parse_seeds(args.seeds) if args.seeds else list(MAIN_SEEDS)
            warmup_eval(study, cell)
            for seed in seeds:
                for arm in arms:
                    run_one(study, cell, arm, seed)


if __name__ == "__main__":
    main()
