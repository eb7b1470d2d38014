"""The experiment scripts: their imports (library only), helpers, the ordering checks of the mismatch matrix, and
--quick runs of both studies."""

import ast
import contextlib
import dataclasses
import glob
import io
import json
import math
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments import common, mismatch_matrix, organism, organism_staleness, organism_sweep, stability  # noqa: E402

# Settings that make a run take seconds: a 4-step warm-up cached under tmp_path, 2 prompts x 4 responses.
TINY_SET = ["warmup.steps=4", "warmup.batch_size=8", "rl.dynamic_sampling=False", "sampler.max_new_tokens=12"]


# ------------------------------------------------------------------------------------------------ layering

def _experiment_sources():
    """(name, Python source) of every study script, notebook generator and notebook code cell in experiments/."""
    import nbformat

    for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py"))
                       + glob.glob(os.path.join(ROOT, "experiments", "notebooks", "*.py"))):
        with open(path) as f:
            yield os.path.relpath(path, ROOT), f.read()
    for path in sorted(glob.glob(os.path.join(ROOT, "experiments", "notebooks", "*.ipynb"))):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            # IPython magics and shell escapes are not Python: blank them out.
            lines = ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in cell.source.splitlines()]
            yield f"{os.path.relpath(path, ROOT)} code cell {i}", "\n".join(lines)


def forbidden_imports(source: str) -> list[str]:
    """The imports of `source` the experiments may not make: anything under triage_jax.tools (CLIs), and anything
    of triage_jax.trainer but its library loop, Trainer."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "triage_jax.tools" or a.name.startswith(("triage_jax.tools.", "triage_jax.trainer")):
                    bad.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            if node.module == "triage_jax.tools" or node.module.startswith("triage_jax.tools."):
                bad.append(f"from {node.module} import {', '.join(names)}")
            elif node.module == "triage_jax" and "tools" in names:
                bad.append("from triage_jax import tools")
            elif node.module == "triage_jax.trainer" and set(names) - {"Trainer"}:
                bad.append(f"from triage_jax.trainer import {', '.join(names)}")
    return bad


def test_forbidden_imports_are_detected():
    src = ("from triage_jax.tools.mismatch import diagnostics\nimport triage_jax.tools.eval\n"
           "from triage_jax import tools, probe\nfrom triage_jax.trainer import Trainer, load_policy\n"
           "def f():\n    from triage_jax.tools import eval\n")
    assert len(forbidden_imports(src)) == 5
    ok = "from triage_jax import build, probe\nfrom triage_jax.trainer import Trainer\nfrom . import tools\n"
    assert forbidden_imports(ok) == []


def test_experiments_import_only_library_modules():
    """The studies and notebooks build on triage_jax's library modules, never on the CLIs in triage_jax.tools nor
    the trainer's internals (project rule: one owner for each concept, tools/ holds CLIs only)."""
    sources = list(_experiment_sources())
    names = {n for n, _ in sources}
    assert {"experiments/common.py", "experiments/stability.py", "experiments/mismatch_matrix.py",
            "experiments/notebooks/make_notebooks.py"} <= names
    assert any(n.startswith("experiments/notebooks/run_diagnostics.ipynb") for n in names)
    bad = {name: b for name, src in sources if (b := forbidden_imports(src))}
    assert not bad, f"experiments import CLI or trainer internals: {bad}"


# ------------------------------------------------------------------------------------------------ helpers

def test_set_values_rejects_unknown_keys():
    c = common.load_config("tiny")
    common.set_values(c, {"rl.triage.lambda_rep": 0.0, "seed": 3})
    assert c.rl.triage.lambda_rep == 0.0 and c.seed == 3
    with pytest.raises(KeyError, match="rl.triage.lambda_rpe"):
        common.set_values(c, {"rl.triage.lambda_rpe": 0.0})
    with pytest.raises(FileNotFoundError, match="nope"):
        common.load_config("nope")


def test_read_scalars_roundtrip_and_truncated_tail(tmp_path):
    from tensorboardX import SummaryWriter

    w = SummaryWriter(str(tmp_path / "tb"))
    for step in range(1, 4):
        w.add_scalar("a/x", step * 0.5, step)
        w.add_scalar("b", -step, step)
    w.add_histogram("h", np.arange(5.0), 1)
    w.close()
    w = SummaryWriter(str(tmp_path / "tb"), filename_suffix=".resumed")  # a resumed run rewrites step 3
    w.add_scalar("a/x", 9.0, 3)
    w.close()
    s = common.read_scalars(str(tmp_path / "tb"))
    assert set(s) == {"a/x", "b"}
    np.testing.assert_array_equal(s["a/x"][0], [1, 2, 3])
    np.testing.assert_allclose(s["a/x"][1], [0.5, 1.0, 9.0])
    # A record cut short by a crash is skipped, the rest still reads.
    f = sorted((tmp_path / "tb").iterdir())[-1]
    with open(f, "ab") as fh:
        fh.write(struct.pack("<Q", 100) + b"\0" * 10)
    assert common.read_scalars(str(tmp_path / "tb"))["a/x"][1][-1] == 9.0
    with pytest.raises(FileNotFoundError):
        common.read_scalars(str(tmp_path / "empty"))


def test_write_json_nan_and_config_roundtrip(tmp_path):
    common.write_json(str(tmp_path / "x.json"), {"a": math.nan, "b": [np.float32(1.5), math.inf], "c": 2})
    assert json.load(open(tmp_path / "x.json")) == {"a": None, "b": [1.5, None], "c": 2}
    c = common.load_config("tiny_moe")
    c.rl.triage.segment_len = 8
    (tmp_path / "config.json").write_text(c.to_json())
    back = common.config_from_json(str(tmp_path / "config.json"))
    assert back.to_dict() == c.to_dict()
    assert isinstance(back.data.levels, tuple)
    saved = json.loads(c.to_json())
    saved["train"]["retired_key"] = 1  # a run written by an older schema still loads
    (tmp_path / "old.json").write_text(json.dumps(saved))
    with pytest.warns(UserWarning, match="train.retired_key"):
        assert common.config_from_json(str(tmp_path / "old.json")).rl.triage.segment_len == 8


def test_markdown_table():
    t = common.markdown_table(["a", "b"], [["x", 0.123456], ["y", math.nan]], digits=3)
    assert t.splitlines() == ["| a | b |", "|---|---|", "| x | 0.123 |", "| y | - |"]


def test_rolling_mean_is_trailing_and_skips_nans():
    x = np.array([[1.0, 2.0, np.nan, 4.0, 6.0], [np.nan, np.nan, 3.0, 5.0, 7.0]])
    np.testing.assert_array_equal(common.rolling_mean(x, 1), x)
    np.testing.assert_allclose(common.rolling_mean(x, 2), [[1, 1.5, 2, 4, 5], [np.nan, np.nan, 3, 4, 6]])
    # A window longer than the run averages everything seen so far.
    np.testing.assert_allclose(common.rolling_mean(x, 9)[0], [1, 1.5, 1.5, 7 / 3, 13 / 4])


