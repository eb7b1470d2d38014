"""Backend-independent quantizer numerics, checked on the CPU (docs/numerics.md, "GPU").

- `ieee.div_rn` is IEEE 754 division, bit for bit against NumPy, subnormals, ties and special values included.
- The quantizers with the portable divisions that the non-CPU backends run (div_rn elsewhere, div_wide on CUDA)
  give the CPU's bits on every case of tests/quant_cases.py.
- Their programs as a GPU computes them (CUDA branches, IEEE subnormals kept: tests/ieee_numpy.py, a NumPy
  evaluation of the jaxpr) give the CPU's bits too: the GPU branches' explicit flushes are the ones they need.
- The guard for a GPU lowering that this machine can reach: every quantizer exported for CUDA (`jax.export`,
  platforms=["cuda"]; the CPU build of jaxlib lowers for CUDA) holds no float32 division (XLA:GPU's is not
  correctly rounded), no float64 division that LLVM may shrink back to one, and no float add or subtract fed by
  a float multiply (what the GPU compiler contracts into an FMA, one rounding instead of two). Below StableHLO:
  tests/test_gpu_aot.py (XLA:GPU's PTX, compiled here) and tests/test_gpu.py (the bits on a device).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import ieee_numpy
import quant_cases
from triage_jax.quant import backends
from triage_jax.quant import formats as fmt
from triage_jax.quant import ieee

F32 = np.float32


def _np_div(a, b):
    with np.errstate(all="ignore"):
        return (a / b).astype(F32)


def _assert_ieee(a, b):
    a, b = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32))
    got = np.asarray(jax.jit(ieee.div_rn)(a, b))
    want = _np_div(a, b)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), list(zip(a[~same][:5], b[~same][:5], want[~same][:5], got[~same][:5]))


def _random_floats(rng, n, lo=0, hi=2**32):
    return rng.integers(lo, hi, n, dtype=np.uint64).astype(np.uint32).view(F32)


def test_div_rn_is_ieee_division_on_random_bits_and_ranges():
    rng = np.random.default_rng(0)
    n = 1 << 17
    _assert_ieee(_random_floats(rng, n), _random_floats(rng, n))  # every exponent, NaN and Inf included
    _assert_ieee(rng.standard_normal(n), rng.standard_normal(n))
    _assert_ieee(rng.standard_normal(n) * 1e-30, rng.standard_normal(n) * 1e10)  # subnormal results
    sub = rng.integers(1, 2**23, n).astype(np.uint32).view(F32)
    _assert_ieee(sub, rng.standard_normal(n))  # subnormal operands
    _assert_ieee(rng.standard_normal(n), sub)
    _assert_ieee(rng.standard_normal(n) * 1e30, rng.standard_normal(n) * 1e-10)  # overflow to Inf
    positive = _random_floats(rng, n, 0, 0x7F800000)
    _assert_ieee(np.full(n, 2688.0), positive)  # the NVFP4 encode scale
    _assert_ieee(np.ones(n), positive)  # S_dec and the block multipliers


def test_div_rn_ties_and_special_values():
    k = np.arange(1, 1 << 14, dtype=np.uint32).view(F32)  # k * 2^-149: exact halves after a division
    for d in (2.0, 4.0, 3.0, 0.5, 1.5, 2.0**-20, 2.0**30):
        _assert_ieee(k, np.full(k.shape, d))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2688.0, 1e-45, -1e-45,
                        np.finfo(F32).max, np.finfo(F32).tiny, 6.0, 448.0], F32)
    a, b = np.meshgrid(special, special)
    _assert_ieee(a.ravel(), b.ravel())


def _flush(a):
    a = np.asarray(a, F32)
    return np.where(np.abs(a) < np.finfo(F32).tiny, np.copysign(F32(0), a), a).astype(F32)


def test_div_is_the_cpu_division_on_every_backend():
    """ieee.div is XLA:CPU's division (IEEE, subnormals flushed: FTZ/DAZ); div_flushed, what the other backends
    run, gives the same bits here on every exponent, subnormals included."""
    rng = np.random.default_rng(1)
    a, b = _random_floats(rng, 1 << 15), _random_floats(rng, 1 << 15)
    a[:4096] = rng.integers(0, 2**23, 4096).astype(np.uint32).view(F32) * rng.choice([-1, 1], 4096)  # subnormal
    b[4096:8192] = rng.standard_normal(4096) * 1e37  # subnormal quotients
    want = _flush(_np_div(_flush(a), _flush(b)))
    for fn in (ieee.div, ieee.div_flushed, ieee.div_wide):
        got = np.asarray(jax.jit(fn)(a, b))
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), (fn.__name__, a[~same][:4], b[~same][:4], want[~same][:4], got[~same][:4])


def test_flush_subnormals_keeps_everything_else():
    x = np.array([1e-40, -1e-40, 1e-45, np.finfo(F32).tiny, -np.finfo(F32).tiny, 0.0, -0.0, 1.0, np.inf, np.nan], F32)
    got = np.asarray(jax.jit(ieee.flush_subnormals)(x))
    assert list(got.view(np.uint32)) == list(_flush(x).view(np.uint32))


def _ops_whose_bits_change(x, **patches) -> list[str]:
    """The ops of tests/quant_cases.py whose outputs on x change bits when ieee's functions are replaced by
    `patches` (name -> function), e.g. the branch another platform runs, forced on the CPU."""
    x = jnp.asarray(x)
    native = {op: quant_cases.run(op, x) for op in quant_cases.OPS}
    jax.clear_caches()  # the jitted quantizers' traces are cached
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in patches.items():
            mp.setattr(ieee, name, fn)
        patched = {op: quant_cases.run(op, x) for op in quant_cases.OPS}
    jax.clear_caches()
    return [op for op in quant_cases.OPS
            if not all(np.array_equal(quant_cases.bits(a), quant_cases.bits(b))
                       for a, b in zip(native[op], patched[op], strict=True))]


def test_flush_small_is_flush_subnormals():
    """ieee.ftz's branch off the CPU (float operations, fusible into XLA:GPU's Triton fusions) flushes exactly as
    the integer form: subnormals to the zero of their sign, zeros, normals, Inf and NaN kept; here under the CPU's
    FTZ / DAZ too, which keeps a flushed zero's sign."""
    rng = np.random.default_rng(3)
    with np.errstate(invalid="ignore"):  # the random bit patterns' NaNs pass through a float64 cast
        x = np.concatenate([_random_floats(rng, 1 << 16),
                            rng.integers(1, 2**23, 4096).astype(np.uint32).view(F32) * rng.choice([-1, 1], 4096),
                            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, np.finfo(F32).tiny,
                                      -np.finfo(F32).tiny, np.finfo(F32).max], F32)]).astype(F32)
    got, want = (np.asarray(jax.jit(f)(x)).view(np.uint32) for f in (ieee.flush_small, ieee.flush_subnormals))
    assert np.array_equal(got, want), (x[got != want][:4], got[got != want][:4], want[got != want][:4])


