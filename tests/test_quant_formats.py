"""Bit-exact NVFP4 / MXFP8 / FP8 reference quantizers (spec numerics.md): test vectors and properties."""

import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from triage_jax import quant
from triage_jax.quant import formats as fmt

F32 = jnp.float32
SETTINGS = settings(max_examples=25, deadline=None)


def u8(a) -> list[int]:
    a = np.asarray(a)
    if a.dtype != np.uint8:
        a = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.uint8))
    return [int(v) for v in a.ravel()]


def codes(data) -> list[int]:
    return u8(quant.e2m1_codes(data))


# --- the six hand-checked vectors ------------------------------------------------------------------------------


def test_tv1_tie_breaking_vector():
    x = jnp.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6], F32)
    q = quant.quantize_nvfp4(x)
    assert u8(q.scale) == [0x7E]
    assert codes(q.data) == [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 0xF]
    assert u8(quant.pack_fp4(q.data)) == [0x00, 0x21, 0x22, 0x43, 0x44, 0x65, 0x66, 0xF7]
    assert u8(q.packed) == [0x00, 0x21, 0x22, 0x43, 0x44, 0x65, 0x66, 0xF7]
    assert float(q.amax) == 6.0


def test_tv2_explicit_amax():
    x = jnp.array([10, -10, 4.0625, -4.0625, 4, 1, .40625, .203125] + [0] * 8, F32)
    q = quant.quantize_nvfp4(x, amax=2688.0)
    assert u8(q.scale) == [0x3D] and float(q.scale.astype(F32)[0]) == 1.625
    assert codes(q.data) == [7, 0xF, 4, 0xC, 4, 1, 0, 0] + [0] * 8
    assert u8(quant.pack_fp4(q.data)) == [0xF7, 0xC4, 0x14, 0, 0, 0, 0, 0]


def test_tv3a_zero_block():
    q = quant.quantize_nvfp4(jnp.zeros(16, F32), amax=2688.0)
    assert u8(q.scale) == [0x00] and codes(q.data) == [0] * 16
    assert not np.isnan(np.asarray(q.dequantize())).any()


def test_tv3b_subnormal_scale_kept():
    q = quant.quantize_nvfp4(jnp.array([.01, -.01, .005, .0025] + [0] * 12, F32), amax=2688.0)
    assert u8(q.scale) == [0x01] and float(q.scale.astype(F32)[0]) == 2.0**-9  # not clamped to 2^-6
    assert codes(q.data) == [7, 0xF, 5, 3] + [0] * 12


def test_tv4_mxfp8_rceil():
    q = quant.quantize_mxfp8(jnp.array([480, -480, 17, 1, 449, -.5] + [0] * 26, F32))
    assert u8(q.scale) == [0x80]
    assert u8(q.data)[:6] == [0x77, 0xF7, 0x50, 0x30, 0x76, 0xA8]


def test_tv5_mxfp8_tiny():
    q = quant.quantize_mxfp8(jnp.array([1, 2**-17, 2**-18, 3 * 2**-19, -1.5 * 2**-16, 0] + [0] * 26, F32))
    assert u8(q.scale) == [0x77]
    assert u8(q.data)[:6] == [0x78, 0x01, 0x00, 0x01, 0x83, 0x00]


# --- the float32-arithmetic E2M1 rounding equals XLA's cast ----------------------------------------------------


def _cast_codes(y):
    sat = jnp.where(jnp.isnan(y), 6.0, jnp.clip(y, -6.0, 6.0))
    return np.asarray(jax.lax.bitcast_convert_type(sat.astype(jnp.float4_e2m1fn), jnp.uint4)).astype(np.uint8)


def test_e2m1_rne_matches_cast_on_ties_and_grid():
    grid = np.concatenate([fmt.E2M1_GRID, (fmt.E2M1_GRID[1:] + fmt.E2M1_GRID[:-1]) / 2])  # values and ties
    y = np.concatenate([grid, -grid, np.nextafter(grid, 10), np.nextafter(grid, -10), [7.0, -9.0, np.nan, -0.0]])
    y = jnp.asarray(y, F32)
    np.testing.assert_array_equal(np.asarray(fmt.e2m1_rne_codes(y)), _cast_codes(y))


