"""experiments/mismatch_matrix.py: the MXFP4 rows and --settings (a subset of the rows) without measuring."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import mismatch_matrix as mm  # noqa: E402
from triage_jax.quant import PRESETS  # noqa: E402


def test_mxfp4_rows_use_registered_presets():
    rows = {s.label: s for s in mm.SETTINGS}
    assert (rows["MXFP4 / MXFP4"].learner, rows["MXFP4 / MXFP4"].sampler) == ("w4a4_mx", "w4a4_mx")
    assert rows["W4A16 (MXFP4 weights)"].sampler == "w4a16_mx" and rows["W4A4 (MXFP4 act.)"].sampler == "w4a4_mx"
    for s in mm.SETTINGS:
        assert s.learner in PRESETS and s.sampler in PRESETS, s.label
    assert len(mm.LABELS) == len(set(mm.LABELS))


def test_settings_subset_and_table():
    args = mm.parse_args(["--settings", "MXFP4 / MXFP4, BF16 / BF16"])
    assert args.settings == ["BF16 / BF16", "MXFP4 / MXFP4"]  # table order, plain labels (the args go to the JSON)
    assert mm.parse_args([]).settings == list(mm.LABELS)
    with pytest.raises(SystemExit):
        mm.parse_args(["--settings", "FP3 / FP3"])
    metrics = {"mean_abs_delta": 0.01, "se_abs_delta": 0.001}
    report = {"results": {"float32": {"tiny": {"BF16 / BF16": metrics, "MXFP4 / MXFP4": metrics}}}}
    table = mm.table(report)
    measures = next(x.measures for x in mm.SETTINGS if x.label == "MXFP4 / MXFP4")
    assert f"| MXFP4 / MXFP4 | {measures} | - | 0.01 +- 0.001 |" in table and "NVFP4 / NVFP4" not in table
    assert all(x.measures for x in mm.SETTINGS)  # every row says what it measures


def test_decomposition_rows_and_table():
    from triage_jax import probe

    with pytest.raises(SystemExit):
        mm.parse_args(["--decompose", "bf16"])  # nothing to take apart
    assert mm.parse_args([]).decompose == "w4a4" and mm.parse_args(["--decompose", ""]).decompose == ""
    steps = [st.name for st in probe.decomposition("w4a4")]
    rows = [{"step": n, "mean_abs_delta": 0.0 if i == 0 else 0.01 * i, "max_abs_delta": 0.0 if i == 0 else 0.1,
             "routing_flip_frac": None} for i, n in enumerate(steps)]
    moe = [dict(r, routing_flip_frac=0.05) for r in rows]
    report = {"args": {"decompose": "w4a4"}, "decomposition": {"float32": {"tiny": rows, "tiny_moe": moe}}}
    table = mm.decomposition_table(report).splitlines()
    assert table[0].count("|") == 4 and "tiny float32" in table[0] and "tiny_moe float32" in table[0]
    assert table[2] == f"| {steps[0]} | 0 (max 0) | 0 (max 0), flips 5.0% |"
    assert table[3] == f"| {steps[1]} | 0.01 | 0.01, flips 5.0% |" and len(table) == 2 + len(steps)
    assert mm.decomposition_table({"decomposition": {}}) == ""
