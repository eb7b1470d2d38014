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
    assert "| MXFP4 / MXFP4 | - | 0.01 +- 0.001 |" in table and "NVFP4 / NVFP4" not in table