def test_e2m1_decode_is_the_float4_cast_bit_for_bit():
    """Every byte's low nibble decodes to ml_dtypes' float4_e2m1fn value as float32, sign of zero included (code 8
    is -0); the high nibble is ignored."""
    codes = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(jax.lax.bitcast_convert_type((codes & 0xF).astype(jnp.uint4), jnp.float4_e2m1fn).astype(F32))
    got = np.asarray(fmt.e2m1_decode(codes))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@SETTINGS
@given(hnp.arrays(np.float32, 64, elements=st.floats(-8, 8, width=32)))
def test_e2m1_rne_matches_cast(y):
    np.testing.assert_array_equal(np.asarray(fmt.e2m1_rne_codes(jnp.asarray(y))), _cast_codes(jnp.asarray(y)))


# --- properties ---------------------------------------------------------------------------------------------------

# Rows of 32 values: random signs and mantissas over a wide exponent range, so blocks hit normal, subnormal and
# zero E4M3 scales, and some blocks are all zero.
_mag = st.floats(2.0**-30, 2.0**20, width=32)
_val = st.one_of(st.just(0.0), _mag, _mag.map(lambda v: -v))
blocks32 = hnp.arrays(np.float32, st.sampled_from([(1, 32), (2, 32), (4, 32)]), elements=_val)


def _half_step(a):
    """Half the E2M1 grid step at magnitude a (the rounding error bound inside the grid)."""
    return np.where(a >= 4, 1.0, np.where(a >= 2, 0.5, 0.25))


def _check_error_bound(x, q):
    x = np.asarray(x, np.float64)
    dq = np.asarray(q.dequantize(), np.float64)
    s = np.asarray(q.scale.astype(F32), np.float64)
    g = np.asarray(q.global_decode_scale(), np.float64)
    if q.scaling == "row":
        g = g[..., 0:1]
    d = np.repeat(s, 16, axis=-1) * g  # the decoded step multiplier of each element's block
    err = np.abs(x - dq)
    eps = 1e-6 * np.abs(x) + 1e-30
    nz = d > 0
    a = np.abs(x[nz]) / d[nz]
    # Inside the grid: half a step; past 6 (the block scale rounded down): the clip excess, the scale's own effect.
    bound = d[nz] * (_half_step(np.minimum(a * (1 + 1e-6), 6.0)) + np.maximum(a - 6.0, 0.0))
    assert np.all(err[nz] <= bound + eps[nz]), np.max(err[nz] - bound)
    # A normal E4M3 scale is within 2^-4 (relative) of its target, so the clip excess is at most 6/(1-1/16)-6.
    normal = np.repeat(s >= 2.0**-6, 16, axis=-1)
    assert np.all(err[normal & nz] <= d[normal & nz] * (1.0 + 0.4) + eps[normal & nz])
    # Scale code 0: the whole block is below half the smallest subnormal scale (2^-10) times 6 * g.
    gz = np.broadcast_to(g, x.shape)
    assert np.all(np.abs(x[~nz]) <= 6 * 2.0**-10 * gz[~nz] * (1 + 1e-6)) and np.all(dq[~nz] == 0)


@SETTINGS
@given(blocks32, st.sampled_from(["tensor", "row"]))
def test_nvfp4_dequantization_error_bound(x, scaling):
    q = quant.quantize_nvfp4(jnp.asarray(x), scaling=scaling)
    _check_error_bound(x, q)


@SETTINGS
@given(blocks32, st.floats(1.0, 1e6, width=32))
def test_nvfp4_error_bound_with_reused_amax(x, factor):
    amax = float(np.max(np.abs(x))) * factor  # a reused amax is never below the tensor's own
    _check_error_bound(x, quant.quantize_nvfp4(jnp.asarray(x), amax=amax))


