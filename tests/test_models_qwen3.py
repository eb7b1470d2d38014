"""Qwen3 modules: KV-cache path, padding/causality, remat, prequantization, sharding metadata."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax.models import Qwen3, get_model_config, init_kv_cache, prequantize_model
from triage_jax.models.kv_cache import FP8, fp8_write_scale, quantize_fp8_kv
from triage_jax.models.layers import MergedLinear
from triage_jax.quant import LayerPrecision, PrecisionPolicy, QuantizedWeight
from triage_jax.quant.formats import NVFP4Int8Tensor, NVFP4Tensor

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.1)
SMALL_MOE = dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@functools.partial(nnx.jit, static_argnames=("policy",))
def fwd(model, ids, mask, policy=None):
    return model(ids, attention_mask_bt=mask, policy=policy)


# The sampler quantizes inside jit; so does the on-the-fly forward here (XLA may rewrite `amax / 448` as a
# reciprocal multiply, so an eager and a jitted quantization can differ in the last bit of a scale).
jit_prequantize = nnx.jit(prequantize_model, static_argnums=1)


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    cfg = get_model_config("tiny", **(SMALL if request.param == "dense" else SMALL_MOE))
    return Qwen3(cfg, rngs=nnx.Rngs(0))


def _left_padded(seed=0, b=3, t=10, pads=(0, 2, 5), vocab=64):
    ids = jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)
    mask = jnp.arange(t)[None, :] >= jnp.asarray(pads)[:, None]
    return jnp.where(mask, ids, 0), mask


def _continue(ids, lens, k):
    """Token k of each row's continuation: ids[b, lens[b] + k] as a [B, 1] batch."""
    return jnp.take_along_axis(ids, (jnp.asarray(lens) + k)[:, None], axis=1)


