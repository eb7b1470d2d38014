"""Backend registry and capability probe; Pallas kernels bit-exact against the reference in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax import quant
from triage_jax.kernels import pallas_quant as pk
from triage_jax.quant import PRESETS, backends
from triage_jax.quant import formats as fmt
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


def test_a_probe_first_asked_inside_a_trace_gives_the_real_answer():
    """A backend is first resolved where a model is traced (its copy prepared under jax.eval_shape, a qdot under
    jit): its probe still computes on concrete arrays, and the answer cached for the process is the real one. The
    pallas probe compares its kernels' bits with the reference's (bool of an array)."""
    backends._probe.cache_clear()
    asked = []

    def traced(x):
        asked.append(quant.resolve_backend("pallas"))
        return x

    try:
        jax.eval_shape(traced, jnp.ones(3))
        assert asked == ["pallas"] and backends.available_backends()["pallas"][0]
    finally:
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
@pytest.mark.parametrize("shape", [(32, 96), (2, 16, 64), (272, 32)])
def test_pallas_nvfp4_bit_exact(scaling, shape):
    """Several grid tiles down K (block_g=1) and across N (272 rows: 3 tiles of 128 columns, the last padded)."""
    x = _x(shape)
    ref = quant.quantize_nvfp4(x, scaling=scaling)
    got = pk.quantize_nvfp4(x, scaling=scaling, block_g=1, block_n=128, interpret=True)
    np.testing.assert_array_equal(_bits(got.packed), _bits(ref.packed))
    np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))
    np.testing.assert_array_equal(np.asarray(got.amax), np.asarray(ref.amax))
    assert got.scaling == scaling and got.data.shape == shape


def test_pallas_nvfp4_amax_reuse_and_nan():
    x = _x((16, 64)).at[3, 7].set(jnp.nan)
    for amax in (None, 1e4):
        ref = quant.quantize_nvfp4(x, amax=amax)
        got = pk.quantize_nvfp4(x, amax=amax, block_g=1, interpret=True)
        np.testing.assert_array_equal(_bits(got.packed), _bits(ref.packed))
        np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))


@pytest.mark.parametrize("shape", [(16, 128), (2, 8, 64), (300, 64)])
def test_pallas_mxfp8_bit_exact(shape):
    x = _x(shape, seed=1)
    ref, got = quant.quantize_mxfp8(x), pk.quantize_mxfp8(x, block_g=1, block_n=128, interpret=True)
    np.testing.assert_array_equal(_bits(got.data), _bits(ref.data))
    np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))


@pytest.mark.parametrize("scaling", ["tensor", "tile2d"])
def test_pallas_kn_weight_quantizers_bit_exact(scaling):
    """Weights quantized in their own K-major layout (no transpose) equal the reference's K-major quantizers, and
    the backend's prequantize uses them."""
    w = _x((96, 272), seed=13).at[5, 7].set(jnp.nan)
    ref, got = fmt.quantize_nvfp4_kn(w, scaling=scaling), pk.quantize_nvfp4_kn(w, scaling=scaling, block_g=2,
                                                                                  interpret=True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    if scaling == "tensor":
        ref, got = fmt.quantize_mxfp8_kn(w), pk.quantize_mxfp8_kn(w, interpret=True)
        np.testing.assert_array_equal(_bits(got.data), _bits(ref.data))
        np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))
    assert backends.get_backend("pallas").quantize_kn is pk.BACKEND.quantize_kn is not None


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


def test_align_tool_checks_a_backend_against_the_reference(capsys):
    """The align tool's table for one backend: every quantizer, qdot and qragged row, 0 mismatches (the slow test
    below runs every available backend, Pallas and fp4_gemm in their ~1 minute of interpreters)."""
    assert align.main(["--small", "--repeats", "1", "--backends", "xla_int8"]) == 0
    out = capsys.readouterr().out
    assert "14 checks on 1 backends: 0 mismatches" in out, out
    assert "xla_int8 quantize nvfp4:tile2d" in out and "xla_int8 qragged w4a4" in out, out


