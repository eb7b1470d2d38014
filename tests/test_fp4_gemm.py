"""The Mosaic GPU 4-bit weight GEMM (kernels/fp4_gemm.py): its numerics in Mosaic GPU's CPU interpreter, its
lowering for CUDA (jax.export on the CPU), and on a GPU (-m gpu) the compiled kernel against the reference."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from triage_jax.kernels import fp4_gemm as fg
from triage_jax.quant import formats as fmt


def _weight(n, k, fmt_name, seed=0):
    w = jax.random.normal(jax.random.key(seed), (n, k)) * 0.05
    w = w.at[3, 5].set(40.0)  # one outlier block: scales across the range
    return fmt.quantize_nvfp4(w) if fmt_name == "nvfp4" else fmt.quantize_mxfp4(w)


def _x(m, k, seed=1):
    return jax.random.normal(jax.random.key(seed), (m, k)).astype(jnp.bfloat16)


def _check(got, x, q):
    ref, bound = fg.reference(x, q), fg.accumulation_bound(x, q)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    err = np.abs(np.asarray(got) - np.asarray(ref))
    assert np.all(err <= np.asarray(bound)), f"max error {err.max()} over the bound {float(bound.max())}"


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,split_k", [(1, 1), (20, 2), (64, None)])
def test_fp4_matmul_equals_the_reference_within_accumulation_order(fmt_name, m, split_k):
    """Decode-sized M (padded to 16), split-K (partial sums added after the kernel) or not, both scale formats."""
    q = _weight(128, 256, fmt_name)
    x = _x(m, 256)
    _check(fg.fp4_matmul(x, fg.prepare_weight(q), split_k=split_k, chunks_per_step=2), x, q)


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_fp4_matmul_pads_n_and_k(fmt_name):
    """N = 40 (not a multiple of 64) and, for NVFP4, K = 80 (not a multiple of 32): padded with zero codes and
    scales, the padding never reaches the output, and to_tensor still gives the tensor back."""
    k = 80 if fmt_name == "nvfp4" else 96
    q = _weight(40, k, fmt_name, seed=5)
    pw = fg.prepare_weight(q)
    assert pw.shape == (40, k) and pw.codes.shape == (-(-k // 32), 64, 16)
    x = _x(3, k)
    _check(fg.fp4_matmul(x, pw), x, q)
    np.testing.assert_array_equal(np.asarray(pw.dequantize()), np.asarray(q.dequantize()))


def test_fp4_matmul_several_row_tiles():
    """M = 272: two 256-row tiles of x^T, the second padded."""
    q = _weight(64, 64, "nvfp4", seed=2)
    x = _x(272, 64, seed=3)
    _check(fg.fp4_matmul(x, fg.prepare_weight(q)), x, q)


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_a_layer_view_of_stacked_weights_is_that_layers_product_bit_for_bit(fmt_name):
    """FP4GemmWeight.layer_view (a scanned model's layer: the kernel reads layer i of the stacked codes and scales
    in place) against the layer's own weight, for every layer, the index traced: the same kernel schedule, so the
    same bits; to_tensor / dequantize / shape are the layer's. A wrong layer (or none) fails: the layers differ."""
    layers = [fg.prepare_weight(_weight(128, 96, fmt_name, seed=10 + i)) for i in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = _x(5, 96, seed=4)
    view_product = jax.jit(lambda i: fg.fp4_matmul(x, stacked.layer_view(i, stacked.amax[i])))
    for i, w in enumerate(layers):
        view = stacked.layer_view(jnp.int32(i), stacked.amax[i])
        assert view.shape == (128, 96) and not fg.concat_weights([view, view])
        np.testing.assert_array_equal(np.asarray(view_product(jnp.int32(i))), np.asarray(fg.fp4_matmul(x, w)))
        np.testing.assert_array_equal(np.asarray(view.dequantize()), np.asarray(w.dequantize()))
    with pytest.raises(ValueError, match="stacked weights expected"):
        layers[0].layer_view(jnp.int32(0), layers[0].amax)


def test_weight_layout_holds_each_block_in_one_nibble_plane():
    """codes[c, n, j]: low nibble W[n, 32c + j], high nibble W[n, 32c + 16 + j]; scales K-major."""
    q = _weight(64, 96, "nvfp4", seed=4)
    pw = fg.prepare_weight(q)
    c = np.asarray(pw.codes)
    planes = np.stack([c & 0xF, c >> 4], axis=2)  # [K/32, N, 2, 16]
    np.testing.assert_array_equal(planes.transpose(1, 0, 2, 3).reshape(64, 96), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(pw.scales).T, np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)))
    assert pw.shape == (64, 96) and float(pw.factor) == float(q.global_decode_scale())
    for a, b in zip(jax.tree.leaves(pw.to_tensor()), jax.tree.leaves(q)):  # the exact inverse
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1
                                                 else a), np.asarray(jax.lax.bitcast_convert_type(b, jnp.uint8)
                                                                     if b.dtype.itemsize == 1 else b))