@SETTINGS
@given(
    st.lists(st.integers(0x08, 0x7E), min_size=2, max_size=2),
    hnp.arrays(np.uint8, (2, 16), elements=st.integers(0, 15)),
    st.booleans(),
)
def test_nvfp4_idempotent_on_representable_values(scale_bytes, code_arr, own_amax):
    """x = e2m1(q) * s exactly (one +-6 per block) quantizes back to the same bytes; with its own amax when one
    block carries the largest scale 448 (then the global factor is exactly 1)."""
    code_arr = code_arr.copy()
    code_arr[:, 0] = 7  # +6 in each block: the block amax is 6 * s
    scale_bytes = list(scale_bytes)
    if own_amax:
        scale_bytes[0] = 0x7E  # 448
    s = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(scale_bytes, jnp.uint8), jnp.float8_e4m3fn), np.float32)
    vals = np.asarray(fmt.e2m1_decode(jnp.asarray(code_arr)))
    x = jnp.asarray((vals * s[:, None]).reshape(1, 32), F32)
    q = quant.quantize_nvfp4(x) if own_amax else quant.quantize_nvfp4(x, amax=2688.0)
    assert u8(q.scale) == scale_bytes
    assert u8(quant.e2m1_codes(q.data)) == [int(c) for c in code_arr.ravel()]
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(x))


def test_nvfp4_zero_and_subnormal_blocks():
    x = np.zeros((1, 48), np.float32)
    x[0, 16:20] = [2e-3, -3e-3, 5e-4, 0]  # subnormal scale next to a large block
    x[0, 32:48] = np.linspace(-100, 100, 16)
    q = quant.quantize_nvfp4(jnp.asarray(x))
    sb = u8(q.scale)
    assert sb[0] == 0 and 0 < sb[1] < 0x08 and sb[2] == 0x7E  # zero, subnormal (unclamped), max
    dq = np.asarray(q.dequantize())
    assert np.all(dq[0, :16] == 0) and np.isfinite(dq).all()
    _check_error_bound(x, q)


@SETTINGS
@given(hnp.arrays(np.float32, (3, 32), elements=_val))
def test_row_scaling_is_per_row_tensor_scaling(x):
    x = jnp.asarray(x)
    row = quant.quantize_nvfp4(x, scaling="row")
    for i in range(3):
        t = quant.quantize_nvfp4(x[i])
        assert u8(row.packed[i]) == u8(t.packed) and u8(row.scale[i]) == u8(t.scale)
        assert float(row.amax[i, 0]) == float(t.amax)
    one = quant.quantize_nvfp4(x[:1], scaling="row")
    ten = quant.quantize_nvfp4(x[:1], scaling="tensor")
    assert u8(one.packed) == u8(ten.packed) and u8(one.scale) == u8(ten.scale)
    np.testing.assert_array_equal(np.asarray(one.dequantize()), np.asarray(ten.dequantize()))


@SETTINGS
@given(hnp.arrays(np.float32, (4, 32), elements=_val))
def test_amax_reuse_equals_quantizing_the_whole(x):
    """A slice quantized with the whole tensor's amax gets the bytes the whole tensor's quantization gives it."""
    whole = quant.quantize_nvfp4(jnp.asarray(x))
    part = quant.quantize_nvfp4(jnp.asarray(x[1:3]), amax=whole.amax)
    assert u8(part.packed) == u8(whole.packed[1:3]) and u8(part.scale) == u8(whole.scale[1:3])
    own = quant.quantize_nvfp4(jnp.asarray(x), amax=float(np.max(np.abs(x))))
    assert u8(own.packed) == u8(whole.packed)


@SETTINGS
@given(hnp.arrays(np.float32, (32, 48), elements=st.floats(-1e3, 1e3, width=32)))
def test_tile2d_w_and_wt_quantize_alike(w):
    w = jnp.asarray(w)
    a = quant.quantize_nvfp4(w, scaling="tile2d")
    b = quant.quantize_nvfp4(w.T, scaling="tile2d")
    np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b.dequantize()).T)
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes).T)
    # one scale per 16x16 tile
    s = np.asarray(a.scale.astype(F32)).reshape(2, 16, 3)
    assert (s == s[:, :1, :]).all()


