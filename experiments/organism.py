"""The TRIAGE study on the model organism's regime: every arm x seeds, TRIAGE's thresholds from a pilot run.

    python experiments/organism.py [--quick] [--cell lr5e-5] [--steps 40] [--seeds 0,1,2] [--jobs 2]
        [--pilot_steps 10] [--thresholds FILE] [--extend DIR] [--results experiments/results] [--tag organism]
    python experiments/organism.py --combine TAG,TAG[,...] --tag NEW

1. Pilot: the NVFP4 arm without a correction, `--pilot_steps` steps at `--pilot_seed` (not a study seed), with
   train.save_deltas=1; `triage_jax.deltas.propose` reads TRIAGE's thresholds off its token deltas. They are
   written to <results>/<tag>_thresholds.json before the first study run and used by both TRIAGE arms
   (`--thresholds FILE` reuses an earlier pilot's instead).
2. Study: every arm of experiments/stability.py (BF16, NVFP4, +TIS, +TRIAGE, TRIAGE without repair, TIS from a
   branch, OPSM, the exact-mode control) x seeds, on one cell of experiments/organism_sweep.py (`--cell`), each
   run by the study's own `run_one`. `--jobs N` splits the runs over N worker processes, each pinned to one core
   (a branch runs in its parent's worker, right after it); on 2 cores, 2 workers do ~1.2x the steps per second of
   one process on both cores. `--extend DIR --thresholds FILE` continues an earlier study's finished runs (its
   --out_dir, same settings, TRIAGE's --k_rep included) to --steps, as stability.py --extend; a branch arm is
   continued from its own last checkpoint, without its parent, and needs the extended study's --branch_step.
   `--combine TAG,TAG --tag NEW` merges earlier invocations of one regime (more seeds, an arm extended later) into
   one results file, tables and figure, without training.
3. Outcome: per arm and seed, the collapse rule's verdict and onset (`rl.monitor.collapsed`), the first alarm of
   each level, the alarm's lead time before the collapse (null when either is missing), the final metrics and
   held-out avg@n / pass@k -> <results>/<tag>.json. The tables (<tag>.md) and the curves
   (<figures>/<tag>.png) are drawn from that file (`--replot` redraws them without training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common, organism_sweep, stability  # noqa: E402

# Relative cost of one run of each arm, measured on the organism (exact mode: 802 s vs 326-407 s, its learner runs
# the W4A4 emulation; a branch trains only after branch_step).
COST = {"exact": 2.0, "nvfp4_triage": 1.05, "triage_no_repair": 1.05, "tis_from_branch": 0.5}
CONTROLS = ("bf16", "exact")  # no precision mismatch reaches their objective: any alarm there is a false alarm
# With rl.staleness >= 1 the trainer also logs the two parts of delta (docs/rl_math.md#stale-rollouts).
STALE_WATCHED = tuple(f"mismatch_{part}/{m}" for part in ("precision", "staleness")
                      for m in ("mean_abs_delta", "rho_asym", "delta_q05", "tail_persistence"))

DEFAULTS = dict(steps=40, seeds="0,1,2", pilot_steps=10, eval_problems=32, eval_n=4, jobs=2)  # jobs: at most the cores
QUICK = dict(steps=3, seeds="0", pilot_steps=2, eval_problems=2, eval_n=2, jobs=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    p.add_argument("--config", default="organism", help="base config (configs/NAME.py or a path)")
    p.add_argument("--cell", default="lr5e-5", help=f"the regime: one of {list(organism_sweep.CELLS)}")
    p.add_argument("--arms", default=",".join(stability.ARMS), help=f"subset of {list(stability.ARMS)}")
    p.add_argument("--steps", type=int, default=None, help=f"GRPO steps per run (default {DEFAULTS['steps']})")
    p.add_argument("--seeds", default=None, help=f"comma-separated RL seeds (default {DEFAULTS['seeds']})")
    p.add_argument("--staleness", type=int, default=0,
                   help="rl.staleness of every run (0: synchronous; s: step k trains on step k-s's rollout)")
    p.add_argument("--k_rep", type=int, default=None, help="TRIAGE's repair starts at this update (default steps/4)")
    p.add_argument("--branch_step", type=int, default=None,
                   help="where tis_from_branch leaves nvfp4 (default steps/2; with --extend, the extended study's)")
    p.add_argument("--pilot_steps", type=int, default=None, help="steps of the pilot run")
    p.add_argument("--pilot_seed", type=int, default=100, help="the pilot's RL seed (keep it out of --seeds)")
    p.add_argument("--thresholds", default=None, help="an earlier pilot's <tag>_thresholds.json (skips the pilot)")
    p.add_argument("--eval_problems", type=int, default=None, help="held-out problems of each run's avg@n")
    p.add_argument("--eval_n", type=int, default=None, help="samples per held-out problem")
    p.add_argument("--jobs", type=int, default=None, help="worker processes, one core each (1: this process)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every run (repeatable), after the cell's")
    p.add_argument("--out_dir", default=None, help="where the runs go (default runs/<tag>)")
    p.add_argument("--results", default=os.path.join(common.ROOT, "experiments", "results"))
    p.add_argument("--figures", default=common.FIGURES)
    p.add_argument("--compile_cache", default=os.path.join(common.ROOT, "runs", "jax_cache"),
                   help="JAX persistent compilation cache folder ('' to disable)")
    p.add_argument("--extend", default=None, metavar="DIR",
                   help="continue an earlier study's finished shorter runs (its --out_dir; same settings and "
                        "--thresholds) to --steps from their last checkpoint")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs under --out_dir that finished with the same config (an interrupted study)")
    p.add_argument("--replot", action="store_true", help="redraw the tables and figure from <tag>.json")
    p.add_argument("--tag", default=None, help="file name stem of the outputs (default organism[_quick])")
    p.add_argument("--combine", default=None, metavar="TAG,TAG,...",
                   help="merge earlier invocations' <results>/<TAG>.json of one regime (other seeds or arms) into "
                        "--tag's results, tables and figure, without training")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "arm:seed,..." (a worker process)
    p.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)  # the worker's core
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, min(v, cores) if k == "jobs" else v)
    if args.combine is not None:
        args.combine = [t for t in args.combine.split(",") if t]
        if len(set(args.combine)) != len(args.combine) or len(args.combine) < 2:
            p.error(f"--combine: give two or more different result tags, got {args.combine}")
        if args.tag is None or args.tag in args.combine:
            p.error("--combine: give a new --tag for the merged results")
        return args
    if args.cell not in organism_sweep.CELLS:
        p.error(f"--cell: unknown {args.cell!r}; choose from {list(organism_sweep.CELLS)}")
    seeds = [int(s) for s in str(args.seeds).split(",") if s]
    if args.pilot_seed in seeds and args.thresholds is None:
        p.error(f"--pilot_seed {args.pilot_seed} is one of --seeds {seeds}: the thresholds must come from a run "
                "the study does not report")
    for name in ("pilot_steps", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.worker and args.jobs > cores:
        p.error(f"--jobs {args.jobs}: this process may run on {cores} core(s) only")
    if args.staleness < 0:
        p.error(f"--staleness must be >= 0, got {args.staleness}")
    if args.k_rep is None:
        args.k_rep = max(1, args.steps // 4)
    if args.thresholds is not None and not os.path.exists(args.thresholds):
        p.error(f"--thresholds: {args.thresholds} does not exist")
    if args.extend is not None and args.thresholds is None:
        p.error("--extend: give the extended study's --thresholds (a new pilot would change TRIAGE's settings)")
    stem = "organism" + (f"_stale{args.staleness}" if args.staleness else "")
    args.tag = args.tag or (f"{stem}_quick" if args.quick else stem)
    args.out_dir = args.out_dir or os.path.join(common.ROOT, "runs", args.tag)
    # The study's own parser validates steps, seeds, arms, overrides and (with the thresholds) each extension.
    stability_args(args, extension_overrides(args))
    return args


def stability_argv(args, thresholds: dict[str, float]) -> list[str]:
    """The stability study's command line for this regime: the cell's overrides, TRIAGE's k_rep and thresholds."""
    ns = argparse.Namespace(config=args.config, arms=args.arms, steps=args.steps, seeds=args.seeds,
                            eval_problems=args.eval_problems, eval_n=args.eval_n, out_dir=args.out_dir, extend=args.extend,
                            overrides=[f"rl.staleness={args.staleness}"] + list(args.overrides)
                            + [f"rl.triage.k_rep={args.k_rep}"]
                            + [f"{k}={v!r}" for k, v in thresholds.items()])
    ks = "1" if args.eval_n == 1 else f"1,{args.eval_n}"
    branch = [] if args.branch_step is None else ["--branch_step", str(args.branch_step)]
    return organism_sweep.study_argv(ns, args.cell) + ["--ks", ks] + branch


