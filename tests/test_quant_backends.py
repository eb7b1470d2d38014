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
    te_ok, te_reason = avail["te"]
    if "does not import" in te_reason:  # TE not installed: selecting it says so, naming the extra to install
        with pytest.raises(quant.BackendUnavailableError, match="'te' is unavailable here: transformer_engine.jax "
                                                                "does not import.*install the 'te' extra"):
            quant.qdot(x, w, PRESETS["w4a4"], backend="te")
    with pytest.raises(quant.BackendUnavailableError, match="'te' is unavailable"):
        quant.qdot(x, w, PRESETS["w4a4"], backend="te")
    with pytest.raises(quant.BackendUnavailableError, match="'te' is unavailable"):
        quant.qragged_dot(x, jnp.ones((2, 32, 16)), jnp.asarray([2, 2], jnp.int32), PRESETS["w4a4"], backend="te")
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


@pytest.fixture
def registered():
    """Register test backends; restores the registry (and the probe cache) afterwards."""
    saved = dict(backends._REGISTRY)
    yield lambda b: quant.register_backend(b)
    backends._REGISTRY.clear()
    backends._REGISTRY.update(saved)
    backends._probe.cache_clear()


def test_qdot_dispatches_through_the_registry_only(registered):
    """Replacing the registry's `xla` entry changes what qdot(backend="xla") runs: no name is special-cased."""
    calls = []

    def dot(x, w, prec):
        calls.append(("dot", x.shape, tuple(w.shape), prec))
        return jnp.full((x.shape[0], w.shape[-1]), 7.0, jnp.float32)

    def grouped(x, w, gs, prec):
        calls.append(("grouped", x.shape, tuple(w.shape), prec))
        return jnp.full((x.shape[0], w.shape[-1]), 3.0, jnp.float32)

    x, w = _x((2, 4, 32)), _x((32, 16), seed=1)
    for name in ("xla", "fake"):
        calls.clear()
        registered(backends.Backend(name, lambda: (True, "test"), dot=dot, grouped_dot=grouped))
        y = quant.qdot(x, w, PRESETS["w4a4"], backend=name)
        assert calls == [("dot", (8, 32), (32, 16), PRESETS["w4a4"])]
        np.testing.assert_array_equal(np.asarray(y), np.full((2, 4, 16), 7.0))
        y = quant.qragged_dot(x[0], _x((2, 32, 16)), jnp.asarray([1, 3], jnp.int32), PRESETS["w4a8"], backend=name)
        assert calls[-1] == ("grouped", (4, 32), (2, 32, 16), PRESETS["w4a8"])
        np.testing.assert_array_equal(np.asarray(y), np.full((4, 16), 3.0))


def test_composed_forward_uses_the_backends_quantize_and_matmul(registered):
    """A backend with only quantize + matmul gets the composed dense forward and the reference grouped GEMM."""
    seen = []

    def quantize(x, fmt_name, scaling="tensor", amax=None):
        seen.append(("quantize", fmt_name, scaling))
        return backends.reference_quantize(x, fmt_name, scaling, amax)

    def matmul(lhs, rhs):
        seen.append(("matmul", type(lhs).__name__, type(rhs).__name__))
        return backends.reference_matmul(lhs, rhs)

    registered(backends.Backend("plain", lambda: (True, "test"), quantize, matmul))
    x, w = _x((8, 64), seed=2), _x((64, 32), seed=3)
    y = quant.qdot(x, w, PRESETS["w4a8"], backend="plain")
    assert seen == [("quantize", "mxfp8", "tensor"), ("quantize", "nvfp4", "tensor"),
                    ("matmul", "MXFP8Tensor", "NVFP4Tensor")]
    ref = quant.qdot(x, w, PRESETS["w4a8"])
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    seen.clear()
    we, gs = _x((2, 64, 32), seed=4), jnp.asarray([3, 5], jnp.int32)
    y = quant.qragged_dot(x, we, gs, PRESETS["w4a4"], backend="plain")
    assert [s[0] for s in seen] == ["quantize", "quantize"]  # per-expert weights: one vmapped call
    ref = quant.qragged_dot(x, we, gs, PRESETS["w4a4"])
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


def test_unsupported_operations_raise_with_their_reason(registered):
    registered(backends.Backend("dense_only", lambda: (True, "test"), backends.reference_quantize,
                                backends.reference_matmul, unsupported={"grouped_dot": "no grouped GEMM in this lib"}))
    x = _x((4, 32))
    with pytest.raises(quant.BackendUnsupportedError, match="'dense_only' does not provide grouped_dot: no grouped"):
        quant.qragged_dot(x, _x((2, 32, 16)), jnp.asarray([2, 2], jnp.int32), PRESETS["w4a4"], backend="dense_only")
    te = backends._REGISTRY["te"]  # the TE entry declares what it does not provide instead of stubbing it
    assert te.dot is not None and not te.supports("quantize") and not te.supports("grouped_dot")
    with pytest.raises(quant.BackendUnsupportedError, match="'te' does not provide quantize: TE quantizes inside"):
        te.op("quantize")
    with pytest.raises(ValueError, match="both provided and declared unsupported"):
        backends.Backend("bad", lambda: (True, ""), backends.reference_quantize, unsupported={"quantize": "x"})


