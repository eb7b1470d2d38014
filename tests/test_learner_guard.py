"""The update's finite guard covers the new parameters and optimizer state, not only the gradients: an lr of inf or
NaN (finite gradients, non-finite new weights) is never applied and counts in the non-finite streak."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax import build, models
from triage_jax.config import base_config
from triage_jax.learner import nonfinite_count, update_count


def _learner_and_batch(lr):
    c = base_config()
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 2, 4, 8, 8
    c.optim.lr = lr  # build.learner does not validate: the guard must hold on its own
    c.optim.warmup_steps = 1
    c.rl.triage.segment_len = 4
    learner = build.learner(c, models.Qwen3(models.get_model_config("tiny", num_hidden_layers=1),
                                            rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    n, p, r = 8, 4, 6
    ids = rng.integers(2, 100, (n, p + r)).astype(np.int32)
    attn = np.ones((n, p + r), bool)
    resp = attn[:, p:].astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1, -0.1], np.float32)
    old, _ = learner.logprobs(ids, attn, r)
    slogp = np.asarray(old) + rng.normal(scale=0.1, size=(n, r)).astype(np.float32)
    batch, _, _ = learner.prepare(input_ids=ids, attn_mask=attn, resp_mask=resp, adv=adv, sampler_logp=slogp,
                                  old_logp=old, ref_logp=jnp.zeros_like(old))
    return learner, batch


@pytest.mark.parametrize("lr", [float("inf"), float("nan")])
def test_nonfinite_new_state_is_not_applied_and_counts(lr):
    learner, batch = _learner_and_batch(lr)
    before = jax.device_get((learner.params, learner.opt_state.inner_state))
    for k in (1, 2):
        out = jax.device_get(learner.update(batch))
        assert np.isfinite(out["grad_norm"])  # the gradient is fine: apply_if_finite alone would apply it
        assert out["skipped_update"] == 1.0
        assert int(nonfinite_count(learner.opt_state)) == k
    after = jax.device_get((learner.params, learner.opt_state.inner_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert int(update_count(learner.opt_state)) == 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(learner.params)))


def test_finite_update_resets_the_streak():
    learner, batch = _learner_and_batch(1e-3)
    out = jax.device_get(learner.update(batch))
    assert out["skipped_update"] == 0.0 and int(nonfinite_count(learner.opt_state)) == 0
    assert learner.num_updates == 1