def extension_overrides(args) -> dict:
    """The thresholds an --extend run is checked with (the extended study's); none otherwise."""
    return load_thresholds(args.thresholds)["overrides"] if args.extend else {}


def stability_args(args, thresholds: dict[str, float], redraw: bool = False):
    """The stability study's parsed settings; `redraw` (a report from saved runs) skips the --extend source checks."""
    return stability.parse_args(stability_argv(args, thresholds) + (["--replot"] if redraw else []))


# ------------------------------------------------------------------------------------------------ the pilot

def thresholds_path(args) -> str:
    return os.path.join(args.results, f"{args.tag}_thresholds.json")


def run_pilot(args, log) -> dict:
    """The pilot's NVFP4 run with its token deltas saved, and the thresholds proposed from them (also written to
    thresholds_path before any study run)."""
    from triage_jax import deltas
    from triage_jax.rl.corrections import make_config

    pargs = stability_args(args, {})
    pargs.arms, pargs.seeds, pargs.steps = ["nvfp4"], [args.pilot_seed], args.pilot_steps
    pargs.out_dir = os.path.join(args.out_dir, "pilot")
    pargs.overrides = {**pargs.overrides, "train.save_deltas": 1}
    t0 = time.perf_counter()
    stability.run_one(pargs, "nvfp4", args.pilot_seed, log)  # the study's own run path, with its deltas saved
    c = stability.arm_config(pargs, "nvfp4", args.pilot_seed)
    base = make_config("triage", c.rl.triage.to_dict())
    proposed, pool = deltas.propose(c.run_dir, base)
    rec = {"pilot": {"arm": "nvfp4", "seed": args.pilot_seed, "steps": args.pilot_steps, "run_dir": c.run_dir,
                     "responses": int(pool.delta.shape[0]), "tokens": int(pool.mask.sum()),
                     "wall_s": time.perf_counter() - t0},
           "default": {k: getattr(base, k) for k in deltas.THRESHOLD_KEYS},
           "proposed": {k: getattr(proposed, k) for k in deltas.THRESHOLD_KEYS},
           "overrides": deltas.overrides(proposed)}
    os.makedirs(args.results, exist_ok=True)
    common.write_json(thresholds_path(args), rec)
    log("pilot: " + ", ".join(f"{k} {rec['default'][k]:.4g} -> {v:.4g}" for k, v in rec["proposed"].items()))
    return rec