# ------------------------------------------------------------------------------------------------ mismatch matrix

def test_orderings_are_computed_from_the_numbers():
    paper = mismatch_matrix.PAPER
    # On the paper's own numbers every claim it makes about itself is checked, some hold and some do not.
    ours = {m: {k: v[m] for k, v in paper.items() if m in v} for m in ("tiny", "tiny_moe")}
    rows = mismatch_matrix.check_orderings(ours)
    assert all(p == h for _, _, p, h in rows)
    verdict = {(n, m): p for n, m, p, _ in rows}
    assert verdict[("weights-only < MXFP8 act. < NVFP4 act.", "tiny")]
    assert not verdict[("matched NVFP4 < NVFP4 learner / BF16 sampler", "tiny_moe")]  # 0.0668 > 0.0621
    assert verdict[("W4A4 sampler: MoE < dense", "both")]
    # Reversing one measured pair flips exactly the claims that involve it.
    flipped = {m: dict(v) for m, v in ours.items()}
    flipped["tiny"]["W4A16"], flipped["tiny"]["W4A4 (NVFP4 act.)"] = 0.2, 0.001
    changed = {(n, m) for n, m, p, h in mismatch_matrix.check_orderings(flipped) if p != h}
    assert ("weights-only < MXFP8 act. < NVFP4 act.", "tiny") in changed
    assert ("matched BF16 has the smallest mismatch", "tiny") in changed  # 0.001 < BF16/BF16 now
    assert all(m == "tiny" or n == "W4A4 sampler: MoE < dense" for n, m in changed)
    # A missing row leaves the claim undecided for us, not false.
    partial = {"tiny": {"W4A16": 0.01}}
    rows = mismatch_matrix.check_orderings(partial)
    assert all(h is None for n, m, p, h in rows if n.startswith("weights-only"))


def test_standard_error_and_margin():
    # Two responses of 2 tokens: per-response means 1 and 3, equal weights: SE = std([1,3], ddof=1) / sqrt(2) = 1.
    delta = np.array([[1.0, -1.0], [3.0, 3.0]])
    mask = np.ones((2, 2), bool)
    assert mismatch_matrix.standard_error(delta, mask) == pytest.approx(1.0)
    assert math.isnan(mismatch_matrix.standard_error(delta[:1], mask[:1]))  # one response: undefined
    vals, se = {"a": 1.0, "b": 2.0, "c": 4.0}, {"a": 0.3, "b": 0.4, "c": 0.0}
    assert mismatch_matrix.claim_margin("chain", ("a", "b", "c"), vals, se) == pytest.approx(2.0)  # 1 / 0.5
    assert mismatch_matrix.claim_margin("min", "a", vals, se) == pytest.approx(2.0)
    assert mismatch_matrix.claim_margin("chain", ("a", "b"), vals, {"a": math.nan, "b": 0.1}) is None
    assert mismatch_matrix.claim_margin("chain", ("a", "x"), vals, se) is None


@pytest.mark.slow  # ~1 min of CPU (a 4-step warm-up, 5 sampler compilations); 5 min on a busy 2-core CPU
def test_mismatch_matrix_end_to_end(tmp_path):
    """Real measurement on a 4-step warm-up: every setting measured, quantized samplers disagree more than BF16."""
    out = tmp_path / "out"
    fig = tmp_path / "fig" / "mm.png"
    argv = ["--models", "tiny", "--dtypes", "float32", "--num_prompts", "3", "--group_size", "2", "--out", str(out),
            "--figure", str(fig), "--compile_cache", ""]
    for s in TINY_SET[:2] + [f"warmup.cache_dir={tmp_path / 'warm'}"]:
        argv += ["--set", s]
    assert mismatch_matrix.main(argv) == 0
    rep = json.load(open(out / "mismatch_matrix.json"))
    res = rep["results"]["float32"]["tiny"]
    assert set(res) == {s.label for s in mismatch_matrix.SETTINGS}
    d = {k: v["mean_abs_delta"] for k, v in res.items()}
    assert d["BF16 / BF16"] < 1e-4  # float32 both ways: only reduction-order noise
    for k in ("NVFP4 / NVFP4", "BF16 / NVFP4", "W4A4 (NVFP4 act.)", "KV FP8 (W4A4 sampler)"):
        assert d[k] > 10 * d["BF16 / BF16"], k
    assert d["W4A4 (NVFP4 act.)"] == d["BF16 / NVFP4"]  # the same pair of precisions, sampled once
    md = (out / "mismatch_matrix.md").read_text()
    bf16_row = next(line for line in md.splitlines() if line.startswith("| BF16 / BF16 |"))
    assert "| 0.0110 |" in bf16_row and "paper's ordering" in md  # the paper's value beside ours
    assert fig.stat().st_size > 1000
    assert len(os.listdir(tmp_path / "warm")) == 1  # the override reached the config


# ------------------------------------------------------------------------------------------------ stability

def test_stability_args():
    a = stability.parse_args(["--quick"])
    assert a.steps == stability.QUICK["steps"] and a.seeds == [0, 1, 2] and a.branch_step == 2
    # The smoke run keeps out of the default study's run folders (which --replot reads).
    assert a.out_dir == os.path.join(ROOT, "runs", "stability_quick")
    assert stability.parse_args([]).out_dir == os.path.join(ROOT, "runs", "stability")
    a = stability.parse_args(["--arms", "bf16,nvfp4", "--set", "optim.lr=3e-4", "--set", "tokenizer=char"])
    assert a.overrides == {"optim.lr": 3e-4, "tokenizer": "char"} and a.steps == stability.DEFAULTS["steps"]
    for bad in (["--arms", "tis_from_branch"], ["--arms", "bogus"], ["--steps", "4", "--branch_step", "4"],
                ["--eval_n", "2", "--ks", "1,4"], ["--set", "novalue"], ["--smooth", "0"]):
        with pytest.raises(SystemExit):
            stability.parse_args(bad)