def test_prefill_then_decode_equals_full_forward(model):
    """Right-padded prompts of 7, 5 and 2 tokens, then 3 decode steps, each row at its own slot."""
    ids, _ = _left_padded(pads=(0, 0, 0))
    full = np.asarray(fwd(model, ids, jnp.ones(ids.shape, bool)))
    lens = np.array([7, 5, 2])
    cache = init_kv_cache(model.cfg, 3, 64, dtype=jnp.float32)
    step = jax.jit(lambda m, i, c, msk: m(i, attention_mask_bt=msk, cache=c))
    prompt_mask = jnp.arange(7)[None, :] < jnp.asarray(lens)[:, None]
    pre, cache = step(model, ids[:, :7], cache, prompt_mask)
    real = np.asarray(prompt_mask)
    np.testing.assert_allclose(np.asarray(pre)[real], full[:, :7][real], atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [7, 5, 2]
    for k in range(3):  # one token at a time
        dec, cache = step(model, _continue(ids, lens, k), cache, jnp.ones((3, 1), bool))
        np.testing.assert_allclose(np.asarray(dec[:, 0]), full[np.arange(3), lens + k], atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [10, 8, 5]


def test_padding_does_not_change_real_tokens(model):
    ids, mask = _left_padded()
    padded = np.asarray(fwd(model, ids, mask))
    alone = np.asarray(fwd(model, ids[2:3, 5:], jnp.ones((1, 5), bool)))  # row 2 without its 5 pads
    assert np.isfinite(padded).all()  # pad queries see no key: finite garbage, never NaN
    np.testing.assert_allclose(padded[2, 5:], alone[0], atol=1e-5)


def test_causality(model):
    ids, _ = _left_padded(pads=(0, 0, 0))
    ones = jnp.ones(ids.shape, bool)
    a = np.asarray(fwd(model, ids, ones))
    b = np.asarray(fwd(model, ids.at[:, 6:].set(1), ones))
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


def test_fp8_kv_cache_scale_is_set_by_prefill_and_clipped_after(model):
    ids, _ = _left_padded(pads=(0, 0, 0))
    full = np.asarray(fwd(model, ids, jnp.ones(ids.shape, bool)))
    lens = np.array([7, 5, 2])
    mask = jnp.arange(7)[None, :] < jnp.asarray(lens)[:, None]
    cache = init_kv_cache(model.cfg, 3, 64, kv_format="fp8", fp8_headroom=2.0)
    assert cache.is_fp8 and float(cache.k_scale[0]) == 0.0
    step = nnx.jit(lambda m, i, c, msk: m(i, attention_mask_bt=msk, cache=c))
    pre, cache = step(model, ids[:, :7], cache, mask)
    # Scale from the real prefill tokens: amax * headroom / 448.
    x = model.layers[0].input_norm(model.embed(ids[:, :7]))
    from triage_jax.models.layers import apply_rope, rope_cos_sin
    pos = jnp.broadcast_to(jnp.arange(7), (3, 7))
    cos, sin = rope_cos_sin(pos, 16, model.cfg.rope_theta, jnp.float32)
    attn = model.layers[0].attn
    k = apply_rope(attn.k_norm(attn.k_proj(x)), cos, sin)
    amax = jnp.max(jnp.where(mask[:, :, None, None], jnp.abs(k), 0))
    np.testing.assert_allclose(float(cache.k_scale[0]), float(amax) * 2.0 / 448, rtol=1e-6)
    scale0 = cache.k_scale
    dec, cache = step(model, _continue(ids, lens, 0), cache, jnp.ones((3, 1), bool))
    np.testing.assert_array_equal(np.asarray(cache.k_scale), np.asarray(scale0))  # reused, not re-derived
    real = np.asarray(mask)
    # FP8 (3 mantissa bits) perturbs the logits a little, not the distribution.
    assert _mean_kl(full[:, :7][real], np.asarray(pre)[real]) < 2e-3
    assert _mean_kl(full[np.arange(3), lens], np.asarray(dec[:, 0])) < 2e-3
    # Clip before the cast: out-of-range values saturate at +-448 instead of becoming NaN.
    q = quantize_fp8_kv(jnp.asarray([1e6, -1e6, 1.0]), jnp.float32(1.0))
    assert np.asarray(q.astype(jnp.float32)).tolist() == [448.0, -448.0, 1.0]


def test_a_cache_whose_scales_are_set_skips_the_amax_with_the_same_bits(model):
    """The engine's decode rounds mark their FP8 cache `scales_set` (the prefill set every scale): a write must then
    store the same codes and keep the same scales as one that derives them; and a set scale is never 0, even where
    amax * headroom / 448 flushes to zero (a 0 would divide every later write by zero)."""
    ids, _ = _left_padded(pads=(0, 0, 0))
    lens = np.array([7, 5, 2])
    mask = jnp.arange(7)[None, :] < jnp.asarray(lens)[:, None]
    step = nnx.jit(lambda m, i, c, msk: m(i, attention_mask_bt=msk, cache=c))
    _, cache = step(model, ids[:, :7], init_kv_cache(model.cfg, 3, 64, kv_format="fp8"), mask)
    nxt, ones = _continue(ids, lens, 0), jnp.ones((3, 1), bool)
    a, ca = step(model, nxt, cache, ones)
    b, cb = step(model, nxt, cache.replace(scales_set=True), ones)
    assert cb.scales_set and not ca.scales_set
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for x, y in zip(jax.tree.leaves((ca.kv, ca.k_scale, ca.v_scale)),
                    jax.tree.leaves((cb.kv, cb.k_scale, cb.v_scale))):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    tiny = jnp.full((1, 1, 1, 4), 2e-38, jnp.float32)  # normal, but 2e-38 * 2 / 448 is subnormal: flushed
    assert float(fp8_write_scale(jnp.float32(0.0), tiny, jnp.ones((1, 1), bool), 2.0)) == 1.0
    assert float(fp8_write_scale(jnp.float32(0.0), 0 * tiny, jnp.ones((1, 1), bool), 2.0)) == 1.0


def _mean_kl(ref, new):
    lp, lq = jax.nn.log_softmax(jnp.asarray(ref)), jax.nn.log_softmax(jnp.asarray(new))
    return float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))