# ------------------------------------------------------------------------------------------------ the runs

def plan(arms: list[str], seeds: list[int], jobs: int, done=frozenset()) -> list[list[tuple[str, int]]]:
    """The (arm, seed) runs split over `jobs` workers, longest first onto the least loaded (a branch travels with
    its parent, right after it, when both are listed); each worker's list in seed order, parents before branches.
    A parent and its branches are left out only when all of them are in `done`."""
    units = []
    for seed in seeds:
        for arm in arms:
            if stability.BRANCH_PARENT.get(arm) in arms:
                continue  # travels with its parent (a branch alone: an --extend of its own run)
            members = [arm] + [ch for ch, par in stability.BRANCH_PARENT.items() if par == arm and ch in arms]
            if all((a, seed) in done for a in members):
                continue
            units.append((sum(COST.get(a, 1.0) for a in members), seed, members))
    loads, bins = [0.0] * jobs, [[] for _ in range(jobs)]
    for cost, seed, members in sorted(units, key=lambda u: -u[0]):
        j = int(np.argmin(loads))
        loads[j] += cost
        bins[j].append((seed, members))
    order = {a: i for i, a in enumerate(arms)}
    return [[(a, seed) for seed, members in sorted(b, key=lambda u: (u[0], order[u[1][0]])) for a in members]
            for b in bins]


def outcome_path(run_dir: str) -> str:
    return os.path.join(run_dir, "outcome.json")


