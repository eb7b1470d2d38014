"""Routing replay (R3) for MoE: the sampler records each token's expert ids, the learner routes by them (the
trainer end to end on configs/tiny_moe.py is `slow`)."""

import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax import probe
from triage_jax.config import ConfigError, base_config, validate
from triage_jax.models import Qwen3, get_model_config
from triage_jax.models.moe import route, routing_dtype
from triage_jax.rl.delta import token_delta
from triage_jax.rollout import Rollout
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig
from triage_jax.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [77], [8, 9], [60, 61, 62]]
CFG = SamplingConfig(max_new_tokens=16, stop_ids=(7, 11, 19, 23))


@pytest.fixture(scope="module")
def model():
    return Qwen3(get_model_config("tiny_moe", num_hidden_layers=2), rngs=nnx.Rngs(0))


def test_route_replays_given_experts_with_its_own_weights():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2, 0.0 + 1e-9], [0.1, 0.2, 0.3, 0.4]]))
    probs, w, e = route(logits, 2, True, jnp.asarray([[2, 3], [-1, -1]]))
    assert e.tolist() == [[2, 3], [3, 2]]  # row 0 replayed, row 1 keeps its own top-2
    np.testing.assert_allclose(np.asarray(w), [[0.2 / (0.2 + 1e-9), 1e-9 / (0.2 + 1e-9)], [4 / 7, 3 / 7]],
                               rtol=1e-5)
    _, w_raw, _ = route(logits, 2, False, jnp.asarray([[2, 1], [0, 3]]))
    np.testing.assert_allclose(np.asarray(w_raw), [[0.2, 0.3], [0.1, 0.4]], rtol=1e-5)
    # The gating weights stay differentiable in the router logits (verl's R3: the router still learns).
    g = jax.grad(lambda z: jnp.sum(route(z, 2, False, jnp.asarray([[2, 1], [0, 3]]))[1] * jnp.arange(2.0)))(logits)
    assert float(jnp.abs(g).max()) > 0.01


def test_routing_ids_are_stored_compactly():
    assert [routing_dtype(e) for e in (8, 128, 129, 32768, 40000)] == [jnp.int8, jnp.int8, jnp.int16, jnp.int16,
                                                                        jnp.int32]


@pytest.mark.parametrize("scan", [False, True])
def test_replaying_the_own_routing_is_the_plain_forward(scan):
    m = Qwen3(get_model_config("tiny_moe", num_hidden_layers=2, scan_layers=scan), rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (2, 9), 1, 100)
    forward = nnx.jit(lambda m, routing: m(ids, return_aux=True, routing_btlk=routing))
    logits, aux = forward(m, None)
    own = aux["experts_btlk"]
    assert own.shape == (2, 9, 2, 2)
    replayed, aux2 = forward(m, own.astype(jnp.int8))
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(logits))
    assert float(aux2["moe_aux_loss"]) == float(aux["moe_aux_loss"])
    other = jnp.where(jnp.arange(9)[None, :, None, None] < 5, (own + 1) % 8, -1)  # -1: the layer's own choice
    changed, aux3 = forward(m, other.astype(jnp.int8))
    np.testing.assert_array_equal(np.asarray(aux3["experts_btlk"][:, :5]), np.asarray(other[:, :5]))
    assert float(jnp.abs(changed - logits).max()) > 1e-3


def _engine(model, slots, **kw):
    return Engine(CFG, EngineConfig(max_slots=slots, max_len=128, **kw), model=model, record_routing=True)


def test_recorded_routing_does_not_depend_on_slot_or_batch(model):
    ref = _engine(model, 15, continuous=False).generate(PROMPTS, jax.random.key(0), n=3)
    routing = np.asarray(ref.routing)
    assert routing.dtype == np.int8 and routing.shape == (15, 11 + 16, 2, 2)
    real = np.concatenate([np.asarray(ref.prompt_mask), np.asarray(ref.mask)], axis=1)
    fed = real.copy()
    fed[np.arange(15), 11 + np.asarray(ref.lengths) - 1] = False  # a response's last token is never fed
    assert np.all((routing >= 0) == fed[:, :, None, None])
    np.testing.assert_array_equal(routing[0, :11], routing[2, :11])  # G samples share their prompt's prefill
    out = _engine(model, 5, steps_per_round=3, prefill_batch=2).generate(PROMPTS, jax.random.key(0), n=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.routing), routing)
    # Other requests around it do not matter either: the first two prompts alone record the same ids.
    alone = _engine(model, 4).generate(PROMPTS[:2], jax.random.key(0), n=3)
    np.testing.assert_array_equal(np.asarray(alone.routing), routing[:6])


