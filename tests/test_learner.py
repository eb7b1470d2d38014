"""The learner step is the same computation on 1 device and on a 2x2x2 mesh of 8 simulated CPU devices."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from triage_jax import models
    from triage_jax.config import base_config
    from triage_jax import build

    mesh = json.loads(sys.argv[1])
    c = base_config()
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 2, 4, 8, 4
    for k, v in mesh.items():
        c.mesh[k] = v
    c.optim.warmup_steps = 1
    mc = models.get_model_config("tiny", vocab_size=128, num_hidden_layers=2)
    model = models.Qwen3(mc, rngs=nnx.Rngs(0))
    learner = build.learner(c, model)
    rng = np.random.default_rng(0)
    n, p, r = 8, 8, 8
    ids = rng.integers(2, 100, (n, p + r)).astype(np.int32)
    attn = np.ones((n, p + r), bool); attn[:4, :3] = False
    resp = np.ones((n, r), np.float32); resp[::3, 5:] = 0
    adv = rng.normal(size=n).astype(np.float32)
    old, _ = learner.logprobs(ids, attn, r)
    slogp = np.asarray(old) + rng.normal(scale=0.05, size=(n, r)).astype(np.float32)
    batch, metrics, _ = learner.prepare(input_ids=ids, attn_mask=attn, resp_mask=resp, adv=adv,
        sampler_logp=slogp, old_logp=old, ref_logp=jnp.zeros_like(old))
    out = [learner.update(batch), learner.update(batch)]
    print("RESULT", json.dumps({"loss": [float(o["loss"]) for o in out],
                                "grad_norm": [float(o["grad_norm"]) for o in out],
                                "delta": float(metrics["mismatch/mean_abs_delta"]),
                                "devices": len(jax.devices()), "mesh": dict(learner.mesh.shape)}))
""")


