"""MXFP4 (OCP MX v1.0; numerics.md "MXFP4"): hand-checked vectors, a float64 reference, packing, the dot and the
presets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax import quant
from triage_jax.quant import PRESETS, LayerPrecision
from triage_jax.quant import backends as be
from triage_jax.quant import formats as fmt

F32 = jnp.float32
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _u8(a) -> list[int]:
    return [int(v) for v in np.asarray(a).ravel()]


def _block(head, fill=0.0):
    """One 32-element block starting with `head`."""
    return jnp.asarray(list(head) + [fill] * (32 - len(head)), F32)


# --- hand-checked vectors ---------------------------------------------------------------------------------------

# amax 7.9: floor(log2 7.9) = 2, so the OCP exponent is 0 (code 127) and 7, 7.9 saturate to 6; RCEIL takes
# 2^1 >= 7.9/6 (code 128) and rounds x/2. Ties go to the even code: 5 -> 4 (idx 6), 3.5 -> 4, 0.25 -> 0,
# -1.25 -> -1 (idx 2); under RCEIL 2.5 -> 2 (idx 4), 1.75 -> 2, 0.125 -> 0.
VEC = [7.0, 6.0, 5.0, 3.5, 0.25, 0.26, -1.25, -7.9]


def test_floor_vector():
    q = quant.quantize_mxfp4(_block(VEC)[None], rounding="floor")
    assert _u8(q.exponents) == [127]
    assert _u8(q.codes[0, :8]) == [7, 7, 6, 6, 0, 1, 0xA, 0xF]
    assert np.asarray(q.block_values())[0, :8].tolist() == [6, 6, 4, 4, 0, 0.5, -1, -6]
    assert _u8(q.codes[0, 8:]) == [0] * 24
    # packed like NVFP4: element 2i in bits 0-3, element 2i+1 in bits 4-7
    assert _u8(q.packed[0, :4]) == [0x77, 0x66, 0x10, 0xFA]
    assert q.data.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e8m0fnu
    assert q.exponents.dtype == jnp.uint8 and q.shape == (1, 32)


def test_rceil_vector():
    q = quant.quantize_mxfp4(_block(VEC)[None], rounding="rceil")
    assert _u8(q.exponents) == [128]
    assert _u8(q.codes[0, :8]) == [6, 5, 4, 4, 0, 0, 0x9, 0xE]
    assert np.asarray(q.dequantize())[0, :8].tolist() == [8, 6, 4, 4, 0, 0, -1, -8]


def test_exponent_edges():
    # amax exactly 6 * 2^k: both rules give 2^k; just above it RCEIL steps up, floor saturates instead.
    cases = {  # amax: (floor code, rceil code)
        6.0: (127, 127), 6.0000005: (127, 128), 4.0: (127, 127), 1.0: (125, 125), 1.5: (125, 125),
        1.5000001: (125, 126), 0.75: (124, 124), 2.0 ** -120: (5, 5), 3.0 * 2.0 ** 100: (226, 226),
    }
    for amax, (lo, hi) in cases.items():
        x = _block([amax, -amax / 3])[None]
        assert _u8(quant.quantize_mxfp4(x, "floor").exponents) == [lo], amax
        assert _u8(quant.quantize_mxfp4(x, "rceil").exponents) == [hi], amax


def test_zero_and_tiny_blocks_get_scale_code_zero():
    # A zero block gets scale code 0 (E8M0 has no zero: code 0 is 2^-127) and zero elements, so it decodes to 0.
    x = jnp.stack([_block([]), _block([1e-40, -3e-39]), _block([2.0 ** -126])])
    for rounding in ("floor", "rceil"):
        q = quant.quantize_mxfp4(x, rounding)
        assert _u8(q.exponents) == [0, 0, 0]
        assert _u8(q.codes[0]) == [0] * 32
        assert float(q.decoded_scale()[0, 0]) == 2.0 ** -127
        assert np.all(np.asarray(q.dequantize())[0] == 0)
    # 2^-126 * 2^127 = 2 on the grid (code 4)
    assert int(quant.quantize_mxfp4(x, "floor").codes[2, 0]) == 4


def test_nonfinite():
    x = _block([1.0, jnp.nan])[None]
    q = quant.quantize_mxfp4(x)
    assert _u8(q.exponents) == [125] and int(q.codes[0, 1]) == 7  # NaN is ignored by the amax, saturates to +6
    qi = quant.quantize_mxfp4(_block([1.0, jnp.inf])[None])
    assert _u8(qi.exponents) == [255] and np.isnan(np.asarray(qi.dequantize())[0]).all()  # NaN scale


def test_bad_input_names_the_shape():
    with pytest.raises(ValueError, match=r"quantize_mxfp4: last \(contraction\) dim of shape \(3, 48\) is 48, "
                                         r"not a multiple of 32"):
        quant.quantize_mxfp4(jnp.zeros((3, 48)))
    with pytest.raises(ValueError, match=r"\(2, 40\)"):
        fmt.quantize_mxfp4_kn(jnp.zeros((40, 2)))
    with pytest.raises(ValueError, match="rounding"):
        quant.quantize_mxfp4(jnp.zeros((1, 32)), rounding="nearest")
    with pytest.raises(TypeError, match="int32"):
        quant.quantize_mxfp4(jnp.zeros((1, 32), jnp.int32))
    with pytest.raises(ValueError, match="K=48"):
        quant.qdot(jnp.zeros((2, 48)), jnp.zeros((48, 8)), PRESETS["w4a4_mx"])


# --- float64 reference --------------------------------------------------------------------------------------------


def _reference(x: np.ndarray, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [.., K], biased exponents [.., K/32]) in float64, straight from the spec's words."""
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        if rounding == "floor":
            e = np.floor(np.log2(amax)) - 2
        else:  # smallest e with 2^e >= amax / 6, decided by exact comparisons
            e = np.ceil(np.log2(amax / 6))
            e = np.where(6 * 2.0 ** (e - 1) >= amax, e - 1, e)
            e = np.where(6 * 2.0 ** e < amax, e + 1, e)
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    y = np.clip(xb / 2.0 ** e[..., None], -6, 6)
    a = np.abs(y)
    dist = np.abs(a[..., None] - GRID)
    idx = np.argmin(dist, -1)  # first (lower) on ties...
    tie = np.isclose(np.take_along_axis(dist, np.minimum(idx + 1, 7)[..., None], -1)[..., 0],
                     np.take_along_axis(dist, idx[..., None], -1)[..., 0], rtol=0, atol=0) & (idx < 7)
    idx = np.where(tie & (idx % 2 == 1), idx + 1, idx)  # ...then to the even index
    codes = np.where(np.signbit(y), idx | 8, idx)  # the sign bit is kept, also on a value that rounds to 0
    return codes.reshape(x.shape).astype(np.uint8), (e + 127).astype(np.uint8)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_matches_float64_reference(rounding):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)) * np.exp2(rng.integers(-30, 30, (64, 1)))
    x[3] = 0.0  # zero row
    x[5, :32] = rng.choice(GRID, 32) * rng.choice([-1, 1], 32) * 0.5 ** 3  # grid points and midpoints
    x[6, :32] = np.linspace(-6, 6, 32)
    x[7, :16] = np.concatenate([(GRID[1:] + GRID[:-1]) / 2, -(GRID[1:] + GRID[:-1]) / 2, [6.0, 0]])[:16]  # ties
    x = x.astype(np.float32)
    q = quant.quantize_mxfp4(jnp.asarray(x), rounding)
    codes, e = _reference(x, rounding)
    np.testing.assert_array_equal(np.asarray(q.exponents), e)
    np.testing.assert_array_equal(np.asarray(q.codes), codes)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_kn_fake_quant_and_packing_agree(rounding):
    w = jax.random.normal(jax.random.key(0), (2, 64, 48)) * 3
    a = quant.quantize_mxfp4(jnp.swapaxes(w, -1, -2), rounding)
    b = fmt.quantize_mxfp4_kn(w, rounding)
    assert np.array_equal(a.packed, b.packed) and np.array_equal(a.exponents, b.exponents)
    assert np.array_equal(fmt.mxfp4_fake_quant(jnp.swapaxes(w, -1, -2), rounding), a.block_values())
    assert np.array_equal(fmt.mxfp4_fake_quant_kn(w, rounding), jnp.swapaxes(a.block_values(), -1, -2))
    # .data / from_data / pack_fp4 round trip, and bf16 holds the values exactly
    c = fmt.MXFP4Tensor.from_data(a.data, a.scale, rounding)
    assert np.array_equal(c.packed, a.packed) and np.array_equal(quant.pack_fp4(a.data), a.packed)
    v = a.block_values()
    assert np.array_equal(v.astype(jnp.bfloat16).astype(F32), v)
    # float4 data decodes to the same values as the codes (ml_dtypes' float4_e2m1fn)
    np.testing.assert_array_equal(np.asarray(a.data.astype(F32)), np.asarray(fmt.e2m1_decode(a.codes)))


