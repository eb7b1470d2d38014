"""The collapse-rate study's machinery on hand-made records: the regime rule, the statistics, the monitor's ROC,
the run claims that let several workers share a study (experiments/collapse_rate.py, collapse_report.py)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from experiments import collapse_rate as cr
from experiments import collapse_report as rep


def record(cell, arm, seed, acc, avg8, steps=None, **series):
    """A run record as collapse_rate writes it: accuracy per step (and any other metric series)."""
    n = len(acc)
    hist = {"step": list(range(n)), "reward/accuracy": list(acc)}
    hist.update({k: list(v) for k, v in series.items()})
    return {"cell": cell, "arm": arm, "seed": seed, "steps": steps or n, "eval": {"avg@8": avg8, "pass@8": avg8},
            "train_s_this_process": 1.0, "history": hist}


def write(parts, rec):
    path = os.path.join(parts, rec["cell"], f"{rec['arm']}_seed{rec['seed']}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f)


def flat(n=60, level=0.5):
    return [level] * n


def collapsing(onset, n=60, level=0.5):
    return [level] * onset + [0.1] * (n - onset)


def test_regime_picks_the_largest_learning_rate_whose_bf16_runs_all_learn(tmp_path):
    parts = str(tmp_path)
    with open(os.path.join(parts, "warmup_eval.json"), "w") as f:
        json.dump({"avg@8": 0.40}, f)
    for seed in (0, 1, 2):
        write(parts, record("lr1e-4", "bf16", seed, flat(), 0.45))
        write(parts, record("lr3e-4", "bf16", seed, flat(), 0.50))
    assert not rep.regime_complete(parts) and rep.chosen_cell(parts) is None  # lr1e-3 has no runs yet
    write(parts, record("lr1e-3", "bf16", 0, flat(), 0.55))
    write(parts, record("lr1e-3", "bf16", 1, collapsing(10), 0.55))  # one collapse disqualifies the cell
    assert rep.regime_complete(parts) and rep.chosen_cell(parts) == "lr3e-4"  # decided without seed 2
    write(parts, record("lr1e-3", "bf16", 2, flat(), 0.55))
    rows = {r["cell"]: r for r in rep.regime(parts)}
    assert rep.regime_complete(parts) and rows["lr1e-3"]["collapsed"] == [False, True, False]
    assert [rows[c]["qualifies"] for c in ("lr1e-4", "lr3e-4", "lr1e-3")] == [True, True, False]
    assert rep.chosen_cell(parts) == "lr3e-4"
    write(parts, record("lr3e-4", "bf16", 2, flat(), 0.39))  # one seed below the warm-up: not learning
    assert rep.chosen_cell(parts) == "lr1e-4"


def test_comparison_statistics():
    bf = [record("c", "bf16", s, flat(300), 0.5 + 0.01 * s) for s in range(12)]
    nv = [record("c", "nvfp4", s, collapsing(100 + 10 * s, 300) if s < 6 else flat(300), 0.4 + 0.01 * s)
          for s in range(12)]
    out = rep.compare(bf, nv, horizon=280)
    assert out["collapses"] == [0, 6]
    assert out["fisher_p"] == pytest.approx(stats.fisher_exact([[0, 12], [6, 6]])[1])
    assert out["logrank"]["p"] < 0.05 and abs(out["logrank"]["statistic"]) > 1.96  # scipy: a z-score
    lo, hi = out["wilson95"][0]
    assert lo == 0.0 and hi == pytest.approx(0.2425, abs=1e-3)  # Wilson 95% for 0 of 12
    assert out["avg8_diff"] == pytest.approx(-0.1) and out["avg8_diff_ci95"][1] < 0
    assert out["mannwhitney_p"] < 0.01
    km = dict(out["km"][1])
    assert km[0.0] == 1.0 and min(km.values()) == pytest.approx(0.5)
    none = rep.compare(bf[:3], bf[3:6], horizon=280)
    assert none["logrank"]["p"] is None and none["fisher_p"] == 1.0


def test_collapse_past_the_horizon_is_censored():
    late = record("c", "nvfp4", 0, collapsing(290, 300), 0.4)  # 10 low steps: the rule cannot confirm it
    assert rep.onset(late) == (False, None)
    t, e = rep.survival([late], horizon=280)
    assert t.tolist() == [280.0] and e.tolist() == [False]


def test_monitor_roc_scores_hits_and_false_alarms():
    n = 120
    rise = [1.0] * 40 + [1.0 + 0.05 * i for i in range(n - 40)]  # excess rising from step 40
    hit = record("c", "nvfp4", 0, collapsing(80, n), 0.3, **{"mismatch/rho_asym_excess": rise})
    quiet = record("c", "bf16", 0, flat(n), 0.5, **{"mismatch/rho_asym_excess": [1.0] * n})
    noisy = record("c", "bf16", 1, flat(n), 0.5, **{"mismatch/rho_asym_excess": [3.0] * 30 + [1.0] * (n - 30)})
    roc = rep.monitor_roc([hit, quiet, noisy])
    row = next(r for r in roc if r["metric"] == "rho_asym_excess" and r["level"] == 1 and r["threshold"] == 1.2)
    assert row["positives"] == 1 and row["tpr"] == 1.0 and row["median_lead"] > 0
    assert row["false_alarms_per_100"] == pytest.approx(100 * 1 / (2 * n))  # the noisy run's one alarm onset
    high = next(r for r in roc if r["metric"] == "rho_asym_excess" and r["level"] == 2 and r["threshold"] == 3.0)
    assert high["tpr"] == 0.0 and high["false_alarms_per_100"] == 0.0


def test_compact_rows_round_trip_with_missing_values():
    hist = [{"step": 0, "reward/accuracy": 0.25, "mismatch/rho_asym": float("nan")},
            {"step": 1, "reward/accuracy": 0.123456789, "mismatch/rho_asym": 1.5}]
    col = cr.compact(hist)
    assert col["mismatch/rho_asym"] == [None, 1.5] and col["reward/accuracy"][1] == 0.123457
    back = rep.rows({"history": col})
    assert math.isnan(back[0]["mismatch/rho_asym"]) and back[1]["step"] == 1


def test_claims_share_runs_between_workers(tmp_path):
    part = str(tmp_path / "c" / "bf16_seed0.json")
    assert cr.claim(part)
    assert cr.claim(part)  # this process's own lock is taken again
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(part + ".lock", "w") as f:
            f.write(str(other.pid))
        assert not cr.claim(part)  # a live worker holds it
    finally:
        other.kill()
        other.wait()
    assert cr.claim(part)  # its process is gone: the stale lock is taken over
    with open(part + ".lock") as f:
        assert int(f.read()) == os.getpid()


def test_report_writes_its_table_json_and_figure(tmp_path):
    parts, out = str(tmp_path / "parts"), str(tmp_path / "out")
    os.makedirs(parts)
    with open(os.path.join(parts, "warmup_eval.json"), "w") as f:
        json.dump({"avg@8": 0.40}, f)
    for seed in (0, 1, 2):
        write(parts, record("lr1e-4", "bf16", seed, flat(60), 0.5))
        write(parts, record("lr1e-4", "nvfp4", seed, collapsing(20, 60) if seed == 0 else flat(60), 0.45))
    for cell in ("lr3e-4", "lr1e-3"):
        write(parts, record(cell, "bf16", 0, flat(60), 0.3))
    got = rep.write(parts, out, figures=out)
    assert got["chosen_cell"] == "lr1e-4" and got["bf16_vs_nvfp4"]["collapses"] == [0, 1]
    assert os.path.getsize(os.path.join(out, "collapse_rate.png")) > 10000
    md = open(os.path.join(out, "collapse_rate.md")).read()
    assert "Fisher's exact test" in md and "| nvfp4 | 0 | yes, step 20 |" in md
    assert json.load(open(os.path.join(out, "collapse_rate.json")))["runs"]["nvfp4"][0]["onset"] == 20
