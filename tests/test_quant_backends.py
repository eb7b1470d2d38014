"""Backend registry and capability probe; Pallas kernels bit-exact against the reference in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax import quant
from triage_jax.kernels import pallas_quant as pk
from triage_jax.quant import PRESETS, backends
from triage_jax.tools import align

F32 = jnp.float32
ON_CPU = jax.default_backend() == "cpu"


def _bits(a):
    a = jnp.asarray(a)
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a)


def _x(shape, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, F32) * jnp.exp(3 * jax.random.normal(k2, shape[:-1] + (1,)))
    return x.at[..., 5].set(0.0)


def test_registry_reports_every_backend_with_a_reason():
    avail = quant.available_backends()
    assert set(avail) >= {"xla", "pallas", "cudnn", "te"}
    for ok, reason in avail.values():
        assert isinstance(ok, bool) and reason
    assert avail["xla"][0]


@pytest.mark.skipif(not ON_CPU, reason="CPU capability expectations")
def test_cpu_capabilities_and_no_silent_substitution():
    avail = quant.available_backends()
    assert avail["pallas"][0] and "interpret" in avail["pallas"][1]
    assert not avail["cudnn"][0] and "compute capability" in avail["cudnn"][1]
    assert not avail["te"][0]
    assert quant.resolve_backend("auto") == "xla"  # interpret-mode Pallas is for checks, not speed
    assert quant.resolve_backend("pallas") == "pallas"
    with pytest.raises(quant.BackendUnavailableError, match="'cudnn' is unavailable here: .*compute capability"):
        quant.resolve_backend("cudnn")
    x, w = jnp.ones((4, 32)), jnp.ones((32, 16))
    with pytest.raises(quant.BackendUnavailableError, match="'te' is unavailable"):
        quant.qdot(x, w, PRESETS["w4a4"], backend="te")
    with pytest.raises(ValueError, match="unknown quantization backend 'tpu'"):
        quant.qdot(x, w, PRESETS["w4a4"], backend="tpu")


def test_register_custom_backend_and_probe_failure():
    def broken_probe():
        raise OSError("no driver")

    quant.register_backend(backends.Backend("broken", broken_probe, backends.reference_quantize,
                                            backends.reference_matmul))
    try:
        ok, reason = quant.available_backends()["broken"]
        assert not ok and "OSError: no driver" in reason
        with pytest.raises(quant.BackendUnavailableError, match="no driver"):
            quant.resolve_backend("broken")
    finally:
        backends._REGISTRY.pop("broken")
        backends._probe.cache_clear()


@pytest.mark.parametrize("scaling", ["tensor", "row", "tile2d"])
@pytest.mark.parametrize("shape", [(32, 96), (2, 16, 64)])
def test_pallas_nvfp4_bit_exact(scaling, shape):
    x = _x(shape)
    ref = quant.quantize_nvfp4(x, scaling=scaling)
    got = pk.quantize_nvfp4(x, scaling=scaling, block_m=16, block_k=32, interpret=True)  # several grid tiles
    np.testing.assert_array_equal(_bits(got.packed), _bits(ref.packed))
    np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))
    np.testing.assert_array_equal(np.asarray(got.amax), np.asarray(ref.amax))
    assert got.scaling == scaling and got.data.shape == shape


def test_pallas_nvfp4_amax_reuse_and_nan():
    x = _x((16, 64)).at[3, 7].set(jnp.nan)
    for amax in (None, 1e4):
        ref = quant.quantize_nvfp4(x, amax=amax)
        got = pk.quantize_nvfp4(x, amax=amax, block_k=32, interpret=True)
        np.testing.assert_array_equal(_bits(got.packed), _bits(ref.packed))
        np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))


@pytest.mark.parametrize("shape", [(16, 128), (2, 8, 64)])
def test_pallas_mxfp8_bit_exact(shape):
    x = _x(shape, seed=1)
    ref, got = quant.quantize_mxfp8(x), pk.quantize_mxfp8(x, block_m=8, block_k=64, interpret=True)
    np.testing.assert_array_equal(_bits(got.data), _bits(ref.data))
    np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))


@pytest.mark.parametrize("lhs_fmt,rhs_fmt", [("nvfp4", "nvfp4"), ("mxfp8", "nvfp4"), ("none", "nvfp4"),
                                             ("fp8", "fp8"), ("nvfp4-row", "nvfp4")])
def test_pallas_dequant_matmul_matches_reference(lhs_fmt, rhs_fmt):
    x, w = _x((32, 128), seed=2), _x((48, 128), seed=3)
    q = {"nvfp4": quant.quantize_nvfp4, "mxfp8": quant.quantize_mxfp8, "fp8": quant.quantize_fp8,
         "none": lambda a: a, "nvfp4-row": lambda a: quant.quantize_nvfp4(a, scaling="row")}
    lhs, rhs = q[lhs_fmt](x), q[rhs_fmt](w)
    got = pk.dequant_matmul(lhs, rhs, block_m=16, block_n=16, block_k=32, interpret=True)
    ref = backends.reference_matmul(lhs, rhs)
    # exact bf16 products; only the float32 summation order differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("preset", ["w4a4", "w4a8", "fp8"])
def test_qdot_pallas_backend_matches_xla(preset):
    x, w = _x((2, 8, 64), seed=4), _x((64, 32), seed=5)
    y_p = quant.qdot(x, w, PRESETS[preset], backend="pallas")
    y_x = quant.qdot(x, w, PRESETS[preset], backend="xla")
    np.testing.assert_allclose(np.asarray(y_p), np.asarray(y_x), rtol=1e-5, atol=1e-5 * float(jnp.abs(y_x).max()))
    qw_p = quant.prequantize(w, PRESETS[preset], backend="pallas")
    qw_x = quant.prequantize(w, PRESETS[preset])
    assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(jax.tree.leaves(qw_p), jax.tree.leaves(qw_x)))


def test_qragged_pallas_quantizers():
    x, w = _x((24, 64), seed=6), _x((2, 64, 32), seed=7) * 0.01
    gs = jnp.asarray([10, 14], jnp.int32)
    np.testing.assert_array_equal(np.asarray(quant.qragged_dot(x, w, gs, PRESETS["w4a4"], backend="pallas")),
                                  np.asarray(quant.qragged_dot(x, w, gs, PRESETS["w4a4"])))


def test_align_tool_small_exits_zero(capsys):
    assert align.main(["--small", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 mismatches" in out and "pallas" in out and "quantize nvfp4:tile2d" in out and "qdot w4a4" in out


def test_align_tool_flags_a_mismatch(monkeypatch, capsys):
    """A backend whose quantizer is off by one code must fail the check."""
    def off_by_one(x, fmt_name, scaling="tensor", amax=None):
        q = backends.reference_quantize(x, fmt_name, scaling, amax)
        if fmt_name == "nvfp4":
            q = q.replace(packed=q.packed ^ jnp.uint8(1))
        return q

    quant.register_backend(backends.Backend("skewed", lambda: (True, "test"), off_by_one, backends.reference_matmul))
    try:
        assert align.main(["--small", "--repeats", "1", "--backends", "skewed"]) == 1
        assert "MISMATCH" in capsys.readouterr().out
    finally:
        backends._REGISTRY.pop("skewed")
        backends._probe.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas needs a GPU")
def test_pallas_compiled_on_gpu_bit_exact():
    x = _x((256, 1024), seed=8)
    for scaling in ("tensor", "row", "tile2d"):
        ref, got = quant.quantize_nvfp4(x, scaling=scaling), pk.quantize_nvfp4(x, scaling=scaling, interpret=False)
        np.testing.assert_array_equal(_bits(got.packed), _bits(ref.packed))
        np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))
    ref, got = quant.quantize_mxfp8(x), pk.quantize_mxfp8(x, interpret=False)
    np.testing.assert_array_equal(_bits(got.data), _bits(ref.data))
    w = _x((512, 1024), seed=9)
    y = pk.dequant_matmul(quant.quantize_nvfp4(x), quant.quantize_nvfp4(w), interpret=False)
    r = backends.reference_matmul(quant.quantize_nvfp4(x), quant.quantize_nvfp4(w))
    np.testing.assert_allclose(np.asarray(y), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))
