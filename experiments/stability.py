"""The TRIAGE comparison at CPU scale: GRPO on the synthetic math task under each mismatch treatment, over seeds.

    python experiments/stability.py [--quick] [--config tiny] [--steps 240] [--seeds 0,1,2] [--arms ...]
        [--out_dir runs/<tag>] [--results experiments/results] [--figures experiments/figures]
        [--set rl.num_prompts=4 --set optim.lr=3e-4 ...]

Arms (docs/rl_math.md#corrections; every NVFP4 arm samples with the W4A4 NVFP4 sampler against the BF16 learner):
  bf16              BF16 sampler, no correction (the mismatch-free reference)
  nvfp4             NVFP4 sampler, no correction
  nvfp4_tis         NVFP4 + token-level TIS, C = 2
  nvfp4_triage      NVFP4 + TRIAGE (gate + bounded repair)
  triage_no_repair  ablation: TRIAGE with lambda_rep = 0
  tis_from_branch   ablation: the nvfp4 run's checkpoint at --branch_step, continued with TIS switched on
  opsm              NVFP4 + off-policy sequence masking (DeepSeek-V3.2; rl.opsm.delta)
  exact             control: W4A4 on both sides in exact mode (learner.exact): quantized, but delta = 0

Arms run one after another in this process, seed by seed; all seeds start from one cached supervised warm-up
(seed --warmup_seed). Each run's TensorBoard logs, checkpoints and history.json go under
out_dir/<arm>/seed<k>; the curves (mean over seeds, shaded min..max) and the results table with each arm's
final avg@n / pass@k on held-out problems go to --figures and --results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402

ARMS = {
    "bf16": {"sampler.precision": "bf16", "rl.correction": "none"},
    "nvfp4": {"sampler.precision": "w4a4", "rl.correction": "none"},
    "nvfp4_tis": {"sampler.precision": "w4a4", "rl.correction": "token_tis", "rl.token_tis.C": 2.0},
    "nvfp4_triage": {"sampler.precision": "w4a4", "rl.correction": "triage"},
    "triage_no_repair": {"sampler.precision": "w4a4", "rl.correction": "triage", "rl.triage.lambda_rep": 0.0},
    "tis_from_branch": {"sampler.precision": "w4a4", "rl.correction": "token_tis", "rl.token_tis.C": 2.0},
    "opsm": {"sampler.precision": "w4a4", "rl.correction": "opsm"},
    "exact": {"sampler.precision": "w4a4", "learner.precision": "w4a4", "learner.exact": True,
              "rl.correction": "none"},
}
BRANCH_PARENT = {"tis_from_branch": "nvfp4"}

# Plotted against step: (history key, axis label).
CURVES = (
    ("reward/mean", "reward (DAPO, +-1)"),
    ("mismatch/mean_abs_delta", "mean |delta|"),
    ("mismatch/rho_asym", "rho_asym (A-d- / A+d+ mass)"),
    ("mismatch/delta_q05", "delta 5% quantile"),
    ("mismatch/tail_persistence", "tail persistence (x chance)"),
    ("reward/accuracy", "rollout accuracy"),
)

# Settings shared by every arm. TRIAGE's segment length is the config's own (configs/tiny.py sets 8: its responses
# are <= 24 tokens, so 64-token segments would hold a whole response; configs/organism.py keeps the paper's 64).
COMMON = {"train.progress": False}

DEFAULTS = dict(steps=240, seeds="0,1,2", num_prompts=8, group_size=8, eval_problems=64, eval_n=8, ks="1,8")
QUICK = dict(steps=4, seeds="0,1,2", num_prompts=4, group_size=4, eval_problems=16, eval_n=4, ks="1,4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a few-minute smoke run: {QUICK}")
    p.add_argument("--config", default="tiny", help="base config (configs/NAME.py or a path)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {list(ARMS)}")
    p.add_argument("--steps", type=int, default=None, help=f"GRPO steps per run (default {DEFAULTS['steps']})")
    p.add_argument("--seeds", default=None, help=f"comma-separated RL seeds (default {DEFAULTS['seeds']})")
    p.add_argument("--num_prompts", type=int, default=None, help="prompts per rollout batch")
    p.add_argument("--group_size", type=int, default=None, help="responses per prompt")
    p.add_argument("--branch_step", type=int, default=None, help="where tis_from_branch leaves nvfp4 (default steps/2)")
    p.add_argument("--eval_problems", type=int, default=None, help="held-out problems for the final avg@n")
    p.add_argument("--eval_n", type=int, default=None, help="samples per problem (avg@n)")
    p.add_argument("--ks", default=None, help="k values of pass@k (each <= eval_n)")
    p.add_argument("--eval_top_p", type=float, default=0.7, help="nucleus sampling of the eval (DAPO: 0.7)")
    p.add_argument("--eval_reward", default="math_verify", choices=("math_verify", "dapo"))
    p.add_argument("--fp4", default="w4a4",
                   help="the preset of every quantized arm's sampler (and the exact arm's learner), e.g. w4a4_mx")
    p.add_argument("--qset", dest="quantized_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to the quantized arms only (repeatable), e.g. "
                        "sampler.rules=\"('lm_head$=w4a4',)\"")
    p.add_argument("--warmup_seed", type=int, default=0, help="the seed whose cached warm-up every run starts from")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every arm (repeatable)")
    p.add_argument("--out_dir", default=None, help="where the runs go (default runs/<tag>)")
    p.add_argument("--extend", default=None, metavar="DIR",
                   help="continue the finished shorter runs under DIR (DIR/<arm>/seed<k>: the same settings, fewer "
                        "steps) to --steps instead of training from step 0 (a resumed run continues bit for bit)")
    p.add_argument("--results", default=os.path.join(common.ROOT, "experiments", "results"))
    p.add_argument("--figures", default=common.FIGURES)
    p.add_argument("--compile_cache", default=os.path.join(common.ROOT, "runs", "jax_cache"),
                   help="JAX persistent compilation cache folder ('' to disable)")
    p.add_argument("--replot", action="store_true",
                   help="redo the table and figure from an earlier invocation's results JSON and run histories")
    p.add_argument("--smooth", type=int, default=None,
                   help="plot each run's trailing mean over this many steps (default steps/20; 1 = raw)")
    p.add_argument("--tag", default=None, help="file name stem of the outputs (default stability[_quick])")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.seeds = [int(s) for s in str(args.seeds).split(",") if s != ""]
    args.ks = [int(k) for k in str(args.ks).split(",") if k != ""]
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    for child, parent in BRANCH_PARENT.items():
        if child in args.arms and parent not in args.arms and args.extend is None:
            p.error(f"--arms: {child} branches from {parent}'s checkpoint; include {parent}")
    if not args.seeds:
        p.error("--seeds is empty")
    for name in ("steps", "num_prompts", "group_size", "eval_problems", "eval_n"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    branch_given = args.branch_step is not None
    if not branch_given:
        args.branch_step = max(1, args.steps // 2)
    if not 0 < args.branch_step < args.steps:
        p.error(f"--branch_step must be in [1, steps={args.steps}), got {args.branch_step}")
    if any(k < 1 or k > args.eval_n for k in args.ks):
        p.error(f"--ks: every k must be in [1, eval_n={args.eval_n}], got {args.ks}")
    if args.smooth is not None and args.smooth < 1:
        p.error(f"--smooth must be >= 1, got {args.smooth}")
    from triage_jax.quant.policy import PRESETS

    if args.fp4 not in PRESETS:
        p.error(f"--fp4: unknown preset {args.fp4!r}; choose from {list(PRESETS)}")
    args.overrides = common.parse_overrides(p, args.overrides)
    args.quantized_overrides = common.parse_overrides(p, args.quantized_overrides)
    args.tag = args.tag or ("stability_quick" if args.quick else "stability")
    # Per tag, so a --quick run never wipes the default study's runs (which --replot reads).
    args.out_dir = args.out_dir or os.path.join(common.ROOT, "runs", args.tag)
    if args.extend is not None and not args.replot:
        # An extended branch continues its own run; its branch point is the extended study's, not steps/2.
        branched = [a for a in args.arms if a in BRANCH_PARENT]
        if branched and not branch_given:
            p.error(f"--extend: {branched} left their parent at the extended study's --branch_step; give it")
        for arm in args.arms:
            for seed in args.seeds:
                try:
                    extension_source(args, arm, seed)
                except ValueError as e:
                    p.error(f"--extend: {e}")
    return args


def arm_config(args, arm: str, seed: int):
    """The full config of one (arm, seed) run; validated by the Trainer."""
    c = common.absolute_paths(common.load_config(args.config))
    batch = args.num_prompts * args.group_size
    arm_settings = {k: (args.fp4 if k.endswith(".precision") and v == "w4a4" else v) for k, v in ARMS[arm].items()}
    common.set_values(c, {
        **COMMON, "seed": seed, "train.steps": args.steps, "train.ckpt_every": args.steps,
        "rl.num_prompts": args.num_prompts, "rl.group_size": args.group_size,
        "rl.mini_batch": batch, "rl.micro_batch": batch, **arm_settings,
    })
    common.set_values(c, args.overrides)
    if c.sampler.precision != "bf16":
        common.set_values(c, args.quantized_overrides)
    if c.learner.exact:  # the control computes one policy: the sampler's per-layer formats on both sides
        c.learner.rules = c.sampler.rules
    c.run_dir = os.path.join(os.path.abspath(args.out_dir), arm, f"seed{seed}")
    return common.absolute_paths(c)


# What a longer run of the same settings may change: its length and where it lives.
EXTEND_FREE = ("run_dir", "train.steps", "train.ckpt_every")


def extension_source(args, arm: str, seed: int) -> tuple[str, int]:
    """(run folder, its last step) of the finished shorter run that `--extend` continues for (arm, seed); a
    ValueError names what is missing or which settings differ from this run's."""
    src = os.path.join(os.path.abspath(args.extend), arm, f"seed{seed}")
    saved = os.path.join(src, "config.json")
    if not os.path.exists(saved):
        raise ValueError(f"{saved} does not exist (no finished {arm} seed {seed} run to extend)")

    from triage_jax.config import flatten

    with open(saved) as f:
        old = flatten(json.load(f))
    new = flatten(json.loads(arm_config(args, arm, seed).to_json()))
    differ = sorted(k for k in set(old) | set(new) if k not in EXTEND_FREE and old.get(k) != new.get(k))
    if differ:
        raise ValueError(f"{src} ran other settings: " + ", ".join(f"{k} {old.get(k)!r} (now {new.get(k)!r})"
                                                                   for k in differ[:5]))
    steps = int(old["train.steps"])
    if not steps < args.steps:
        raise ValueError(f"{src} ran {steps} steps; --steps {args.steps} does not extend it")
    if not os.path.isdir(os.path.join(src, "checkpoints", str(steps))):
        raise ValueError(f"{src} has no step-{steps} checkpoint to continue from")
    # A branch run holds its parent's checkpoint from where it left it (run_one copies it in).
    if arm in BRANCH_PARENT and not os.path.isdir(os.path.join(src, "checkpoints", str(args.branch_step))):
        raise ValueError(f"{src} did not branch at --branch_step {args.branch_step} (no step-{args.branch_step} "
                         f"checkpoint of {BRANCH_PARENT[arm]})")
    return src, steps