def test_cache_errors(model):
    cache = init_kv_cache(model.cfg, 2, 8)
    with pytest.raises(ValueError, match="cache overflow"):
        model(jnp.zeros((2, 9), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="batch"):
        model(jnp.zeros((3, 1), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="kv_format"):
        init_kv_cache(model.cfg, 2, 8, kv_format="int8")


@pytest.mark.parametrize("preset, backend", [("w4a4", "xla"), ("w4a4_mx", "xla"), ("w4a4", "xla_int8")])
def test_prequantized_forward_is_bit_exact(model, preset, backend):
    """The sampler's copy on the xla backends, q / k / v and gate / up merged into one weight each (one 4-bit decode
    on XLA:GPU instead of one per part), gives the on-the-fly quantized forward's logits bit for bit: each NVFP4
    part keeps its own tensor amax (the parts' amax differ here), and XLA:CPU's merged GEMM sums as the parts' do."""
    policy = PrecisionPolicy.from_spec(preset, act_scaling="row", backend=backend)
    ids, mask = _left_padded()
    if model.cfg.is_moe:
        try:
            jax.eval_shape(lambda i: model(i, policy=policy), ids)
        except NotImplementedError:
            pytest.skip("quantized qragged_dot not available yet")
    q = jit_prequantize(model, policy)
    attn = q.layers[0].attn
    assert isinstance(attn.qkv_proj, MergedLinear) and attn.q_proj is None and attn.v_proj is None
    merged = attn.qkv_proj.kernel.get_value()
    assert isinstance(merged, QuantizedWeight) and merged.shape == (64, 64 + 32 + 32)
    if preset == "w4a4":
        assert isinstance(merged.q, NVFP4Int8Tensor if backend == "xla_int8" else NVFP4Tensor)
        amax = np.asarray(merged.q.amax)[:, 0]
        assert amax.shape == (128,) and len(set(amax[[0, 64, 96]])) == 3  # q's, k's and v's own amax
    assert isinstance(q.layers[0].attn.o_proj.kernel.get_value(), QuantizedWeight)
    if not model.cfg.is_moe:
        assert isinstance(q.layers[0].mlp.gate_up_proj, MergedLinear) and q.layers[0].mlp.up_proj is None
    assert not isinstance(model.layers[0].attn.q_proj.kernel.get_value(), QuantizedWeight)  # original untouched
    assert not isinstance(q.embed.embedding.get_value(), QuantizedWeight)  # embed stays high precision
    a = np.asarray(fwd(model, ids, mask, policy))
    b = np.asarray(fwd(q, ids, mask, policy))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - np.asarray(fwd(model, ids, mask))).max() > 1e-3  # quantization did something


def test_prequantized_forward_is_bit_exact_at_wide_heads():
    """The same at head_dim 64 (the tiny preset's): XLA:CPU sums a row reduction in an order it picks by the
    array's shape, so q and k normalized as one merged [B, T, N + KVH, 64] slice rounded otherwise than q's and k's
    own (155 of these 1,920 logits differed, and the tiny main job's rewards after the first step with them)."""
    cfg = get_model_config("tiny", **dict(SMALL, num_hidden_layers=1, head_dim=64))
    m = Qwen3(cfg, rngs=nnx.Rngs(0))
    policy = PrecisionPolicy.from_spec("w4a4", act_scaling="row")
    q = jit_prequantize(m, policy)
    assert isinstance(q.layers[0].attn.qkv_proj, MergedLinear)
    ids, mask = _left_padded()
    np.testing.assert_array_equal(np.asarray(fwd(m, ids, mask, policy)), np.asarray(fwd(q, ids, mask, policy)))


def test_projections_a_mesh_splits_are_not_merged():
    """A mesh whose tensor axis splits the heads and the MLP keeps q / k / v and gate / up apart (a merged weight
    has no logical names: it would be replicated there); one that splits only what the sampler replicates (fsdp)
    merges them."""
    from jax.sharding import AbstractMesh

    from triage_jax import sharding as shd

    m = Qwen3(get_model_config("tiny", **SMALL), rngs=nnx.Rngs(0))
    policy = PrecisionPolicy.from_spec("w4a16")
    mesh = lambda **sizes: AbstractMesh(tuple(sizes.get(a, 1) for a in shd.MESH_AXES), shd.MESH_AXES)  # noqa: E731
    apart = prequantize_model(m, policy, mesh=mesh(tensor=2)).layers[0]
    assert apart.attn.qkv_proj is None and isinstance(apart.attn.k_proj.kernel.get_value(), QuantizedWeight)
    assert apart.mlp.gate_up_proj is None and apart.mlp.up_proj is not None
    merged = prequantize_model(m, policy, mesh=mesh(fsdp=2)).layers[0]
    assert isinstance(merged.attn.qkv_proj, MergedLinear) and isinstance(merged.mlp.gate_up_proj, MergedLinear)
    own = prequantize_model(m, policy, mesh=mesh(tensor=2), rules=(("heads", None), ("kv", None), ("mlp", None)))
    assert isinstance(own.layers[0].attn.qkv_proj, MergedLinear)  # these rules replicate them
    plain = prequantize_model(m, PrecisionPolicy.from_spec("bf16"), mesh=mesh(tensor=2)).layers[0]
    assert plain.attn.qkv_proj is None and plain.attn.q_proj is not None  # unquantized: nothing to merge


def test_prequantized_tied_head():
    cfg = get_model_config("tiny", **SMALL, tie_word_embeddings=True)
    m = Qwen3(cfg, rngs=nnx.Rngs(1))
    # (w4a16 in float32 is not bit-exact at the qdot level itself: see the quant tests / report.)
    policy = PrecisionPolicy(default=LayerPrecision(weight="nvfp4", act="nvfp4"),
                             rules=(("lm_head", LayerPrecision(weight="fp8", act="fp8")),))
    q = prequantize_model(m, policy)  # eager call: the kernels are still quantized by compiled code
    assert isinstance(q.lm_head_kernel(), QuantizedWeight) and not isinstance(m.lm_head_kernel(), QuantizedWeight)
    ids = jnp.arange(8)[None] % 64
    mask = jnp.ones_like(ids, bool)
    np.testing.assert_array_equal(np.asarray(fwd(m, ids, mask, policy)), np.asarray(fwd(q, ids, mask, policy)))


@pytest.mark.parametrize("mode, kind", [("full", SMALL_MOE), ("save_dots", SMALL)])
def test_remat_gives_same_loss_and_grads(mode, kind):
    cfg = get_model_config("tiny", **kind)
    base = Qwen3(cfg, rngs=nnx.Rngs(0))
    rem = Qwen3(cfg.replace(remat=mode), rngs=nnx.Rngs(0))
    ids, mask = _left_padded()

    def loss(m):
        lg, aux = m(ids, attention_mask_bt=mask, return_aux=True)
        return jnp.mean(jax.nn.log_softmax(lg)[..., 0] * mask) + 0.01 * aux["moe_aux_loss"]

    l0, g0 = nnx.jit(nnx.value_and_grad(loss))(base)
    l1, g1 = nnx.jit(nnx.value_and_grad(loss))(rem)
    gd, st = nnx.split(rem)
    jaxpr = str(jax.make_jaxpr(lambda s: loss(nnx.merge(gd, s)))(st))
    assert jaxpr.count("checkpoint") + jaxpr.count("remat") >= cfg.num_hidden_layers
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), nnx.state(g0, nnx.Param),
                 nnx.state(g1, nnx.Param))