@pytest.mark.parametrize("case", sorted(quant_cases.inputs()))
def test_the_gpus_ftz_gives_the_cpu_bits(case):
    """Every quantizer and dequantizer with ieee.ftz and ieee.ftz_int flushing explicitly (flush_small and
    flush_subnormals, the branches that run where the backend keeps subnormals) gives the CPU's bits, where XLA:CPU
    flushes by itself."""
    bad = _ops_whose_bits_change(quant_cases.inputs()[case], ftz=ieee.flush_small, ftz_int=ieee.flush_subnormals)
    assert not bad, f"{case}: flush_small changes the bits of {bad}"


def test_div_wide_is_div_flushed_where_rounding_twice_could_bite():
    """Quotients near 1 with full 24-bit significands (where a float64 quotient lands closest to a float32
    rounding midpoint), every exponent pair, and the quantizers' own numerators: div_wide's bits are
    div_flushed's, the integer IEEE division's, NaN canonical in both."""
    rng = np.random.default_rng(2)
    n = 1 << 18
    sig = lambda: (rng.integers(1 << 23, 1 << 24, n) | 1).astype(F32)  # odd 24-bit significands
    cases = [(sig(), sig()), (_random_floats(rng, n), _random_floats(rng, n)),
             (np.full(n, 2688.0, F32), _random_floats(rng, n, 0, 0x7F800000)),
             (np.ones(n, F32), _random_floats(rng, n, 0x00800000, 0x7F800000))]
    for a, b in cases:
        got, want = (np.asarray(jax.jit(fn)(a, b)).view(np.uint32) for fn in (ieee.div_wide, ieee.div_flushed))
        assert np.array_equal(got, want), (a[got != want][:4], b[got != want][:4])


# The divisions other platforms run, as ieee.div's stand-in: div_wide (CUDA) with the caller's promises, div_rn
# without (its operands and results keep their subnormals; the CPU's own FTZ flushes them here).
_PORTABLE = {"div_rn": lambda a, b, *, flushed=False, normal=False: ieee.div_rn(a, b), "div_wide": ieee.div_wide}


@pytest.mark.parametrize("division", sorted(_PORTABLE))
@pytest.mark.parametrize("case", sorted(quant_cases.inputs()))
def test_portable_division_gives_the_cpu_bits(case, division):
    bad = _ops_whose_bits_change(quant_cases.inputs()[case], div=_PORTABLE[division])
    assert not bad, f"{case}: {division} changes the bits of {bad}"