@pytest.mark.slow  # 67 s on 2 cores (pytest -n 2): the interpreters; the default run stays near 15 min
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


def _export_for_cuda(fn, shape):
    from jax import export

    export.export(jax.jit(fn), platforms=["cuda"])(jax.ShapeDtypeStruct(shape, jnp.float32))


@pytest.mark.parametrize("op", ["nvfp4", "nvfp4:row", "nvfp4:tile2d", "nvfp4_kn", "nvfp4_kn:tile2d", "mxfp8",
                                "mxfp8_kn"])
def test_pallas_quantizers_lower_for_cuda(op):
    """The CPU-side guard of the kernels' GPU lowering: jaxlib's CPU build lowers Pallas for CUDA (Mosaic GPU) in
    jax.export, so a change that breaks it (an 8-bit op, a reduction over part of a tile, a TMA tile over 256 or
    a row under 128) fails here. A non-multiple of 128 columns exercises the padding. The compile below it (PTX,
    ptxas, SASS) is tests/test_gpu_aot.py's (deviceless, through jax's CUDA PJRT plugin); the bits on a device
    are test_pallas_compiled_on_gpu_bit_exact's (-m gpu)."""
    name, _, scaling = op.partition(":")
    fn = {"nvfp4": lambda a: pk.quantize_nvfp4(a, scaling=scaling or "tensor", interpret=False),
          "nvfp4_kn": lambda a: pk.quantize_nvfp4_kn(a, scaling=scaling or "tensor", interpret=False),
          "mxfp8": lambda a: pk.quantize_mxfp8(a, interpret=False),
          "mxfp8_kn": lambda a: pk.quantize_mxfp8_kn(a, interpret=False)}[name]
    _export_for_cuda(fn, (96, 512))


def _kernel_hazards(fn, shape) -> list[str]:
    """Float divisions, and float adds / subtracts fed by a float multiply, in the Pallas kernel bodies of fn (their
    jaxprs, call boundaries followed): ptxas may contract a mul.f32 feeding an add.f32 into one FMA, and a
    division would be the GPU's approximate one (docs/numerics.md, "GPU")."""
    bad = []

    def walk(jaxpr, producer):
        for eqn in jaxpr.eqns:
            is_float = any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars if hasattr(v.aval, "dtype"))
            name = eqn.primitive.name
            if is_float and name == "div":
                bad.append(f"div {eqn}")
            if is_float and name in ("add", "sub") and any(producer.get(v) == "mul" for v in eqn.invars
                                                           if not isinstance(v, jax.extend.core.Literal)):
                bad.append(f"{name} of a mul: {eqn}")
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                inner = {iv: producer.get(ov) for iv, ov in zip(sub.invars, eqn.invars)
                         if not isinstance(ov, jax.extend.core.Literal)}
                walk(sub, inner)
            for v in eqn.outvars:
                producer[v] = name if is_float else None

    for eqn in jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(shape, jnp.float32)).eqns:
        if eqn.primitive.name == "pallas_call":
            walk(eqn.params["jaxpr"], {})
    return bad


@pytest.mark.parametrize("op", ["nvfp4:row", "nvfp4_kn:tile2d", "mxfp8"])
def test_pallas_kernel_bodies_have_no_division_and_no_contractible_multiply_add(op):
    name, _, scaling = op.partition(":")
    fn = {"nvfp4": lambda a: pk.quantize_nvfp4(a, scaling=scaling, interpret=False),
          "nvfp4_kn": lambda a: pk.quantize_nvfp4_kn(a, scaling=scaling, interpret=False),
          "mxfp8": lambda a: pk.quantize_mxfp8(a, interpret=False)}[name]
    assert not _kernel_hazards(fn, (64, 256))