def test_pallas_kernel_module_registers_itself():
    import triage_jax.kernels

    assert backends.KERNEL_BACKENDS["pallas"] == pk.__name__
    quant.available_backends()
    assert backends._REGISTRY["pallas"] is pk.BACKEND  # the kernel module's own entry, not one built in backends.py
    assert "jax-triton" not in triage_jax.kernels.__doc__ and "pallas_quant" in triage_jax.kernels.__doc__


def test_kernel_module_that_does_not_import_is_registered_unavailable(registered, monkeypatch):
    monkeypatch.setitem(backends.KERNEL_BACKENDS, "ghost", "triage_jax.kernels.no_such_kernels")
    ok, reason = quant.available_backends()["ghost"]
    assert not ok and "triage_jax.kernels.no_such_kernels does not import (ModuleNotFoundError" in reason
    with pytest.raises(quant.BackendUnavailableError, match="'ghost' is unavailable here: kernel module"):
        quant.qdot(_x((4, 32)), _x((32, 16)), PRESETS["w4a4"], backend="ghost")
    backends._KERNELS_LOADED.discard("triage_jax.kernels.no_such_kernels")


def test_no_module_imports_another_modules_private_names():
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    bad = []
    for path in [*(root / "triage_jax").rglob("*.py"), *(root / "kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("triage_jax", "kernels")):
                bad += [f"{path.relative_to(root)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_")]
    assert not bad, bad


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


@pytest.mark.xfail(strict=True, raises=(ValueError, NotImplementedError),
                   reason="the Pallas kernels do not lower to Mosaic GPU yet: per-16-element block reductions and "
                          "[rows, 1] scale tiles (kernels/pallas_quant.py's docstring); strict, so the day they "
                          "lower this fails and becomes the CPU-side guard of their GPU lowering")
def test_pallas_lowers_for_cuda():
    """The CPU-side guard of a GPU lowering: jaxlib's CPU build lowers Pallas for CUDA (Mosaic GPU) in jax.export,
    so a kernel that cannot compile on a GPU is caught here (the error is Mosaic GPU's, raised on the first one)."""
    from jax import export

    spec = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    for fn in (lambda a: pk.quantize_nvfp4(a, interpret=False), lambda a: pk.quantize_mxfp8(a, interpret=False),
               lambda a: pk.dequant_matmul(quant.quantize_nvfp4(a), quant.quantize_nvfp4(a), interpret=False)):
        export.export(jax.jit(fn), platforms=["cuda"])(spec)


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


@pytest.mark.parametrize("preset", ["w4a16", "w4a8", "w4a4", "fp8"])
def test_xla_int8_weights_give_the_xla_results_bit_for_bit(preset):
    """NVFP4 weights stored as int8 2*e2m1 codes (backend xla_int8): the same forward to the bit, dense and per
    expert; the codes are exact (-12..12) and the values, dequantized and decoded, equal the packed tensor's."""
    x, w, we = _x((32, 128), seed=10), _x((128, 48), seed=11) * 0.05, _x((3, 128, 48), seed=12) * 0.05
    prec = PRESETS[preset]
    qi, qx = quant.prequantize(w, prec, backend="xla_int8"), quant.prequantize(w, prec)
    y = quant.qdot(x, qi, prec, backend="xla_int8")
    np.testing.assert_array_equal(_bits(y), _bits(quant.qdot(x, qx, prec)))
    gs = jnp.asarray([10, 0, 22], jnp.int32)
    yg = quant.qragged_dot(x, quant.prequantize(we, prec, backend="xla_int8"), gs, prec, backend="xla_int8")
    np.testing.assert_array_equal(_bits(yg), _bits(quant.qragged_dot(x, quant.prequantize(we, prec), gs, prec)))
    if preset == "fp8":  # only NVFP4 weights change storage
        assert type(qi.q) is type(qx.q)
        return
    assert qi.q.codes.dtype == jnp.int8 and int(jnp.abs(qi.q.codes).max()) <= 12
    assert qi.q.codes.nbytes == 2 * qx.q.packed.nbytes
    np.testing.assert_array_equal(np.asarray(qi.q.block_values()), np.asarray(qx.q.block_values()))
    np.testing.assert_array_equal(np.asarray(qi.q.dequantize()), np.asarray(qx.q.dequantize()))  # -0 stored as 0


def test_xla_int8_sampler_gives_the_xla_samplers_tokens():
    from flax import nnx

    from triage_jax.models import Qwen3, get_model_config
    from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model, sampler_policy

    model = Qwen3(get_model_config("tiny", num_hidden_layers=2), rngs=nnx.Rngs(0))
    prompts = [[5, 17, 99, 3], [40, 41, 42], [77, 8, 9, 60]]

    def sample(backend):
        policy = sampler_policy("w4a16", backend=backend)
        eng = Engine(SamplingConfig(max_new_tokens=12), EngineConfig(max_slots=4, max_len=32), policy=policy,
                     model=prepare_model(model, policy))
        out = eng.generate(prompts, jax.random.key(0), n=2)
        return np.asarray(out.tokens), np.asarray(out.logprobs)

    (t0, l0), (t1, l1) = sample("xla"), sample("xla_int8")
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_array_equal(l1, l0)