def test_the_numpy_model_keeps_what_the_cpu_flushes():
    """tests/ieee_numpy.py computes as a GPU does: a subnormal product stays, where XLA:CPU flushes it; the CUDA
    branch of a platform_dependent is the one taken."""
    tiny = np.full(4, np.finfo(F32).tiny, F32)
    fn = lambda v: jax.lax.platform_dependent(v, cpu=lambda u: u * 0.5, cuda=lambda u: u * 0.25)
    (gpu,) = ieee_numpy.run(fn, tiny)
    assert (gpu == tiny / F32(4)).all() and (gpu > 0).all()
    assert (np.asarray(jax.jit(lambda v: v * 0.25)(tiny)) == 0).all()


def test_the_nvfp4_scale_divisions_keep_their_promises():
    """The quotients formats' NVFP4 scale divisions promise normal (ieee.div's `normal`, which spares the GPU
    their flushes), at their bounds in IEEE float32: 2688 / amax at amax = FLT_MAX (a smaller amax gives a larger
    S), and 1 / (s * S_dec) at the largest block scale (448) times the largest S_dec (1 / the smallest S)."""
    fmax, tiny = np.finfo(F32).max, np.finfo(F32).tiny
    with np.errstate(over="ignore"):
        s_min = F32(fmt.NVFP4_RANGE) / fmax
        assert s_min >= tiny
        s_dec_max = F32(1.0) / s_min
        assert F32(1.0) / (F32(fmt.E4M3_MAX) * s_dec_max) >= tiny


@pytest.mark.parametrize("case", sorted(quant_cases.inputs()))
def test_the_gpu_branches_with_ieee_subnormals_give_the_cpu_bits(case):
    """Every quantizer and dequantizer as a GPU computes it (the CUDA branch of each platform_dependent, float32
    and float64 arithmetic keeping subnormals: tests/ieee_numpy.py evaluates its jaxpr in NumPy) gives the CPU's
    bits. Under the CPU's own FTZ (the tests above) a flush missing from a GPU branch changes nothing; here the
    `extremes` case fails without the flush of the input, of S_dec = 1 / S or of the block scale times S_dec. A
    chain of float converts is one convert, as XLA:GPU makes it: with the bare E4M3 convert in `e4m3_cast`, MXFP8's
    and FP8's dequantized values (quantized in the same program) fail; so do the xla backend's MXFP8 / FP8 GEMM
    operands (`backends.fake_quant`), which are then not quantized at all."""
    x = quant_cases.inputs()[case]
    ops = {**quant_cases.OPS, **{f"fake_quant_{f}_{s}": functools.partial(backends.fake_quant, fmt_name=f, scaling=s)
                                 for f, s in (("nvfp4", "row"), ("mxfp8", "tensor"), ("fp8", "tensor"))}}
    bad = [op for op, fn in ops.items()
           if not all(np.array_equal(quant_cases.bits(np.asarray(a)), quant_cases.bits(np.asarray(b)))
                      for a, b in zip(jax.tree.leaves(jax.jit(fn)(x)), ieee_numpy.run(fn, x), strict=True))]
    assert not bad, f"{case}: the GPU's arithmetic changes the bits of {bad}"


def _with_nan_inf() -> np.ndarray:
    x = quant_cases.inputs()["bf16"].copy()
    x[0, 3], x[1, 40], x[2, 7], x[3, :] = np.nan, np.inf, -np.inf, np.nan  # a NaN row: amax from zeros
    return x


@pytest.mark.parametrize("case", sorted(quant_cases.inputs()) + ["nan_inf"])
def test_the_gpus_sliced_amaxes_give_the_cpu_bits(case):
    """nvfp4_fake_quant's amaxes off the CPU (formats._amaxes_sliced: block amaxes from 16 strided slices, the
    global amax reduced from |x|) are the CPU's (_amaxes_reduced: a reduce per block, the global from those), bit
    for bit, row and tensor scaling, amax given or not, NaN dropped as TE's fmaxf does; and so are the fake-quant
    values and factors when the CPU takes the sliced branch too."""
    x = jnp.asarray(_with_nan_inf() if case == "nan_inf" else quant_cases.inputs()[case])
    for scaling in ("row", "tensor"):
        given = jnp.max(jnp.abs(x[:, :128]), axis=-1, keepdims=True) if scaling == "row" else jnp.float32(7.5)
        for amax in (None, given):
            want, got = (jax.jit(lambda v, a, f=f: f(v, scaling, a))(x, amax)
                         for f in (fmt._amaxes_reduced, fmt._amaxes_sliced))
            for w, g in zip(want, got, strict=True):
                assert np.array_equal(quant_cases.bits(np.asarray(w)), quant_cases.bits(np.asarray(g))), (scaling, amax)
    ops = ("nvfp4_fake", "nvfp4_fake_row")
    native = {op: quant_cases.run(op, x) for op in ops}
    jax.clear_caches()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fmt, "_amaxes_reduced", fmt._amaxes_sliced)
        sliced = {op: quant_cases.run(op, x) for op in ops}
    jax.clear_caches()
    for op in ops:
        assert all(np.array_equal(quant_cases.bits(a), quant_cases.bits(b))
                   for a, b in zip(native[op], sliced[op], strict=True)), op


