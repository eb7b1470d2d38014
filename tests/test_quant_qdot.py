"""The quantized dot (dense and grouped): forward and gradients against float references, policies."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax import quant
from triage_jax.quant import PRESETS, LayerPrecision, PrecisionPolicy
from triage_jax.quant.backends import get_backend

F32 = jnp.float32
BF16 = jnp.bfloat16


def _data(m=24, k=64, n=32, seed=0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), F32) * jnp.exp(jax.random.normal(kc, (m, 1)))
    w = jax.random.normal(kw, (k, n), F32) * 0.05
    return x, w


def _dq(x, fmt_name, scaling):
    """The float reference operand: dequantize(quantize(x)) in float64, or x itself."""
    if fmt_name == "none":
        return np.asarray(x, np.float64)
    q = {"nvfp4": lambda: quant.quantize_nvfp4(x, scaling=scaling), "mxfp8": lambda: quant.quantize_mxfp8(x),
         "fp8": lambda: quant.quantize_fp8(x)}[fmt_name]()
    return np.asarray(q.dequantize(F32), np.float64)


PRECS = {
    "fp8": PRESETS["fp8"],
    "w4a16": PRESETS["w4a16"],
    "w4a8": PRESETS["w4a8"],
    "w4a4": PRESETS["w4a4"],
    "w4a4_row_tile2d": LayerPrecision(weight="nvfp4", act="nvfp4", act_scaling="row", weight_scaling="tile2d"),
}


@pytest.mark.parametrize("name", sorted(PRECS))
def test_qdot_forward_matches_dequantize_then_float_dot(name):
    prec = PRECS[name]
    x, w = _data()
    y = quant.qdot(x.reshape(2, 12, 64), w, prec).reshape(24, 32)
    ref = _dq(x, prec.act, prec.act_scaling) @ _dq(w.T, prec.weight, prec.weight_scaling).T
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    # quantization really happened: not the float dot
    assert np.abs(np.asarray(y) - np.asarray(x @ w)).max() > 1e-3


def test_qdot_bf16_preset_is_the_plain_dot():
    x, w = _data()
    np.testing.assert_array_equal(np.asarray(quant.qdot(x, w, PRESETS["bf16"])), np.asarray(jnp.dot(x, w)))


@pytest.mark.parametrize("name", ["w4a4", "w4a8", "fp8"])
@pytest.mark.parametrize("grad", ["bf16", "f32"])
def test_qdot_straight_through_gradients(name, grad):
    prec = dataclasses.replace(PRECS[name], grad=grad)
    x, w = _data()
    c = jax.random.normal(jax.random.key(9), (24, 32))
    gx, gw = jax.grad(lambda a, b: jnp.sum(quant.qdot(a, b, prec) * c), (0, 1))(x, w)
    dt = F32 if grad == "f32" else BF16
    r = lambda a: np.asarray(a.astype(dt), np.float64)  # noqa: E731
    np.testing.assert_allclose(np.asarray(gx), r(c) @ r(w).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), r(x).T @ r(c), rtol=1e-5, atol=1e-4)


def test_prequantized_weight_reuse():
    prec = PRECS["w4a4"]
    x, w = _data()
    qw = quant.prequantize(w, prec)
    assert isinstance(qw, quant.QuantizedWeight) and qw.shape == w.shape
    f = jax.jit(lambda a, b: quant.qdot(a, b, prec))
    np.testing.assert_array_equal(np.asarray(f(x, qw)), np.asarray(f(x, w)))
    c = jnp.ones((24, 32))
    gx = jax.grad(lambda a: jnp.sum(quant.qdot(a, qw, prec) * c))(x)
    ref = np.asarray(c.astype(BF16), np.float64) @ np.asarray(qw.dequantize().astype(BF16), np.float64).T
    np.testing.assert_allclose(np.asarray(gx), ref, rtol=1e-5)
    assert quant.prequantize(w, PRESETS["bf16"]) is w
    with pytest.raises(ValueError, match="pre-quantized as nvfp4"):
        quant.qdot(x, qw, PRESETS["fp8"])


@pytest.mark.parametrize("preset, backend", [("w4a4", "xla"), ("w4a16_mx", "xla"), ("w4a16", "xla_int8")])
def test_merged_weights_give_each_parts_bits_at_the_4b_shapes(preset, backend):
    """A layer's q / k / v quantized once and merged (concat_prequantized: one 4-bit decode on XLA:GPU instead of
    three) give each part's own product bit for bit at the 4B's shapes (K 2560, N 4096 + 1024 + 1024), for one row
    and a decode batch: each NVFP4 part's tensor factor scales its own columns (the parts' amax differ 4x), and
    XLA:CPU's GEMM sums a column of the merged weight as it sums the part's. The merged weight's dequantize is
    the parts' too (the straight-through backward's values)."""
    prec = dataclasses.replace(PRESETS[preset], act_scaling="row") if PRESETS[preset].act != "none" else PRESETS[preset]
    keys = jax.random.split(jax.random.key(1), 4)
    ws = [(jax.random.normal(k, (2560, n), F32) * 0.02 * (i + 1)).astype(BF16)
          for i, (k, n) in enumerate(zip(keys, (4096, 1024, 1024)))]
    quantize = jax.jit(lambda w: quant.prequantize(w, prec, backend=backend))
    parts = [quantize(w) for w in ws]
    merged = quant.concat_prequantized(parts, backend)
    assert merged is not None and merged.shape == (2560, 6144)
    f = jax.jit(lambda a, b: get_backend(backend).forward(a, b.q, prec))  # float32, before qdot's cast to x's
    for m in (1, 64):
        x = jax.random.normal(jax.random.fold_in(keys[3], m), (m, 2560), F32).astype(BF16)
        want = np.concatenate([np.asarray(f(x, p)) for p in parts], axis=-1)
        np.testing.assert_array_equal(np.asarray(f(x, merged)), want)
    np.testing.assert_array_equal(np.asarray(merged.dequantize()),
                                  np.concatenate([np.asarray(p.dequantize()) for p in parts], axis=-1))
    assert quant.concat_prequantized(parts[:1], backend) is None  # nothing to merge
    assert quant.concat_prequantized([parts[0], quantize(ws[1][:1024])], backend) is None  # another K


def _manual_nvfp4_grads(x, w, c, key):
    """dx, dw of sum(qdot * c) under grad='nvfp4', rebuilt from the formats module (float64 products)."""
    k_d, k_w = jax.random.split(key)
    gq = quant.quantize_nvfp4(c, sr_key=k_d)
    wq = quant.quantize_nvfp4(w)
    dx = np.asarray(gq.dequantize(), np.float64) @ np.asarray(wq.dequantize(), np.float64).T
    pad = -x.shape[0] % 16
    xp, cp = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(c, ((0, pad), (0, 0)))
    xq = quant.quantize_nvfp4(quant.rht16(xp, axis=0).T)
    cq = quant.quantize_nvfp4(quant.rht16(cp, axis=0).T, sr_key=k_w)
    dw = np.asarray(xq.dequantize(), np.float64) @ np.asarray(cq.dequantize(), np.float64).T
    return dx, dw


def test_nvfp4_gradients_sr_and_rht():
    prec = dataclasses.replace(PRECS["w4a4"], grad="nvfp4")
    x, w = _data(m=24)  # 24 tokens: padded to 32 for the RHT
    c = jax.random.normal(jax.random.key(3), (24, 32))
    key = jax.random.key(11)
    loss = lambda a, b, k: jnp.sum(quant.qdot(a, b, prec, sr_key=k) * c)  # noqa: E731
    gx, gw = jax.jit(jax.grad(loss, (0, 1)))(x, w, key)
    dx, dw = _manual_nvfp4_grads(x, w, c, key)
    np.testing.assert_allclose(np.asarray(gx), dx, rtol=1e-5, atol=1e-5 * np.abs(dx).max())
    np.testing.assert_allclose(np.asarray(gw), dw, rtol=1e-5, atol=1e-5 * np.abs(dw).max())
    # the gradient estimate is near the true one, and SR makes it key dependent
    true_dw = np.asarray(x, np.float64).T @ np.asarray(c, np.float64)
    assert np.abs(dw - true_dw).max() < 0.5 * np.abs(true_dw).max()
    gx2, _ = jax.jit(jax.grad(loss, (0, 1)))(x, w, jax.random.key(12))
    assert not np.array_equal(np.asarray(gx), np.asarray(gx2))
    # without a key: derived deterministically
    f = jax.jit(jax.grad(lambda a: jnp.sum(quant.qdot(a, w, prec) * c)))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(f(x)))


def test_nvfp4_gradients_unbiased_through_sr():
    """Averaging dgrad over keys approaches the dgrad of the RNE-quantized weight (SR on g is unbiased)."""
    prec = dataclasses.replace(PRECS["w4a16"], grad="nvfp4")
    x, w = _data(m=16, k=32, n=16)
    c = jax.random.normal(jax.random.key(4), (16, 16))
    g = jax.jit(lambda k: jax.grad(lambda a: jnp.sum(quant.qdot(a, w, prec, sr_key=k) * c))(x))
    mean = np.mean([np.asarray(g(jax.random.key(i))) for i in range(200)], axis=0)
    target = np.asarray(c, np.float64) @ np.asarray(quant.quantize_nvfp4(w).dequantize(), np.float64).T
    one = np.asarray(g(jax.random.key(0)))
    assert np.abs(mean - target).mean() < 0.25 * np.abs(one - target).mean()


# --- grouped ---------------------------------------------------------------------------------------------------


def _moe(m=40, k=64, n=32, e=3, seed=5):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), F32)
    w = jax.random.normal(kw, (e, k, n), F32) * 0.05 * jnp.arange(1, e + 1, dtype=F32)[:, None, None]
    return x, w, jnp.asarray([11, 0, 25] if e == 3 else [m], jnp.int32)


@pytest.mark.parametrize("name", ["w4a4_row_tile2d", "w4a8", "fp8", "w4a16"])
def test_qragged_forward_is_per_expert_qdot(name):
    prec = PRECS[name]
    if prec.act == "nvfp4":
        prec = dataclasses.replace(prec, act_scaling="row")  # per-row amax: a group's rows do not see the others
    if prec.act == "fp8":
        prec = dataclasses.replace(prec, act="none")  # per-tensor activation scale spans the groups
    x, w, gs = _moe()
    y = np.asarray(quant.qragged_dot(x, w, gs, prec))
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        ye = np.asarray(quant.qdot(x[start:start + size], w[e], prec))
        np.testing.assert_allclose(y[start:start + size], ye, rtol=1e-5, atol=1e-6)
        start += size
    assert np.all(y[start:] == 0)


def test_qragged_high_precision_bfloat16_runs_and_sums_in_float32():
    # The tiny MoE in bfloat16 compute: a plain bf16 grouped dot (the CPU runtime has no bf16 x bf16 -> f32 dot).
    x, w, gs = _moe()
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    y = jax.jit(lambda a, b: quant.qragged_dot(a, b, gs, LayerPrecision()))(xb, wb)
    assert y.dtype == jnp.bfloat16
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        ref = np.asarray(xb[start:start + size], np.float32) @ np.asarray(wb[e], np.float32)
        np.testing.assert_allclose(np.asarray(y[start:start + size], np.float32), ref, rtol=2**-8, atol=1e-6)
        start += size
    assert np.all(np.asarray(y[start:], np.float32) == 0)


def test_qragged_forward_tensor_scaled_activation_reference():
    prec = PRECS["w4a4"]
    x, w, gs = _moe()
    y = np.asarray(quant.qragged_dot(x, w, gs, prec))
    xd = _dq(x, "nvfp4", "tensor")
    start = 0
    for e, size in enumerate(np.asarray(gs)):
        ref = xd[start:start + size] @ _dq(w[e].T, "nvfp4", "tensor").T
        np.testing.assert_allclose(y[start:start + size], ref, rtol=2e-5, atol=1e-5)
        start += size


@pytest.mark.parametrize("grad", ["bf16", "f32"])
def test_qragged_straight_through_gradients(grad):
    prec = dataclasses.replace(PRECS["w4a4"], grad=grad)
    x, w, gs = _moe()
    c = jax.random.normal(jax.random.key(1), (40, 32))
    gx, gw = jax.grad(lambda a, b: jnp.sum(quant.qragged_dot(a, b, gs, prec) * c), (0, 1))(x, w)
    dt = F32 if grad == "f32" else BF16
    rx, rw = x.astype(dt).astype(F32), w.astype(dt).astype(F32)
    rx_, rw_ = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs, precision="highest") * c.astype(dt)),
                        (0, 1))(rx, rw)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx_), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw_), rtol=1e-5, atol=1e-4)


def test_qragged_one_expert_nvfp4_grads_equal_dense():
    """One expert of 24 tokens is padded to 48 rows (24 + 15 rounded up); dense qdot on the same zero-padded
    rows draws the same stochastic rounding, so both give the same gradients."""
    prec = dataclasses.replace(PRECS["w4a4"], grad="nvfp4")
    x, w, gs = _moe(m=24, e=1)
    c = jax.random.normal(jax.random.key(2), (24, 32))
    key = jax.random.key(3)
    gx, gw = jax.jit(jax.grad(lambda a, b: jnp.sum(quant.qragged_dot(a, b, gs, prec, sr_key=key) * c), (0, 1)))(x, w)
    xp, cp = jnp.pad(x, ((0, 24), (0, 0))), jnp.pad(c, ((0, 24), (0, 0)))
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(quant.qdot(a, b, prec, sr_key=key) * cp), (0, 1)))(xp, w[0])
    np.testing.assert_allclose(np.asarray(gw[0]), np.asarray(dw), rtol=1e-5, atol=1e-6)
    # dgrad: same operands up to the zero rows (whose rounding draws differ), so compare on the manual reference
    k_d, _ = jax.random.split(key)
    ref = np.asarray(quant.quantize_nvfp4(c, sr_key=k_d).dequantize(), np.float64) @ np.asarray(
        quant.quantize_nvfp4(w[0]).dequantize(), np.float64).T
    np.testing.assert_allclose(np.asarray(gx), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_qragged_nvfp4_grads_pad_each_group():
    """Per-group padding: the wgrad of each expert only sees its own tokens (an expert with no tokens gets 0)."""
    prec = dataclasses.replace(PRECS["w4a4"], grad="nvfp4")
    x, w, gs = _moe()
    c = jax.random.normal(jax.random.key(2), (40, 32))
    gx, gw = jax.jit(jax.grad(lambda a, b: jnp.sum(quant.qragged_dot(a, b, gs, prec) * c), (0, 1)))(x, w)
    assert np.all(np.asarray(gw[1]) == 0) and np.isfinite(np.asarray(gx)).all()
    true = np.asarray(x[11:36], np.float64).T @ np.asarray(c[11:36], np.float64)
    assert np.abs(np.asarray(gw[2]) - true).max() < 0.5 * np.abs(true).max()
    assert np.all(np.asarray(gx[36:]) == 0)


def test_qragged_prequantized_per_expert():
    prec = PRECS["w4a4"]
    x, w, gs = _moe()
    qw = quant.prequantize(w, prec)
    assert qw.q.amax.shape == (3,)  # one amax per expert
    np.testing.assert_array_equal(np.asarray(quant.qragged_dot(x, qw, gs, prec)),
                                  np.asarray(quant.qragged_dot(x, w, gs, prec)))
    gx = jax.grad(lambda a: jnp.sum(quant.qragged_dot(a, qw, gs, prec)))(x)
    assert gx.shape == x.shape and np.isfinite(np.asarray(gx)).all()


def test_bad_inputs():
    x, w = _data()
    with pytest.raises(ValueError, match=r"contraction mismatch.*\(24, 64\).*\(48, 32\)"):
        quant.qdot(x, jnp.ones((48, 32)), PRECS["w4a4"])
    with pytest.raises(ValueError, match=r"K=40.*multiple of 16"):
        quant.qdot(jnp.ones((4, 40)), jnp.ones((40, 8)), PRECS["w4a4"])
    with pytest.raises(ValueError, match=r"K=48.*multiple of 32"):
        quant.qdot(jnp.ones((4, 48)), jnp.ones((48, 8)), PRECS["w4a8"])
    with pytest.raises(ValueError, match=r"expected x\[..., K\] and w\[K, N\]"):
        quant.qdot(x, jnp.ones((2, 64, 32)), PRECS["w4a4"])
    with pytest.raises(TypeError, match="int32"):
        quant.qdot(x.astype(jnp.int32), w, PRECS["w4a4"])
    with pytest.raises(ValueError, match=r"N is dgrad's contraction"):
        quant.qdot(x, jnp.ones((64, 20)), dataclasses.replace(PRECS["w4a4"], grad="nvfp4"))
    xm, we, _ = _moe()
    with pytest.raises(ValueError, match=r"group_sizes must be int \[E=3\]"):
        quant.qragged_dot(xm, we, jnp.asarray([40], jnp.int32), PRECS["w4a4"])
    with pytest.raises(ValueError, match=r"w\[E, K, N\]"):
        quant.qragged_dot(xm, we[0], jnp.asarray([40], jnp.int32), PRECS["w4a4"])


def test_policy_presets_and_rules():
    pol = PrecisionPolicy.from_spec("w4a4", act_scaling="row", kv_cache="fp8",
                                    rules=[(r"layers\.0\.", "w4a8")])
    assert pol.for_layer("layers.3.mlp.down_proj") == dataclasses.replace(PRESETS["w4a4"], act_scaling="row")
    assert pol.for_layer("layers.0.mlp.down_proj") == PRESETS["w4a8"]
    for path in ("embed_tokens", "lm_head", "layers.1.mlp.router", "layers.1.input_layernorm"):
        assert not pol.for_layer(path).quantized
    assert pol.kv_cache == "fp8"
    with pytest.raises(ValueError, match="unknown precision preset 'w3a3'"):
        PrecisionPolicy.from_spec("w3a3")
    with pytest.raises(ValueError, match="grad='sr'"):
        LayerPrecision(grad="sr")


def test_parse_rules():
    from triage_jax.quant.policy import layers_regex, parse_rule, parse_rules

    # last 15% of 28 layers, rounded up: the last 5
    assert parse_rules(["last:0.15=bf16", "first:2=w4a16", r"mlp\.down_proj=w4a8"], 28) == (
        (r"^layers\.(23|24|25|26|27)\.", "bf16"), (r"^layers\.(0|1)\.", "w4a16"), (r"mlp\.down_proj", "w4a8"))
    assert layers_regex([3, 1]) == r"^layers\.(1|3)\."
    pol = PrecisionPolicy.from_spec("w4a4", rules=parse_rules(["last:1=bf16"], 12))
    assert not pol.for_layer("layers.11.mlp.down_proj").quantized and pol.for_layer("layers.1.mlp.down_proj").quantized
    assert pol.for_layer("layers.10.mlp.down_proj").quantized  # "1" must not match "11"'s prefix the other way
    assert parse_rule("a=b=w4a4") == ("a=b", "w4a4")  # split at the last "="
    for bad, msg in (("last:0=bf16", "not a layer count in 1..4"), ("last:5=bf16", "1..4"),
                     ("first:1.5=bf16", "1..4"), ("x=w3a3", "unknown preset 'w3a3'"), ("noeq", "expected REGEX=PRESET"),
                     ("(=bf16", "bad regex"), ("last:abc=bf16", "neither a layer count")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            parse_rule(bad, 4)
    with pytest.raises(ValueError, match="number of layers"):
        parse_rule("last:2=bf16")


# --- the non-finite debug mode is part of the compiled program's key ---------------------------------------------


def test_debug_nonfinite_mode_change_reaches_the_next_jitted_call():
    """Flipping the mode after a first call changes what the next call of the same jitted function does."""
    x, w = _data()
    x = x.at[3, 5].set(jnp.nan)
    f = jax.jit(lambda x, w, policy: quant.qdot(x, w, policy.for_layer("layers.0.mlp.up_proj"), name="up"),
                static_argnums=2)
    off = PrecisionPolicy.from_spec("w4a4", debug_nonfinite=False)
    jax.block_until_ready(f(x, w, off))  # off: the NaN saturates silently (spec)
    on = PrecisionPolicy.from_spec("w4a4", debug_nonfinite="raise")
    with pytest.raises(Exception, match=r"non-finite input to qdot in layer 'up': 1 NaN and 0 Inf.*\(24, 64\)"):
        jax.block_until_ready(f(x, w, on))
    jax.block_until_ready(f(x, w, off))  # and back: the first program, still silent


def test_debug_nonfinite_checks_weight_grouped_and_gradient():
    x, w = _data()
    on = dataclasses.replace(PRECS["w4a4"], debug_nonfinite=True)
    assert on.debug_nonfinite == "raise"
    with pytest.raises(Exception, match=r"qdot \(weight\) in layer 'mlp'.*\(64, 32\)"):
        jax.block_until_ready(jax.jit(lambda a, b: quant.qdot(a, b, on, name="mlp"))(x, w.at[0, 0].set(jnp.inf)))
    xm, we, gs = _moe()
    with pytest.raises(Exception, match="non-finite input to qragged_dot in layer 'experts'"):
        jax.block_until_ready(quant.qragged_dot(xm.at[0, 0].set(jnp.nan), we, gs, on, name="experts"))
    nv = dataclasses.replace(on, grad="nvfp4")
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(quant.qdot(a, b, nv, name="mlp") * jnp.nan)))
    with pytest.raises(Exception, match=r"qdot backward \(output gradient\) in layer 'mlp'"):
        jax.block_until_ready(grad(x, w))


def test_a_models_quantized_dots_trace_each_shape_once(monkeypatch):
    """qdot's forward is traced once per (shapes, precision, backend), not once per call: a 36-layer model's 144
    W4A4 dots are 4 traces (qdot._forward). Counted through a backend whose forward is xla's; a backend registered
    in its place under the same name is traced afresh (the trace is the backend object's, not its name's)."""
    from triage_jax.quant import backends as be

    traces = []

    def forward(x, w, prec):
        traces.append(x.shape)
        return be.reference_dot(x, w, prec)

    def counting():
        monkeypatch.setitem(be._REGISTRY, "counting", be.Backend("counting", lambda: (True, "test"), dot=forward))

    counting()
    prec = PRESETS["w4a4"]
    x, w = _data(m=16, k=64, n=64)
    ws = [quant.prequantize(w * (i + 1), prec) for i in range(3)]

    def layers(x):
        for wi in ws:  # three dots of one shape, then one of another
            x = quant.qdot(x, wi, prec, backend="counting")
        return quant.qdot(x[:8], ws[0], prec, backend="counting")

    got = jax.jit(layers)(x)
    assert traces == [(16, 64), (8, 64)]
    counting()
    jax.jit(lambda a: layers(a))(x)
    assert traces == [(16, 64), (8, 64)] * 2
    ref = x
    for wi in ws:
        ref = quant.qdot(ref, wi, prec)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(quant.qdot(ref[:8], ws[0], prec)))
