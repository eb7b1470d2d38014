"""The collapse-rate study's report (experiments/collapse_rate.py fixes its rules): the regime pick, BF16 vs NVFP4
with their test statistics, the monitor as a predictor, the direction signals against their nulls.

Reads the per-run records under <parts>/<cell>/<arm>_seed<k>.json; writes <results>/collapse_rate.{json,md}.
"""

from __future__ import annotations

import glob
import json
import math
import os

import numpy as np
from scipy import stats

from experiments import common

LEAD_H = 50  # an alarm within this many steps before an onset is a true positive
WINDOW = 50  # the first / last steps the signal tables average
SIGNALS = ("mismatch/mean_abs_delta", "mismatch/delta_q05", "mismatch/rho_asym", "mismatch/rho_asym_null",
           "mismatch/rho_asym_excess", "mismatch/rho_asym_direction", "mismatch/tail_persistence",
           "mismatch/tail_persistence_excess", "entropy", "reward/accuracy")
# (alarm, watched metric, level) -> threshold grid of that level: the monitor's ROC.
ROC_GRID = {
    ("rho_asym", "rho_asym_excess"): (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0),
    ("rho_asym", "rho_asym"): (0.8, 1.0, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0),
    ("rho_asym", "rho_asym_direction"): (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0),
    ("tail_persistence", "tail_persistence_excess"): (1.0, 1.25, 1.5, 2.0, 3.0, 4.0),
    ("tail_persistence", "tail_persistence"): (1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    ("delta_q05", "delta_q05"): (0.25, 0.5, 1.0, 2.0, 3.0, 5.0),
}


def load(parts: str) -> dict[str, list[dict]]:
    """{cell: [record, ...]} of every finished run under `parts`."""
    out: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(parts, "*", "*_seed*.json"))):
        with open(path) as f:
            rec = json.load(f)
        out.setdefault(rec["cell"], []).append(rec)
    return out


def rows(rec: dict) -> list[dict]:
    """A record's per-step dicts (NaN where a value is missing), as the collapse rule and the monitor read them."""
    h = rec["history"]
    keys = [k for k in h if k != "step"]
    return [{"step": s, **{k: (math.nan if h[k][i] is None else h[k][i]) for k in keys}}
            for i, s in enumerate(h["step"])]


def onset(rec: dict) -> tuple[bool, int | None]:
    from triage_jax.rl import monitor

    return monitor.collapsed(rows(rec))


