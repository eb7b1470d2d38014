"""scan_layers=True: stacked layers under nnx.scan give the unscanned model's outputs, cache path and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax.models import (
    ModelConfig, Qwen3, from_pretrained, get_model_config, init_kv_cache, prequantize_model, save_pretrained,
)
from triage_jax.quant import LayerPrecision, PrecisionPolicy, QuantizedWeight

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, initializer_range=0.1, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["tiny", "tiny_moe"])
def pair(request, tmp_path_factory):
    """The same weights as a looped and as a scanned model (through an HF checkpoint)."""
    cfg = get_model_config(request.param, **SMALL, moe_intermediate_size=32)
    looped = Qwen3(cfg, rngs=nnx.Rngs(0))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(looped, path)
    return looped, from_pretrained(path, scan_layers=True)


@functools.partial(nnx.jit, static_argnames=("policy",))
def fwd(model, ids, mask, policy=None):
    return model(ids, attention_mask_bt=mask, policy=policy, return_aux=True)


def _batch():
    ids = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    mask = jnp.arange(9)[None, :] >= jnp.asarray([0, 3])[:, None]
    return ids, mask


def test_scanned_params_are_stacked_with_a_layers_axis(pair):
    _, scanned = pair
    kernel = scanned.layers.attn.q_proj.kernel
    assert kernel.get_value().shape == (3, 64, 4, 16)
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "kv")


def test_scanned_forward_and_aux_equal_looped(pair):
    looped, scanned = pair
    ids, mask = _batch()
    (a, aux_a), (b, aux_b) = fwd(looped, ids, mask), fwd(scanned, ids, mask)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(b)[real], np.asarray(a)[real], atol=1e-5)
    np.testing.assert_allclose(float(aux_b["moe_aux_loss"]), float(aux_a["moe_aux_loss"]), rtol=1e-6)


def test_scanned_prefill_decode_equals_full_forward(pair):
    _, scanned = pair
    ids, _ = _batch()
    full, _ = fwd(scanned, ids, jnp.ones(ids.shape, bool))
    step = nnx.jit(lambda m, i, c: m(i, cache=c))
    cache = init_kv_cache(scanned.cfg, 2, 64, dtype=jnp.float32)
    pre, cache = step(scanned, ids[:, :5], cache)
    dec, cache = step(scanned, ids[:, 5:], cache)  # 4 tokens at once after the cached 5
    np.testing.assert_allclose(np.asarray(pre), np.asarray(full[:, :5]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(dec), np.asarray(full[:, 5:]), atol=1e-5)
    assert np.asarray(cache.lengths).tolist() == [9, 9]


def test_scanned_remat_gradients_equal_looped(pair):
    looped, scanned = pair
    ids, mask = _batch()
    scanned = nnx.merge(*nnx.split(scanned))
    scanned.cfg = scanned.cfg.replace(remat="full")

    def loss(m):
        lg, aux = m(ids, attention_mask_bt=mask, return_aux=True)
        return jnp.sum(jax.nn.log_softmax(lg)[..., 3] * mask) + aux["moe_aux_loss"]

    ga = nnx.jit(nnx.grad(loss))(looped)
    gb = nnx.jit(nnx.grad(loss))(scanned)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(gb.layers.attn.q_proj.kernel[...][i]),
                                   np.asarray(ga.layers[i].attn.q_proj.kernel[...]), atol=1e-5)
    # Loop vs scan sum in another order: float32 noise relative to the gradient's size.
    np.testing.assert_allclose(np.asarray(gb.embed.embedding[...]), np.asarray(ga.embed.embedding[...]), atol=1e-5,
                               rtol=1e-5)


def test_scanned_prequantize_is_per_layer_and_bit_exact(pair):
    _, scanned = pair
    policy = PrecisionPolicy.from_spec("w4a4", act_scaling="row")
    ids, mask = _batch()
    q = nnx.jit(prequantize_model, static_argnums=1)(scanned, policy)
    w = q.layers.mlp.down_proj.kernel.get_value() if q.layers.mlp is not None else \
        q.layers.moe.experts.down_proj.kernel.get_value()
    assert isinstance(w, QuantizedWeight) and jax.tree.leaves(w)[0].shape[0] == 3
    np.testing.assert_array_equal(np.asarray(fwd(q, ids, mask, policy)[0]),
                                  np.asarray(fwd(scanned, ids, mask, policy)[0]))


def test_scan_rejects_layer_specific_policies_and_mixed_layers(pair):
    _, scanned = pair
    policy = PrecisionPolicy(rules=((r"layers\.1\.attn", LayerPrecision(weight="nvfp4")),))
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.q_proj"):
        scanned(jnp.zeros((1, 4), jnp.int32), policy=policy)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8, mlp_only_layers=(0,),
                    scan_layers=True)


def test_engine_decodes_a_scanned_model(pair):
    """The rollout engine runs a scan_layers=True model (its decode loop builds the model inside the loop, where
    nnx.scan can use it) and draws the looped model's greedy tokens with its log-probs."""
    from triage_jax.sampler import Engine, EngineConfig, SamplingConfig

    looped, scanned = pair
    prompts = [[5, 17, 9, 3], [40, 41, 42], [7, 8, 9, 60, 2]]

    def run(model):
        eng = Engine(SamplingConfig(max_new_tokens=6, greedy=True), EngineConfig(max_slots=4, max_len=16),
                     model=model)
        return eng, eng.generate(prompts, jax.random.key(0))

    (_, a), (eng, b) = run(looped), run(scanned)
    np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
    np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=1e-5)
    # The scanned model's slots hold one stacked [L, slots, KVH, S, Dh] cache (no restacking per step).
    assert len(eng.last_kv_sharding.shard_shape((3, 4, 2, 64, 16))) == 5