def test_extend_accepts_only_a_shorter_run_of_the_same_settings(tmp_path):
    """--extend checks every source run before any training: present, the same settings but for the length, fewer
    steps, its last checkpoint on disk; each refusal names the problem."""
    short = stability.parse_args(["--quick", "--arms", "bf16", "--seeds", "0", "--out_dir", str(tmp_path / "a")])
    src = tmp_path / "a" / "bf16" / "seed0"
    argv = ["--quick", "--arms", "bf16", "--seeds", "0", "--steps", "6", "--out_dir", str(tmp_path / "b"),
            "--extend", str(tmp_path / "a")]

    def refusal(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            stability.parse_args(argv)
        return err.getvalue()

    def write(c):
        os.makedirs(src, exist_ok=True)
        (src / "config.json").write_text(c.to_json())

    assert "config.json does not exist" in refusal(argv)
    c = stability.arm_config(short, "bf16", 0)
    c.optim.lr = 1e-3
    write(c)
    assert "optim.lr 0.001" in refusal(argv)
    write(stability.arm_config(short, "bf16", 0))  # the quick preset's 4 steps
    assert "no step-4 checkpoint" in refusal(argv)
    os.makedirs(src / "checkpoints" / "4")
    assert "does not extend it" in refusal(argv[:6] + ["4"] + argv[7:])
    assert stability.extension_source(stability.parse_args(argv), "bf16", 0) == (str(src), 4)
    # A branch is extended alone, from its own run, at the extended study's branch point (given, and checked).
    branch = tmp_path / "a" / "tis_from_branch" / "seed0"
    os.makedirs(branch / "checkpoints" / "4")
    (branch / "config.json").write_text(stability.arm_config(short, "tis_from_branch", 0).to_json())
    bargv = argv[:2] + ["tis_from_branch"] + argv[3:]
    assert "--branch_step" in refusal(bargv)  # the default (steps/2 = 3) is not where it branched
    assert "did not branch at --branch_step 2" in refusal(bargv + ["--branch_step", "2"])
    os.makedirs(branch / "checkpoints" / "2")
    assert stability.extension_source(stability.parse_args(bargv + ["--branch_step", "2"]), "tis_from_branch",
                                      0) == (str(branch), 4)


@pytest.mark.slow  # three tiny runs of 2-3 steps
def test_an_extended_run_is_the_longer_run(tmp_path):
    """A 2-step run continued to 3 steps with --extend gives the 3-step run's numbers exactly: every step's
    metrics and the final eval."""
    base = ["--quick", "--arms", "nvfp4", "--seeds", "0", "--num_prompts", "2", "--group_size", "4",
            "--eval_problems", "2", "--eval_n", "2", "--ks", "1,2", "--eval_reward", "dapo"]
    for s in TINY_SET + [f"warmup.cache_dir={tmp_path / 'warm'}"]:
        base += ["--set", s]
    runs = {}
    for name, extra in (("short", ["--steps", "2"]), ("fresh", ["--steps", "3"]),
                        ("extended", ["--steps", "3", "--extend", str(tmp_path / "short")])):
        args = stability.parse_args(base + extra + ["--out_dir", str(tmp_path / name)])
        runs[name] = stability.run_one(args, "nvfp4", 0, log=lambda msg: None)
    ext, fresh = runs["extended"], runs["fresh"]
    assert ext["extended"] == {"run_dir": str(tmp_path / "short" / "nvfp4" / "seed0"), "steps": 2}
    assert fresh["extended"] is None
    def differ(h1, h2):  # (step, key) where two histories differ (NaN equals NaN; wall times are not numbers)
        assert len(h1) == len(h2)
        return [(i, k) for i, (a, b) in enumerate(zip(h1, h2)) for k in sorted(set(a) | set(b))
                if not k.startswith("time/") and not (a.get(k) == b.get(k) or (math.isnan(a.get(k, 0.0))
                                                                               and math.isnan(b.get(k, 0.0))))]

    assert len(ext["history"]) == 3 and differ(ext["history"], fresh["history"]) == []
    assert differ(ext["history"][:2], runs["short"]["history"]) == []
    assert ext["eval"] == fresh["eval"]

    # The branch arm: a 3-step branch (leaving nvfp4 at step 1) equals the 2-step one's run extended alone.
    branch = {}
    for name, extra in (("bshort", ["--steps", "2"]), ("bfresh", ["--steps", "3"])):
        args = stability.parse_args(base[:2] + ["nvfp4,tis_from_branch"] + base[3:] + extra
                                    + ["--branch_step", "1", "--out_dir", str(tmp_path / name)])
        stability.run_one(args, "nvfp4", 0, log=lambda msg: None)
        branch[name] = stability.run_one(args, "tis_from_branch", 0, log=lambda msg: None)
    args = stability.parse_args(base[:2] + ["tis_from_branch"] + base[3:] + [
        "--steps", "3", "--branch_step", "1", "--out_dir", str(tmp_path / "bext"), "--extend", str(tmp_path / "bshort")])
    bext = stability.run_one(args, "tis_from_branch", 0, log=lambda msg: None)
    assert bext["extended"]["steps"] == 2 and len(bext["history"]) == 3
    assert differ(bext["history"], branch["bfresh"]["history"]) == [] and bext["eval"] == branch["bfresh"]["eval"]


def test_arm_configs_differ_only_where_they_should(tmp_path):
    a = stability.parse_args(["--quick", "--out_dir", str(tmp_path)])
    cfgs = {arm: stability.arm_config(a, arm, 1) for arm in stability.ARMS}
    assert cfgs["bf16"].sampler.precision == "bf16" and cfgs["nvfp4"].sampler.precision == "w4a4"
    assert cfgs["nvfp4_tis"].rl.correction == "token_tis" and cfgs["nvfp4_tis"].rl.token_tis.C == 2.0
    assert cfgs["triage_no_repair"].rl.triage.lambda_rep == 0.0 and cfgs["nvfp4_triage"].rl.triage.lambda_rep > 0
    assert len({c.run_dir for c in cfgs.values()}) == len(cfgs)
    assert cfgs["opsm"].rl.correction == "opsm" and cfgs["opsm"].sampler.precision == "w4a4"
    ex = cfgs.pop("exact")  # the control: quantized on both sides, exact mode
    assert ex.learner.exact and ex.learner.precision == ex.sampler.precision == "w4a4"
    for c in cfgs.values():
        assert c.seed == 1 and c.learner.precision == "bf16" and not c.learner.exact
        assert c.rl.triage.segment_len == 8  # configs/tiny.py's own; the study no longer forces one
        assert c.rl.num_prompts * c.rl.group_size == c.rl.mini_batch
    # --fp4 swaps the format of every quantized arm and of nothing else.
    mx = stability.parse_args(["--quick", "--out_dir", str(tmp_path), "--fp4", "w4a4_mx"])
    assert stability.arm_config(mx, "nvfp4_triage", 0).sampler.precision == "w4a4_mx"
    ex = stability.arm_config(mx, "exact", 0)
    assert ex.learner.precision == ex.sampler.precision == "w4a4_mx"
    assert stability.arm_config(mx, "bf16", 0).sampler.precision == "bf16"
    with pytest.raises(SystemExit):
        stability.parse_args(["--fp4", "w3a3"])


def test_outcome_applies_the_collapse_rule_and_the_monitor():
    """A run whose accuracy halves for 20 steps after step 15 collapses there; rho_asym climbing from 1.0 raises
    the level-1 alarm before it; the final window averages the last steps only."""
    hist = []
    for i in range(1, 41):
        acc = 0.6 if i < 15 else 0.1
        # The monitor reads rho_asym over its null by default (docs/rl_math.md#nulls): both climb here.
        hist.append({"step": i, "reward/accuracy": acc, "mismatch/rho_asym": 1.0 + 0.1 * i,
                     "mismatch/rho_asym_excess": 1.0 + 0.1 * i, "mismatch/tail_persistence": 1.0,
                     "mismatch/delta_q05": -0.05, "reward/mean": 2 * acc - 1})
    out = stability.outcome(hist, {}, final_steps=4)
    assert out["collapsed"] and out["collapse_step"] == 15
    assert out["first_alarm_step"] is not None and out["first_alarm_step"] < 15
    assert out["first_alarms"]["level1"]["rho_asym"] == out["first_alarm_step"]
    assert out["first_alarms"]["level1"]["tail_persistence"] is None
    assert out["final"]["reward/accuracy"] == pytest.approx(0.1)
    assert out["final"]["mismatch/rho_asym"] == pytest.approx(1.0 + 0.1 * 38.5)
    assert out["final"]["mismatch/hidden_by_mean"] is None  # never logged: no number invented
    calm = [{**r, "reward/accuracy": 0.6, "mismatch/rho_asym": 0.8, "mismatch/rho_asym_excess": 0.8} for r in hist]
    out = stability.outcome(calm, {}, final_steps=4)
    assert not out["collapsed"] and out["collapse_step"] is None and out["first_alarm_step"] is None


def test_drift_table_compares_first_and_last_window():
    args = stability.parse_args(["--steps", "16", "--arms", "bf16"])  # final window: 16 // 8 = 2 steps
    hist = lambda vals: [{"reward/mean": v, "mismatch/tail_persistence": math.nan} for v in vals]  # noqa: E731
    study = {"runs": {"bf16": {0: {"history": hist([0.0, 1.0] + [5.0] * 12 + [2.0, 4.0])},
                               1: {"history": hist([2.0, 3.0] + [5.0] * 12 + [6.0, 8.0])}}}}
    (row,) = stability.drift_rows(study, args)
    assert row[0] == "bf16" and row[1] == "1.500 -> 5.000"
    assert row[-1] == "- -> -"  # never defined: no number invented


@pytest.mark.slow  # 242 s on 2 busy cores (pytest -n 2)
def test_stability_quick_writes_every_output(tmp_path):
    """--quick with tiny settings: runs every arm (the branch from the nvfp4 checkpoint), table, figure, logs."""
    warm = tmp_path / "warm"
    sets = TINY_SET + [f"warmup.cache_dir={warm}"]
    argv = ["--quick", "--seeds", "0,1", "--steps", "3", "--num_prompts", "2", "--group_size", "4",
            "--eval_problems", "2", "--eval_n", "2", "--ks", "1,2", "--eval_reward", "dapo",
            "--out_dir", str(tmp_path / "runs"), "--results", str(tmp_path / "res"),
            "--figures", str(tmp_path / "fig"), "--compile_cache", str(tmp_path / "jax_cache")]
    for s in sets:
        argv += ["--set", s]
    assert stability.main(argv) == 0
    results, drift = (tmp_path / "res" / "stability_quick.md").read_text().split("First -> last")
    order = [a for a in stability.ARMS if a not in stability.BRANCH_PARENT] + list(stability.BRANCH_PARENT)
    for table in (results, drift):
        rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| arm")]
        assert [r.split("|")[1].strip() for r in rows] == order
    rows = [ln for ln in results.splitlines() if ln.startswith("| ") and not ln.startswith("| arm")]
    assert all(r.split("|")[2].strip() == "2" for r in rows)
    assert (tmp_path / "fig" / "stability_quick.png").stat().st_size > 1000
    summary = json.load(open(tmp_path / "res" / "stability_quick.json"))
    for arm in stability.ARMS:
        for seed in ("0", "1"):
            r = summary["runs"][arm][seed]
            assert 0.0 <= r["eval"]["avg@2"] <= 1.0
            hist = common.read_history(r["run_dir"])
            assert len(hist) == 3 and os.path.exists(os.path.join(r["run_dir"], "tb"))
    # The branch shares the nvfp4 run's first step(s) exactly and then differs in its correction.
    for seed in ("0", "1"):
        parent = common.read_history(summary["runs"]["nvfp4"][seed]["run_dir"])
        child = common.read_history(summary["runs"]["tis_from_branch"][seed]["run_dir"])
        b = summary["args"]["branch_step"]
        keys = [k for k in parent[0] if not k.startswith("time/")]
        assert [{k: p[k] for k in keys} for p in parent[:b]] == [{k: q[k] for k in keys} for q in child[:b]]
        cfg = {a: common.config_from_json(os.path.join(summary["runs"][a][seed]["run_dir"], "config.json"))
               for a in ("nvfp4", "tis_from_branch")}
        assert cfg["nvfp4"].rl.correction == "none" and cfg["tis_from_branch"].rl.correction == "token_tis"
    # Seeds share the warm-up: one trained cache, the other a link to it.
    entries = sorted(os.listdir(warm))
    assert len(entries) == 2 and sum(os.path.islink(warm / e) for e in entries) == 1


def test_scripts_have_a_cli_help():
    for script in ("mismatch_matrix.py", "stability.py", "organism_sweep.py", "organism.py", "organism_staleness.py"):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), "--help"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr


def test_compile_cache_is_scoped_to_its_block(tmp_path):
    """A study run in-process caches its programs, and compilations after it no longer write there (the test
    suite's later tests once all wrote to a study's cache folder, and one of those writes crashed the process)."""
    import jax
    import jax.numpy as jnp

    before = jax.config.jax_compilation_cache_dir
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # so a leaked cache would take any program
    try:
        with common.compile_cache(str(tmp_path / "cache")):
            jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(jnp.arange(7.0)).block_until_ready()
            inside = set(os.listdir(tmp_path / "cache"))
        assert inside, "nothing was cached inside the block"
        jax.jit(lambda x: jnp.cos(x) * 5.0 - 2.5)(jnp.arange(9.0)).block_until_ready()
        assert set(os.listdir(tmp_path / "cache")) == inside
        assert jax.config.jax_compilation_cache_dir == before
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


def test_organism_sweep_args():
    a = organism_sweep.parse_args(["--cells", "base,mxfp4", "--quick"])
    assert a.cells == ["base", "mxfp4"] and a.steps == organism_sweep.QUICK["steps"]
    s = organism_sweep.study_args(a, "mxfp4")
    assert s.fp4 == "w4a4_mx" and s.arms == ["bf16", "nvfp4"] and s.out_dir.endswith(os.path.join("mxfp4"))
    s = organism_sweep.study_args(organism_sweep.parse_args(["--cells", "updates4"]), "updates4")
    assert s.overrides == {"rl.mini_batch": 8, "rl.micro_batch": 8}
    c = stability.arm_config(s, "nvfp4", 0)
    assert c.rl.mini_batch == 8 and c.rl.num_prompts * c.rl.group_size == 32  # 4 updates per rollout batch
    # A quantized-arms-only lever leaves the BF16 reference alone; the exact control takes it on both sides.
    s = organism_sweep.study_args(organism_sweep.parse_args(["--cells", "lm_head_fp4", "--arms", "bf16,nvfp4,exact"]),
                                  "lm_head_fp4")
    cfg = {arm: stability.arm_config(s, arm, 0) for arm in ("bf16", "nvfp4", "exact")}
    assert cfg["nvfp4"].sampler.rules == ("lm_head$=w4a4",) and cfg["nvfp4"].learner.rules == ()
    assert cfg["bf16"].sampler.rules == () and cfg["exact"].learner.rules == cfg["exact"].sampler.rules != ()
    s = organism_sweep.study_args(organism_sweep.parse_args(["--cells", "act_tensor_lr5e-5"]), "act_tensor_lr5e-5")
    cfg = {arm: stability.arm_config(s, arm, 0) for arm in ("bf16", "nvfp4")}
    assert cfg["nvfp4"].sampler.act_scaling == "tensor" and cfg["bf16"].sampler.act_scaling == "row"
    assert cfg["nvfp4"].optim.lr == cfg["bf16"].optim.lr == 5e-5
    c = stability.arm_config(organism_sweep.study_args(organism_sweep.parse_args(["--cells", "len256_lr5e-5"]),
                                                       "len256_lr5e-5"), "nvfp4", 0)
    assert c.sampler.max_new_tokens == 256
    for bad in (["--cells", "nope"], ["--cells", ""], ["--arms", "bogus"], ["--set", "novalue"]):
        with pytest.raises(SystemExit):
            organism_sweep.parse_args(bad)