def warmup_avg(parts: str) -> float | None:
    path = os.path.join(parts, "warmup_eval.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return float(json.load(f)["avg@8"])


def regime(parts: str) -> list[dict]:
    """Per candidate cell: the BF16 runs of seeds 0-2, their avg@8 against the warm-up's, and whether it qualifies."""
    from experiments.collapse_rate import CELLS, REGIME_SEEDS

    base = warmup_avg(parts)
    out = []
    for cell, spec in CELLS.items():
        recs = {r["seed"]: r for r in load(parts).get(cell, []) if r["arm"] == "bf16" and r["seed"] in REGIME_SEEDS}
        done = sorted(recs)
        after = [recs[s]["eval"]["avg@8"] for s in done]
        collapsed = [onset(recs[s])[0] for s in done]
        failed = base is not None and any(a <= base or c for a, c in zip(after, collapsed))
        complete = len(done) == len(REGIME_SEEDS) and base is not None
        ok = complete and not failed
        # One seed that did not learn (or collapsed) decides the cell: the rule needs all three.
        out.append({"cell": cell, "lr": spec.lr, "description": spec.description, "seeds": done,
                    "avg8_before": base, "avg8_after": after, "collapsed": collapsed, "complete": complete,
                    "decided": failed or complete, "qualifies": ok})
    return out


def regime_complete(parts: str) -> bool:
    """Whether every candidate cell is decided: its three BF16 runs all learned, or one of them did not."""
    return all(r["decided"] for r in regime(parts))


def chosen_cell(parts: str) -> str | None:
    """The regime rule: among the cells whose three BF16 runs all learned without collapsing, the largest lr; None
    while a cell is undecided."""
    rows = regime(parts)
    ok = [r for r in rows if r["qualifies"]]
    return max(ok, key=lambda r: r["lr"])["cell"] if ok and all(r["decided"] for r in rows) else None


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval of a rate k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def bootstrap_diff(a: np.ndarray, b: np.ndarray, reps: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(b) - mean(a), resampling each arm's runs."""
    rng = np.random.default_rng(seed)
    d = rng.choice(b, (reps, b.size)).mean(1) - rng.choice(a, (reps, a.size)).mean(1)
    return tuple(float(x) for x in np.percentile(d, [2.5, 97.5]))


def survival(recs: list[dict], horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """(time, event) per run: the onset step for a collapse confirmed by the rule, else censored at the horizon."""
    t, e = [], []
    for r in recs:
        done, step = onset(r)
        t.append(step if done else horizon)
        e.append(bool(done))
    return np.asarray(t, float), np.asarray(e, bool)


def kaplan_meier(t: np.ndarray, e: np.ndarray) -> list[tuple[float, float]]:
    """(step, survival probability) after each distinct onset (scipy.stats.ecdf on censored data)."""
    if not e.any():
        return [(0.0, 1.0)]
    res = stats.ecdf(stats.CensoredData(uncensored=t[e], right=t[~e]))
    sf = res.sf
    return [(0.0, 1.0)] + [(float(q), float(p)) for q, p in zip(sf.quantiles, sf.probabilities)]


def compare(a_recs: list[dict], b_recs: list[dict], horizon: int) -> dict:
    """Arm b against arm a: collapse rates (Wilson), Fisher's exact, log-rank, final avg@8 (Mann-Whitney U, the
    bootstrap interval of the difference of means)."""
    ta, ea = survival(a_recs, horizon)
    tb, eb = survival(b_recs, horizon)
    table = [[int(ea.sum()), int((~ea).sum())], [int(eb.sum()), int((~eb).sum())]]
    fisher_p = float(stats.fisher_exact(table)[1])
    if ea.any() or eb.any():
        lr = stats.logrank(stats.CensoredData(uncensored=ta[ea], right=ta[~ea]),
                           stats.CensoredData(uncensored=tb[eb], right=tb[~eb]))
        logrank = {"statistic": float(lr.statistic), "p": float(lr.pvalue)}
    else:
        logrank = {"statistic": None, "p": None, "note": "no onset in either arm: nothing to rank"}
    va = np.asarray([r["eval"]["avg@8"] for r in a_recs])
    vb = np.asarray([r["eval"]["avg@8"] for r in b_recs])
    mw = stats.mannwhitneyu(vb, va, alternative="two-sided")
    return {"n": [len(a_recs), len(b_recs)], "collapses": [table[0][0], table[1][0]],
            "rate": [table[0][0] / max(1, len(a_recs)), table[1][0] / max(1, len(b_recs))],
            "wilson95": [wilson(table[0][0], len(a_recs)), wilson(table[1][0], len(b_recs))],
            "fisher_p": fisher_p, "logrank": logrank,
            "km": [kaplan_meier(ta, ea), kaplan_meier(tb, eb)],
            "avg8_mean": [float(va.mean()), float(vb.mean())], "avg8_sd": [float(va.std(ddof=1)) if va.size > 1
                                                                           else None,
                                                                           float(vb.std(ddof=1)) if vb.size > 1
                                                                           else None],
            "avg8_diff": float(vb.mean() - va.mean()), "avg8_diff_ci95": bootstrap_diff(va, vb),
            "mannwhitney_u": float(mw.statistic), "mannwhitney_p": float(mw.pvalue)}


def _alarm_levels(recs: list[dict], alarm: str, metric: str, level: int, threshold: float) -> list[np.ndarray]:
    """Per run, the level of `alarm` at each step with that level's threshold set to `threshold` (the other level
    kept ordered) and the watched metric `metric`."""
    from triage_jax.rl import monitor

    d = monitor.MonitorConfig()
    kw = {}
    if alarm == "rho_asym":
        kw["rho_metric"] = metric
        kw.update(rho_level1=min(threshold, d.rho_level2) if level == 2 else threshold,
                  rho_level2=threshold if level == 2 else max(threshold, d.rho_level2))
    elif alarm == "tail_persistence":
        kw["persistence_metric"] = metric
        kw.update(persistence_level1=min(threshold, d.persistence_level2) if level == 2 else threshold,
                  persistence_level2=threshold if level == 2 else max(threshold, d.persistence_level2))
    else:
        kw.update(q05_level1=min(threshold, d.q05_level2) if level == 2 else threshold,
                  q05_level2=threshold if level == 2 else max(threshold, d.q05_level2))
    cfg = monitor.MonitorConfig(**kw)
    return [np.asarray([a[f"alarm/{alarm}"] for a in monitor.replay(rows(r), cfg)[1]]) for r in recs]


def monitor_roc(recs: list[dict]) -> list[dict]:
    """Per alarm, watched metric, level and threshold: the true-positive rate over the collapsed runs (an alarm
    within LEAD_H steps before the onset) and false alarms per 100 steps (alarm onsets: the level reached from
    below) over the runs that did not collapse, with the median lead time of the detected collapses."""
    verdicts = [onset(r) for r in recs]
    out = []
    for (alarm, metric), grid in ROC_GRID.items():
        for level in (1, 2):
            for th in grid:
                levels = _alarm_levels(recs, alarm, metric, level, th)
                hits, leads, false_alarms, quiet_steps = 0, [], 0, 0
                for (done, step), lv, r in zip(verdicts, levels, recs):
                    steps = np.asarray(r["history"]["step"])
                    on = lv >= level
                    if done:
                        near = on & (steps >= step - LEAD_H) & (steps <= step)
                        if near.any():
                            hits += 1
                            leads.append(int(step - steps[np.argmax(near)]))
                    else:
                        false_alarms += int(on[0]) + int(np.sum(on[1:] & ~on[:-1]))
                        quiet_steps += len(steps)
                n_pos = sum(v[0] for v in verdicts)
                out.append({"alarm": alarm, "metric": metric, "level": level, "threshold": th,
                            "tpr": hits / n_pos if n_pos else None, "positives": n_pos,
                            "false_alarms_per_100": 100 * false_alarms / quiet_steps if quiet_steps else None,
                            "median_lead": float(np.median(leads)) if leads else None})
    return out


def _window_mean(rec: dict, key: str, first: bool) -> float:
    v = np.asarray([x for x in rec["history"][key] if x is not None], float) if key in rec["history"] else []
    v = v[:WINDOW] if first else v[-WINDOW:]
    return float(np.mean(v)) if len(v) else math.nan


def signals(by_arm: dict[str, list[dict]]) -> dict:
    """Per arm and signal: the mean over runs of the first / last WINDOW steps' means (and their SE), the share of
    steps whose rho_asym beat its null at p < 0.05, and NVFP4 vs BF16 on the last-window means (Mann-Whitney)."""
    out: dict = {"arms": {}, "nvfp4_vs_bf16_last": {}}
    for arm, recs in by_arm.items():
        t = {}
        for key in SIGNALS:
            first = np.asarray([_window_mean(r, key, True) for r in recs])
            last = np.asarray([_window_mean(r, key, False) for r in recs])
            t[key] = {"first": float(np.nanmean(first)) if np.isfinite(first).any() else None,
                      "last": float(np.nanmean(last)) if np.isfinite(last).any() else None,
                      "last_se": float(np.nanstd(last, ddof=1) / math.sqrt(np.isfinite(last).sum()))
                      if np.isfinite(last).sum() > 1 else None}
        ps = [x for r in recs for x in r["history"].get("mismatch/rho_asym_null_p", []) if x is not None]
        t["frac_steps_rho_p_below_0.05"] = float(np.mean(np.asarray(ps) < 0.05)) if ps else None
        out["arms"][arm] = t
    if "bf16" in by_arm and "nvfp4" in by_arm:
        for key in SIGNALS:
            a = np.asarray([_window_mean(r, key, False) for r in by_arm["bf16"]])
            b = np.asarray([_window_mean(r, key, False) for r in by_arm["nvfp4"]])
            a, b = a[np.isfinite(a)], b[np.isfinite(b)]
            if a.size and b.size:
                mw = stats.mannwhitneyu(b, a, alternative="two-sided")
                out["nvfp4_vs_bf16_last"][key] = {"u": float(mw.statistic), "p": float(mw.pvalue)}
    return out


def build(parts: str) -> dict:
    """Everything the report says, from the records under `parts`."""
    data = load(parts)
    report: dict = {"warmup_avg8": warmup_avg(parts), "regime": regime(parts), "chosen_cell": chosen_cell(parts)}
    cell = report["chosen_cell"]
    main = data.get(cell, []) if cell else []
    by_arm: dict[str, list[dict]] = {}
    for r in sorted(main, key=lambda r: r["seed"]):
        by_arm.setdefault(r["arm"], []).append(r)
    report["runs"] = {arm: [{"seed": r["seed"], "collapsed": onset(r)[0], "onset": onset(r)[1],
                             "avg8": r["eval"]["avg@8"], "pass8": r["eval"].get("pass@8"),
                             "train_s": r.get("train_s_this_process")} for r in recs]
                      for arm, recs in by_arm.items()}
    if main:
        steps = max(r["steps"] for r in main)
        report["steps"], report["horizon"] = steps, steps - 20
        if "bf16" in by_arm and "nvfp4" in by_arm:
            report["bf16_vs_nvfp4"] = compare(by_arm["bf16"], by_arm["nvfp4"], steps - 20)
        report["monitor_roc"] = monitor_roc(main)
        report["signals"] = signals(by_arm)
        report["compute"] = {"runs": len(main), "train_s": float(sum(r.get("train_s_this_process", 0) for r in main))}
    return report


def _f(x, d=3) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{d}f}"


def markdown(rep: dict) -> str:
    lines = ["# The collapse-rate study", "",
             "Rules fixed before the runs: experiments/collapse_rate.py (docstring). Generated by "
             "`python experiments/collapse_rate.py report`.", "",
             f"Warm-up policy: held-out avg@8 {_f(rep['warmup_avg8'])} (64 problems x 8, BF16 sampling, T = 1, "
             "top_p 0.7).", "", "## Regime (BF16, seeds 0-2)", ""]
    lines.append(common.markdown_table(
        ["cell", "lr", "seeds done", "avg@8 after (per seed)", "collapsed", "qualifies"],
        [[r["cell"], r["lr"], len(r["seeds"]), " / ".join(_f(a) for a in r["avg8_after"]),
          sum(r["collapsed"]), "yes" if r["qualifies"] else ("no" if r["decided"] else "pending")]
         for r in rep["regime"]]))
    lines += ["", f"Chosen cell: **{rep['chosen_cell'] or 'none yet'}**", ""]
    if "bf16_vs_nvfp4" in rep:
        c = rep["bf16_vs_nvfp4"]
        lines += [f"## BF16 vs NVFP4 ({rep['steps']} steps, onsets observable to step {rep['horizon']})", ""]
        lines.append(common.markdown_table(
            ["arm", "runs", "collapsed", "rate (Wilson 95%)", "held-out avg@8 mean (sd)"],
            [[arm, c["n"][i], c["collapses"][i], f"{_f(c['rate'][i], 2)} ({_f(c['wilson95'][i][0], 2)}-"
              f"{_f(c['wilson95'][i][1], 2)})", f"{_f(c['avg8_mean'][i])} ({_f(c['avg8_sd'][i])})"]
             for i, arm in enumerate(("bf16", "nvfp4"))]))
        lr = c["logrank"]
        lines += ["", f"Fisher's exact test (collapse counts): p = {_f(c['fisher_p'])}. Log-rank (onsets): "
                  + (f"z = {_f(lr['statistic'])}, p = {_f(lr['p'])}." if lr["p"] is not None else lr["note"] + ".")
                  + f" avg@8 NVFP4 - BF16 = {_f(c['avg8_diff'])} (bootstrap 95% {_f(c['avg8_diff_ci95'][0])} to "
                  f"{_f(c['avg8_diff_ci95'][1])}), Mann-Whitney U = {_f(c['mannwhitney_u'], 1)}, "
                  f"p = {_f(c['mannwhitney_p'])}.", ""]
        per = []
        for arm, runs in rep["runs"].items():
            for r in runs:
                per.append([arm, r["seed"], "yes, step %d" % r["onset"] if r["collapsed"] else "no", _f(r["avg8"]),
                            _f(r["train_s"], 0)])
        lines += ["Per run:", "", common.markdown_table(["arm", "seed", "collapsed", "avg@8", "train s"], per), ""]
    if "signals" in rep:
        s = rep["signals"]
        lines += [f"## Direction signals against their nulls (mean over runs of the first / last {WINDOW} steps)", ""]
        head = ["signal"] + [f"{a} first -> last" for a in s["arms"]] + ["NVFP4 vs BF16, last (MWU p)"]
        body = []
        for key in SIGNALS:
            row = [key.removeprefix("mismatch/")]
            for arm in s["arms"]:
                v = s["arms"][arm][key]
                row.append(f"{_f(v['first'])} -> {_f(v['last'])}")
            t = s["nvfp4_vs_bf16_last"].get(key)
            row.append(_f(t["p"]) if t else "-")
            body.append(row)
        lines += [common.markdown_table(head, body), ""]
        lines += ["Share of steps whose rho_asym beats its shuffle null at p < 0.05: " + ", ".join(
            f"{a} {_f(v['frac_steps_rho_p_below_0.05'], 2)}" for a, v in s["arms"].items()), ""]
    if "monitor_roc" in rep:
        pos = rep["monitor_roc"][0]["positives"] if rep["monitor_roc"] else 0
        lines += ["## The monitor as a predictor", "",
                  f"{pos} collapsed run(s) to detect (an alarm within {LEAD_H} steps before the onset is a hit); "
                  "false alarms per 100 steps over the runs that did not collapse.", ""]
        lines.append(common.markdown_table(
            ["alarm", "metric", "level", "threshold", "TPR", "false alarms / 100 steps", "median lead"],
            [[r["alarm"], r["metric"], r["level"], r["threshold"], _f(r["tpr"], 2), _f(r["false_alarms_per_100"], 2),
              _f(r["median_lead"], 0)] for r in rep["monitor_roc"]]))
        lines.append("")
    if "compute" in rep:
        lines += [f"Compute: {rep['compute']['runs']} runs, {rep['compute']['train_s'] / 3600:.2f} h of training "
                  "in the processes that finished them (2-core CPU, beside other work at nice 19).", ""]
    return "\n".join(lines)


FIGURE_CURVES = (("reward/accuracy", "rollout accuracy"), ("mismatch/mean_abs_delta", "mean |delta|"),
                 ("mismatch/rho_asym", "rho_asym (raw)"), ("mismatch/rho_asym_excess", "rho_asym / shuffle null"),
                 ("mismatch/rho_asym_direction", "direction odds ratio"), ("entropy", "entropy"))


def figure(parts: str, path: str, smooth: int = 15) -> str | None:
    """The chosen cell's curves per arm (mean over seeds of a trailing mean, min..max band) and the Kaplan-Meier
    survival of each arm; None when the cell has no runs yet."""
    cell = chosen_cell(parts)
    recs = load(parts).get(cell, []) if cell else []
    if not recs:
        return None
    plt = common.use_agg()
    by_arm: dict[str, list[dict]] = {}
    for r in recs:
        by_arm.setdefault(r["arm"], []).append(r)
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    for ax, (key, label) in zip(axes.flat, FIGURE_CURVES):
        for arm, rs in sorted(by_arm.items()):
            n = min(len(r["history"]["step"]) for r in rs)
            vals = np.asarray([[np.nan if v is None else v for v in r["history"].get(key, [None] * n)[:n]]
                               for r in rs], float)
            common.band(ax, np.arange(n), common.rolling_mean(vals, smooth), f"{arm} ({len(rs)} seeds)")
        ax.set_title(label)
        ax.set_xlabel("step")
    ax = axes.flat[len(FIGURE_CURVES)]
    for arm, rs in sorted(by_arm.items()):
        horizon = max(r["steps"] for r in rs) - 20
        km = kaplan_meier(*survival(rs, horizon))
        xs, ys = [p[0] for p in km] + [horizon], [p[1] for p in km] + [km[-1][1]]
        ax.step(xs, ys, where="post", label=arm)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("surviving (collapse rule; censored at the horizon)")
    ax.set_xlabel("step")
    axes.flat[-1].axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.subplots_adjust(hspace=0.35)
    fig.suptitle(f"collapse-rate study, cell {cell}: mean over seeds of a {smooth}-step trailing mean, min..max band")
    return common.save_figure(fig, path)


def write(parts: str, results: str, figures: str | None = None) -> dict:
    rep = build(parts)
    if figures:
        rep["figure"] = figure(parts, os.path.join(figures, "collapse_rate.png"))
    os.makedirs(results, exist_ok=True)
    common.write_json(os.path.join(results, "collapse_rate.json"), rep)
    with open(os.path.join(results, "collapse_rate.md"), "w") as f:
        f.write(markdown(rep))
    print(markdown(rep))
    return rep