def test_the_compiled_kernels_e2m1_decode_gives_every_codes_value_in_both_nibbles():
    """The compiled kernel's decode (_e2m1_bits_at: bits moved into a float32 that is 2^-126 times the value, then
    times 2^126; _e4m3_bits likewise for the block scales, times 2^120) for every byte, both nibbles and every
    scale: the bits of formats.e2m1_decode (-0 for code 8) and e4m3_decode_nonneg, and every product exact in
    bfloat16 (the kernel multiplies there). The float steps run in NumPy, which keeps the subnormals (code 1, scale
    codes below 8) before the power of two, as a GPU kernel without .FTZ does; XLA:CPU would flush them (the
    interpreter keeps the field-by-field decodes for that reason)."""
    byte = jnp.arange(256, dtype=jnp.int32)
    codes = jnp.arange(127, dtype=jnp.int32)  # every non-negative finite E4M3 block scale
    scales = np.asarray(fmt.e4m3_decode_nonneg(codes.astype(jnp.uint8)))
    scale_bits = np.asarray(jax.jit(fg._e4m3_bits)(codes)).astype(np.int32)
    np.testing.assert_array_equal((scale_bits.view(np.float32) * np.float32(2.0**120)).view(np.uint32),
                                  scales.view(np.uint32))
    for shift in (0, 4):
        bits = np.asarray(jax.jit(lambda c, s=shift: fg._e2m1_bits_at(c, s))(byte)).astype(np.int32)
        got = bits.view(np.float32) * np.float32(2.0**126)
        want = np.asarray(fmt.e2m1_decode(((byte >> shift) & 0xF).astype(jnp.uint8)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        # The kernel multiplies in bfloat16: every product is a bfloat16 value, so it is the float32 product's.
        prod = want[:, None] * scales[None]
        np.testing.assert_array_equal(prod.astype(jnp.bfloat16).astype(np.float32).view(np.uint32),
                                      prod.view(np.uint32))


def test_bad_inputs_are_named():
    q = _weight(64, 64, "nvfp4")
    with pytest.raises(ValueError, match="tensor scaling"):
        fg.prepare_weight(fmt.quantize_nvfp4(jnp.ones((64, 64)), scaling="row"))
    with pytest.raises(ValueError, match=r"x\[M, 64\]"):
        fg.fp4_matmul(_x(4, 32), fg.prepare_weight(q))
    with pytest.raises(ValueError, match="registers"):
        fg.fp4_matmul(_x(4, 64), fg.prepare_weight(q), interpret=True, a_operand="registers")
    with pytest.raises(ValueError, match="split_k=3"):
        fg.fp4_matmul(_x(4, 64), fg.prepare_weight(q), split_k=3, chunks_per_step=1)


@pytest.mark.parametrize("k,n", [(2560, 9728), (9728, 2560)])
@pytest.mark.parametrize("m,a_operand", [(1, "smem"), (64, "registers"), (300, "smem")])
def test_fp4_matmul_lowers_for_cuda_at_qwen3_4b_shapes(k, n, m, a_operand):
    """The CPU-side guard of the GPU lowering (Mosaic GPU's TMA, wgmma, register layouts and shared-memory budget
    are all checked when it lowers). The PTX compile itself is test_fp4_matmul_compiled_on_gpu's."""
    pw = jax.eval_shape(lambda: fg.prepare_weight(fmt.quantize_nvfp4(jnp.zeros((n, k)))))
    fn = jax.jit(lambda x, w: fg.fp4_matmul(x, w, interpret=False, a_operand=a_operand))
    export.export(fn, platforms=["cuda"])(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), pw)


def test_fp4_grouped_matmul_lowers_for_cuda():
    """Qwen3-30B-A3B's expert MLP shape at decode: 128 experts, 512 routed rows."""
    pw = jax.eval_shape(lambda: jax.vmap(fg.prepare_weight)(jax.vmap(fmt.quantize_nvfp4)(jnp.zeros((128, 768, 2048)))))
    fn = jax.jit(lambda x, w, g: fg.fp4_grouped_matmul(x, w, g, interpret=False))
    export.export(fn, platforms=["cuda"])(jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16), pw,
                                          jax.ShapeDtypeStruct((128,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
def test_fp4_grouped_matmul_compiled_on_gpu():
    ws = jax.random.normal(jax.random.key(9), (8, 768, 2048)) * 0.02
    qs = jax.vmap(fmt.quantize_nvfp4)(ws)
    pw = jax.vmap(fg.prepare_weight)(qs)
    x = _x(512, 2048, seed=10)
    gs = jnp.asarray(np.random.default_rng(0).multinomial(500, [1 / 8] * 8), jnp.int32)  # 12 rows past the groups
    ref = _ragged_reference(x, qs, gs)
    for a_operand in ("smem", "registers"):
        got = fg.fp4_grouped_matmul(x, pw, gs, interpret=False, a_operand=a_operand)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                                   atol=4 * 2048 * 2.0**-24 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_fp4_matmul_compiled_on_gpu(fmt_name):
    for (k, n) in ((2560, 9728), (9728, 2560)):
        q = _weight(n, k, fmt_name, seed=k)
        pw = fg.prepare_weight(q)
        for m in (1, 16, 64, 256, 300):
            x = _x(m, k, seed=m)
            for a_operand in ("smem", "registers"):
                _check(fg.fp4_matmul(x, pw, interpret=False, a_operand=a_operand), x, q)


ON_GPU = pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu",
                                                                          reason="the compiled kernel needs a GPU")])