def test_the_kernel_hazard_check_sees_them():
    from jax.experimental import pallas as pl

    def fn(a):
        def body(x_ref, o_ref):
            x = x_ref[...]
            o_ref[...] = x * x + x / 3.0
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), interpret=True)(a)
    assert len(_kernel_hazards(fn, (8, 128))) == 2


@pytest.mark.xfail(strict=True, raises=NotImplementedError,
                   reason="the fused dequantize-matmul decodes 8-bit operands in registers and multiplies with "
                          "jnp.dot; Mosaic GPU has no 8-bit arithmetic and multiplies with wgmma on shared memory "
                          "(kernels/pallas_quant.py's docstring); strict, so the day it lowers this fails")
def test_pallas_dequant_matmul_lowers_for_cuda():
    _export_for_cuda(lambda a: pk.dequant_matmul(quant.quantize_nvfp4(a), quant.quantize_nvfp4(a), interpret=False),
                     (64, 256))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas needs a GPU")
def test_pallas_compiled_on_gpu_bit_exact():
    """The Mosaic GPU kernels compiled, against the xla backend's bits on the same GPU (themselves checked against
    the CPU's in tests/test_gpu.py), and the backend's forward (these quantizers, xla's GEMM) close to xla's."""
    x = _x((300, 1024), seed=8).at[3, 7].set(jnp.nan)
    for scaling in ("tensor", "row", "tile2d"):
        xs = x[:288] if scaling == "tile2d" else x
        ref, got = quant.quantize_nvfp4(xs, scaling=scaling), pk.quantize_nvfp4(xs, scaling=scaling, interpret=False)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    ref, got = quant.quantize_mxfp8(x), pk.quantize_mxfp8(x, interpret=False)
    np.testing.assert_array_equal(_bits(got.data), _bits(ref.data))
    np.testing.assert_array_equal(_bits(got.scale), _bits(ref.scale))
    w = _x((1024, 2560), seed=9)
    for scaling in ("tensor", "tile2d"):
        ref, got = fmt.quantize_nvfp4_kn(w, scaling=scaling), pk.quantize_nvfp4_kn(w, scaling=scaling, interpret=False)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    ref, got = fmt.quantize_mxfp8_kn(w), pk.quantize_mxfp8_kn(w, interpret=False)
    np.testing.assert_array_equal(_bits(got.data), _bits(ref.data))
    for preset in ("w4a4", "w4a16"):
        y_p = quant.qdot(x[8:72], w, PRESETS[preset], backend="pallas")  # the same exact operands; only the
        y_x = quant.qdot(x[8:72], w, PRESETS[preset], backend="xla")  # GEMMs' float32 summation orders may differ
        np.testing.assert_allclose(np.asarray(y_p), np.asarray(y_x), rtol=1e-5, atol=1e-5 * float(jnp.abs(y_x).max()))


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


def test_int8_codes_decode_exactly_in_bfloat16_for_every_code_and_scale():
    """NVFP4Int8Tensor decodes in bf16 (so XLA:GPU can fuse the decode into its GEMM): every E2M1 code times every
    finite non-negative E4M3 scale, subnormals included, gives NVFP4Tensor's float32 value exactly."""
    codes = jnp.tile(jnp.arange(16, dtype=jnp.uint8), 127 * 1)  # 16 codes per block: block j has scale bits j
    scale = jax.lax.bitcast_convert_type(jnp.arange(127, dtype=jnp.uint8), jnp.float8_e4m3fn)[None, :]
    q = fmt.NVFP4Tensor(packed=fmt.pack_codes(codes)[None, :], scale=scale, amax=jnp.float32(1.0))
    qi = fmt.NVFP4Int8Tensor.from_nvfp4(q)
    got = qi.block_values()
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(q.block_values()))
    assert float(jnp.abs(q.block_values()).max()) == 6 * 448 and float(jnp.abs(got[0, 16:32]).min()) == 0


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
