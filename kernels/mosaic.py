"""What every kernel here hands Mosaic GPU: its lowering semantics and exact math, named, and the CPU interpreter's
parameters.

The lowering semantics are pinned to `Lane` (per-thread register layouts, which the kernels name: `load(layout=)`,
`Layout.WGMMA.reduce`) because JAX changed the default under them: jax 0.10 lowers `Lane` by default, jax 0.11
`Warpgroup` (its Pallas changelog, "Turned on Warpgroup lowering by default"), and the quantize kernels do not lower
under `Warpgroup` ("Scalars must be represented by non-vector types" for NVFP4, "Register bitwidth ... divisible by
8" for MXFP8; in jax 0.10.2 with that default forced and in jax 0.11.1's own Pallas lowering). Named, the program
that runs on the GPU is the one the CPU-side export tests lower.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

SEMANTICS = plgpu.LoweringSemantics.Lane


def compiler_params(**kwargs) -> plgpu.CompilerParams:
    """Mosaic GPU's compiler parameters with the kernels' lowering semantics (module docstring) and exact math:
    `approx_math` would let Mosaic GPU lower float ops to PTX's approximate forms, and the kernels' bits are
    fixed (docs/numerics.md, "GPU"), so it is named too rather than left to a default."""
    return plgpu.CompilerParams(lowering_semantics=SEMANTICS, approx_math=False, **kwargs)


_FOR_GPU = contextvars.ContextVar("triage_jax_mosaic_for_gpu", default=False)


def default_interpret() -> bool:
    """Mosaic GPU's CPU interpreter everywhere but on a GPU (or inside `lowering_for_gpu`)."""
    return not _FOR_GPU.get() and jax.default_backend() != "gpu"


@contextlib.contextmanager
def lowering_for_gpu():
    """Within, the kernels lower for Mosaic GPU in any process: for a program compiled for a GPU that this process
    does not run on (tools/gpu_aot.py's compile-only H200), which the interpreter's host callbacks cannot enter."""
    token = _FOR_GPU.set(True)
    try:
        yield
    finally:
        _FOR_GPU.reset(token)


def interpret_params():
    """Parameters of Mosaic GPU's CPU interpreter (shared memory, TMA copies, wgmma from shared memory), as
    `plgpu.kernel(interpret=)` takes them; jax 0.10 has no public name for them."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