def finished(sargs) -> set[tuple[str, int]]:
    """The (arm, seed) runs whose outcome is on disk and whose saved config is the one this study would run."""
    out = set()
    for arm in sargs.arms:
        for seed in sargs.seeds:
            c = stability.arm_config(sargs, arm, seed)
            saved = os.path.join(c.run_dir, "config.json")
            if os.path.exists(outcome_path(c.run_dir)) and os.path.exists(saved):
                with open(saved) as f:
                    if json.load(f) == json.loads(c.to_json()):
                        out.add((arm, seed))
    return out


def run_tasks(sargs, tasks: list[tuple[str, int]], log) -> None:
    """Train each (arm, seed) in order; each run's outcome (all but its history) goes next to its history.json."""
    for arm, seed in tasks:
        r = stability.run_one(sargs, arm, seed, log)
        common.write_json(outcome_path(r["run_dir"]), {k: v for k, v in r.items() if k != "history"})


def run_workers(args, bins, log) -> None:
    """One pinned worker process per bin (this script with --worker), waited for; a failed worker's log tail is
    the error."""
    cores = sorted(os.sched_getaffinity(0))
    logs = os.path.join(args.out_dir, "workers")
    os.makedirs(logs, exist_ok=True)
    argv = list(sys.argv[1:] if args._argv is None else args._argv)
    procs = []
    for j, tasks in enumerate(bins):
        if not tasks:
            continue
        core = cores[j % len(cores)]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--thresholds", thresholds_path(args),
               "--worker", ",".join(f"{a}:{s}" for a, s in tasks), "--core", str(core)]
        out = open(os.path.join(logs, f"worker{j}.log"), "w")
        # No preexec_fn and close_fds=False: CPython then spawns without forking this (JAX-threaded) process.
        procs.append((j, out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, close_fds=False)))
        log(f"worker {j} on core {core}: {len(tasks)} runs ({', '.join(f'{a}:{s}' for a, s in tasks)})")
    failed = []
    for j, out, proc in procs:
        rc = proc.wait()
        out.close()
        if rc != 0:
            failed.append(j)
    if failed:
        tails = {j: open(os.path.join(logs, f"worker{j}.log")).read()[-2000:] for j in failed}
        raise RuntimeError(f"worker(s) {failed} failed; logs in {logs}:\n" + "\n".join(tails.values()))


def collect(sargs) -> dict[str, dict[int, dict]]:
    """Every finished run of the study (outcome.json + history.json), arm by arm."""
    runs = {}
    for arm in sargs.arms:
        for seed in sargs.seeds:
            run_dir = stability.arm_config(sargs, arm, seed).run_dir
            if os.path.exists(outcome_path(run_dir)):
                with open(outcome_path(run_dir)) as f:
                    r = json.load(f)
                runs.setdefault(arm, {})[seed] = {**r, "history": common.read_history(run_dir)}
    return runs


# ------------------------------------------------------------------------------------------------ results

def lead_time(r: dict) -> int | None:
    """Steps from the first level-1 alarm to the collapse onset (negative: the alarm came late); None unless
    both happened."""
    if not r.get("collapsed") or r.get("first_alarm_step") is None or r.get("collapse_step") is None:
        return None
    return int(r["collapse_step"]) - int(r["first_alarm_step"])


def alarm_summary(runs: dict) -> dict:
    """Per arm: runs alarmed at level 1 / 2, lead times before collapses, and false alarms (an alarm in a run
    that did not collapse); the pooled false-alarm rate of the control arms."""
    out = {}
    for arm, per_seed in runs.items():
        rs = list(per_seed.values())
        lvl = {L: [r["first_alarms"][f"level{L}"]["any"] for r in rs] for L in (1, 2)}
        calm = [r for r in rs if not r["collapsed"]]
        out[arm] = {"runs": len(rs), "collapsed": sum(r["collapsed"] for r in rs),
                    "alarmed_level1": sum(x is not None for x in lvl[1]),
                    "alarmed_level2": sum(x is not None for x in lvl[2]),
                    "lead_times": [lead_time(r) for r in rs if lead_time(r) is not None],
                    "false_alarms": sum(r["first_alarm_step"] is not None for r in calm),
                    "not_collapsed": len(calm)}
    ctrl = [out[a] for a in CONTROLS if a in out]
    n = sum(a["runs"] for a in ctrl)
    rate = sum(a["alarmed_level1"] for a in ctrl) / n if n else None
    return {"per_arm": out, "control_arms": [a for a in CONTROLS if a in out], "control_false_alarm_rate": rate}