@pytest.mark.parametrize("kv_format", ["f32", "fp8"])
def test_stacked_and_per_layer_caches_agree_on_either_model(pair, kv_format):
    """Every cache form works with either model and holds the same bits: a stacked cache carried through the
    scan (layer i written and read at a traced index), a per-layer tuple in the loop, and the mixed pairs
    (stacked around the scan / indexed by a static layer); with a layer's keys and values in one buffer (combined,
    the GPU's layout: one scatter writes both) or in two (the CPU's). The layout is paired with the other two
    factors so that each pair of the three factors meets in all four combinations (half the compiles of all eight)."""
    from triage_jax.models import kv_cache as kvc

    def split(cache):  # the stacked split form of any cache: its keys, values, scales and lengths to compare
        cache = kvc.stack(cache)
        kv = (cache.kv[:, 0], cache.kv[:, 1]) if cache.combined else cache.kv
        return cache.replace(kv=kv, combined=False)

    ids, _ = _batch()
    step = nnx.jit(lambda m, i, c: m(i, cache=c))
    results = {}
    for name, model in zip(("looped", "scanned"), pair):
        for stacked in (False, True):
            combined = stacked != (name == "scanned")  # looped: (F, F), (T, T); scanned: (F, T), (T, F)
            cache = init_kv_cache(model.cfg, 2, 64, kv_format=kv_format, stacked=stacked, combined=combined)
            assert cache.stacked == stacked and cache.combined == combined and cache.num_layers == 3
            pre, cache = step(model, ids[:, :5], cache)
            dec, cache = step(model, ids[:, 5:], cache)
            assert cache.stacked == stacked and cache.combined == combined  # a call returns the form it got
            assert kvc.unstack(kvc.stack(cache)).num_layers == 3
            results[name, stacked, combined] = (pre, dec, split(cache))
    base_pre, base_dec, base_cache = results["looped", False, False]
    for key, (pre, dec, cache) in results.items():
        # The looped and scanned forms sum the same terms in the same order here: equal bits.
        np.testing.assert_array_equal(np.asarray(pre), np.asarray(base_pre), err_msg=str(key))
        np.testing.assert_array_equal(np.asarray(dec), np.asarray(base_dec), err_msg=str(key))
        for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(base_cache)):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=str(key))
    if kv_format == "fp8":  # each layer set its own scale at its first write
        assert len(set(np.asarray(base_cache.k_scale).tolist())) == 3


def test_unstack_layers_gives_the_per_layer_model_with_each_layers_weights(pair):
    """The trainer's scanned learner -> the sampler's unrolled copy: layer i gets slice i of every stacked
    variable (a wrong order or a shared slice changes the forward), and the copy decodes like the looped model."""
    from triage_jax.models import unstack_layers
    from triage_jax.sampler import prepare_model

    looped, scanned = pair
    unrolled = unstack_layers(scanned)
    assert not unrolled.cfg.scan_layers and len(unrolled.layers) == 3
    assert unstack_layers(looped) is looped
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(unrolled.layers[i].attn.o_proj.kernel[...]),
                                      np.asarray(looped.layers[i].attn.o_proj.kernel[...]))
    ids, mask = _batch()
    (a, aux_a), (b, aux_b) = fwd(looped, ids, mask), fwd(unrolled, ids, mask)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))  # the same per-layer program: the same bits
    # prepare_model (the sampler sync) unstacks: its quantized copy has per-layer kernels.
    policy = PrecisionPolicy.from_spec("w4a4", act_scaling="row")
    q = prepare_model(scanned, policy)
    assert not q.cfg.scan_layers
    np.testing.assert_array_equal(np.asarray(fwd(q, ids, mask, policy)[0]),
                                  np.asarray(fwd(prepare_model(looped, policy), ids, mask, policy)[0]))
    # unstack=False (the benchmarks' scanned samplers) keeps the layers stacked, each quantized per layer.
    kept = prepare_model(scanned, policy, unstack=False)
    assert kept.cfg.scan_layers and isinstance(kept.layers.attn.o_proj.kernel.get_value(), QuantizedWeight)