@SETTINGS
@given(hnp.arrays(np.uint8, (3, 8), elements=st.integers(0, 255)))
def test_pack_unpack_round_trip(packed):
    data = quant.unpack_fp4(jnp.asarray(packed))
    assert data.dtype == jnp.float4_e2m1fn and data.shape == (3, 16)
    assert u8(quant.pack_fp4(data)) == [int(v) for v in packed.ravel()]
    lo = np.asarray(quant.e2m1_codes(data))[:, 0::2]
    np.testing.assert_array_equal(lo, packed & 0xF)  # element 2i in the low nibble


def test_nvfp4_tensor_pytree_and_data():
    x = jax.random.normal(jax.random.key(0), (2, 3, 32))
    q = jax.jit(lambda v: quant.quantize_nvfp4(v, scaling="row"))(x)
    assert q.data.dtype == jnp.float4_e2m1fn and q.data.shape == x.shape
    assert q.scale.dtype == jnp.float8_e4m3fn and q.scale.shape == (2, 3, 2) and q.amax.shape == (2, 3, 1)
    r = quant.NVFP4Tensor.from_data(q.data, q.scale, q.amax, "row")
    assert u8(r.packed) == u8(q.packed)
    leaves = jax.tree.leaves(q)
    assert len(leaves) == 3


@SETTINGS
@given(st.integers(-100, 100), st.floats(0.5, 1.0, width=32, exclude_max=True), st.booleans())
def test_mxfp8_rceil_differs_from_floor_only_in_448_512(k, frac, sign):
    """Block amax = 2^k * 512 * frac: RCEIL and FLOOR agree except for amax in (448*2^k, 512*2^k)."""
    amax = np.float32(np.ldexp(512.0 * frac, k))
    x = np.zeros(32, np.float32)
    x[3] = -amax if sign else amax
    x[5] = amax / 3
    rc = quant.quantize_mxfp8(jnp.asarray(x))
    fl = quant.quantize_mxfp8(jnp.asarray(x), rounding="floor")
    e_rc, e_fl = u8(rc.scale)[0], u8(fl.scale)[0]
    in_gap = 448 * 2.0**k < amax < 512 * 2.0**k
    assert (e_rc == e_fl + 1) if in_gap else (e_rc == e_fl)
    # RCEIL never saturates: amax / 2^(e-127) <= 448
    assert float(np.abs(np.asarray(rc.data.astype(F32))).max()) <= 448


@SETTINGS
@given(hnp.arrays(np.float32, (2, 64), elements=_val))
def test_mxfp8_dequantization_error(x):
    q = quant.quantize_mxfp8(jnp.asarray(x))
    s = np.repeat(np.asarray(q.scale.astype(F32), np.float64), 32, axis=-1)
    err = np.abs(np.asarray(q.dequantize(), np.float64) - x)
    # E4M3 rounds to 3 mantissa bits: relative 2^-4; below 2^-6 the subnormal step 2^-9 (times the scale).
    assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, 2.0**-10 * s) * (1 + 1e-6))


def test_stochastic_rounding_unbiased_and_to_neighbours():
    y = jnp.asarray([0.1, 0.3, 0.75, 1.2, 1.9, 2.5, 3.3, 4.4, 5.9, -0.6, -2.2, -5.0, 6.0, 0.0], F32)
    n = 4000
    c = fmt.e2m1_sr_codes(jnp.broadcast_to(y, (n, y.shape[0])), jax.random.key(7))
    v = np.asarray(fmt.e2m1_decode(c))
    a = np.abs(np.asarray(y))
    grid = fmt.E2M1_GRID
    lo = np.array([grid[grid <= m].max() for m in a]) * np.sign(np.asarray(y))
    hi = np.array([grid[grid >= m].min() for m in a]) * np.sign(np.asarray(y))
    assert np.all((v == lo) | (v == hi))
    step = np.abs(hi - lo)
    tol = 5 * step / (2 * np.sqrt(n)) + 1e-7  # 5 sigma (the variance is at most step^2 / 4)
    assert np.all(np.abs(v.mean(axis=0) - np.asarray(y)) <= tol)
    # deterministic under the key
    np.testing.assert_array_equal(np.asarray(c), np.asarray(fmt.e2m1_sr_codes(jnp.broadcast_to(y, (n, 14)),
                                                                            jax.random.key(7))))


