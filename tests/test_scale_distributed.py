"""Multi-host start-up from the environment, and a collective orbax checkpoint written by two JAX processes."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from triage_jax import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_single_host_is_a_no_op():
    assert distributed.plan({}) is None
    assert distributed.plan({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert distributed.plan({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert distributed.initialize({}) is False


def test_plan_reads_launchers():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2",
           "JAX_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed.plan(env) == ("explicit", dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                                                      process_id=2, local_device_ids=[0, 1]))
    assert distributed.plan({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}) == ("slurm", {})
    assert distributed.plan({"OMPI_COMM_WORLD_SIZE": "2"}) == ("openmpi", {})
    assert distributed.plan({"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"}) == ("tpu", {})
    assert distributed.plan({"TRIAGE_DISTRIBUTED": "1"}) == ("auto", {})
    assert distributed.plan({"TRIAGE_DISTRIBUTED": "0", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}) is None


def test_plan_names_incomplete_or_bad_variables():
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID'\] missing"):
        distributed.plan({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=2 is not in"):
        distributed.plan({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.plan({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"})


WORKER = textwrap.dedent("""
    import json, sys
    from triage_jax import distributed
    assert distributed.initialize()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from triage_jax import sharding as shd
    from triage_jax.checkpoint import Checkpointer

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    mesh = shd.make_mesh({"fsdp": 4})  # spans both processes
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    sh = NamedSharding(mesh, P("fsdp"))
    x = jax.make_array_from_callback(full.shape, sh, lambda idx: full[idx])
    total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x * 2))  # a cross-process reduction
    ck = Checkpointer(sys.argv[1])
    ck.save(1, {"w": x}, {"procs": jax.process_count()})  # every process writes its own shards
    ck.close()
    print("RESULT", json.dumps({"pid": jax.process_index(), "total": total}))
""")

RESTORE = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from triage_jax import sharding as shd
    from triage_jax.checkpoint import Checkpointer

    mesh = shd.make_mesh({})
    target = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P()))}
    step, state, meta = Checkpointer(sys.argv[1]).restore(target)
    print("RESULT", json.dumps({"step": step, "meta": meta, "w": np.asarray(state["w"]).tolist()}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_write_one_checkpoint_that_restores_on_one(tmp_path):
    port = _free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
                   JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "ck")], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(next(l for l in o.splitlines() if l.startswith("RESULT "))[7:]) for o, _ in outs]
    assert sorted(r["pid"] for r in results) == [0, 1]
    assert all(r["total"] == 2 * sum(range(48)) for r in results)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", RESTORE, str(tmp_path / "ck")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert got["step"] == 1 and got["meta"] == {"procs": 2}
    np.testing.assert_array_equal(got["w"], np.arange(48, dtype=np.float32).reshape(8, 6))