def _fake_sweep_record(seed: int, acc: float) -> dict:
    drift = {key: [acc, acc / 2] for key, _, _ in organism_sweep.WATCHED}
    drift["mismatch/tail_persistence"] = [None, acc]  # a window where it was never finite: JSON null
    return {"collapsed": seed == 2, "collapse_step": 21 if seed == 2 else None, "first_alarm_step": 5 + seed,
            "final": {}, "eval": {"avg@4": acc}, "train_s": 1.0, "run_dir": "gone", "drift": drift}


def test_organism_sweep_merge_joins_sweeps_and_a_studys_arms(tmp_path):
    """Side-by-side sweep processes and the study end in one table: a sweep report's cells join, a study report's
    runs count for its regime's cell (only the sweep's arms), the first report to name a (cell, arm) wins, and a
    report of other steps is a parser error naming --merge."""
    seeds = {str(s): _fake_sweep_record(s, 0.25) for s in range(3)}
    sweep = {"args": {"steps": 40}, "total_s": 600.0,
             "cells": {"mxfp4_lr5e-5": {**dataclasses.asdict(organism_sweep.CELLS["mxfp4_lr5e-5"]), "window": 5,
                                        "arms": {"nvfp4": seeds}},
                       "lr5e-5": {**dataclasses.asdict(organism_sweep.CELLS["lr5e-5"]), "window": 5,
                                  "arms": {"nvfp4": {str(s): _fake_sweep_record(s, 0.75) for s in range(3)}}}}}
    study = {"args": {"steps": 40}, "total_s": 3000.0, "final_window": 5, "warmup_eval": {"avg@4": 0.7},
             "regime": {"cell": "lr5e-5"},
             "arms": {arm: {str(s): _fake_sweep_record(s, 0.5) for s in range(3)}
                      for arm in ("bf16", "nvfp4", "nvfp4_tis")}}
    paths = []
    for name, rep in (("a.json", sweep), ("study.json", study)):
        paths.append(str(tmp_path / name))
        common.write_json(paths[-1], rep)
    res = tmp_path / "res"
    assert organism_sweep.main(["--replot", "--steps", "40", "--results", str(res), "--out_dir",
                                str(tmp_path / "runs"), "--tag", "m", "--merge", *paths]) == 0
    with open(res / "m.json") as f:
        cells = json.load(f)["cells"]
    assert list(cells["lr5e-5"]["arms"]) == ["bf16", "nvfp4"]  # the study's TIS arm is not a sweep arm
    assert cells["lr5e-5"]["arms"]["nvfp4"]["0"]["eval"]["avg@4"] == 0.75  # the first report named it
    assert cells["lr5e-5"]["arms"]["bf16"]["0"]["eval"]["avg@4"] == 0.5
    assert list(cells["mxfp4_lr5e-5"]["arms"]) == ["nvfp4"]
    md = (res / "m.md").read_text()
    assert "Joins `a.json` (10.0 min)" in md and "Joins `study.json` (50.0 min)" in md
    assert "| lr5e-5 | bf16 | 1/3 (21) | 5, 6, 7 |" in md and "| mxfp4_lr5e-5 | nvfp4 | 1/3 (21) |" in md
    # Merging again over the merged report (no runs of its own: its wall time saved as null) redraws the same table.
    assert organism_sweep.main(["--replot", "--steps", "40", "--results", str(res), "--out_dir",
                                str(tmp_path / "runs"), "--tag", "m", "--merge", *paths]) == 0
    assert (res / "m.md").read_text() == md
    with pytest.raises(SystemExit):
        organism_sweep.parse_args(["--steps", "20", "--merge", paths[0]])
    with pytest.raises(SystemExit):
        organism_sweep.parse_args(["--steps", "40", "--merge", str(tmp_path / "missing.json")])