def _run(mesh: dict, devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(mesh)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_one_device_equals_2x2x2_mesh():
    single = _run({}, 1)
    sharded = _run({"data": 2, "fsdp": 2, "tensor": 2}, 8)
    assert sharded["devices"] == 8 and sharded["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}
    assert single["delta"] == pytest.approx(sharded["delta"], rel=1e-5, abs=1e-6)
    for a, b in zip(single["loss"], sharded["loss"]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for a, b in zip(single["grad_norm"], sharded["grad_norm"]):
        assert a == pytest.approx(b, rel=1e-4)


def _learner_and_batch(micro: int, agg: str = "token-mean", correction: str = "triage", k_rep: int = 0,
                       shift=None):
    """A tiny learner and a prepared batch of 8 responses (left padding, a short response, mixed advantages);
    `shift` [8] moves each response's sampler log-probs (a negative shift on A < 0 rows: delta > 0; etc.)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from triage_jax import build, models
    from triage_jax.config import base_config

    c = base_config()
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 2, 4, 8, micro
    c.rl.agg, c.rl.correction = agg, correction
    c.rl.triage.k_rep = k_rep
    c.rl.triage.segment_len = 4
    mc = models.get_model_config("tiny", num_hidden_layers=2)
    learner = build.learner(c, models.Qwen3(mc, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(1)
    n, p, r = 8, 6, 10
    ids = rng.integers(2, 100, (n, p + r)).astype(np.int32)
    attn = np.ones((n, p + r), bool)
    attn[:3, :2] = False
    attn[5, p + 4:] = False
    resp = attn[:, p:].astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1, -0.1], np.float32)
    old, _ = learner.logprobs(ids, attn, r)
    noise = rng.normal(scale=0.2, size=(n, r)).astype(np.float32)
    if shift is not None:
        noise = noise + np.asarray(shift, np.float32)[:, None]
    slogp = np.asarray(old) + noise
    batch, _, _ = learner.prepare(input_ids=ids, attn_mask=attn, resp_mask=resp, adv=adv, sampler_logp=slogp,
                                  old_logp=old, ref_logp=jnp.zeros_like(old))
    return learner, batch


# The per-sequence aggregation runs with -m slow (~25 s): tests/test_rl_grpo.py checks every aggregation's
# micro-batch sums against the full batch; this one checks the learner's accumulation around them.
@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_micro_batch_accumulation_is_exact(agg):
    import jax
    import numpy as np

    outs = []
    for micro in (8, 2):
        learner, batch = _learner_and_batch(micro, agg)
        # Two updates: the second one's loss and gradient depend on every parameter the first one moved.
        outs.append([jax.device_get(learner.update(batch)) for _ in range(2)])
    for full, accumulated in zip(*outs):
        for k in ("loss", "policy_loss", "repair_loss", "grad_norm", "clipfrac"):
            # Loss values near 0 (advantages cancel at ratio 1): compare at float32 summation-order noise.
            np.testing.assert_allclose(full[k], accumulated[k], rtol=2e-4, atol=1e-6, err_msg=k)


def test_update_moves_params_and_reports_finite_terms():
    import jax
    import numpy as np

    learner, batch = _learner_and_batch(4)
    before = jax.device_get(learner.params)
    out = jax.device_get(learner.update(batch))
    assert out["skipped_update"] == 0 and np.isfinite(out["loss"]) and out["grad_norm"] > 0
    assert out["repair_loss"] >= 0 and out["empty_minibatch"] == 0 and learner.num_updates == 1
    after = jax.device_get(learner.params)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before, after))
    assert max(moved) > 0


# Sampler log-probs above the learner's on A < 0 rows (delta < 0: TRIAGE gates them) and on A > 0 rows (the
# repair term's gap logp - sampler_logp < 0 is what it pushes back).
SHIFT = [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.0, 0.3]


def _hand_loss(learner, batch, step):
    """The learner's objective assembled from the rl building blocks by hand: TRIAGE's gate as token weights
    in the clipped surrogate (token-mean), plus the repair term at update index `step`."""
    import jax.numpy as jnp

    from triage_jax.logprobs import response_logprobs
    from triage_jax.rl import grpo, triage

    cfg = learner.correction.cfg
    p = batch.input_ids.shape[1] - batch.resp_len
    delta = jnp.where(batch.resp_mask > 0, batch.old_logp - batch.sampler_logp, 0.0)  # learner - sampler
    alpha = triage.gate_weights(batch.adv, delta, batch.resp_mask, cfg)

    def f(params):
        logp = response_logprobs(learner.model(params), batch.input_ids[:, :p], batch.attn_mask[:, :p],
                                 batch.input_ids[:, p:], batch.attn_mask[:, p:], policy=learner.policy,
                                 temperature=learner.settings.temperature, vocab_chunk=learner.settings.vocab_chunk)
        pl_sum, denom, _ = grpo.policy_loss(logp, batch.old_logp, batch.adv, batch.resp_mask, weights=alpha)
        rep = triage.repair_loss(batch.adv, logp, batch.sampler_logp, batch.resp_mask, jnp.int32(step), cfg)
        return pl_sum / denom + rep, rep

    return f, alpha


# micro=2 checks everything micro=8 does and the accumulation too; micro=8 runs with -m slow.
@pytest.mark.parametrize("micro", [pytest.param(8, marks=pytest.mark.slow), 2])
def test_learner_objective_equals_hand_assembled_loss(micro):
    """Fails if the learner dropped the TRIAGE weights, flipped delta's sign, lost the repair term, or
    accumulated micro-batches inexactly."""
    import jax
    import numpy as np

    learner, batch = _learner_and_batch(micro, shift=SHIFT)
    f, alpha = _hand_loss(learner, batch, step=0)
    assert float(np.abs(np.asarray(alpha) - 1.0).max()) > 0.05  # the gate is active on this batch
    (want_loss, want_rep), want_g = jax.jit(jax.value_and_grad(f, has_aux=True))(learner.params)
    assert float(want_rep) > 1e-4  # so is the repair term
    loss, terms, _, grads = learner.loss_and_grads(batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(terms["repair_loss"]), float(want_rep), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g)):
        # Float32 sums in another order: an element near zero can differ by ~1e-4 of its leaf's largest one (the
        # size of that order's rounding depends on the CPU's kernels); a dropped weight or term moves far more.
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=1e-4 * float(np.abs(w).max()))


def test_repair_warmup_counts_optimizer_updates():
    """k_rep counts the learner's applied updates: no repair at update 0, repair from update 1 on (k_rep=1);
    an empty mini-batch in between does not advance the count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    learner, batch = _learner_and_batch(8, k_rep=1, shift=SHIFT)
    assert float(learner.loss_and_grads(batch)[1]["repair_loss"]) == 0.0
    empty = batch.replace(loss_mask=jnp.zeros_like(batch.loss_mask), resp_mask=jnp.zeros_like(batch.resp_mask))
    learner.update(empty)
    assert learner.num_updates == 0
    assert float(jax.device_get(learner.update(batch))["repair_loss"]) == 0.0  # the update at index 0
    assert learner.num_updates == 1
    f, _ = _hand_loss(learner, batch, step=1)
    want_loss, want_rep = jax.jit(f)(learner.params)
    loss, terms, _, _ = learner.loss_and_grads(batch)
    assert float(terms["repair_loss"]) > 0
    np.testing.assert_allclose(float(terms["repair_loss"]), float(want_rep), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, atol=1e-7)


def test_all_fill_minibatch_takes_no_step():
    """Params and optimizer state stay bit-identical across a mini-batch without a real token (AdamW would
    otherwise apply its momentum and weight decay), and its metrics say so."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    learner, batch = _learner_and_batch(4)
    learner.update(batch)  # a real step first: non-zero momentum
    before = jax.device_get((learner.params, learner.opt_state))
    empty = batch.replace(loss_mask=jnp.zeros_like(batch.loss_mask), resp_mask=jnp.zeros_like(batch.resp_mask),
                          attn_mask=batch.attn_mask.at[:, -batch.resp_len:].set(False))
    out = jax.device_get(learner.update(empty))
    after = jax.device_get((learner.params, learner.opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert out["empty_minibatch"] == 1 and out["skipped_update"] == 0 and learner.num_updates == 1
    assert np.isnan(out["clipfrac"])  # the whole mini-batch's denominator is empty: NaN, reported


@pytest.mark.parametrize("correction", ["triage", "seq_mis"])
def test_metrics_stay_finite_when_one_micro_batch_is_empty(correction):
    """clipfrac, ratio_mean, ppo_kl, ... are masked sums over micro-batches divided once: a micro-batch without
    a token (rows 0-1 here) adds nothing instead of turning the mini-batch's metrics NaN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    learner, batch = _learner_and_batch(2, correction=correction)
    no_tokens = jnp.arange(batch.num)[:, None] < 2
    batch = batch.replace(loss_mask=jnp.where(no_tokens, 0.0, batch.loss_mask),
                          resp_mask=jnp.where(no_tokens, 0.0, batch.resp_mask))
    out = jax.device_get(learner.update(batch))
    for k in ("clipfrac", "clipfrac_low", "clipfrac_high", "dual_clipfrac", "ratio_mean", "ppo_kl", "loss"):
        assert np.isfinite(out[k]), k
    assert out["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # first update: logp == old_logp