def test_a_dense_engine_cannot_record_routing():
    dense = Qwen3(get_model_config("tiny", num_hidden_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="record_routing=True.*MoE model"):
        _engine(dense, 2)


def _sample(model, sampler):
    return probe.sample_responses(model, PROMPTS[:3], CFG, sampler=sampler, kv="bf16", seed=0, pad_id=0,
                                  record_routing=True)


def test_replay_removes_every_routing_flip(model):
    """W4A4 sampler vs float32 BF16 learner: quantization flips some tokens' experts; replaying the sampler's
    ids leaves none."""
    out = _sample(model, "w4a4")
    flips, recorded = probe.routing_flips(probe.learner_routing(model, out, "bf16"), out.routing)
    assert recorded > 60 and flips > 0
    replayed = probe.learner_routing(model, out, "bf16", routing=out.routing)
    assert probe.routing_flips(replayed, out.routing) == (0, recorded)
    kept = np.asarray(out.routing[:, :-1]) >= 0
    np.testing.assert_array_equal(np.asarray(replayed)[kept], np.asarray(out.routing[:, :-1])[kept])


def test_replay_at_identical_float32_precision_keeps_the_sampler_numbers(model):
    out = _sample(model, "bf16")
    replayed = probe.learner_routing(model, out, "bf16", routing=out.routing)
    assert probe.routing_flips(replayed, out.routing)[0] == 0
    lp = probe.recompute_logprobs(model, out, "bf16", temperature=1.0, vocab_chunk=128, routing=out.routing)
    assert float(jnp.abs(token_delta(lp, out.logprobs, out.mask)).max()) < 1e-4


def test_rollout_rows_carry_their_routing():
    ro = Rollout.fill_rows(2, 3, 4, 0, routing_like=np.zeros((1, 7, 2, 2), np.int8))
    assert ro.routing.shape == (2, 7, 2, 2) and ro.routing.dtype == np.int8 and np.all(ro.routing == -1)
    both = Rollout.concat([ro, ro]).take(np.array([3, 0]))
    assert both.routing.shape == (2, 7, 2, 2)
    assert Rollout.fill_rows(2, 3, 4, 0).take(np.array([1])).routing is None


def test_routing_replay_needs_an_moe_model():
    c = base_config()
    c.rl.routing_replay = True
    with pytest.raises(ConfigError, match=r"config\.rl\.routing_replay: .*'tiny' is a dense model"):
        validate(c, check_paths=False)
    c.model.preset = "tiny_moe"
    validate(c, check_paths=False)


def test_learner_recompute_and_update_replay_the_routing():
    """Learner.logprobs and the update's loss replay a batch's routing: other ids than the learner's own change
    the log-probs and the loss, and the router still gets a gradient."""
    from triage_jax import build

    c = base_config()
    c.model.preset = "tiny_moe"
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 2, 2, 4, 2
    c.rl.correction = "none"
    mc = get_model_config("tiny_moe", num_hidden_layers=2)
    learner = build.learner(c, Qwen3(mc, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    n, p, r = 4, 5, 6
    ids = rng.integers(2, 100, (n, p + r)).astype(np.int32)
    attn = np.ones((n, p + r), bool)
    attn[:2, :2] = False
    resp = attn[:, p:].astype(np.float32)
    forward = nnx.jit(lambda m, ids, am: m(ids, None, am, return_hidden=True, return_aux=True)[1])
    aux = forward(learner.model(), jnp.asarray(ids[:, :-1]), jnp.asarray(attn[:, :-1]))
    own = np.concatenate([np.asarray(aux["experts_btlk"]), np.full((n, 1, 2, 2), -1)], 1).astype(np.int8)
    other = np.where(own >= 0, (own + 3) % 8, -1).astype(np.int8)
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)

    def run(routing):
        old, _ = learner.logprobs(ids, attn, r, routing=routing)
        batch, _, _ = learner.prepare(input_ids=ids, attn_mask=attn, resp_mask=resp, adv=adv,
                                      sampler_logp=np.asarray(old) - 0.1, old_logp=old,
                                      ref_logp=jnp.zeros_like(old), routing=routing)
        loss, _, _, grads = learner.loss_and_grads(batch)
        return np.asarray(old), float(loss), grads

    # (Replaying the own ids is the plain forward: test_replaying_the_own_routing_is_the_plain_forward.)
    base, other_run = run(own), run(other)  # one compilation each for the recompute and the loss
    assert np.abs(other_run[0] - base[0]).max() > 1e-3 and other_run[1] != pytest.approx(base[1], abs=1e-6)
    router_g = other_run[2]["layers"][0]["moe"]["router"]["kernel"]
    assert float(jnp.abs(router_g[...]).max()) > 0


@pytest.mark.slow
def test_trainer_runs_with_routing_replay_on_tiny_moe(tmp_path):
    c = runpy.run_path(os.path.join(ROOT, "configs", "tiny_moe.py"))["get_config"]()
    c.run_dir, c.warmup.cache_dir = str(tmp_path / "run"), str(tmp_path / "warm")
    c.warmup.steps, c.warmup.batch_size = 4, 8
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 2, 4, 4, 2
    c.rl.dynamic_sampling, c.rl.overlong_buffer = False, 8
    c.sampler.max_new_tokens = 12
    c.train.steps, c.train.energy_every, c.train.progress = 2, 2, False
    c.rl.routing_replay = True
    tr = Trainer(c)
    seen = []
    original = tr.learner.logprobs

    def logprobs(*a, routing=None, **kw):
        seen.append(routing)
        return original(*a, routing=routing, **kw)

    tr.learner.logprobs = logprobs
    hist = tr.run()
    assert len(hist) == 2
    for m in hist:
        assert np.isfinite(m["learner/loss"]) and np.isfinite(m["mismatch/mean_abs_delta"])
        assert m["learner/grad_norm"] > 0
    r = seen[0]
    # [responses, prompt + response, MoE layers, top-k]; the rollout trims prompt padding to its longest prompt.
    assert r is not None and r.dtype == np.int8 and r.shape[0] == 8 and r.shape[2:] == (4, 2)
    assert 12 < r.shape[1] <= c.sampler.max_prompt_len + 12 and (r >= 0).any()
    assert all(s is not None for s in seen)  # the recompute and the energy pass both replay
