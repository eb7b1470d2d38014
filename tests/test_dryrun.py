"""The memory dry-run compiles the learner and decode steps for a simulated mesh and prints a per-device table."""

import os
import re
import subprocess
import sys

import pytest

from triage_jax.tools import dryrun, gpu_aot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dryrun(*args: str, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "triage_jax.tools.dryrun", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def _table(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("step",):
            rows[cells[0]] = cells[1:]
    return rows


def test_parse_mesh_names_bad_axes():
    assert dryrun.parse_mesh("data=2, fsdp=4,expert=8") == {"data": 2, "fsdp": 4, "expert": 8}
    assert dryrun.parse_mesh("") == {}
    for bad in ("fsdp", "pipe=2", "fsdp=0", "fsdp=x"):
        with pytest.raises(ValueError, match="--mesh"):
            dryrun.parse_mesh(bad)


@pytest.mark.slow  # 73 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_dryrun_tiny_moe_on_simulated_expert_mesh():
    """End to end on 8 simulated devices, expert parallelism on: every remat policy and the rollout programs compile;
    parameters and optimizer state are split over the mesh (per-device bytes = total / shards)."""
    out = _dryrun("--config=configs/tiny_moe.py", "--mesh=fsdp=2,expert=4", "--remat=all", "--seq_len=16",
                  "--prompt_len=8", "--hbm_gb=80,0.0001", "--prefill_batch=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "on 8 simulated cpu devices" in out.stdout
    assert "prefill 2 prompts/device" in out.stdout  # --prefill_batch, not the config's 8
    assert "scan_layers=False" in out.stdout  # the config's model.scan_layers (tiny_moe: off) without the flag
    rows = _table(out.stdout)
    assert set(rows) == {"learner remat=none attn=xla", "learner remat=full attn=xla",
                         "learner remat=save_dots attn=xla",
                         "rollout 8 slots/device, cache 64, KV 0.00 GB", "rollout 16 slots/device, cache 64, KV 0.00 GB"}
    assert "80GB: 1024 slots/device (8192 in all), 1 wave(s) for 8192 responses" in out.stdout
    for name, cells in rows.items():
        params, opt, args, temps, outputs, peak = (float(x) for x in cells[:6])
        assert peak > 0 and temps >= 0
        assert cells[-2] == "yes" and cells[-1] == "NO", (name, cells)  # fits 80 GB, not 100 kB
    # tiny_moe's float32 Adam moments are twice its parameters, both split over the 8 devices.
    p, o = float(rows["learner remat=full attn=xla"][0]), float(rows["learner remat=full attn=xla"][1])
    assert o == pytest.approx(2 * p, abs=0.011)


@pytest.mark.slow  # ~30 s on 2 cores: two learner compiles
@pytest.mark.skipif(not gpu_aot.plugin_installed(), reason="jax's CUDA PJRT plugin not installed: bash .ci/gpu_aot_plugin.sh")
def test_dryrun_h200_target_compiles_for_compile_only_h200s():
    """--target=h200 compiles the learner step with XLA:GPU for as many compile-only H200s as the mesh has (not the
    config's sampler_devices), sharded as on the CPU target: the same per-device parameters and optimizer state."""
    args = ("--config=configs/tiny.py", "--mesh=fsdp=2", "--seq_len=16", "--prompt_len=8", "--skip_decode")
    gpu, cpu = _dryrun(*args, "--target=h200"), _dryrun(*args)
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert "on 2 simulated H200 (compile-only) devices" in gpu.stdout
    assert "on 2 simulated cpu devices" in cpu.stdout
    (g,), (c,) = _table(gpu.stdout).values(), _table(cpu.stdout).values()
    assert g[:2] == c[:2] and float(g[0]) > 0  # params, optimizer state
    assert float(g[3]) > 0  # the GPU program's temporaries


def test_dryrun_h200_target_without_the_plugin_says_how_to_get_it():
    out = _dryrun("--config=configs/tiny.py", "--mesh=fsdp=2", "--seq_len=8", "--prompt_len=8", "--skip_decode",
                  "--target=h200", env_extra={"TRIAGE_GPU_AOT": os.path.join(ROOT, "no-such-plugin")})
    assert out.returncode != 0
    assert "--target=h200 needs jax's CUDA PJRT plugin" in out.stderr and "gpu_aot_plugin.sh" in out.stderr
    assert "compiling" not in out.stdout  # refused before any compile


def test_dryrun_rejects_a_batch_that_does_not_split():
    out = _dryrun("--config=configs/tiny.py", "--mesh=fsdp=4", "--micro_batch=6", "--seq_len=8", "--prompt_len=8",
                  "--skip_decode")
    assert out.returncode != 0 and "--micro_batch=6 does not split over the 4 batch shards" in out.stderr


def test_per_device_bytes_counts_one_shard():
    script = (
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "from triage_jax import sharding as shd\n"
        "from triage_jax.tools.dryrun import per_device_bytes\n"
        "mesh = shd.make_mesh({'fsdp': 4})\n"
        "x = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P('fsdp')))\n"
        "y = jax.ShapeDtypeStruct((5,), jnp.bfloat16, sharding=NamedSharding(mesh, P()))\n"
        "print('BYTES', per_device_bytes({'x': x, 'y': y}))\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"BYTES (\d+)", out.stdout).group(1) == str(2 * 6 * 4 + 5 * 2)
