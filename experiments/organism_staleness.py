"""Stale-policy training on the model organism: staleness x {NVFP4, +TIS, +TRIAGE, OPSM} x seeds, precision and
staleness mismatch side by side.

    python experiments/organism_staleness.py [--staleness 0,1,2] [--arms nvfp4,nvfp4_tis,nvfp4_triage,opsm]
        [--steps 20] [--seeds 0,1,2] [--thresholds experiments/results/organism/organism_thresholds.json] [--jobs 2]
        [--precision_gate 2] [--quick] [--tag organism_staleness] [--merge results/<earlier tag>.json ...]

Each staleness value s is one `experiments/organism.py --staleness s` study (same cell, thresholds fixed by the
organism study's pilot, its worker processes), tagged <tag>_s<s>; at the --precision_gate values (default: the
largest s) a TRIAGE run gating on the precision part of delta (`rl.delta_source=precision`) is added as arm
`nvfp4_triage@precision`. Other flags (--jobs, --cell, --set, --config ...) go to every study. The combined report (<tag>.{md,json}) answers the two questions of the stale-policy study:

- does the direction signal still warn first: per delta part (total, precision, staleness), the first step of the
  rho_asym alarm against the delta_q05 (size) alarm, `rl.monitor`'s thresholds replayed on that part's history;
- which delta should TRIAGE gate on: TRIAGE on the total delta vs on its precision part, at each s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common, organism, organism_sweep, stability  # noqa: E402

PARTS = ("mismatch", "mismatch_precision", "mismatch_staleness")
PRECISION_GATE = "nvfp4_triage@precision"
COLUMNS = (("mean_abs_delta", "mean abs delta", 4), ("rho_asym", "rho_asym", 2),
           ("quad_mass_Aneg_dneg", "A-d- mass", 3), ("delta_q05", "delta q05", 3))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--staleness", default="0,1,2", help="comma-separated rl.staleness values")
    p.add_argument("--arms", default="nvfp4,nvfp4_tis,nvfp4_triage,opsm")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 20; --quick: organism.py's)")
    p.add_argument("--seeds", default=None, help="comma-separated RL seeds (default 0,1,2; --quick: organism.py's)")
    p.add_argument("--thresholds", default=os.path.join(common.ROOT, "experiments", "results", "organism",
                                                         "organism_thresholds.json"),
                   help="TRIAGE thresholds fixed beforehand: the organism study's pilot (experiments/organism.py)")
    p.add_argument("--precision_gate", default=None,
                   help="staleness values that also run TRIAGE gating on the precision delta (default: the largest "
                        "s; '' for none)")
    p.add_argument("--quick", action="store_true", help="organism.py's --quick settings")
    p.add_argument("--tag", default=None, help="file name stem (default organism_staleness[_quick])")
    p.add_argument("--results", default=os.path.join(common.ROOT, "experiments", "results"))
    p.add_argument("--out_dir", default=os.path.join(common.ROOT, "runs"),
                   help="each study's runs go to OUT_DIR/<its tag>")
    p.add_argument("--report_only", action="store_true", help="rebuild the report from the per-s results")
    p.add_argument("--merge", nargs="*", default=[],
                   help="earlier combined reports (<tag>.json) of the same steps, seeds and thresholds whose runs join "
                        "this report where this study has no run of that (s, arm)")
    args, rest = p.parse_known_args(argv)  # the rest goes to every organism.py study (--jobs, --set, --cell ...)
    preset = organism.QUICK if args.quick else {"steps": 20, "seeds": "0,1,2"}
    args.steps = preset["steps"] if args.steps is None else args.steps
    args.seeds = preset["seeds"] if args.seeds is None else args.seeds
    args.staleness = [int(s) for s in args.staleness.split(",") if s]
    if not args.staleness or min(args.staleness) < 0:
        p.error(f"--staleness: need values >= 0, got {args.staleness}")
    gate = str(max(args.staleness)) if args.precision_gate is None else args.precision_gate
    args.precision_gate = [int(s) for s in gate.split(",") if s]
    if any(s not in args.staleness or s == 0 for s in args.precision_gate):
        p.error(f"--precision_gate: each value must be one of --staleness {args.staleness} and >= 1 (at s = 0 the "
                f"precision delta is the total), got {args.precision_gate}")
    if not os.path.exists(args.thresholds):
        p.error(f"--thresholds: {args.thresholds} does not exist; run experiments/organism.py first (its pilot "
                "writes it) or point at another <tag>_thresholds.json")
    args.tag = args.tag or ("organism_staleness_quick" if args.quick else "organism_staleness")
    args.rest = rest
    for path in args.merge:
        if not os.path.exists(path):
            p.error(f"--merge: {path} does not exist")
        with open(path) as f:
            earlier = json.load(f)["args"]
        for key in ("steps", "seeds"):
            if earlier[key] != getattr(args, key):
                p.error(f"--merge: {path} ran --{key} {earlier[key]}, this report --{key} {getattr(args, key)}")
        if os.path.basename(earlier["thresholds"]) != os.path.basename(args.thresholds):
            p.error(f"--merge: {path} used thresholds {earlier['thresholds']}, this report {args.thresholds}")
    for s, argv_s in studies(args):  # organism.py's parser validates each study before anything runs
        organism.parse_args(argv_s)
    return args


def studies(args) -> list[tuple[str, list[str]]]:
    """(name, organism.py argv) of each study: one per s, plus the precision-gated TRIAGE for s >= 1."""
    common_argv = ["--steps", str(args.steps), "--seeds", args.seeds, "--results", args.results] + args.rest
    if args.quick:
        common_argv = ["--quick"] + common_argv
    common_argv += ["--thresholds", args.thresholds]
    out = []
    for s in args.staleness:
        name = f"{args.tag}_s{s}"
        out.append((name, common_argv + ["--staleness", str(s), "--arms", args.arms, "--tag", name,
                                         "--out_dir", os.path.join(args.out_dir, name)]))
        if s in args.precision_gate:
            gate = f"{name}_precision"
            out.append((gate, common_argv + ["--staleness", str(s), "--arms", "nvfp4_triage",
                                             "--set", "rl.delta_source='precision'", "--tag", gate,
                                             "--out_dir", os.path.join(args.out_dir, gate)]))
    return out


def part_history(history: list[dict], part: str) -> list[dict]:
    """The history with `part`'s diagnostics under mismatch/ (what rl.monitor reads), so its alarms can be
    replayed on the precision or the staleness delta alone."""
    pre = part + "/"
    return [{"step": row.get("step", i), **{"mismatch/" + k[len(pre):]: v for k, v in row.items()
                                            if k.startswith(pre)}}
            for i, row in enumerate(history)]


def part_alarms(history: list[dict], monitor_settings: dict) -> dict:
    """Per delta part: the first level-1 step of each alarm (None: never; the part not logged: absent)."""
    from triage_jax.rl import monitor

    cfg = monitor.monitor_config(monitor_settings)
    out = {}
    for part in PARTS:
        if not any(k.startswith(part + "/") for k in history[0]):
            continue
        out[part] = monitor.first_alarms(part_history(history, part), cfg, level=1)
    return out


def collect(args) -> dict:
    """Every finished study's runs: {s: {arm: {seed: record}}}, records from organism.py's results plus per-part
    first -> last windows and alarms."""
    out = {}
    for name, argv in studies(args):
        path = os.path.join(args.results, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            res = json.load(f)
        s, k = res["regime"]["staleness"], res["final_window"]
        for arm, per_seed in res["arms"].items():
            label = PRECISION_GATE if name.endswith("_precision") else arm
            for seed, r in per_seed.items():
                hist = common.read_history(r["run_dir"])
                cfg = common.config_from_json(os.path.join(r["run_dir"], "config.json"))
                rec = {"collapsed": r["collapsed"], "first_alarm_step": r["first_alarm_step"], "eval": r["eval"],
                       "run_dir": r["run_dir"], "alarms": part_alarms(hist, cfg.monitor.to_dict()),
                       "windows": {f"{p}/{m}": organism_sweep.window_means(hist, f"{p}/{m}", k)
                                   for p in PARTS for m, _, _ in COLUMNS},
                       "overlap_frac": organism_sweep.window_means(hist, "time/overlap_frac", len(hist))[0]}
                out.setdefault(str(s), {}).setdefault(label, {})[seed] = rec
    for path in args.merge:  # records of earlier reports, already reduced (their run folders may be gone)
        with open(path) as f:
            for s, arms in json.load(f)["studies"].items():
                for arm, per_seed in arms.items():
                    for r in per_seed.values():  # JSON stores a part never logged (s = 0) as null
                        r["windows"] = {k: [np.nan if v is None else v for v in w] for k, w in r["windows"].items()}
                    out.setdefault(s, {}).setdefault(arm, per_seed)
    order = list(stability.ARMS) + [PRECISION_GATE]
    return {s: {a: out[s][a] for a in sorted(out[s], key=order.index)} for s in sorted(out, key=int)}


def direction_first(alarms: dict) -> str:
    """'rho' when the direction alarm came strictly before the size alarm (or only it fired), 'size' for the
    reverse, 'tie', or '-' when neither fired."""
    r, q = alarms.get("rho_asym"), alarms.get("delta_q05")
    if r is None and q is None:
        return "-"
    if q is None or (r is not None and r < q):
        return "rho"
    if r is None or q < r:
        return "size"
    return "tie"


def report(data: dict, args) -> str:
    rows = []
    for s, arms in data.items():
        for arm, per_seed in arms.items():
            runs = list(per_seed.values())
            row = [s, arm, len(runs)]
            for part in PARTS:
                for m, _, digits in COLUMNS[:2] if part != "mismatch" else COLUMNS:
                    key = f"{part}/{m}"
                    with warnings.catch_warnings():  # a part never logged (s = 0) prints as '-'
                        warnings.simplefilter("ignore", RuntimeWarning)
                        first = np.nanmean([r["windows"][key][0] for r in runs])
                        last = np.nanmean([r["windows"][key][1] for r in runs])
                    row.append(f"{common.fmt(float(first), digits)} -> {common.fmt(float(last), digits)}")
            for part in PARTS:
                row.append(" ".join(direction_first(r["alarms"][part]) if part in r["alarms"] else "."
                                    for r in runs))
            ev = [r["eval"] for r in runs if r.get("eval")]
            n = [k for k in ev[0] if k.startswith("avg@")][0] if ev else None
            row.append(common.fmt(float(np.mean([e[n] for e in ev])), 3) if n else "-")
            rows.append(row)
    header = (["s", "arm", "seeds"] + [f"total {lb}" for _, lb, _ in COLUMNS]
              + [f"{p.split('_')[1]} {lb}" for p in PARTS[1:] for _, lb, _ in COLUMNS[:2]]
              + [f"first alarm ({p.replace('mismatch_', '') if '_' in p else 'total'})" for p in PARTS]
              + ["avg@n"])
    table = common.markdown_table(header, rows)
    return (f"## {args.tag}: stale-policy GRPO on the organism, {args.steps} steps, seeds {args.seeds}\n\n"
            "Columns: first -> last window of each metric, mean over seeds, for the total delta and its precision "
            "and staleness parts (docs/rl_math.md#stale-rollouts); 'first alarm': per seed, whether rl.monitor's "
            "rho_asym (direction) alarm fired before its delta_q05 (size) alarm on that part ('rho'), after "
            "('size'), together ('tie') or neither ('-'); '.': the part is not logged (s = 0). "
            f"`{PRECISION_GATE}`: TRIAGE gating on the precision part (rl.delta_source=precision).\n\n"
            + table + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if not args.report_only:
        for name, argv_s in studies(args):
            print(f"[staleness {time.perf_counter() - t0:6.0f}s] {name}", flush=True)
            organism.main(argv_s)
    data = collect(args)
    text = report(data, args)
    common.write_json(os.path.join(args.results, f"{args.tag}.json"),
                      {"args": vars(args), "total_s": None if args.report_only else time.perf_counter() - t0,
                       "studies": data})
    with open(os.path.join(args.results, f"{args.tag}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
