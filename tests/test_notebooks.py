"""The experiment notebooks run top to bottom on CPU (nbclient), and the committed .ipynb match their generator."""

import os
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "experiments", "notebooks")
sys.path.insert(0, NB_DIR)

import make_notebooks  # noqa: E402


def execute(name: str, env: dict | None = None) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": NB_DIR}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def outputs(nb, kind="image/png"):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if kind in o.get("data", {})]


def test_committed_notebooks_match_the_generator(tmp_path):
    make_notebooks.main(str(tmp_path))
    for name in make_notebooks.NOTEBOOKS:
        fresh = nbformat.read(str(tmp_path / name), as_version=4)
        committed = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
        assert [c.source for c in fresh.cells] == [c.source for c in committed.cells], \
            f"{name} is stale: run python experiments/notebooks/make_notebooks.py"
        assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code")


def test_walkthrough_notebook_runs():
    nb = execute("nvfp4_triage_walkthrough.ipynb")
    assert len(outputs(nb)) == 3  # staircase/error, delta/alpha, repair penalty figures
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "NVFP4, tensor scaling" in text and "rho_asym" in text


def _tiny_run(tmp_path):
    """A 3-step NVFP4 run with a 4-step warm-up, written as experiments/stability.py writes its runs."""
    sys.path.insert(0, ROOT)
    from experiments import common
    from triage_jax.trainer import Trainer

    c = common.load_config("tiny")
    common.set_values(c, {"run_dir": str(tmp_path / "run"), "warmup.cache_dir": str(tmp_path / "warm"),
                          "warmup.steps": 4, "warmup.batch_size": 8, "rl.num_prompts": 2, "rl.group_size": 4,
                          "rl.mini_batch": 8, "rl.micro_batch": 8, "rl.dynamic_sampling": False,
                          "sampler.max_new_tokens": 12, "train.steps": 3,
                          "train.progress": False, "rl.correction": "none", "rl.triage.segment_len": 4})
    Trainer(c).run()
    with open(os.path.join(c.run_dir, "config.json"), "w") as f:
        f.write(c.to_json())
    return c.run_dir


@pytest.mark.slow  # 55 s on 2 busy cores (pytest -n 2)
def test_diagnostics_notebook_runs_on_a_run(tmp_path):
    run_dir = _tiny_run(tmp_path)
    nb = execute("run_diagnostics.ipynb", {"TRIAGE_RUN_DIR": run_dir})
    assert len(outputs(nb)) == 3  # quadrants, delta heatmaps, tail persistence
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"run: {run_dir}" in text and "checkpoint step 3" in text