@pytest.mark.parametrize("where", ["here", ON_GPU])  # here: the interpreter off a GPU; gpu: the compiled kernel
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_merged_weights_give_each_parts_product(fmt_name, where):
    """q / k / v as one weight (concat_weights): each part's columns are its own product with its own tensor
    factor (the parts' amax differ 800x here), the parts come back unchanged, and what cannot merge is refused."""
    qs = [_weight(n, 128, fmt_name, seed=s) for n, s in ((128, 10), (64, 11), (64, 12))]
    if fmt_name == "nvfp4":
        qs[1] = fmt.quantize_nvfp4(jax.random.normal(jax.random.key(13), (64, 128)) * 0.05)  # no outlier: amax ~0.2
    pws = [fg.prepare_weight(q) for q in qs]
    merged = fg.concat_weights(pws)
    assert merged.shape == (256, 128) and merged.splits == (128, 64, 64)
    x = _x(5, 128)
    y = fg.fp4_matmul(x, merged, chunks_per_step=2)
    for part, q, (a, b) in zip(merged.unmerged(), qs, ((0, 128), (128, 192), (192, 256))):
        _check(y[:, a:b], x, q)
        for got, want in zip(jax.tree.leaves(part.to_tensor()), jax.tree.leaves(q)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(merged.dequantize()),
                                  np.concatenate([np.asarray(q.dequantize()) for q in qs]))
    with pytest.raises(ValueError, match="merged"):
        merged.to_tensor()
    assert fg.concat_weights(pws[:1]) is None  # nothing to merge
    assert fg.concat_weights([pws[0], fg.prepare_weight(_weight(40, 128, fmt_name))]) is None  # N % 64: padding
    assert fg.concat_weights([pws[0], fg.prepare_weight(_weight(64, 96, fmt_name))]) is None  # another K
    assert fg.concat_weights([merged, pws[0]]) is None