def eval_examples(c, n: int):
    """Held-out problems: the run's held-out synthetic split (`build.held_out`, as tools/eval)."""
    from triage_jax import build

    return list(build.held_out(c, n))


def evaluate_model(model, tok, c, args) -> dict:
    """avg@n and pass@k (triage_jax.evaluation) of the learner's weights sampled in BF16 at T=1 (the eval tool's
    defaults)."""
    from triage_jax import sampler
    from triage_jax.evaluation import evaluate

    return evaluate(model, tok, eval_examples(c, args.eval_problems), n=args.eval_n, ks=args.ks, temperature=1.0,
                    top_p=args.eval_top_p, top_k=0, policy=sampler.sampler_policy("bf16"), reward=args.eval_reward,
                    batch=64, seed=1234, max_prompt_len=c.sampler.max_prompt_len,
                    max_new_tokens=c.sampler.max_new_tokens)


def fresh_run_dir(path: str) -> None:
    """A run folder holding nothing from an earlier invocation (the trainer would resume from it)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)


FINAL_KEYS = ("reward/mean", "reward/accuracy", "mismatch/mean_abs_delta", "mismatch/rho_asym",
              "mismatch/delta_q05", "mismatch/tail_persistence", "mismatch/tail_concentration",
              "mismatch/hidden_by_mean")


def outcome(history: list[dict], monitor_settings: dict, final_steps: int) -> dict:
    """What one run's history says: the collapse rule (`rl.monitor.collapsed`), the first step of each early-warning
    alarm under the run's own monitor thresholds (level 1 and 2; `first_alarm_step` = any alarm at level 1), and
    each FINAL_KEYS metric's mean over the last `final_steps` steps (None where never finite)."""
    from triage_jax.rl import monitor

    done, onset = monitor.collapsed(history)
    cfg = monitor.monitor_config(monitor_settings)
    first1, first2 = monitor.first_alarms(history, cfg, level=1), monitor.first_alarms(history, cfg, level=2)
    final = {}
    for key in FINAL_KEYS:
        v = [row.get(key) for row in history[-final_steps:]]
        v = [float(x) for x in v if x is not None and math.isfinite(x)]
        final[key] = float(np.mean(v)) if v else None
    return {"collapsed": done, "collapse_step": onset, "first_alarm_step": first1["any"],
            "first_alarms": {"level1": first1, "level2": first2}, "final": final}