def test_error_bound_and_rounding_order():
    x = jax.random.normal(jax.random.key(3), (256, 64))
    err = {r: float(jnp.mean(jnp.abs(quant.quantize_mxfp4(x, r).dequantize() - x))) for r in ("floor", "rceil")}
    nv = float(jnp.mean(jnp.abs(quant.quantize_nvfp4(x).dequantize() - x)))
    assert nv < min(err.values())  # 16-blocks with E4M3 scales beat 32-blocks with power-of-two scales
    assert max(err.values()) < 0.15


# --- the dot and the presets --------------------------------------------------------------------------------------


MX_PRESETS = ["w4a16_mx", "w4a8_mx", "w4a4_mx", "w4a4_mx_rceil"]


def _dq(x, f):
    if f == "none":
        return np.asarray(x, np.float64)
    return np.asarray(be.reference_quantize(x, f).dequantize(F32), np.float64)


@pytest.mark.parametrize("name", MX_PRESETS)
def test_qdot_presets(name):
    prec = PRESETS[name]
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (12, 64))
    w = jax.random.normal(kw, (64, 16)) * 0.05
    y = quant.qdot(x, w, prec)
    ref = _dq(x, prec.act) @ _dq(w.T, prec.weight).T
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    assert np.abs(np.asarray(y) - np.asarray(x @ w)).max() > 1e-3
    qw = quant.prequantize(w, prec)
    assert isinstance(qw.q, fmt.MXFP4Tensor)
    assert np.array_equal(quant.qdot(x, qw, prec), y)  # the sampler's pre-quantized weight, bit for bit
    # MX activations have block-local scales only: a row's result does not depend on the other rows
    if prec.act != "none":
        assert np.array_equal(quant.qdot(x[:3], w, prec), y[:3])
        assert dataclasses.replace(prec, act_scaling="row") != prec  # (the field exists but changes nothing)
        assert np.array_equal(quant.qdot(x, w, dataclasses.replace(prec, act_scaling="row")), y)
    g = jax.grad(lambda w_: jnp.sum(quant.qdot(x, w_, prec)))(w)  # straight-through backward
    np.testing.assert_allclose(np.asarray(g), np.asarray(jnp.sum(x, 0)[:, None] * jnp.ones((1, 16))),
                               rtol=1e-2, atol=1e-2)