# --- the fp4_gemm backend -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["w4a16", "w4a4", "w4a8"])
def test_fp4_gemm_backend_qdot_matches_xla(preset):
    """Prequantized (the sampler's sync) and raw weights; W4A4's activations quantized token-wise: the qdot output
    (bf16, as the model sees it) is xla's, and the backward runs through the kernel's layout."""
    from triage_jax import quant
    from triage_jax.quant import PRESETS

    prec = PRESETS[preset]
    x, w = _x(5, 128), jax.random.normal(jax.random.key(2), (128, 64)) * 0.05
    qw = quant.prequantize(w, prec, backend="fp4_gemm")
    assert isinstance(qw.q, fg.FP4GemmWeight) and qw.shape == (128, 64)
    ref = np.asarray(quant.qdot(x, quant.prequantize(w, prec), prec), np.float32)
    for wgt in (qw, w):
        got = np.asarray(quant.qdot(x, wgt, prec, backend="fp4_gemm"), np.float32)
        np.testing.assert_allclose(got, ref, rtol=2**-7, atol=1e-6)  # one bf16 rounding of the same float32 sum
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), np.asarray(quant.prequantize(w, prec).dequantize()))
    g = jax.grad(lambda a: quant.qdot(a, qw, prec, backend="fp4_gemm").astype(jnp.float32).sum())(x)
    g_ref = jax.grad(lambda a: quant.qdot(a, quant.prequantize(w, prec), prec).astype(jnp.float32).sum())(x)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_ref, np.float32))


def test_a_forward_traced_for_the_interpreter_is_traced_again_for_the_gpu():
    """qdot traces a forward once per shape (its own jit); the kernel's form depends on where it lowers
    (mosaic.lowering_for_gpu: for a compile-only GPU in this process, tools/gpu_aot.py), so that is part of the
    trace's key (`Backend.trace_key`): a program compiled for the H200 after a CPU run at the same shapes gets the
    kernel itself, not the CPU interpreter's form (which cannot run there)."""
    from triage_jax import quant
    from triage_jax.kernels import mosaic
    from triage_jax.quant import PRESETS

    prec = PRESETS["w4a16"]
    qw = quant.prequantize(jax.random.normal(jax.random.key(4), (128, 64)) * 0.05, prec, backend="fp4_gemm")
    x = _x(8, 128)

    def kernel_interpret():  # the `interpret` parameter of the Mosaic GPU kernel in a fresh outer trace
        found = []

        def walk(jaxpr):
            for e in jaxpr.eqns:
                if "interpret" in e.params:
                    found.append(e.params["interpret"])
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    walk(sub)

        walk(jax.make_jaxpr(lambda a: quant.qdot(a, qw, prec, backend="fp4_gemm"))(x).jaxpr)
        assert len(found) == 1, found
        return found[0]

    assert kernel_interpret()  # here: the CPU interpreter's parameters
    with mosaic.lowering_for_gpu():
        assert not kernel_interpret()  # the kernel, as a GPU runs it
    assert kernel_interpret()


