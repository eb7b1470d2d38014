"""Multi-host start-up: `jax.distributed.initialize` from the launcher's environment, a no-op on one host.

Call `initialize()` first thing in main, before any JAX work. Sources, in order:
  - explicit: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID
    (optionally JAX_LOCAL_DEVICE_IDS), e.g. set by hand or by a torchrun-style launcher;
  - SLURM (srun with more than one task), Open MPI (mpirun with more than one rank), a multi-host Cloud TPU slice
    (TPU_WORKER_HOSTNAMES lists several workers): JAX's own cluster detection fills in every argument;
  - TRIAGE_DISTRIBUTED=1 forces JAX's auto-detection (another supported cluster), =0 turns all of this off.
After it, every process runs the same program on its local devices; `jax.devices()` is the global list, the mesh
spans all hosts, the data loader reads shard `jax.process_index()` of `jax.process_count()`, and orbax writes one
checkpoint collectively.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)

EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _count(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env.get(key, "1"))
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def plan(env: Mapping[str, str] | None = None) -> tuple[str, dict] | None:
    """(launcher name, keyword arguments for jax.distributed.initialize), or None when this is one process."""
    env = os.environ if env is None else env
    forced = env.get("TRIAGE_DISTRIBUTED", "").strip().lower()
    if forced in ("0", "false", "no", "off"):
        return None
    present = [k for k in EXPLICIT if env.get(k)]
    if present:
        if len(present) != len(EXPLICIT):
            missing = [k for k in EXPLICIT if k not in present]
            raise ValueError(f"multi-host: {present} set but {missing} missing; set all of {list(EXPLICIT)}")
        kwargs = dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                      num_processes=_count(env, "JAX_NUM_PROCESSES"), process_id=_count(env, "JAX_PROCESS_ID"))
        if not 0 <= kwargs["process_id"] < kwargs["num_processes"]:
            raise ValueError(f"multi-host: JAX_PROCESS_ID={kwargs['process_id']} is not in "
                             f"[0, JAX_NUM_PROCESSES={kwargs['num_processes']})")
        if env.get("JAX_LOCAL_DEVICE_IDS"):
            kwargs["local_device_ids"] = [int(i) for i in env["JAX_LOCAL_DEVICE_IDS"].split(",")]
        return "explicit", kwargs
    if env.get("SLURM_JOB_ID") and _count(env, "SLURM_NTASKS") > 1:
        return "slurm", {}
    if _count(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi", {}
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return "tpu", {}
    if forced in ("1", "true", "yes", "on"):
        return "auto", {}
    return None


def initialize(env: Mapping[str, str] | None = None) -> bool:
    """Join the multi-host job described by the environment; returns whether jax.distributed was initialized.

    Idempotent (a second call does nothing). On one host (no launcher variables) it touches nothing.
    """
    import jax
    from jax._src import distributed as _dist

    p = plan(env)
    if p is None:
        return False
    if _dist.global_state.client is not None:
        return True
    name, kwargs = p
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed (%s): process %d of %d, %d local / %d global devices", name, jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True