def test_qragged_mxfp4_is_per_expert_qdot():
    prec = PRESETS["w4a4_mx"]
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (40, 64))
    w = jax.random.normal(kw, (3, 64, 32)) * 0.05
    gs = jnp.asarray([11, 0, 25], jnp.int32)
    y = np.asarray(quant.qragged_dot(x, w, gs, prec))
    yq = np.asarray(quant.qragged_dot(x, quant.prequantize(w, prec), gs, prec))
    np.testing.assert_array_equal(y, yq)
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        np.testing.assert_allclose(y[start:start + size], np.asarray(quant.qdot(x[start:start + size], w[e], prec)),
                                   rtol=1e-5, atol=1e-6)
        start += size
    assert np.all(y[start:] == 0)


@pytest.mark.parametrize("name", ["w4a4_mx", "w4a8_mx"])
def test_composed_backend_gets_exact_values(name):
    # A backend without MXFP4 kernels (composed quantize + matmul: pallas) is handed the exact bf16 values.
    prec = PRESETS[name]
    x = jax.random.normal(jax.random.key(4), (8, 64))
    w = jax.random.normal(jax.random.key(5), (64, 16))
    ref = np.asarray(be.reference_dot(x, w, prec))
    np.testing.assert_array_equal(np.asarray(be.composed_dot(be.get_backend("xla"), x, w, prec)), ref)
    np.testing.assert_array_equal(np.asarray(quant.qdot(x, w, prec, backend="pallas")), np.asarray(quant.qdot(x, w, prec)))


def test_presets_and_policy():
    assert {"w4a16_mx", "w4a8_mx", "w4a4_mx", "w4a4_mx_rceil"} <= set(PRESETS)
    assert PRESETS["w4a4_mx"] == LayerPrecision(weight="mxfp4", act="mxfp4")
    pol = quant.PrecisionPolicy.from_spec("w4a4_mx", act_scaling="row")
    assert pol.for_layer("layers.0.mlp.down_proj").weight == "mxfp4"
    assert pol.for_layer("lm_head") == LayerPrecision()
    with pytest.raises(ValueError, match="mxfp4"):
        LayerPrecision(weight="mxfp6")
