"""Suite-wide fixtures, and one persistent XLA compilation cache shared by the run's processes."""

import gc
import os
import shutil
import tempfile

# One compilation cache for the whole run (set before jax is imported, so this process reads it too): the pytest
# controller makes a fresh folder and exports it, and the xdist workers and every CLI a test starts in a subprocess
# inherit it. A program compiled once (the trainer's, the engine's) is then loaded, not recompiled, by every later
# test module (each module drops the in-memory programs, below), worker and subprocess: the default run measured
# 16 min instead of 22 on 2 cores. Every program is cached (threshold 0 s). Set JAX_COMPILATION_CACHE_DIR yourself
# to share or keep the cache across runs (.ci/run shares one between its two test runs); the suite then
# leaves that folder in place.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="triage_jax_test_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
    """The process that made the run's cache folder removes it (workers inherited it and leave it alone)."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends. XLA:CPU maps each executable's code into its own memory
    regions; one process compiling the whole suite's programs (several thousand) reached the kernel's map limit
    (vm.max_map_count, 65,530) near the 600th test, and the next compilation died with a segmentation fault."""
    yield
    jax.clear_caches()
    gc.collect()