_DEF = re.compile(r'^\s*(%[\w#:]+) = "?(stablehlo\.\w+|func\.call @\w+|call @\w+)"?(.*)$')
_FLOAT = re.compile(r"x(f16|bf16|f32|f64)>|<(f16|bf16|f32|f64)>")


def cuda_hazards(fn, *args) -> dict[str, list[str]]:
    """The float divisions, and the float adds / subtracts with an operand a float multiply produced, of fn's
    program exported for CUDA (StableHLO text; every function of the module, branches and callees included).
    A float64 division counts only where an operand is a convert: LLVM turns fptrunc(fpext / fpext) into a
    float32 division (quant/ieee.py, `_widen`); ieee.div_wide's operands are float64 products (x * 2^-896)."""
    text = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    defs, out = {}, {"divide": [], "multiply_add": []}
    for line in text.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, op, rest = m.groups()
        defs[name] = op
        result_type = rest.rsplit(":", 1)[-1]
        if not _FLOAT.search(result_type):
            continue
        operands = re.findall(r"%[\w#:]+", rest.rsplit(":", 1)[0])
        if op == "stablehlo.divide" and (not re.search(r"[x<]f64>", result_type)
                                         or any(defs.get(a) == "stablehlo.convert" for a in operands)):
            out["divide"].append(line.strip()[:160])
        if op in ("stablehlo.add", "stablehlo.subtract"):
            if any(defs.get(a) == "stablehlo.multiply" for a in operands):
                out["multiply_add"].append(line.strip()[:160])
    return out


def test_the_guard_sees_what_it_guards_against():
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    h = cuda_hazards(lambda a: a * a + a / 3.0 + jnp.float32(2.0) / a, x)
    assert len(h["divide"]) == 2 and len(h["multiply_add"]) == 1

    def widened_by_convert(a):
        with jax.enable_x64(True):
            return (a.astype(jnp.float64) / (a + 1.0).astype(jnp.float64)).astype(jnp.float32)

    assert len(cuda_hazards(widened_by_convert, x)["divide"]) == 1
    assert cuda_hazards(lambda a: ieee.rounded(a * a) + ieee.div(a, a + 1.0), x) == {"divide": [], "multiply_add": []}


@pytest.mark.parametrize("op", sorted(quant_cases.OPS))
def test_cuda_program_has_no_division_and_no_contractible_multiply_add(op):
    h = cuda_hazards(quant_cases.OPS[op], jax.ShapeDtypeStruct((64, 256), jnp.float32))
    assert h == {"divide": [], "multiply_add": []}, h


def test_rht16_is_the_butterfly_order_bit_for_bit():
    """rht16's bits are those of its butterflies (strides 8, 4, 2, 1, then s/4) in float32, whatever backend."""
    x = (np.random.default_rng(3).standard_normal((64, 48)) * 2.0 ** np.arange(-24, 24)[None, :]).astype(F32)
    h = np.asarray(fmt.hadamard16())
    signs_over_4 = h[:, 0]  # Sylvester's H16 has a first column of ones: column 0 of H is s / 4
    v = x.T.reshape(48, 4, 16)
    for stride in (8, 4, 2, 1):
        p = v.reshape(48, 4, 16 // (2 * stride), 2, stride)
        v = np.stack([p[..., 0, :] + p[..., 1, :], p[..., 0, :] - p[..., 1, :]], axis=-2).reshape(48, 4, 16)
    want = np.ascontiguousarray((v * signs_over_4).reshape(48, 64).T)
    got = np.asarray(jax.jit(lambda a: fmt.rht16(a, axis=0))(x))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    ref = np.einsum("ji,bik->bjk", h.astype(np.float64), x.astype(np.float64).reshape(4, 16, 48)).reshape(64, 48)
    scale = np.abs(ref).max(axis=0)  # columns span 2^-24 .. 2^23: compare each against its own magnitude
    assert (np.abs(got - ref) <= 1e-6 * scale).all()
