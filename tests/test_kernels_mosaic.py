"""Every Mosaic GPU kernel names its lowering semantics (kernels/mosaic.py): jax 0.11 changed the default from
`Lane` to `Warpgroup`, under which the quantize kernels do not lower, so a kernel left to the default would run a
program on the GPU that the CPU-side export tests (jax 0.10's default) never lowered."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from triage_jax.kernels import fp4_gemm as fg
from triage_jax.kernels import mosaic
from triage_jax.kernels import pallas_quant as pk
from triage_jax.quant import formats as fmt

_F32 = jax.ShapeDtypeStruct((96, 512), jnp.float32)


def _kernel_params(fn, *args) -> list:
    """The compiler parameters of every Pallas kernel in fn's jaxpr (pallas_call, and mpmd_map: plgpu.kernel's)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("pallas_call", "mpmd_map"):
                found.append(eqn.params["compiler_params"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _fp4_weight(e=None):
    """An abstract 4-bit weight [256, 512] in the kernel's layout; with e, one per expert."""
    if e is None:
        return jax.eval_shape(lambda: fg.prepare_weight(fmt.quantize_nvfp4(jnp.zeros((256, 512)))))
    return jax.eval_shape(lambda: jax.vmap(fg.prepare_weight)(jax.vmap(fmt.quantize_nvfp4)(jnp.zeros((e, 256, 512)))))


KERNELS = {
    "nvfp4": (lambda a: pk.quantize_nvfp4(a, interpret=False), _F32),
    "nvfp4:row": (lambda a: pk.quantize_nvfp4(a, scaling="row", interpret=False), _F32),
    "nvfp4:tile2d": (lambda a: pk.quantize_nvfp4(a, scaling="tile2d", interpret=False), _F32),
    "nvfp4_kn": (lambda a: pk.quantize_nvfp4_kn(a, interpret=False), _F32),
    "mxfp8": (lambda a: pk.quantize_mxfp8(a, interpret=False), _F32),
    "mxfp8_kn": (lambda a: pk.quantize_mxfp8_kn(a, interpret=False), _F32),
    "fp4_matmul": (lambda x, w: fg.fp4_matmul(x, w, interpret=False),
                   jax.ShapeDtypeStruct((16, 512), jnp.bfloat16), _fp4_weight()),
    "fp4_grouped_matmul": (lambda x, w, g: fg.fp4_grouped_matmul(x, w, g, interpret=False),
                           jax.ShapeDtypeStruct((32, 512), jnp.bfloat16), _fp4_weight(4),
                           jax.ShapeDtypeStruct((4,), jnp.int32)),
}


@pytest.fixture
def warpgroup_default(monkeypatch):
    """jax 0.11's default semantics in the installed JAX: a CompilerParams() that names none gets Warpgroup (and
    approximate math)."""
    cls, init = plgpu.CompilerParams, plgpu.CompilerParams.__init__

    def init_0_11(self, *args, **kwargs):
        kwargs.setdefault("lowering_semantics", plgpu.LoweringSemantics.Warpgroup)
        kwargs.setdefault("approx_math", True)  # not a JAX change; a default the bits must not rest on either
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", init_0_11)
    assert plgpu.CompilerParams().lowering_semantics == plgpu.LoweringSemantics.Warpgroup


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_compiled_kernel_names_the_lane_semantics(name, warpgroup_default):
    """Under jax 0.11's default (emulated), each kernel still carries Lane and exact math: a kernel that left them
    to the defaults (no compiler_params, or CompilerParams() naming none) fails here."""
    fn, *args = KERNELS[name]
    params = _kernel_params(fn, *args)
    assert params, f"{name}: no Pallas kernel in its program"
    for p in params:
        p = p.get("mosaic_gpu", p) if isinstance(p, dict) else p  # pallas_call keeps a dict keyed by backend
        assert getattr(p, "lowering_semantics", None) == mosaic.SEMANTICS, f"{name}: {p}"
        assert getattr(p, "approx_math", None) is False, f"{name}: {p}"


def test_interpret_mode_is_the_default_off_the_gpu():
    assert mosaic.default_interpret() == (jax.default_backend() != "gpu")
