"""MoE block: grouped (sorted, ragged_dot) expert compute vs a dense per-expert reference; routing; aux loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax.models import get_model_config
from triage_jax.models.moe import MoE, RouterStats, load_balancing_loss, route, router_stats, sort_by_expert

CFG = get_model_config("tiny_moe", hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=3,
                       initializer_range=0.2)


def _dense_reference(moe: MoE, x_btd):
    """Every expert on every token, masked by the routing: the slow loop the grouped path must equal."""
    x_td = x_btd.reshape(-1, x_btd.shape[-1])
    logits = x_td @ moe.router.kernel[...]
    probs = jax.nn.softmax(logits, -1)
    w_tk, e_tk = jax.lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        w_tk = w_tk / w_tk.sum(-1, keepdims=True)
    out = jnp.zeros_like(x_td)
    ex = moe.experts
    for e in range(moe.num_experts):
        h = jax.nn.silu(x_td @ ex.gate_proj.kernel[e]) * (x_td @ ex.up_proj.kernel[e])
        y = h @ ex.down_proj.kernel[e]
        weight = jnp.sum(jnp.where(e_tk == e, w_tk, 0.0), axis=-1)
        out = out + y * weight[:, None]
    return out.reshape(x_btd.shape)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_path_equals_dense_expert_loop(norm_topk_prob):
    moe = MoE(CFG.replace(norm_topk_prob=norm_topk_prob), 0, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 7, 32))
    y, stats = nnx.jit(lambda m, x: m(x))(moe, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(nnx.jit(_dense_reference)(moe, x)), atol=2e-6)
    assert float(stats.rows) == 21 and float(stats.tokens_per_expert.sum()) == 21 * 3


def test_grouped_path_gradients_match_reference():
    moe = MoE(CFG, 0, rngs=nnx.Rngs(2))
    x = jax.random.normal(jax.random.key(3), (2, 5, 32))
    g1 = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2)))(moe)
    g2 = nnx.jit(nnx.grad(lambda m: jnp.sum(_dense_reference(m, x) ** 2)))(moe)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), nnx.state(g1, nnx.Param),
                 nnx.state(g2, nnx.Param))


def test_sort_by_expert_groups_assignments():
    e_tk = jnp.asarray([[2, 0], [1, 2], [2, 1]])
    order, token, sizes = sort_by_expert(e_tk, 4)
    assert sizes.tolist() == [1, 2, 3, 0]
    assert np.asarray(e_tk.reshape(-1)[order]).tolist() == [0, 1, 1, 2, 2, 2]
    assert token.tolist() == (np.asarray(order) // 2).tolist()


def test_route_renormalizes_only_when_asked():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    probs, w, e = route(logits, 2, True)
    np.testing.assert_allclose(np.asarray(w.sum(-1)), [1.0], rtol=1e-6)
    assert e.tolist() == [[0, 1]]
    _, w2, _ = route(logits, 2, False)
    np.testing.assert_allclose(np.asarray(w2), np.asarray(probs[:, :2]), rtol=1e-6)


def _hf_formula(gate_logits_per_layer, num_experts, top_k, mask=None):
    """HF load_balancing_loss_func, written out with numpy (pooled over layers)."""
    tok, prob, rows = np.zeros(num_experts), np.zeros(num_experts), 0.0
    m = np.ones(gate_logits_per_layer[0].shape[0]) if mask is None else mask.reshape(-1).astype(float)
    for lg in gate_logits_per_layer:
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        sel = np.argsort(-p, axis=-1)[:, :top_k]
        for t in range(sel.shape[0]):
            for e in sel[t]:
                tok[e] += m[t]
        prob += (p * m[:, None]).sum(0)
        rows += m.sum()
    return float(np.sum((tok / rows) * (prob / rows)) * num_experts)


def test_load_balancing_loss_matches_hf_formula_with_mask():
    rng = np.random.default_rng(0)
    layers = [rng.normal(size=(12, 6)).astype(np.float32) * 2 for _ in range(3)]
    mask = (rng.random(12) > 0.3)
    stats = []
    for lg in layers:
        probs, _, e = route(jnp.asarray(lg), 2, True)
        stats.append(router_stats(probs, e, jnp.asarray(mask)))
    ours = float(load_balancing_loss(stats, 6))
    np.testing.assert_allclose(ours, _hf_formula(layers, 6, 2, mask), rtol=1e-5)
    # Pooling is not the mean of per-layer losses.
    per_layer = np.mean([_hf_formula([lg], 6, 2, mask) for lg in layers])
    assert abs(ours - per_layer) > 1e-4
    # Perfect balance gives top_k; the loss grows when one expert takes everything.
    assert float(load_balancing_loss([RouterStats(jnp.full(4, 2.0), jnp.full(4, 1.0), jnp.float32(4))], 4)) == 2.0
    assert float(load_balancing_loss([], 4)) == 0.0


def test_moe_model_aux_loss_is_differentiable_through_the_router():
    from triage_jax.models import Qwen3
    cfg = CFG.replace(num_hidden_layers=1, vocab_size=32, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=32)
    m = Qwen3(cfg, rngs=nnx.Rngs(0))
    ids = jnp.arange(10)[None] % 32
    g = nnx.jit(nnx.grad(lambda m: m(ids, return_aux=True)[1]["moe_aux_loss"]))(m)
    assert float(jnp.abs(g.layers[0].moe.router.kernel[...]).max()) > 0


def test_moe_row_chunk_is_a_validated_static_config_field():
    from triage_jax.models import moe as moe_lib

    cfg = get_model_config("tiny_moe")
    assert cfg.moe_row_chunk == 0 and cfg.replace(moe_row_chunk=64).moe_row_chunk == 64
    assert hash(cfg) != hash(cfg.replace(moe_row_chunk=64))
    with pytest.raises(ValueError, match="moe_row_chunk=-1"):
        cfg.replace(moe_row_chunk=-1)
    assert not hasattr(moe_lib, "row_chunking") and not hasattr(moe_lib, "_ROW_CHUNK")  # no hidden global
