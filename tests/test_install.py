"""The installed layout: the repository's top-level kernels/ is `triage_jax.kernels` and never the top-level
`kernels` that transformers imports (the PyPI package of that name), from the repository root or elsewhere."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS_DIR = os.path.realpath(os.path.join(ROOT, "kernels"))


def _python(code: str, *flags: str) -> subprocess.CompletedProcess:
    """`python -c code` started in the repository root, as the README's lines and `python -m ...` run: '' (the
    root) is first on sys.path; the snippets also insert ROOT themselves, as the experiments and notebooks do."""
    return subprocess.run(
        [sys.executable, *flags, "-c", f"import sys; sys.path.insert(0, {ROOT!r})\n{code}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


def _installed_kernels() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_top_level_kernels_import_from_the_root_is_never_the_project_folder():
    r = _python("import os, kernels; print(os.path.realpath(kernels.__file__))")
    if _installed_kernels():
        assert r.returncode == 0, r.stderr
        got = os.path.dirname(r.stdout.strip().splitlines()[-1])
        assert got != KERNELS_DIR, f"`import kernels` from the repository root resolved to {got}"
    else:
        assert "ModuleNotFoundError: No module named 'kernels'" in r.stderr, r.stderr


def test_top_level_kernels_without_the_pypi_package_is_not_found():
    """-S hides site-packages: the project's folder must not stand in for the missing package, and a failed
    import leaves no half-made `kernels` in sys.modules."""
    code = (
        "import sys\n"
        "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n"
        "    print('not found:', e, '| left:', 'kernels' in sys.modules)\n"
        "else:\n    print('imported', kernels.__file__)\n"
    )
    r = _python(code, "-S")
    assert r.returncode == 0, r.stderr
    assert "not found: No module named 'kernels'" in r.stdout and "| left: False" in r.stdout, r.stdout


def test_project_kernels_import_as_triage_jax_kernels_from_the_root():
    r = _python(
        "import os, kernels, triage_jax.kernels.pallas_quant as pk\n"
        "from triage_jax.quant import backends\n"
        "print(os.path.realpath(pk.__file__)); print(backends.available_backends()['pallas'][0])"
    )
    assert r.returncode == 0, r.stderr
    path, ok = r.stdout.strip().splitlines()[-2:]
    assert os.path.dirname(path) == KERNELS_DIR and ok == "True"


@pytest.mark.skipif(not _installed_kernels(), reason="transformers without the PyPI package `kernels` never imports it")
def test_transformers_qwen3_imports_and_runs_from_the_root():
    """What the HF parity tests and experiments/bench_sampler.py do, in a process started as they are started."""
    r = _python(
        "import torch\n"
        "from transformers import Qwen3Config, Qwen3ForCausalLM\n"
        "from transformers.integrations import hub_kernels  # imports the PyPI `kernels`\n"
        "cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)\n"
        "out = Qwen3ForCausalLM(cfg)(torch.tensor([[1, 2, 3]])).logits\n"
        "print(tuple(out.shape))"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "(1, 3, 64)"


def test_sources_compile_without_warnings():
    """Invalid escape sequences in a string (a regex in a docstring) warn on Python 3.12+ (DeprecationWarning on 3.11):
    every source file of the project compiles with warnings as errors."""
    import pathlib
    import warnings

    bad = []
    for sub in ("triage_jax", "kernels", "experiments", "tests", "configs"):
        for path in pathlib.Path(ROOT, sub).rglob("*.py"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                try:
                    compile(path.read_text(), str(path), "exec")
                except (SyntaxError, SyntaxWarning, DeprecationWarning) as e:
                    bad.append(f"{path.relative_to(ROOT)}: {e}")
    assert not bad, bad