def build_results(args, sargs, runs: dict, thresholds: dict, warmup_eval: dict | None, total_s: float) -> dict:
    k = stability.final_window(sargs)
    arms = {}
    for arm, per_seed in runs.items():
        for seed, r in per_seed.items():
            rec = {**organism_sweep.record(r, k), "lead_time": lead_time(r)}
            if args.staleness:
                rec["drift"].update({key: organism_sweep.window_means(r["history"], key, k) for key in STALE_WATCHED})
            arms.setdefault(arm, {})[str(seed)] = rec
    spec = organism_sweep.CELLS[args.cell]
    return {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "regime": {"cell": args.cell, "description": spec.description, "overrides": spec.overrides,
                       "fp4": spec.fp4, "steps": args.steps, "k_rep": args.k_rep, "staleness": args.staleness,
                       "batch": f"{sargs.num_prompts}x{sargs.group_size}", "branch_step": sargs.branch_step},
            "thresholds": thresholds, "collapse_rule": "rl.monitor.collapsed", "final_window": k,
            "warmup_eval": warmup_eval, "total_s": total_s, "alarms": alarm_summary(runs), "arms": arms}


def combine(parts: dict[str, dict], tag: str) -> dict:
    """One results record over several invocations of one regime (a study grown in parts: more seeds, the branch
    arm extended later): their runs side by side, the alarm summary over all of them, total_s their sum. A
    ValueError names a part of another regime (thresholds included) or a run present twice."""
    tag0, first = next(iter(parts.items()))

    def key(res):  # what must agree; branch_step only matters where the branch arm ran
        a = res["args"]
        return ({k: v for k, v in res["regime"].items() if k != "branch_step"}, res["thresholds"]["overrides"],
                a["config"], a["eval_problems"], a["eval_n"], a["overrides"], res["warmup_eval"])

    arms, branch = {}, {}
    for part, res in parts.items():
        if key(res) != key(first):
            raise ValueError(f"--combine: {part} ran another regime or thresholds than {tag0}")
        for arm, per in res["arms"].items():
            for seed, rec in per.items():
                if seed in arms.get(arm, {}):
                    raise ValueError(f"--combine: {arm} seed {seed} is in more than one of {list(parts)}")
                arms.setdefault(arm, {})[seed] = rec
        if "tis_from_branch" in res["arms"]:
            branch[part] = res["regime"]["branch_step"]
    if len(set(branch.values())) > 1:
        raise ValueError(f"--combine: tis_from_branch left nvfp4 at different steps: {branch}")
    order = {a: i for i, a in enumerate(stability.ARMS)}
    arms = {a: dict(sorted(arms[a].items(), key=lambda kv: int(kv[0]))) for a in sorted(arms, key=order.get)}
    regime = {**first["regime"], "branch_step": next(iter(branch.values()), first["regime"]["branch_step"])}
    seeds = sorted({int(s) for per in arms.values() for s in per})
    return {**first, "args": {**first["args"], "arms": ",".join(arms), "seeds": ",".join(map(str, seeds)),
                              "tag": tag, "combined": list(parts)},
            "regime": regime, "total_s": sum(r["total_s"] for r in parts.values()),
            "alarms": alarm_summary(arms), "arms": arms}


def record_args(args, res: dict):
    """The study's settings as a results record holds them (its regime, arms and seeds), for redrawing its report
    and figure (--replot, --combine) whatever the command line says."""
    a, reg = res["args"], res["regime"]
    ns = argparse.Namespace(**{**vars(args), "config": a["config"], "cell": reg["cell"], "arms": a["arms"],
                               "steps": reg["steps"], "seeds": a["seeds"], "staleness": reg["staleness"],
                               "k_rep": reg["k_rep"], "eval_problems": a["eval_problems"], "eval_n": a["eval_n"],
                               "overrides": a["overrides"], "out_dir": a["out_dir"], "extend": a.get("extend"),
                               "branch_step": reg["branch_step"]})
    return stability_args(ns, res["thresholds"]["overrides"], redraw=True)


