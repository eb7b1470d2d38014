"""Eval: the unbiased pass@k estimator (triage_jax.evaluation), and the CLI on a local GSM8K-format file with an HF
checkpoint."""

import json
import os
import subprocess
import sys

import pytest
from flax import nnx

from triage_jax import models
from triage_jax.evaluation import pass_at_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("n,c,k,want", [(4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 4, 1.0), (4, 2, 2, 1 - 1 / 6),
                                        (10, 3, 5, 1 - 21 / 252), (8, 8, 3, 1.0)])
def test_pass_at_k_unbiased(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_rejects_k_over_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_eval_cli_on_gsm8k_file(tmp_path):
    hf = tmp_path / "hf"
    models.save_pretrained(models.Qwen3(models.get_model_config("tiny"), rngs=nnx.Rngs(0)), str(hf))
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}, {"question": "What is 4*2?", "answer": "#### 8"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, "-m", "triage_jax.tools.eval", "--config=configs/tiny.py", f"--config.model.hf_path={hf}",
         f"--config.run_dir={tmp_path / 'run'}", "--config.data.template=short", "--eval_set=gsm8k",
         f"--eval_path={data}", "--n=2", "--k=1,2", "--limit=2", "--batch=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["problems"] == 2 and res["n"] == 2 and res["eval_set"] == "gsm8k"
    assert 0.0 <= res["avg@2"] <= res["pass@2"] <= 1.0  # a random model: scores exist and are ordered