def test_parameters_carry_logical_axis_names():
    cfg = get_model_config("tiny", **SMALL_MOE, tie_word_embeddings=False)
    specs = nnx.get_partition_spec(nnx.state(Qwen3(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    spec = lambda v: tuple(v.get_value())  # noqa: E731
    assert spec(specs["embed"]["embedding"]) == ("vocab", "embed")
    assert spec(specs["lm_head"]["kernel"]) == ("embed", "vocab")
    layer = specs["layers"][0]
    assert spec(layer["attn"]["q_proj"]["kernel"]) == ("embed", "heads", "kv")
    assert spec(layer["attn"]["o_proj"]["kernel"]) == ("heads", "kv", "embed")
    assert spec(layer["moe"]["router"]["kernel"]) == ("embed", "expert")
    assert spec(layer["moe"]["experts"]["down_proj"]["kernel"]) == ("expert", "mlp", "embed")
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(len(tuple(v.get_value())) > 0 for v in leaves)


def test_dtypes_and_hidden_output():
    cfg = get_model_config("tiny", **SMALL, dtype="bfloat16", param_dtype="float32")
    m = Qwen3(cfg, rngs=nnx.Rngs(0))
    ids = jnp.zeros((2, 3), jnp.int32)
    assert fwd(m, ids, None).dtype == jnp.float32  # float32 logits from a bf16 forward
    h = nnx.jit(lambda m, i: m(i, return_hidden=True))(m, ids)
    assert h.shape == (2, 3, 64) and h.dtype == jnp.bfloat16
    assert m.lm_head_kernel().shape == (64, 64)


def test_init_is_deterministic_under_a_seed():
    cfg = get_model_config("tiny", **SMALL)
    a, b = nnx.state(Qwen3(cfg, rngs=nnx.Rngs(3))), nnx.state(Qwen3(cfg, rngs=nnx.Rngs(3)))
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_forward_under_a_mesh_with_logical_rules():
    import flax.linen as nn
    from jax.sharding import Mesh

    cfg = get_model_config("tiny", **SMALL_MOE)
    m = Qwen3(cfg, rngs=nnx.Rngs(0))
    ids, mask = _left_padded()
    ref = np.asarray(fwd(m, ids, mask))
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    rules = (("batch", ("data", "fsdp")), ("length", None), ("embed", "fsdp"), ("heads", "tensor"), ("kv", None))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        out = nnx.jit(lambda m, i, k: m(i, attention_mask_bt=k))(m, ids, mask)
        gd, st = nnx.split(m)
        assert "sharding_constraint" in str(jax.make_jaxpr(lambda s: nnx.merge(gd, s)(ids))(st))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8, jnp.float32])
def test_cache_scatters_move_bits_exactly_and_stay_in_place(dtype):
    """kv_cache.scatter_set / copy_rows (integer views for 1- and 2-byte floats) equal the plain .at[].set, and
    the decode-style write compiles without a float32 copy of a bf16 buffer (XLA:CPU's float scatter)."""
    from triage_jax.models.kv_cache import copy_rows, scatter_set

    rng = np.random.default_rng(0)
    buf = jnp.asarray(rng.normal(size=(4, 2, 64, 8)), jnp.float32).astype(dtype)
    new = jnp.asarray(rng.normal(size=(4, 3, 2, 8)), jnp.float32).astype(dtype)
    rows_b1 = jnp.arange(4)[:, None]
    slot_bt = jnp.asarray([[0, 1, 2], [5, 6, 7], [62, 63, 64], [10, 11, 12]], jnp.int32)  # 64: dropped
    got = scatter_set(buf, (rows_b1, slice(None), slot_bt), new)
    want = buf.at[rows_b1, :, slot_bt].set(new, mode="drop")
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    src = jnp.asarray(rng.normal(size=(2, 2, 16, 8)), jnp.float32).astype(dtype)
    slot_m, row_m = jnp.asarray([3, 4, 0], jnp.int32), jnp.asarray([1, 0, 0], jnp.int32)  # slot 4: dropped
    got = copy_rows(buf, src, slot_m, row_m)
    want = buf.at[slot_m[:, None], :, jnp.arange(16)[None]].set(src[row_m].transpose(0, 2, 1, 3), mode="drop")
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    # Many buffers (a model's layers, a combined buffer's keys and values, a stack: leading axes) in one loop over
    # the entries, each buffer as if copied alone; one loop, not one per buffer (36-72 for a 36-layer model).
    bufs = {"layers": (buf, buf[::-1]), "stacked": jnp.stack([buf, -buf, buf])}
    srcs = {"layers": (src, -src), "stacked": jnp.stack([src, src[::-1], -src])}
    got = jax.jit(lambda b, s: (copy_rows(b["layers"], s["layers"], slot_m, row_m),
                                copy_rows(b["stacked"], s["stacked"], slot_m, row_m, lead=1)))(bufs, srcs)
    want = ([copy_rows(b, s_, slot_m, row_m) for b, s_ in zip(bufs["layers"], srcs["layers"])],
            jnp.stack([copy_rows(b, s_, slot_m, row_m) for b, s_ in zip(bufs["stacked"], srcs["stacked"])]))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    text = jax.jit(lambda b, s: copy_rows(b, s, slot_m, row_m)).lower(bufs["layers"], srcs["layers"]).as_text()
    assert text.count("stablehlo.while") == 1
    if dtype == jnp.bfloat16:
        hlo = jax.jit(lambda b, n: scatter_set(b, (rows_b1, slice(None), slot_bt), n)).lower(buf, new).compile()
        assert "f32[4,2,64,8]" not in hlo.as_text()



@pytest.mark.parametrize("dtype,last", [(jnp.float32, 8), (jnp.bfloat16, 8), (FP8, 8), (jnp.uint16, 8),
                                         (jnp.bfloat16, 3), (FP8, 6)])
def test_row_by_mask_gives_the_rows_exact_bits(dtype, last, monkeypatch):
    """kv_cache.row_by_mask (the insertion's row fetch where a mesh splits the prompt rows) returns s[i]'s exact
    bits: -0, NaN payloads, subnormals, infinities; packed two or four to a uint32 word, or widened where the last
    axis does not pack (3, 6). An index past the rows gives zeros. copy_rows fetching by it equals copy_rows by take."""
    from triage_jax.models import kv_cache

    rng = np.random.default_rng(1)
    size = jnp.dtype(dtype).itemsize
    bits = rng.integers(0, 2 ** (8 * size), size=(5, 2, 4, last), dtype=np.uint64)
    bits[0, 0, 0, :2] = [0, 1 << (8 * size - 1)]  # +0, -0
    s = jax.lax.bitcast_convert_type(jnp.asarray(bits.astype({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])),
                                     dtype)
    as_bits = lambda x: np.asarray(x).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])  # noqa: E731
    for i in range(5):
        got = jax.jit(kv_cache.row_by_mask)(s, jnp.int32(i))
        assert got.dtype == s.dtype and got.shape == (1,) + s.shape[1:]
        np.testing.assert_array_equal(as_bits(got), as_bits(s[i:i + 1]))
    assert not as_bits(jax.jit(kv_cache.row_by_mask)(s, jnp.int32(5))).any()
    if dtype == jnp.uint16:
        return
    buf = jnp.zeros((4, 2, 9, last), dtype)
    slot_m, row_m = jnp.asarray([2, 0, 4, 3], jnp.int32), jnp.asarray([4, 1, 0, 1], jnp.int32)  # slot 4: dropped
    # A fresh function per trace: jax caches traces by function, and the fetch is chosen while tracing.
    copy = lambda: lambda *a: kv_cache.copy_rows(*a)  # noqa: E731
    by_take = jax.jit(copy())(buf, s, slot_m, row_m)
    assert "reduce_sum" not in str(jax.make_jaxpr(copy())(buf, s, slot_m, row_m))
    monkeypatch.setattr(kv_cache, "batch_split", lambda: 2)  # as under a mesh that splits the batch
    by_mask = jax.jit(copy())(buf, s, slot_m, row_m)
    assert "reduce_sum" in str(jax.make_jaxpr(copy())(buf, s, slot_m, row_m))  # the masked fetch
    np.testing.assert_array_equal(as_bits(by_mask), as_bits(by_take))