@pytest.mark.slow  # 97 s on 2 busy cores (pytest -n 2)
def test_organism_sweep_quick_writes_the_table(tmp_path):
    """Two cells of the NVFP4 arm on the tiny config: one record per (cell, arm, seed) with the rule's verdict,
    the table rows in order, and each cell's format reaching its runs."""
    argv = ["--quick", "--config", "tiny", "--cells", "base,mxfp4", "--arms", "nvfp4",
            "--results", str(tmp_path / "res"),
            "--out_dir", str(tmp_path / "runs"), "--compile_cache", ""]
    for s in TINY_SET + [f"warmup.cache_dir={tmp_path / 'warm'}"]:
        argv += ["--set", s]
    assert organism_sweep.main(argv) == 0
    rep = json.load(open(tmp_path / "res" / "organism_sweep_quick.json"))
    assert list(rep["cells"]) == ["base", "mxfp4"]
    for cell, rec in rep["cells"].items():
        assert set(rec["arms"]) == {"nvfp4"}
        for arm, per_seed in rec["arms"].items():
            r = per_seed["0"]
            assert r["collapsed"] in (True, False) and set(r["drift"]) >= {"reward/accuracy", "mismatch/rho_asym"}
            cfg = common.config_from_json(os.path.join(r["run_dir"], "config.json"))
            assert cfg.sampler.precision == {"base": "w4a4", "mxfp4": "w4a4_mx"}[cell]
            assert len(common.read_history(r["run_dir"])) == 3
    md = (tmp_path / "res" / "organism_sweep_quick.md").read_text()
    rows = [ln.split("|")[1:3] for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| cell")]
    assert [(c.strip(), a.strip()) for c, a in rows] == [("base", "nvfp4"), ("mxfp4", "nvfp4")]
    # --replot rebuilds the same records from the runs' history.json, keeping the saved evals.
    assert organism_sweep.main(argv + ["--replot"]) == 0
    again = json.load(open(tmp_path / "res" / "organism_sweep_quick.json"))
    for cell, rec in rep["cells"].items():
        for key in ("collapsed", "collapse_step", "first_alarm_step", "drift", "eval", "final"):
            assert again["cells"][cell]["arms"]["nvfp4"]["0"][key] == rec["arms"]["nvfp4"]["0"][key], key
    assert again["total_s"] == rep["total_s"]
    # ... and from the run folders alone (each run's eval.json), as when several processes share one out_dir.
    os.remove(tmp_path / "res" / "organism_sweep_quick.json")
    assert organism_sweep.main(argv + ["--replot"]) == 0
    alone = json.load(open(tmp_path / "res" / "organism_sweep_quick.json"))
    for cell, rec in rep["cells"].items():
        assert alone["cells"][cell]["arms"]["nvfp4"]["0"]["eval"] == rec["arms"]["nvfp4"]["0"]["eval"]


def test_foreign_cpu_counts_other_processes_not_our_children():
    """A section is judged by competing processes: a detached busy process is foreign, our own child is not."""
    from experiments.loadavg import ForeignCpu, machine_load

    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    meter = ForeignCpu()
    subprocess.run([sys.executable, "-c", spin], check=True)  # our child: its ticks are ours
    own_child = meter.take()
    # Detached (the shell exits at once, the spinner is re-parented): it competes with us like another user's job.
    subprocess.run(f"{sys.executable} -c '{spin}' >/dev/null 2>&1 &", shell=True, check=True)
    time.sleep(1.5)
    foreign = meter.take()
    if foreign is None:
        pytest.skip("no /proc/stat here")
    assert foreign >= 0.6, foreign  # the spinner kept ~1 core busy for the whole window
    assert own_child < foreign - 0.4, (own_child, foreign)
    load = machine_load()
    assert load.with_foreign(0.0).under_load is False
    assert load.with_foreign(load.cores * 0.3).under_load is True
    assert "other processes used 0.00 cores" in load.with_foreign(0.0).line()
    assert ForeignCpu.sample(0.2) is not None


# ------------------------------------------------------------------------------------------------ organism study

def test_organism_args_refuse_what_would_bias_the_study():
    a = organism.parse_args(["--quick"])
    assert a.steps == organism.QUICK["steps"] and a.k_rep == 1 and a.tag == "organism_quick"
    assert organism.parse_args(["--staleness", "2"]).tag == "organism_stale2"
    s = organism.stability_args(organism.parse_args(["--staleness", "1", "--k_rep", "7"]),
                                {"rl.triage.tau_tail": 0.05})
    assert s.overrides["rl.staleness"] == 1 and s.overrides["rl.triage.k_rep"] == 7
    assert s.overrides["rl.triage.tau_tail"] == 0.05 and s.overrides["optim.lr"] == 5e-5  # the cell's lr
    for bad in (["--seeds", "0,100"],  # the pilot's seed would be reported as a study seed
                ["--cell", "nope"], ["--jobs", "0"], ["--jobs", "999"], ["--staleness", "-1"],
                ["--thresholds", "/no/such/file.json"], ["--arms", "tis_from_branch"]):
        with pytest.raises(SystemExit):
            organism.parse_args(bad)


def test_organism_extend_checks_each_run_with_the_studys_thresholds(tmp_path):
    """organism --extend needs the extended study's thresholds and checks every run with them applied: a source
    run of another k_rep (the default follows --steps) is refused by name, the matching one accepted."""
    th = tmp_path / "th.json"
    th.write_text(json.dumps({"overrides": {"rl.triage.tau_tail": 0.05}}))
    common_argv = ["--quick", "--arms", "nvfp4_triage", "--thresholds", str(th)]
    short = organism.stability_args(organism.parse_args(common_argv + ["--out_dir", str(tmp_path / "a")]),
                                    {"rl.triage.tau_tail": 0.05})
    src = tmp_path / "a" / short.out_dir.split(os.sep)[-1] / "nvfp4_triage" / "seed0"
    os.makedirs(src / "checkpoints" / "3")
    (src / "config.json").write_text(stability.arm_config(short, "nvfp4_triage", 0).to_json())
    argv = common_argv + ["--steps", "8", "--out_dir", str(tmp_path / "b"), "--extend", str(tmp_path / "a")]

    def refusal(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            organism.parse_args(argv)
        return err.getvalue()

    assert "--thresholds" in refusal([x for x in argv if x not in ("--thresholds", str(th))])
    assert "rl.triage.k_rep 1 (now 2)" in refusal(argv)  # steps 8 -> k_rep 2
    args = organism.parse_args(argv + ["--k_rep", "1"])
    sargs = organism.stability_args(args, {"rl.triage.tau_tail": 0.05})
    assert sargs.extend.endswith(os.path.join("a", short.out_dir.split(os.sep)[-1]))
    assert stability.extension_source(sargs, "nvfp4_triage", 0) == (str(src), 3)


def test_organism_plan_balances_workers_and_keeps_branches_with_parents():
    arms = list(stability.ARMS)
    bins = organism.plan(arms, [0, 1, 2], 2)
    flat = [t for b in bins for t in b]
    assert sorted(flat) == sorted((a, s) for a in arms for s in (0, 1, 2))  # every run exactly once
    for b in bins:
        for i, (arm, seed) in enumerate(b):
            if arm in stability.BRANCH_PARENT:  # right after its parent, same seed, same worker
                assert b[i - 1] == (stability.BRANCH_PARENT[arm], seed)
        assert [s for _, s in b] == sorted(s for _, s in b)  # seed by seed: an interrupted study has whole seeds
    loads = [sum(organism.COST.get(a, 1.0) for a, _ in b) for b in bins]
    assert max(loads) - min(loads) <= 1.0  # within one run of each other
    one = ["bf16", "nvfp4", "tis_from_branch", "nvfp4_tis", "nvfp4_triage", "triage_no_repair", "opsm", "exact"]
    assert organism.plan(arms, [0], 1) == [[(a, 0) for a in one]]
    # A branch without its parent (an --extend of the branch's own runs) is planned on its own.
    assert sorted(t for b in organism.plan(["tis_from_branch"], [0, 1], 2) for t in b) == [
        ("tis_from_branch", 0), ("tis_from_branch", 1)]


def test_organism_lead_time_and_alarm_summary():
    def run(collapsed, onset, first, level2=None):
        return {"collapsed": collapsed, "collapse_step": onset, "first_alarm_step": first,
                "first_alarms": {"level1": {"any": first}, "level2": {"any": level2}}}

    assert organism.lead_time(run(True, 30, 12)) == 18 and organism.lead_time(run(True, 30, 35)) == -5
    assert organism.lead_time(run(True, 30, None)) is None and organism.lead_time(run(False, None, 4)) is None
    s = organism.alarm_summary({"bf16": {0: run(False, None, 5), 1: run(False, None, None)},
                                "exact": {0: run(False, None, None)},
                                "nvfp4": {0: run(True, 30, 12, 20), 1: run(False, None, 9)}})
    assert s["control_false_alarm_rate"] == pytest.approx(1 / 3)
    n = s["per_arm"]["nvfp4"]
    assert (n["collapsed"], n["alarmed_level1"], n["alarmed_level2"], n["lead_times"], n["false_alarms"],
            n["not_collapsed"]) == (1, 2, 1, [18], 1, 1)


def test_organism_combine_merges_parts_of_one_regime():
    """--combine: the runs of several invocations side by side and the alarm summary over all of them; a part of
    another regime (thresholds included), a run present twice or two branch points are refused by name."""
    def run(collapsed, first):
        return {"collapsed": collapsed, "collapse_step": 30 if collapsed else None, "first_alarm_step": first,
                "first_alarms": {"level1": {"any": first}, "level2": {"any": None}}}

    def part(arms, total_s=60.0, branch_step=50, tau=0.1):
        return {"args": {"config": "organism", "eval_problems": 32, "eval_n": 4, "overrides": [], "tag": "x",
                         "seeds": "?", "arms": "?"},
                "regime": {"cell": "small_lr5e-5", "steps": 100, "k_rep": 10, "staleness": 0,
                           "branch_step": branch_step},
                "thresholds": {"overrides": {"rl.triage.tau_tail": tau}}, "warmup_eval": {"avg@4": 0.5},
                "total_s": total_s, "arms": arms}

    a = part({"nvfp4": {"0": run(True, 7), "1": run(False, 9)}, "bf16": {"0": run(False, None)}})
    b = part({"nvfp4": {"3": run(True, 4)}, "tis_from_branch": {"3": run(False, 5)}}, total_s=30.0, branch_step=20)
    res = organism.combine({"a": a, "b": b}, "ab")
    assert list(res["arms"]) == ["bf16", "nvfp4", "tis_from_branch"]  # the study's arm order
    assert list(res["arms"]["nvfp4"]) == ["0", "1", "3"] and res["args"]["seeds"] == "0,1,3"
    assert res["args"]["tag"] == "ab" and res["total_s"] == 90.0
    assert res["regime"]["branch_step"] == 20  # the branch arm's own part says where it branched
    n = res["alarms"]["per_arm"]["nvfp4"]
    assert (n["runs"], n["collapsed"], n["lead_times"], n["false_alarms"]) == (3, 2, [23, 26], 1)
    with pytest.raises(ValueError, match="c ran another regime or thresholds than a"):
        organism.combine({"a": a, "c": part({"opsm": {"0": run(False, None)}}, tau=0.2)}, "ac")
    with pytest.raises(ValueError, match="nvfp4 seed 1 is in more than one"):
        organism.combine({"a": a, "d": part({"nvfp4": {"1": run(False, None)}})}, "ad")
    with pytest.raises(ValueError, match="different steps"):
        organism.combine({"b": b, "e": part({"tis_from_branch": {"4": run(False, None)}})}, "be")


def test_organism_replot_draws_the_record_not_the_command_line():
    """--replot / --combine redraw a study with the arms, seeds and branch point its record holds (here a branch arm
    extended alone, seeds 3-5), not the command line's defaults, and without checking the long-gone --extend source."""
    res = {"args": {"config": "organism", "arms": "tis_from_branch", "seeds": "3,4,5", "eval_problems": 16,
                    "eval_n": 2, "overrides": [], "out_dir": "runs/nowhere", "extend": "runs/also_nowhere"},
           "regime": {"cell": "small_lr5e-5", "steps": 100, "k_rep": 10, "staleness": 0, "branch_step": 20},
           "thresholds": {"overrides": {"rl.triage.tau_tail": 0.125}}}
    sargs = organism.record_args(organism.parse_args(["--replot", "--tag", "organism_small_s345"]), res)
    assert (sargs.arms, sargs.seeds, sargs.steps, sargs.branch_step) == (["tis_from_branch"], [3, 4, 5], 100, 20)
    assert (sargs.eval_problems, sargs.eval_n) == (16, 2)
    assert sargs.overrides["rl.triage.tau_tail"] == 0.125 and sargs.overrides["optim.lr"] == 5e-5


@pytest.mark.slow  # 170 s on 2 busy cores (pytest -n 2)
def test_organism_quick_two_workers_writes_the_results(tmp_path):
    """Pilot -> thresholds file -> two pinned workers -> organism.json / .md / figure, the thresholds reaching the
    TRIAGE run and --replot redrawing the same table."""
    jobs = min(2, len(os.sched_getaffinity(0)))
    argv = ["--quick", "--config", "tiny", "--arms", "nvfp4,tis_from_branch,nvfp4_triage", "--jobs", str(jobs),
            "--results", str(tmp_path / "res"), "--figures", str(tmp_path / "fig"),
            "--out_dir", str(tmp_path / "runs"), "--compile_cache", ""]
    for s in TINY_SET + [f"warmup.cache_dir={tmp_path / 'warm'}"]:
        argv += ["--set", s]
    assert organism.main(argv) == 0
    th = json.load(open(tmp_path / "res" / "organism_quick_thresholds.json"))
    assert th["pilot"]["seed"] == 100 and th["pilot"]["tokens"] > 0
    assert set(th["proposed"]) == {"tau_tail", "f_lo", "f_hi", "g_lo", "g_hi"}
    res = json.load(open(tmp_path / "res" / "organism_quick.json"))
    assert res["thresholds"]["proposed"] == th["proposed"]
    assert set(res["arms"]) == {"nvfp4", "tis_from_branch", "nvfp4_triage"}
    for arm, per_seed in res["arms"].items():
        r = per_seed["0"]
        for key in ("collapsed", "collapse_step", "first_alarm_step", "final", "eval", "lead_time", "drift"):
            assert key in r, (arm, key)
        assert 0.0 <= r["eval"]["avg@2"] <= 1.0 and len(common.read_history(r["run_dir"])) == 3
        cfg = common.config_from_json(os.path.join(r["run_dir"], "config.json"))
        assert cfg.rl.triage.tau_tail == pytest.approx(th["proposed"]["tau_tail"])  # fixed before every run
        assert os.path.getmtime(tmp_path / "res" / "organism_quick_thresholds.json") < \
            os.path.getmtime(os.path.join(r["run_dir"], "history.json"))
    if jobs > 1:  # one log per worker (one core: the runs ran in this process)
        assert sorted(os.listdir(tmp_path / "runs" / "workers")) == [f"worker{j}.log" for j in range(jobs)]
    md = (tmp_path / "res" / "organism_quick.md").read_text()
    assert "| tau_tail |" in md and "false-alarm rate" in md
    assert (tmp_path / "fig" / "organism_quick.png").stat().st_size > 1000
    assert organism.main(argv + ["--replot"]) == 0
    assert (tmp_path / "res" / "organism_quick.md").read_text() == md
    # --combine: a second part (here the same runs under seed 1) merges into one table and figure.
    part = {**res, "arms": {arm: {"1": per["0"]} for arm, per in res["arms"].items()}}
    common.write_json(str(tmp_path / "res" / "part_b.json"), part)
    assert organism.main(["--combine", "organism_quick,part_b", "--tag", "both", "--results", str(tmp_path / "res"),
                          "--figures", str(tmp_path / "fig")]) == 0
    both = json.load(open(tmp_path / "res" / "both.json"))
    assert all(sorted(per) == ["0", "1"] for per in both["arms"].values())
    assert "seeds [0, 1]" in (tmp_path / "res" / "both.md").read_text()
    assert (tmp_path / "fig" / "both.png").stat().st_size > 1000
    # --resume keeps every finished run (same config) and the pilot's thresholds: nothing retrains.
    stamps = {arm: os.path.getmtime(os.path.join(per["0"]["run_dir"], "history.json"))
              for arm, per in res["arms"].items()}
    assert organism.main(argv + ["--resume"]) == 0
    again = json.load(open(tmp_path / "res" / "organism_quick.json"))
    for arm, per in again["arms"].items():
        assert os.path.getmtime(os.path.join(per["0"]["run_dir"], "history.json")) == stamps[arm]
        assert per["0"]["eval"] == res["arms"][arm]["0"]["eval"]


@pytest.mark.slow  # 96 s on 2 busy cores (pytest -n 2)
def test_organism_staleness_quick_reports_each_delta_part(tmp_path):
    """s = 0 and 1 of the stale-policy study on the tiny config: one record per (s, arm, seed), the precision-gated
    TRIAGE only where staleness exists, per-part alarms only where the parts are logged."""
    th = tmp_path / "th.json"
    common.write_json(str(th), {"overrides": {"rl.triage.tau_tail": 0.05}})
    argv = ["--quick", "--staleness", "0,1", "--arms", "nvfp4_triage", "--thresholds", str(th),
            "--results", str(tmp_path / "res"), "--config", "tiny", "--jobs", "1", "--figures", str(tmp_path / "fig"),
            "--out_dir", str(tmp_path / "runs"), "--compile_cache", ""]
    # Overlong shaping gives the barely warmed-up model's all-wrong groups distinct rewards: the weights move,
    # so the stale runs' staleness delta is not zero.
    for s in TINY_SET + [f"warmup.cache_dir={tmp_path / 'warm'}", "rl.overlong_buffer=8"]:
        argv += ["--set", s]
    argv_s = organism_staleness.parse_args(argv)
    names = [n for n, _ in organism_staleness.studies(argv_s)]
    assert names == ["organism_staleness_quick_s0", "organism_staleness_quick_s1",
                     "organism_staleness_quick_s1_precision"]
    assert all(os.path.join(str(tmp_path / "runs"), n) in a for n, a in organism_staleness.studies(argv_s))
    assert organism_staleness.main(argv) == 0
    rep = json.load(open(tmp_path / "res" / "organism_staleness_quick.json"))["studies"]
    assert set(rep) == {"0", "1"}
    assert set(rep["0"]) == {"nvfp4_triage"} and set(rep["1"]) == {"nvfp4_triage", "nvfp4_triage@precision"}
    assert set(rep["0"]["nvfp4_triage"]["0"]["alarms"]) == {"mismatch"}
    r1 = rep["1"]["nvfp4_triage@precision"]["0"]
    assert set(r1["alarms"]) == {"mismatch", "mismatch_precision", "mismatch_staleness"}
    cfg = common.config_from_json(os.path.join(r1["run_dir"], "config.json"))
    assert (cfg.rl.staleness, cfg.rl.delta_source, cfg.rl.triage.tau_tail) == (1, "precision", 0.05)
    assert r1["windows"]["mismatch_staleness/mean_abs_delta"][1] > 0  # step 2 trains on step 1's rollout
    assert r1["windows"]["mismatch_precision/mean_abs_delta"][1] > 0
    md = (tmp_path / "res" / "organism_staleness_quick.md").read_text()
    assert md.count("| nvfp4_triage") == 3


def test_organism_staleness_merge_joins_earlier_reports_of_the_same_plan(tmp_path):
    """--merge: an earlier combined report's runs join the table where this study has none of that (s, arm), in
    the study's arm order; a report of other steps or seeds is refused by name before anything runs."""
    window = {f"{p}/{m}": [0.5, 0.75] if p == "mismatch" else [None, None]  # JSON's null: a part never logged
              for p in organism_staleness.PARTS for m, _, _ in organism_staleness.COLUMNS}
    rec = {"collapsed": False, "first_alarm_step": 3, "eval": {"avg@4": 0.5}, "run_dir": "gone",
           "alarms": {"mismatch": {"rho_asym": 2, "delta_q05": 5}}, "windows": window, "overlap_frac": None}

    def report_file(name, steps, studies):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"args": {"steps": steps, "seeds": "0", "thresholds": "x/organism_thresholds.json"},
                                    "studies": studies}))
        return str(path)

    a = report_file("a", 20, {"1": {"nvfp4_triage": {"0": rec}}, "0": {"nvfp4": {"0": rec}}})
    b = report_file("b", 20, {"1": {"nvfp4": {"0": rec}, "nvfp4_triage": {"0": {**rec, "first_alarm_step": 9}}}})
    argv = ["--report_only", "--steps", "20", "--seeds", "0", "--results", str(tmp_path), "--tag", "t", "--merge"]
    args = organism_staleness.parse_args(argv + [a, b])
    data = organism_staleness.collect(args)
    assert list(data) == ["0", "1"] and list(data["1"]) == ["nvfp4", "nvfp4_triage"]
    assert data["1"]["nvfp4_triage"]["0"]["first_alarm_step"] == 3  # the first report to name a run wins
    table = organism_staleness.report(data, args)
    assert "| 1 | nvfp4_triage | 1 | 0.5000 -> 0.7500 |" in table and "rho" in table
    with pytest.raises(SystemExit):
        organism_staleness.parse_args(argv + [report_file("c", 40, {})])
    with pytest.raises(SystemExit):
        organism_staleness.parse_args(argv + [str(tmp_path / "missing.json")])