def test_fp4_gemm_backend_hands_other_cases_to_xla():
    from triage_jax import quant
    from triage_jax.quant import PRESETS, backends

    assert backends.available_backends()["fp4_gemm"][0] and backends.resolve_backend("auto") != "fp4_gemm"
    w = jax.random.normal(jax.random.key(3), (2, 64, 64)) * 0.05
    for preset, x in (("fp8", _x(4, 64)), ("w4a16", _x(4, 64).astype(jnp.float32))):
        # not 4-bit weights, or float32 activations the kernel would round: xla's dot
        qw = quant.prequantize(w[0], PRESETS[preset], backend="fp4_gemm")
        got = quant.qdot(x, qw, PRESETS[preset], backend="fp4_gemm")
        ref = quant.qdot(x, quant.prequantize(w[0], PRESETS[preset]), PRESETS[preset])
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def _ragged_reference(x, qs, gs):
    """ragged_dot of x (as bf16) with the per-expert block values, then each row's expert factor, in float32."""
    e, m = gs.shape[0], x.shape[0]
    y = jax.lax.ragged_dot(x.astype(jnp.bfloat16).astype(jnp.float32), jnp.swapaxes(qs.block_values(), 1, 2), gs,
                           precision=jax.lax.Precision.HIGHEST)
    f = jnp.broadcast_to(qs.global_decode_scale() if isinstance(qs, fmt.NVFP4Tensor) else jnp.float32(1.0), (e,))
    return y * f[jnp.repeat(jnp.arange(e), gs, total_repeat_length=m)][:, None]


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("sizes", [(10, 0, 22), (40, 0, 0), (0, 0, 33), (5, 5, 5)])
def test_fp4_grouped_matmul_equals_ragged_dot(fmt_name, sizes):
    """Empty groups, one group holding every row, rows past the groups (0, as ragged_dot gives them), groups that
    share no tile; the group sizes are traced (one compile for all)."""
    ws = jax.random.normal(jax.random.key(4), (3, 64, 128)) * 0.05
    qs = jax.vmap(fmt.quantize_nvfp4 if fmt_name == "nvfp4" else fmt.quantize_mxfp4)(ws)
    pw = jax.vmap(fg.prepare_weight)(qs)
    x, gs = _x(40, 128, seed=6), jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda a, w, g: fg.fp4_grouped_matmul(a, w, g, tile_m=16))(x, pw, gs)
    ref = _ragged_reference(x, qs, gs)
    bound = 2 * 128 * 2.0**-24 * float(jnp.max(jnp.abs(ref))) * 8 + 1e-30  # loose: a wrong tile is O(1) off
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=bound)
    assert not np.any(np.asarray(got)[sum(sizes):])  # rows past the groups are exactly 0