# A NaN with a payload, the smallest subnormal, +Inf (E4M3 has none: its largest finite) as each type's bits.
SPECIAL_BITS = {"bfloat16": (0x7FC1, 0x0001, 0x7F80), "float32": (0x7FC00001, 0x00000001, 0x7F800000),
                "float8_e4m3fn": (0x7F, 0x01, 0x7E)}


def test_layer_rows_give_each_stacks_row_exact_bits():
    """kv_cache.layer_rows (a scanned decode step's small per-layer arrays, one masked reduction for all of them)
    returns s[i] for each stack, bit for bit: -0, NaN payloads, subnormals, infinities; stacks of 1-, 2- and
    4-byte types, packed into uint32 words or widened (odd sizes, one value a layer) side by side; row_by_mask
    of a 1-D narrow stack (its only axis the rows) as well."""
    from triage_jax.models import kv_cache

    rng = np.random.default_rng(2)
    n = 6  # even: a 1-D bf16 stack's rows would pack two to a word
    views = {1: np.uint8, 2: np.uint16, 4: np.uint32}
    kinds = [(jnp.bfloat16, (6,)), (jnp.float32, ()), (jnp.bfloat16, (3,)), (FP8, (2, 4)), (jnp.float32, (1,)),
             (jnp.uint8, (3,)), (jnp.bfloat16, ()), (FP8, (7,)), (jnp.float32, (2, 3))]
    stacks = []
    for dtype, shape in kinds:
        size = jnp.dtype(dtype).itemsize
        bits = rng.integers(0, 2 ** (8 * size), size=(n, *shape), dtype=np.uint64).astype(views[size])
        flat = bits.reshape(n, -1)
        flat[1, 0] = 1 << (8 * size - 1)  # -0 (or 128)
        flat[2:5, 0] = SPECIAL_BITS.get(jnp.dtype(dtype).name, (1, 2, 3))  # NaN with a payload, subnormal, Inf
        stacks.append(jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype) if dtype != jnp.uint8
                      else jnp.asarray(bits))
    as_bits = lambda x: np.asarray(x).view(views[x.dtype.itemsize])  # noqa: E731
    rows = jax.jit(kv_cache.layer_rows)
    for i in range(n):
        got = rows(stacks, jnp.int32(i))
        for s, g in zip(stacks, got):
            assert g.dtype == s.dtype and g.shape == s.shape[1:], (s.dtype, s.shape, g.shape)
            np.testing.assert_array_equal(as_bits(g), as_bits(s[i]), err_msg=f"{s.dtype} {s.shape} row {i}")
        for s in (stacks[1], stacks[6]):  # [L] stacks: row_by_mask alone
            np.testing.assert_array_equal(as_bits(jax.jit(kv_cache.row_by_mask)(s, jnp.int32(i))),
                                          as_bits(s[i:i + 1]))
    assert kv_cache.layer_rows([], jnp.int32(0)) == []