def report(res: dict, sargs) -> str:
    """The markdown: thresholds, the per-arm results and drift tables (stability's), the alarm table."""
    runs = {arm: {int(s): {**r, "history": common.read_history(r["run_dir"])} for s, r in per.items()}
            for arm, per in res["arms"].items()}
    study = {"runs": runs, "warmup_eval": res["warmup_eval"]}
    th = res["thresholds"]
    th_rows = [[k, th["default"][k], v] for k, v in th["proposed"].items()]
    al = res["alarms"]
    al_rows = []
    for arm, a in al["per_arm"].items():
        leads = ", ".join(str(x) for x in a["lead_times"]) or "-"
        al_rows.append([arm, f"{a['collapsed']}/{a['runs']}", f"{a['alarmed_level1']}/{a['runs']}",
                        f"{a['alarmed_level2']}/{a['runs']}", leads,
                        f"{a['false_alarms']}/{a['not_collapsed']}" if a["not_collapsed"] else "-"])
    fin_rows = []
    for arm, per in res["arms"].items():
        row = [arm]
        for key in stability.FINAL_KEYS:
            xs = np.asarray([r["final"][key] for r in per.values() if r["final"].get(key) is not None], float)
            row.append("-" if not xs.size else f"{xs.mean():.4g} +- {xs.std():.2g}")
        fin_rows.append(row)
    reg = res["regime"]
    base = res["warmup_eval"] or {}
    n = sargs.eval_n
    pilot = th.get("pilot")
    pilot_line = (f"from the pilot (NVFP4, seed {pilot['seed']}, {pilot['steps']} steps, {pilot['tokens']} tokens of "
                  f"{pilot['responses']} responses; `triage_jax.deltas.propose`)" if pilot else "given")
    rate = al["control_false_alarm_rate"]
    return (f"## {res['args']['tag']}: the TRIAGE study on the organism, cell `{reg['cell']}` ({reg['description']}), "
            f"{reg['steps']} steps, seeds {sargs.seeds}, batch {reg['batch']}, {res['total_s'] / 60:.1f} min\n\n"
            f"TRIAGE thresholds {pilot_line}, fixed before the study; the repair starts at update {reg['k_rep']}. "
            + (f"tis_from_branch leaves nvfp4 at step {reg['branch_step']}. " if "tis_from_branch" in runs else "")
            + f"Warm-up policy: avg@{n} "
            f"{common.fmt(base.get(f'avg@{n}', math.nan), 3)}.\n\n"
            + common.markdown_table(["threshold", "default", "proposed"], th_rows) + "\n\n"
            f"Final values: the last {res['final_window']} steps of each run, mean +- std over seeds; avg@{n} / "
            f"pass@k on {sargs.eval_problems} held-out problems (BF16 sampling, T = 1).\n\n"
            + stability.results_table(study, sargs) + "\n\n"
            "Every final diagnostic (tail concentration and hidden-by-mean included), mean +- std over seeds:\n\n"
            + common.markdown_table(["arm"] + [k.replace("mismatch/", "") for k in stability.FINAL_KEYS], fin_rows)
            + "\n\n"
            f"First -> last {res['final_window']} steps (mean over steps and seeds):\n\n"
            + stability.drift_table(study, sargs) + "\n\n"
            "Alarms (`rl.monitor`, the run's thresholds): runs alarmed per level, the lead time of the first "
            "level-1 alarm before each collapse, false alarms (an alarm in a run that did not collapse). "
            f"Control arms {', '.join(al['control_arms'])}: false-alarm rate "
            f"{'-' if rate is None else f'{rate:.2f}'}.\n\n"
            + common.markdown_table(["arm", "collapsed", "alarm level 1", "alarm level 2", "lead times",
                                     "false alarms"], al_rows) + "\n")


def write_outputs(args, sargs, res: dict, log) -> str:
    os.makedirs(args.results, exist_ok=True)
    common.write_json(os.path.join(args.results, f"{args.tag}.json"), res)
    text = report(res, sargs)
    with open(os.path.join(args.results, f"{args.tag}.md"), "w") as f:
        f.write(text)
    runs = {arm: {int(s): {"history": common.read_history(r["run_dir"])} for s, r in per.items()}
            for arm, per in res["arms"].items()}
    fig = stability.plot_curves({"runs": runs}, sargs, os.path.join(args.figures, f"{args.tag}.png"))
    log(f"figure: {fig}; table: {os.path.join(args.results, args.tag + '.md')}")
    return text