def run_one(args, arm: str, seed: int, log) -> dict:
    """Train one (arm, seed); returns its history, final eval and wall time. Branch parents save their branch."""
    from triage_jax.trainer import Trainer

    c = arm_config(args, arm, seed)
    common.share_warmup(c, args.warmup_seed)
    parent = BRANCH_PARENT.get(arm)
    extended = None
    if parent is None or args.extend is not None:
        fresh_run_dir(c.run_dir)
    if args.extend is not None:  # the shorter run's last checkpoint (and history) is where this one starts
        src, src_steps = extension_source(args, arm, seed)
        shutil.copytree(os.path.join(src, "checkpoints", str(src_steps)),
                        os.path.join(c.run_dir, "checkpoints", str(src_steps)))
        extended = {"run_dir": src, "steps": src_steps}
    with open(os.path.join(c.run_dir, "config.json"), "w") as f:
        f.write(c.to_json(indent=1))
    t0 = time.perf_counter()
    tr = Trainer(c, progress=False)
    # An extension starts from the shorter run's last checkpoint (a branch's included), a branch from its parent's
    # step-branch_step one.
    start = ((extended["steps"], f"copied from {extended['run_dir']}") if extended is not None else
             (args.branch_step, f"from {parent}") if parent is not None else None)
    if start is not None:
        if not tr.restore() or tr.step != start[0]:
            raise RuntimeError(f"{arm}: no usable step-{start[0]} checkpoint ({start[1]}) in {c.run_dir}")
        history = tr.run(resume=False)
    elif any(p == arm for p in BRANCH_PARENT.values()) and any(ch in args.arms for ch in BRANCH_PARENT):
        tr.run(resume=False, max_steps=args.branch_step)
        for child, par in BRANCH_PARENT.items():
            if par == arm and child in args.arms:
                dst = arm_config(args, child, seed).run_dir
                fresh_run_dir(dst)
                shutil.copytree(os.path.join(c.run_dir, "checkpoints"), os.path.join(dst, "checkpoints"),
                                dirs_exist_ok=True)
        history = tr.run(resume=False)
    else:
        history = tr.run(resume=False)
    train_s = time.perf_counter() - t0
    tr.summary()
    common.write_json(os.path.join(c.run_dir, "history.json"), history)
    t1 = time.perf_counter()
    ev = evaluate_model(tr.learner.model(), tr.tok, c, args)
    eval_s = time.perf_counter() - t1
    # Beside history.json, so a report rebuilt from the run folders (organism_sweep --replot) keeps every run's avg@n.
    common.write_json(os.path.join(c.run_dir, "eval.json"),
                      {"eval": ev, "train_s": train_s, "eval_s": eval_s, "extended": extended})
    out = outcome(history, c.monitor.to_dict(), final_window(args))
    log(f"{arm} seed {seed}: {len(history)} steps in {train_s:.0f}s (+{eval_s:.0f}s eval); "
        f"reward {history[0]['reward/mean']:+.3f} -> {history[-1]['reward/mean']:+.3f}; "
        f"avg@{args.eval_n} {ev[f'avg@{args.eval_n}']:.3f}; collapsed {out['collapsed']} "
        f"(step {out['collapse_step']}), first alarm {out['first_alarm_step']}")
    return {"history": history, "eval": ev, "train_s": train_s, "eval_s": eval_s, "run_dir": c.run_dir,
            "extended": extended, **out}