def test_a_layer_view_of_stacked_expert_weights_is_that_layers_grouped_product_bit_for_bit():
    """Per-expert weights stacked by layer ([L, E, ...]: a scanned MoE's) through FP4GemmWeight.layer_view: the
    kernel reads layer i's experts at L_i E + e of the stacks seen as L x E weights; the same bits as the layer's
    own weights, for every layer (a view reading layer 0's experts, or the wrong expert, fails: they all differ)."""
    layers = [jax.vmap(fg.prepare_weight)(jax.vmap(fmt.quantize_nvfp4)(
        jax.random.normal(jax.random.key(20 + i), (3, 64, 128)) * 0.05)) for i in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x, gs = _x(24, 128, seed=7), jnp.asarray([10, 0, 14], jnp.int32)
    grouped = jax.jit(lambda w, g: fg.fp4_grouped_matmul(x, w, g, tile_m=16))
    for i, w in enumerate(layers):
        view = stacked.layer_view(jnp.int32(i), stacked.amax[i])
        assert view.shape == (3, 64, 128)
        np.testing.assert_array_equal(np.asarray(grouped(view, gs)), np.asarray(grouped(w, gs)))


def test_grouped_tiles_place_each_group_in_its_own_tiles():
    dest, tile_expert, tile_rows = fg.grouped_tiles(jnp.asarray([3, 0, 17, 1], jnp.int32), 24, 8)
    # group 0: rows 0-2 -> tile 0; group 2: rows 3-19 -> tiles 1-3; group 3: row 20 -> tile 4; rows 21-23 past
    np.testing.assert_array_equal(np.asarray(dest), [0, 1, 2, *range(8, 25), 32, 56, 56, 56])
    np.testing.assert_array_equal(np.asarray(tile_expert)[:5], [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(np.asarray(tile_rows), [3, 8, 8, 1, 1, 0, 0])


@pytest.mark.parametrize("preset", ["w4a16", "w4a4"])
def test_fp4_gemm_backend_qragged_dot_matches_xla(preset):
    from triage_jax import quant
    from triage_jax.quant import PRESETS

    prec = PRESETS[preset]
    w = jax.random.normal(jax.random.key(7), (2, 64, 64)) * 0.05
    x, gs = _x(20, 64, seed=8), jnp.asarray([12, 6], jnp.int32)
    qw = quant.prequantize(w, prec, backend="fp4_gemm")
    assert isinstance(qw.q, fg.FP4GemmWeight) and qw.q.codes.shape[0] == 2
    ref = np.asarray(quant.qragged_dot(x, quant.prequantize(w, prec), gs, prec), np.float32)
    for wgt in (qw, w):
        got = np.asarray(quant.qragged_dot(x, wgt, gs, prec, backend="fp4_gemm"), np.float32)
        np.testing.assert_allclose(got, ref, rtol=2**-7, atol=1e-6)


def test_the_fp4_gemm_samplers_copy_runs_qkv_and_gate_up_as_one_gemm_each():
    """prepare_model on the fp4_gemm backend: each layer's q / k / v and gate / up become one kernel call each
    (layers.MergedLinear), and the forward's logits are the xla backend's within the kernel's summation order; a
    policy that gives k_proj its own precision keeps the three apart; a merged copy refuses to be saved as HF."""
    from flax import nnx

    from triage_jax.models import Qwen3, get_model_config, hf_io
    from triage_jax.models.layers import MergedLinear
    from triage_jax.sampler import prepare_model, sampler_policy

    cfg = get_model_config("tiny", num_hidden_layers=1, dtype="bfloat16", param_dtype="bfloat16")
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray([[5, 17, 99, 3, 8]])
    policy = sampler_policy("w4a16", backend="fp4_gemm")
    prepared = prepare_model(model, policy)
    attn, mlp = prepared.layers[0].attn, prepared.layers[0].mlp
    assert isinstance(attn.qkv_proj, MergedLinear) and attn.q_proj is None and attn.v_proj is None
    assert isinstance(mlp.gate_up_proj, MergedLinear) and mlp.up_proj is None and mlp.down_proj is not None
    assert attn.qkv_proj.kernel.get_value().q.splits == (256, 128, 128)
    xla = sampler_policy("w4a16", backend="xla")
    forward = nnx.jit(lambda m, i, p: m(i, policy=p), static_argnums=2)  # eager, each op compiles alone
    ref = np.asarray(forward(prepare_model(model, xla), ids, xla))
    got = np.asarray(forward(prepared, ids, policy))
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.02 * np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    with pytest.raises(ValueError, match="merged"):
        list(hf_io.hf_state_dict(prepared))
    apart = sampler_policy("w4a16", backend="fp4_gemm", rules=((r"k_proj", "w4a4"),))
    with pytest.raises(ValueError, match="merged for one precision"):
        prepared(ids, policy=apart)  # run under another policy than it was prepared with
    kept = prepare_model(model, apart).layers[0]
    assert kept.attn.qkv_proj is None and kept.attn.k_proj is not None and kept.mlp.gate_up_proj is not None


def test_fp4_gemm_weights_are_replicated_and_merged_on_a_tensor_mesh():
    """On a mesh whose tensor axis splits the heads, the fp4_gemm copy still merges q / k / v (its custom kernel is
    not partitioned: its weights are replicated either way), and an unmerged fp4_gemm weight is placed replicated
    (its [K/16, N] scales are not the [N, K/16] layout the logical names split); the xla copy's parts stay apart
    and split by their names."""
    from flax import nnx
    from jax.sharding import AbstractMesh, PartitionSpec as P

    from triage_jax import sharding as shd
    from triage_jax.models import Qwen3, get_model_config
    from triage_jax.models.layers import MergedLinear
    from triage_jax.sampler import prepare_model, sampler_policy

    mesh = AbstractMesh((1, 1, 2, 1), shd.MESH_AXES)
    model = Qwen3(get_model_config("tiny", num_hidden_layers=1, dtype="bfloat16", param_dtype="bfloat16"),
                  rngs=nnx.Rngs(0))
    merged_model = prepare_model(model, sampler_policy("w4a16", backend="fp4_gemm"), mesh=mesh)
    merged = merged_model.layers[0]
    assert isinstance(merged.attn.qkv_proj, MergedLinear) and isinstance(merged.mlp.gate_up_proj, MergedLinear)
    for m in (merged_model, prepare_model(model, sampler_policy("w4a16"))):  # fp4_gemm's and xla's merged copies
        state = nnx.state(m)
        shardings = shd.sampler_state_shardings(state, mesh)  # one per array, as the dry-run maps them
        qkv = jax.tree.map(lambda x, s: s.spec, state, shardings)["layers"][0]["attn"]["qkv_proj"]["kernel"]
        assert all(s == P() for s in jax.tree.leaves(qkv.get_value()))  # no names: replicated
    apart = prepare_model(model, sampler_policy("w4a16", backend="fp4_gemm", rules=((r"k_proj", "w4a4"),)), mesh=mesh)
    k = shd.sampler_state_shardings(nnx.state(apart), mesh)["layers"][0]["attn"]["k_proj"]["kernel"]
    specs = [s.spec for s in jax.tree.leaves(k.get_value(), is_leaf=lambda x: hasattr(x, "spec"))]
    assert len(specs) == 3 and all(s == P() for s in specs)  # codes, scales, amax
    xla = prepare_model(model, sampler_policy("w4a16"), mesh=mesh)
    assert xla.layers[0].attn.qkv_proj is None
    q = shd.sampler_state_shardings(nnx.state(xla), mesh)["layers"][0]["attn"]["q_proj"]["kernel"].get_value()
    assert q.q.packed.spec == P("tensor", None)  # rows (output heads) split over tensor


@pytest.mark.slow
def test_fp4_gemm_sampler_gives_the_xla_samplers_greedy_tokens(monkeypatch):
    """The tiny engine's greedy tokens with the kernel for every 4-bit weight GEMM (Mosaic GPU's interpreter here),
    and with the layers scanned: each layer's kernels read its view of the stacked weights (FP4GemmWeight
    .layer_view), giving the tokens and log-probs of the same layers' weights sliced out of the stacks, bit for
    bit, and the xla sampler's greedy tokens of that model."""
    from flax import nnx

    from triage_jax.kernels.fp4_gemm import FP4GemmWeight
    from triage_jax.models import Qwen3, get_model_config, qwen3
    from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model, sampler_policy

    cfg = get_model_config("tiny", num_hidden_layers=2, dtype="bfloat16", param_dtype="bfloat16")  # bf16: the kernel
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    scanned = Qwen3(cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))  # stacked layers (weights of their own)
    prompts = [[5, 17, 99, 3], [40, 41, 42], [77, 8, 9, 60]]

    def generate(backend, m=model, unstack=True):
        policy = sampler_policy("w4a16", backend=backend)
        prepared = prepare_model(m, policy, unstack=unstack)
        eng = Engine(SamplingConfig(max_new_tokens=8, greedy=True), EngineConfig(max_slots=4, max_len=16),
                     policy=policy, model=prepared)
        return prepared, eng.generate(prompts, jax.random.key(0))

    _, kernel = generate("fp4_gemm")
    xla = np.asarray(generate("xla")[1].tokens)
    np.testing.assert_array_equal(np.asarray(kernel.tokens), xla)
    prepared, viewed = generate("fp4_gemm", scanned, unstack=False)
    w = prepared.layers.mlp.down_proj.kernel.get_value().q
    assert isinstance(w, FP4GemmWeight) and w.codes.ndim == 4  # [L, K/32, N, 16]: what the layers' views read
    monkeypatch.setattr(qwen3, "_layer_indexed", lambda x: False)  # each layer's weights sliced out of the stacks
    jax.clear_caches()  # programs traced with the views
    try:
        _, sliced = generate("fp4_gemm", scanned, unstack=False)
    finally:
        jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(viewed.tokens), np.asarray(sliced.tokens))
    np.testing.assert_array_equal(np.asarray(viewed.logprobs), np.asarray(sliced.logprobs))
    xla_scanned = generate("xla", scanned, unstack=False)[1]
    np.testing.assert_array_equal(np.asarray(viewed.tokens), np.asarray(xla_scanned.tokens))