def load_thresholds(path: str) -> dict:
    """A pilot's thresholds file, or a hand-written one holding only {"overrides": {"rl.triage.KEY": value}}
    (its "proposed" are then those values, its "default" TriageConfig's)."""
    from triage_jax import deltas
    from triage_jax.rl.triage import TriageConfig

    with open(path) as f:
        rec = json.load(f)
    if not isinstance(rec.get("overrides"), dict):
        raise ValueError(f"{path}: not a thresholds file (no 'overrides' mapping); written by a pilot of this script")
    given = {k.removeprefix("rl.triage."): v for k, v in rec["overrides"].items()}
    rec.setdefault("default", {k: getattr(TriageConfig(), k) for k in deltas.THRESHOLD_KEYS})
    rec.setdefault("proposed", {k: given.get(k, rec["default"][k]) for k in deltas.THRESHOLD_KEYS})
    return rec


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.core is not None:  # a worker: pinned before JAX starts its threads
        os.sched_setaffinity(0, {args.core})
    args._argv = argv
    t0 = time.perf_counter()
    tag = f"worker {os.getpid()}" if args.worker else "organism"

    def log(msg):
        print(f"[{tag} {time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    if args.combine:
        parts = {}
        for t in args.combine:
            path = os.path.join(args.results, f"{t}.json")
            if not os.path.exists(path):
                sys.exit(f"organism.py: --combine: {path} does not exist")
            with open(path) as f:
                parts[t] = json.load(f)
        try:
            res = combine(parts, args.tag)
        except ValueError as e:
            sys.exit(f"organism.py: {e}")
        print(write_outputs(args, record_args(args, res), res, log))
        return 0
    if args.replot:
        with open(os.path.join(args.results, f"{args.tag}.json")) as f:
            res = json.load(f)
        print(write_outputs(args, record_args(args, res), res, log))
        return 0
    with common.compile_cache(args.compile_cache):
        if args.worker:
            sargs = stability_args(args, load_thresholds(args.thresholds)["overrides"])
            tasks = [(a, int(s)) for a, s in (x.split(":") for x in args.worker.split(","))]
            run_tasks(sargs, tasks, log)
            return 0
        # The warm-up (trained once if absent) and its eval first: the pilot and every run start from it.
        sargs = stability_args(args, extension_overrides(args))
        c0 = stability.arm_config(sargs, sargs.arms[0], sargs.warmup_seed)
        model, tok, _, _ = common.warm_model(c0, progress=False)
        warmup_eval = stability.evaluate_model(model, tok, c0, sargs)
        del model
        log(f"warm-up policy: avg@{sargs.eval_n} {warmup_eval[f'avg@{sargs.eval_n}']:.3f}")
        if args.thresholds is None and args.resume and os.path.exists(thresholds_path(args)):
            args.thresholds = thresholds_path(args)  # the interrupted study's own pilot
        th = load_thresholds(args.thresholds) if args.thresholds else run_pilot(args, log)
        if args.thresholds:  # the workers read the same file under this tag's name
            os.makedirs(args.results, exist_ok=True)
            if os.path.abspath(args.thresholds) != os.path.abspath(thresholds_path(args)):
                common.write_json(thresholds_path(args), th)
        sargs = stability_args(args, th["overrides"])
        for seed in sargs.seeds:  # link every seed's warm-up here, before workers could race to do it
            common.share_warmup(stability.arm_config(sargs, sargs.arms[0], seed), sargs.warmup_seed)
        done = finished(sargs) if args.resume else set()
        if done:
            log(f"--resume: keeping {len(done)} finished runs")
        bins = plan(sargs.arms, sargs.seeds, args.jobs, done)
        if args.jobs == 1:
            run_tasks(sargs, bins[0] if bins else [], log)
        else:
            run_workers(args, bins, log)
    runs = collect(sargs)
    res = build_results(args, sargs, runs, th, warmup_eval, time.perf_counter() - t0)
    print(write_outputs(args, sargs, res, log))
    log(f"total {res['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