def test_stochastic_rounding_in_quantize_nvfp4():
    x = jax.random.normal(jax.random.key(0), (256, 64))
    base = quant.quantize_nvfp4(x)
    dq = np.mean([np.asarray(quant.quantize_nvfp4(x, sr_key=jax.random.key(i)).dequantize()) for i in range(64)], 0)
    sr = quant.quantize_nvfp4(x, sr_key=jax.random.key(1))
    assert u8(sr.scale) == u8(base.scale)  # SR changes only the element rounding
    assert np.abs(dq - np.asarray(x)).mean() < 0.5 * np.abs(np.asarray(base.dequantize()) - np.asarray(x)).mean()


def test_rht16_orthogonal_and_cancels_in_wgrad():
    h = np.asarray(quant.hadamard16())
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    assert set(np.abs(h).ravel()) == {0.25}
    x = jax.random.normal(jax.random.key(1), (32, 8))
    g = jax.random.normal(jax.random.key(2), (32, 5))
    hx, hg = quant.rht16(x, axis=0), quant.rht16(g, axis=0)
    np.testing.assert_allclose(np.asarray(hx.T @ hg), np.asarray(x.T @ g), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(hx), axis=0), np.linalg.norm(np.asarray(x), axis=0), rtol=1e-5)


def test_fp8_per_tensor():
    x = jnp.asarray([1.0, -448.0 * 2, 3.3, 0.0], F32)
    q = quant.quantize_fp8(x)
    assert float(q.scale) == 2.0 and q.data.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(q.dequantize()), [1.0, -896.0, 3.25, 0.0])
    assert float(quant.quantize_fp8(x, scale=4.0).dequantize()[1]) == -896.0


# --- non-finite inputs ---------------------------------------------------------------------------------------


def test_nan_element_saturates_to_plus6_and_amax_drops_nan():
    x = jnp.asarray([np.nan, 1.0, -3.0] + [0.0] * 13, F32)
    q = quant.quantize_nvfp4(x)
    assert float(q.amax) == 3.0
    assert codes(q.data)[0] == 7
    assert np.isfinite(np.asarray(q.dequantize())).all()


def test_debug_mode_raises_naming_layer_and_shape():
    x = jnp.zeros((2, 16), F32).at[1, 3].set(jnp.nan).at[0, 0].set(jnp.inf)
    quant.quantize_nvfp4(x)  # off (the default): silent, spec behaviour
    with pytest.raises(Exception, match=r"quantize_nvfp4 in layer 'layers.0.mlp'.*1 NaN and 1 Inf.*\(2, 16\)"):
        jax.block_until_ready(jax.jit(lambda v: quant.quantize_nvfp4(v, name="layers.0.mlp", debug=True).packed)(x))
    jax.block_until_ready(quant.quantize_nvfp4(jnp.ones((2, 16)), debug="raise").packed)  # finite: no report
    with pytest.raises(ValueError, match="debug_nonfinite='loud'"):
        quant.quantize_nvfp4(x, debug="loud")


def test_debug_mode_logs():
    x = jnp.zeros((1, 32), F32).at[0, 5].set(jnp.nan)
    logger = logging.getLogger("triage_jax.quant")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        jax.block_until_ready(quant.quantize_mxfp8(x, debug="log").data)
        jax.effects_barrier()
    finally:
        logger.removeHandler(handler)
    assert any("quantize_mxfp8" in m and "(1, 32)" in m for m in seen), seen


