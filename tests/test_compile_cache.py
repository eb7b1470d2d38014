"""The persistent compilation cache the trainer and the tools turn on by default (triage_jax/compile_cache.py)."""

import os
import subprocess
import sys

import pytest

from triage_jax import compile_cache
from triage_jax.config import ConfigError, base_config, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = """
import sys, jax, jax.numpy as jnp
from triage_jax import compile_cache
path = compile_cache.enable(sys.argv[1])
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
print(path, float(f(jnp.ones((64, 64)))))
"""


def _run(setting: str, env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", PROGRAM, setting], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()[0]


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    path = _run("auto", env)
    assert path == str(tmp_path / "xdg" / "triage_jax" / "xla")
    entries = sorted(os.listdir(path))
    assert entries, "the first process wrote no compiled program"
    _run("auto", env)
    assert sorted(os.listdir(path)) == entries  # the second process compiled nothing new: it loaded them
    explicit = str(tmp_path / "mine")
    assert _run(explicit, env) == explicit and os.listdir(explicit)
    assert _run("", env) == "None"  # "" turns it off


def test_the_environment_wins_over_the_per_user_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.default_dir() == str(tmp_path / "env")
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert compile_cache.default_dir() == str(tmp_path / "x" / "triage_jax" / "xla")


def test_the_config_key_is_a_string():
    c = base_config()
    assert c.compile_cache == "auto"
    with pytest.raises((ConfigError, TypeError)):
        c.compile_cache = 3
        validate(c)