def run_study(args, log=print) -> dict:
    """Every arm for every seed (parents before their branches), plus the warm-up policy's own eval."""
    order = [a for a in args.arms if a not in BRANCH_PARENT] + [a for a in args.arms if a in BRANCH_PARENT]
    runs: dict[str, dict[int, dict]] = {a: {} for a in order}
    c0 = arm_config(args, order[0], args.warmup_seed)
    model, tok, _, _ = common.warm_model(c0, progress=False)
    base_eval = evaluate_model(model, tok, c0, args)
    log(f"warm-up policy: avg@{args.eval_n} {base_eval[f'avg@{args.eval_n}']:.3f}")
    for seed in args.seeds:
        for arm in order:
            runs[arm][seed] = run_one(args, arm, seed, log)
    return {"runs": runs, "warmup_eval": base_eval}


# ------------------------------------------------------------------------------------------------ report

def curve(runs_of_arm: dict[int, dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values [seeds, steps]) of one metric; NaN where a run lacks the key or a step."""
    hist = [r["history"] for r in runs_of_arm.values()]
    n = max(len(h) for h in hist)
    vals = np.full((len(hist), n), np.nan)
    for i, h in enumerate(hist):
        for j, row in enumerate(h):
            v = row.get(key, math.nan)
            vals[i, j] = math.nan if v is None else v
    return np.arange(1, n + 1), vals


def final_window(args) -> int:
    return max(1, min(10, args.steps // 8))


def results_rows(study: dict, args) -> list[list]:
    """One row per arm: final metrics averaged over the last steps, then over seeds (mean +- std)."""
    k = final_window(args)
    rows = []

    def ms(xs):
        xs = np.asarray([x for x in xs if x is not None and np.isfinite(x)], float)
        if not xs.size:
            return "-"
        return f"{xs.mean():.3f} +- {xs.std():.3f}" if xs.size > 1 else f"{xs.mean():.3f}"

    def ms4(xs):
        xs = np.asarray([x for x in xs if x is not None and np.isfinite(x)], float)
        return "-" if not xs.size else (f"{xs.mean():.4f} +- {xs.std():.4f}" if xs.size > 1 else f"{xs.mean():.4f}")

    for arm, per_seed in study["runs"].items():
        def last(key):
            out = []
            for r in per_seed.values():
                v = [row.get(key) for row in r["history"][-k:]]
                v = [x for x in v if x is not None and np.isfinite(x)]
                out.append(float(np.mean(v)) if v else None)
            return out

        evs = [r["eval"] for r in per_seed.values()]
        rows.append([arm, len(per_seed), ms(last("reward/mean")), ms4(last("mismatch/mean_abs_delta")),
                     ms(last("mismatch/rho_asym")), ms(last("mismatch/delta_q05")),
                     ms(last("mismatch/tail_persistence")), ms([e[f"avg@{args.eval_n}"] for e in evs])]
                    + [ms([e[f"pass@{kk}"] for e in evs]) for kk in args.ks]
                    + [collapse_cell(per_seed), alarm_cell(per_seed)])
    return rows


def collapse_cell(per_seed: dict) -> str:
    """'k/n' runs collapsed, with the onset steps of those that did (older results without the rule: '-')."""
    if any("collapsed" not in r for r in per_seed.values()):
        return "-"
    onsets = [str(r["collapse_step"]) for r in per_seed.values() if r["collapsed"]]
    n = len(onsets)
    return f"{n}/{len(per_seed)}" + (f" (step {', '.join(onsets)})" if n else "")


def alarm_cell(per_seed: dict) -> str:
    """The first level-1 alarm step of each seed ('-': never)."""
    if any("first_alarm_step" not in r for r in per_seed.values()):
        return "-"
    return ", ".join("-" if r["first_alarm_step"] is None else str(r["first_alarm_step"]) for r in per_seed.values())


DRIFT = (("reward/mean", "reward", 3), ("reward/accuracy", "rollout acc.", 3),
         ("mismatch/mean_abs_delta", "mean abs delta", 4), ("mismatch/delta_q05", "delta q05", 3),
         ("mismatch/rho_asym", "rho_asym", 3), ("mismatch/tail_persistence", "tail persist.", 2))


def drift_rows(study: dict, args) -> list[list]:
    """One row per arm: each metric's mean over the first and over the last `final_window` steps (pooled over
    seeds), as "first -> last": how the run moved, which the final values alone do not show."""
    k = final_window(args)
    rows = []
    for arm, per_seed in study["runs"].items():
        row = [arm]
        for key, _, digits in DRIFT:
            _, vals = curve(per_seed, key)
            with warnings.catch_warnings():  # an all-NaN window (e.g. bf16's tail persistence) prints as '-'
                warnings.simplefilter("ignore", RuntimeWarning)
                first, last = np.nanmean(vals[:, :k]), np.nanmean(vals[:, -k:])
            row.append(f"{common.fmt(float(first), digits)} -> {common.fmt(float(last), digits)}")
        rows.append(row)
    return rows


def drift_table(study: dict, args) -> str:
    return common.markdown_table(["arm"] + [label for _, label, _ in DRIFT], drift_rows(study, args))


def results_table(study: dict, args) -> str:
    header = ["arm", "seeds", "reward", "mean abs delta", "rho_asym", "delta q05", "tail persist.",
              f"avg@{args.eval_n}"] + [f"pass@{k}" for k in args.ks] + ["collapsed", "first alarm"]
    return common.markdown_table(header, results_rows(study, args))


def smooth_window(args) -> int:
    return args.smooth if args.smooth is not None else max(1, round(args.steps / 20))


def plot_curves(study: dict, args, path: str) -> str:
    plt = common.use_agg()
    window = smooth_window(args)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (key, label) in zip(axes.flat, CURVES):
        for arm, per_seed in study["runs"].items():
            steps, vals = curve(per_seed, key)
            common.band(ax, steps, common.rolling_mean(vals, window), arm)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    if "tis_from_branch" in study["runs"]:
        for ax in axes.flat:
            ax.axvline(args.branch_step + 0.5, color="gray", ls=":", lw=1)
    axes.flat[0].legend(fontsize=8)
    smoothing = f"each run's trailing mean over {window} steps, " if window > 1 else ""
    fig.suptitle(f"{args.config}: GRPO on synthetic math; {smoothing}mean over seeds {args.seeds} (band: min..max)")
    fig.tight_layout()
    return common.save_figure(fig, path, dpi=72)


def load_study(path: str, args) -> tuple[dict, float]:
    """The study dict of an earlier invocation (its results JSON + each run's history.json); its settings
    (steps, seeds, eval) replace those of `args`."""
    import json

    with open(path) as f:
        saved = json.load(f)
    for k in ("steps", "seeds", "num_prompts", "group_size", "branch_step", "eval_problems", "eval_n", "ks",
              "eval_top_p", "eval_reward", "config"):
        if k in saved["args"]:
            setattr(args, k, saved["args"][k])
    runs = {arm: {int(seed): {**r, "history": common.read_history(r["run_dir"])} for seed, r in per.items()}
            for arm, per in saved["runs"].items()}
    return {"runs": runs, "warmup_eval": saved["warmup_eval"]}, saved["total_s"]


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[stability {time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    if args.replot:
        study, total = load_study(os.path.join(args.results, f"{args.tag}.json"), args)
    else:
        with common.compile_cache(args.compile_cache):
            study = run_study(args, log)
        total = time.perf_counter() - t0
    table = results_table(study, args)
    base = study["warmup_eval"]
    text = (f"## {args.tag}: {args.config}, {args.steps} steps, seeds {args.seeds}, batch "
            f"{args.num_prompts}x{args.group_size}, branch at step {args.branch_step}, {total / 60:.1f} min\n\n"
            f"Final values: mean over the last {final_window(args)} steps of each run, then mean +- std over "
            f"seeds. avg@{args.eval_n} / pass@k: {args.eval_problems} held-out problems, BF16 sampling at T=1, "
            f"top_p={args.eval_top_p} ({args.eval_reward}). Warm-up policy before RL: avg@{args.eval_n} "
            f"{base[f'avg@{args.eval_n}']:.3f}.\n\n{table}\n\n"
            f"First -> last {final_window(args)} steps (mean over steps and seeds):\n\n"
            f"{drift_table(study, args)}\n")
    print(text)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, f"{args.tag}.md"), "w") as f:
        f.write(text)
    summary = {"args": vars(args), "total_s": total, "warmup_eval": base,
               "runs": {a: {s: {k: v for k, v in r.items() if k != "history"} for s, r in per.items()}
                        for a, per in study["runs"].items()}}
    common.write_json(os.path.join(args.results, f"{args.tag}.json"), summary)
    fig = plot_curves(study, args, os.path.join(args.figures, f"{args.tag}.png"))
    log(f"figure: {fig}; table: {os.path.join(args.results, args.tag + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