def test_debug_env_is_read_once_when_the_policy_is_built(monkeypatch):
    monkeypatch.delenv("TRIAGE_JAX_DEBUG_NONFINITE", raising=False)
    before = quant.PrecisionPolicy.from_spec("w4a4")
    monkeypatch.setenv("TRIAGE_JAX_DEBUG_NONFINITE", "1")
    assert quant.nonfinite_mode_from_env() == "raise"
    after = quant.PrecisionPolicy.from_spec("w4a4")
    assert before.debug_nonfinite is False and after.debug_nonfinite == "raise"  # the built policy keeps its mode
    assert before != after and hash(before) != hash(after)  # so they key different compiled programs
    assert after.for_layer("layers.0.mlp.up_proj").debug_nonfinite == "raise"
    monkeypatch.setenv("TRIAGE_JAX_DEBUG_NONFINITE", "log")
    assert quant.PrecisionPolicy().debug_nonfinite == "log"
    assert quant.PrecisionPolicy(debug_nonfinite=False).debug_nonfinite is False  # explicit beats the env
    assert not hasattr(quant, "set_debug_nonfinite")  # no process-wide switch outside the jit key


# --- bad input -----------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_shape():
    with pytest.raises(ValueError, match=r"\(3, 24\).*multiple of 16"):
        quant.quantize_nvfp4(jnp.ones((3, 24)))
    with pytest.raises(ValueError, match=r"\(2, 48\).*multiple of 32"):
        quant.quantize_mxfp8(jnp.ones((2, 48)))
    with pytest.raises(TypeError, match=r"int32.*\(2, 16\)"):
        quant.quantize_nvfp4(jnp.ones((2, 16), jnp.int32))
    with pytest.raises(ValueError, match=r"shape \(\) has rank 0"):
        quant.quantize_nvfp4(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"tile2d.*\(8, 16\)"):
        quant.quantize_nvfp4(jnp.ones((8, 16)), scaling="tile2d")
    with pytest.raises(ValueError, match="scaling 'col'"):
        quant.quantize_nvfp4(jnp.ones((2, 16)), scaling="col")
    with pytest.raises(ValueError, match=r"amax of shape \(3,\)"):
        quant.quantize_nvfp4(jnp.ones((2, 16)), amax=jnp.ones(3))
    with pytest.raises(TypeError, match="float4_e2m1fn"):
        quant.pack_fp4(jnp.ones((2, 16)))


# --- the fast paths are bit-identical to the plain formulations ----------------------------------------------


def test_both_e4m3_scale_decodes_give_the_same_bits():
    """e4m3_scale_values' two branches (the CPU's integer decode, the float8 convert elsewhere) on every
    non-negative finite E4M3 code, subnormals included, against ml_dtypes' value."""
    codes = jnp.arange(0x7F, dtype=jnp.uint8)
    scale = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    want = np.asarray(scale.astype(F32)).view(np.uint32)
    assert np.array_equal(np.asarray(fmt.e4m3_decode_nonneg(codes)).view(np.uint32), want)  # the CPU's branch
    assert np.array_equal(np.asarray(fmt.e4m3_scale_values(scale)).view(np.uint32), want)


def test_both_e8m0_scale_decodes_give_the_same_values():
    """e8m0_scale_values' two branches (the CPU's integer decode, the float8 convert elsewhere) on all 256 E8M0
    codes against ml_dtypes' value: 2^(e - 127), code 0 the float32 subnormal 2^-127, 255 NaN."""
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert want[0] == 2.0**-127 and np.isnan(want[255])
    scale = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e8m0fnu)
    np.testing.assert_array_equal(np.asarray(fmt._pow2_biased(jnp.asarray(codes))), want)  # the CPU's branch
    np.testing.assert_array_equal(np.asarray(fmt.e8m0_scale_values(scale)), want)
    # The GPU branch's convert, unflushed (XLA:CPU's own convert may flush 2^-127): every code but 0 exact, and
    # MXFP4Tensor.block_values' product flush makes code 0's values the zeros a flushed scale gives.
    conv = np.asarray(scale.astype(F32))
    np.testing.assert_array_equal(conv[1:], want[1:])
    assert conv[0] in (0.0, 2.0**-127)