def test_an_fp8_cache_gives_both_attention_forms_its_dequantized_values():
    """An FP8 cache with its per-tensor scales: on the CPU cached_attention is the blocks form over the cache as
    kv_cache.read dequantizes it, bit for bit; the GPU's forms (attention_rows and the stacked cache's
    attention_in_place, which multiply the scales into the scores and the output instead of dequantizing the
    cache) agree with it to bf16 rounding. A scale applied
    twice, to the wrong side or not at all is off by far more (the scales here are 3.5 and 0.125)."""
    from triage_jax.models import kv_cache as kvc

    rng = np.random.default_rng(1)
    b, t, n, kvh, h, s = 4, 1, 8, 2, 64, 128
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
    ks, vs = jnp.float32(3.5), jnp.float32(0.125)
    k8, v8 = (kvc.quantize_fp8_kv(jnp.asarray(rng.normal(size=(b, kvh, s, h)) * 4, jnp.float32), sc)
              for sc in (ks, vs))
    slot = jnp.asarray(rng.integers(0, s, size=(b, 1)), jnp.int32)
    attend = jax.jit(lambda *a: kvc.cached_attention(*a[:4], h**-0.5, *a[4:]))
    blocks = jax.jit(lambda q, kb, vb, sl, ks, vs: kvc.attention_blocks(
        q, kvc.read(kb, ks, q.dtype), kvc.read(vb, vs, q.dtype), sl, scale=h**-0.5))
    want = np.asarray(blocks(q, k8, v8, slot, ks, vs).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(attend(q, k8, v8, slot, ks, vs).astype(jnp.float32)), want)
    for form in (kvc.attention_rows, kvc.attention_in_place):
        got = np.asarray(jax.jit(functools.partial(form, scale=h**-0.5))(q, k8, v8, slot, ks, vs).astype(jnp.float32))
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), err_msg=form.__name__)

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_both_cached_attention_forms_are_masked_softmax_attention(dtype):
    """kv_cache.cached_attention's forms (64-slot blocks on the CPU, one softmax per row elsewhere: the GPU's,
    and the GPU's multiply-and-sum form for one new token a row over a stacked cache) against jax.nn.dot_product_attention with the causal-slot mask, GQA, one and several new tokens; a float32
    cache agrees to float32 rounding, a bf16 one to the rounding of its probabilities. Each row's result is its
    own: another row's cache, slot or queries never move a bit of it (the engine's "schedule never changes a
    request" rests on that, for a given slot count), and on the CPU the dispatcher is the blocks form, bit for bit."""
    from triage_jax.models import kv_cache as kvc

    rng = np.random.default_rng(0)
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    for b, t, n, kvh, h, s in [(5, 1, 8, 2, 16, 128), (3, 7, 4, 4, 32, 64), (4, 1, 16, 8, 64, 256)]:
        q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(b, kvh, s, h)), dtype) for _ in range(2))
        slot = jnp.asarray(rng.integers(0, s - t, size=(b, 1)) + np.arange(t)[None], jnp.int32)
        mask = (jnp.arange(s)[None, None, :] <= slot[:, :, None])[:, None]
        f32 = lambda x: x.astype(jnp.float32)
        reference = jax.jit(lambda q, k, v, mask, h=h: jax.nn.dot_product_attention(
            f32(q), f32(k).transpose(0, 2, 1, 3), f32(v).transpose(0, 2, 1, 3), mask=mask, scale=h**-0.5))
        want = np.asarray(reference(q, k, v, mask))
        forms = {name: jax.jit(functools.partial(f, scale=h**-0.5)) for name, f in
                 (("blocks", kvc.attention_blocks), ("rows", kvc.attention_rows), ("cpu", kvc.cached_attention),
                  ("in_place", kvc.attention_in_place))}
        got = {name: f(q, k, v, slot) for name, f in forms.items()}
        np.testing.assert_array_equal(np.asarray(f32(got["cpu"])), np.asarray(f32(got["blocks"])))
        for name in ("blocks", "rows", "in_place"):
            np.testing.assert_allclose(np.asarray(f32(got[name])), want, atol=tol, err_msg=f"{name} {(b, t, s)}")
            # The other rows' caches, queries and slots replaced (the same shapes: a batch of another size can sum
            # in another order on the CPU): row 0 is unchanged.
            others = forms[name](q.at[1:].set(-q[1:]), k.at[1:].set(v[1:]), v.at[1:].set(k[1:]),
                                 slot.at[1:].set(slot[1:] // 2))
            np.testing.assert_array_equal(np.asarray(f32(others[0])), np.asarray(f32(got[name][0])), err_msg=name)
