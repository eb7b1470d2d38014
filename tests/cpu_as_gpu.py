"""pytest plugin: the GPU tests' dry run on a machine without a GPU (`python -m pytest -p cpu_as_gpu -m gpu -n 0
tests/test_gpu.py`, with tests/ on the Python path).

`jax.default_backend()` answers "gpu" and `jax.devices("gpu")` gives the CPU devices, so tests/test_gpu.py runs its
GPU-against-CPU comparisons CPU against CPU. What that checks is the tests themselves, not the GPU: a helper they
call renamed, a signature changed, a shape gone wrong would otherwise first show in a GPU session's few minutes.
Tests that need the device itself (its compiled programs, its platform's defaults) skip (`DEVICE_ONLY`)."""

import os

import jax

ENV = "TRIAGE_CPU_AS_GPU"


def pytest_configure(config):
    os.environ[ENV] = "1"
    devices, backend = jax.devices, jax.default_backend

    def cpu_for_gpu(backend_name=None):
        return devices("cpu" if backend_name in ("gpu", "cuda") else backend_name)

    jax.devices = cpu_for_gpu
    jax.default_backend = lambda: "gpu"
    config.add_cleanup(lambda: (setattr(jax, "devices", devices), setattr(jax, "default_backend", backend)))