def test_mxfp4_values_from_an_unflushed_scale_are_the_cpus():
    """Off the CPU, MXFP4 weights decode with an unflushed scale (code 0 is the subnormal 2^-127, and e2m1 * 2^-127
    can be a normal number: 6 * 2^-127), and code 0's products are zeroed instead. That formula, modelled in NumPy
    (IEEE, subnormals kept) on every E2M1 code under scale codes 0, 1, 127, 254 and 255 (NaN), gives the CPU's
    block_values (XLA:CPU reads 2^-127 as 0), zeros' signs included. The GPU tests check the GPU's own bits."""
    rng = np.random.default_rng(0)
    codes = np.array([[0, 1, 127, 254], [255, 0, 126, 3]], np.uint8)
    packed = rng.integers(0, 256, (2, 64), dtype=np.uint8)
    t = fmt.MXFP4Tensor(packed=jnp.asarray(packed), scale=jax.lax.bitcast_convert_type(jnp.asarray(codes),
                                                                                        jnp.float8_e8m0fnu))
    got = np.asarray(t.block_values())
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(2, 128)
    vals = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # 6 * 2^127 overflows; NaN * 0
        prod = vals * np.repeat(codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, axis=-1)
        prod = np.where(np.repeat(codes == 0, 32, axis=-1), prod * np.float32(0.0), prod)
        want = np.where(np.abs(prod) < np.float32(2.0**-126), prod * np.float32(0.0), prod)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    assert np.isnan(got[1, :32]).all() and (got[0, :32] == 0).all() and np.signbit(got[0, :32]).any()


@SETTINGS
@given(hnp.arrays(np.float32, 64, elements=st.floats(0, 448, width=32)))
def test_e4m3_integer_rounding_matches_cast(v):
    val, code = fmt.e4m3_round_nonneg(jnp.asarray(v))
    ref = jnp.asarray(v).astype(jnp.float8_e4m3fn)
    assert u8(code) == u8(ref)
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref.astype(F32)))
    np.testing.assert_array_equal(np.asarray(fmt.e4m3_decode_nonneg(code)), np.asarray(ref.astype(F32)))


def _wide_range_matrix(seed: int, shape) -> np.ndarray:
    """Random signs and magnitudes over ~2^-40..2^20, with zeroed entries and rows (zero / subnormal blocks)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp2(rng.uniform(-40, 20, (shape[0], 1)) + rng.uniform(-4, 4, shape))
    w[rng.random(shape) < 0.1] = 0.0
    w[rng.integers(shape[0])] = 0.0
    return w.astype(np.float32)


@SETTINGS
@given(st.integers(0, 2**31), st.sampled_from(["tensor", "tile2d"]))
def test_kn_weight_quantizers_equal_quantizing_the_transpose(seed, scaling):
    w = jnp.asarray(_wide_range_matrix(seed, (32, 48)))
    a, b = fmt.quantize_nvfp4_kn(w, scaling=scaling), quant.quantize_nvfp4(w.T, scaling=scaling)
    assert u8(a.packed) == u8(b.packed) and u8(a.scale) == u8(b.scale) and float(a.amax) == float(b.amax)
    v, g = fmt.nvfp4_fake_quant_kn(w, scaling=scaling)
    np.testing.assert_array_equal(np.asarray(v).T, np.asarray(b.block_values()))
    assert float(g) == float(b.global_decode_scale())
    np.testing.assert_array_equal(np.asarray(a.block_values_t("split")).T, np.asarray(b.block_values("split")))
    if scaling == "tensor":
        m, n = fmt.quantize_mxfp8_kn(w), quant.quantize_mxfp8(w.T)
        assert u8(m.data) == u8(n.data) and u8(m.scale) == u8(n.scale)


@SETTINGS
@given(hnp.arrays(np.float32, (3, 32), elements=_val), st.sampled_from(["tensor", "row"]))
def test_fake_quant_values_equal_the_decoded_tensor(x, scaling):
    q = quant.quantize_nvfp4(jnp.asarray(x), scaling=scaling)
    v, g = fmt.nvfp4_fake_quant(jnp.asarray(x), scaling=scaling)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(q.block_values()))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(q.global_decode_scale()))
    # the split K order is a per-block permutation: even elements, then odd
    split = np.asarray(q.block_values("split")).reshape(3, 2, 2, 8)
    nat = np.asarray(q.block_values()).reshape(3, 2, 8, 2)
    np.testing.assert_array_equal(split, np.swapaxes(nat, -1, -2))


# --- dequantize in Transformer Engine's order ------------------------------------------------------------------


def _te_dequantize_np(q) -> np.ndarray:
    """TE's dequantize_fp4_kernel in numpy float32: final = (float(s) * amax) * f32(1/(6*448)); out = e2m1 * final."""
    c = np.asarray(q.codes)
    e = np.where(c & 8, -1.0, 1.0).astype(np.float32) * fmt.E2M1_GRID[c & 7]
    s = np.asarray(q.scale.astype(F32), np.float32)  # the E4M3 block scale decoded by XLA's cast
    amax = np.asarray(q.amax, np.float32)
    if q.scaling != "row":
        amax = amax.reshape(amax.shape + (1,) * (s.ndim - amax.ndim))
    factor_inv = np.float32(1.0 / (6.0 * 448.0))
    final = (s * amax) * factor_inv
    return (e.reshape(*s.shape, 16) * final[..., None]).reshape(e.shape)


