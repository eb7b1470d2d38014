"""tests/test_gpu.py never runs where CI runs (no GPU): its dry run here, with the CPU posing as the GPU
(tests/cpu_as_gpu.py), keeps the GPU tests themselves working between GPU sessions."""

import os
import re
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow  # 1:43 on 2 cores (idle): the GPU tests' engines and exact-mode runs, CPU against CPU
def test_the_gpu_tests_pass_on_a_cpu_posing_as_the_gpu():
    """Every GPU test but the device-only ones (DEVICE_ONLY: the device's compiled programs and defaults) passes
    CPU against CPU: a GPU test broken by a code change (a helper renamed, a signature changed) fails here."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "cpu_as_gpu", "-m", "gpu", "-n", "0",
                        "-p", "no:cacheprovider", "-rs", os.path.join(TESTS, "test_gpu.py")],
                       cwd=os.path.dirname(TESTS), env=env, capture_output=True, text=True, timeout=1500)
    out = r.stdout[-5000:]
    assert r.returncode == 0, out
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|skipped|failed|xfailed|xpassed)", out))
    assert counts.get("skipped") == 3 and counts.get("passed", 0) >= 15, (counts, out)