def _old_order_np(q) -> np.ndarray:
    """The order this project used before: (e2m1 * s) * (amax / 2688)."""
    c = np.asarray(q.codes)
    e = np.where(c & 8, -1.0, 1.0).astype(np.float32) * fmt.E2M1_GRID[c & 7]
    s = np.asarray(q.scale.astype(F32), np.float32)
    amax = np.asarray(q.amax, np.float32)
    if q.scaling != "row":
        amax = amax.reshape(amax.shape + (1,) * (s.ndim - amax.ndim))
    g = amax / np.float32(2688.0)
    return ((e.reshape(*s.shape, 16) * s[..., None]) * g[..., None]).reshape(e.shape)


def _u32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@pytest.mark.parametrize("case", ["tensor", "row", "explicit_amax", "per_expert", "weight"])
def test_nvfp4_dequantize_is_te_order_bit_exact(case):
    x = jnp.asarray(_wide_range_matrix(11, (48, 128)) * np.float32(3.7))
    if case == "per_expert":
        q = jax.vmap(quant.quantize_nvfp4)(x.reshape(3, 16, 128))  # amax [3], one per matrix
    elif case == "weight":
        q = quant.prequantize(x.T, quant.PRESETS["w4a16"]).q  # the sampler's pre-quantized weight
    elif case == "explicit_amax":
        q = quant.quantize_nvfp4(x, amax=float(jnp.max(jnp.abs(x))) * 1.37)
    else:
        q = quant.quantize_nvfp4(x, scaling=case)
    te, old = _te_dequantize_np(q), _old_order_np(q)
    assert np.mean(_u32(te) != _u32(old)) > 0.005  # the two orders differ by an ulp on real inputs
    np.testing.assert_array_equal(_u32(q.dequantize()), _u32(te))  # eager
    np.testing.assert_array_equal(_u32(jax.jit(lambda t: t.dequantize())(q)), _u32(te))  # fused under jit
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.bfloat16)), te.astype(jnp.bfloat16))


def test_quantized_weight_dequantize_follows_te_order():
    w = jnp.asarray(_wide_range_matrix(12, (64, 32)))  # w[K, N]
    qw = quant.prequantize(w, quant.PRESETS["w4a16"])
    np.testing.assert_array_equal(_u32(qw.dequantize()), _u32(_te_dequantize_np(qw.q).T))


def test_nvfp4_dequantize_zero_amax_gives_zero_like_te():
    q = quant.quantize_nvfp4(jnp.ones((1, 16), F32), amax=0.0)  # TE: final = s * 0 * f = 0
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.zeros((1, 16), np.float32))
