"""Rollout assembly: DAPO dynamic sampling filters on correctness, advantages use the shaped rewards, fill rows
are spread over the mini-batches."""

import numpy as np
import pytest

from triage_jax.rl import group_advantages, overlong_penalty
from triage_jax.rollout import Rollout, collect, spread_fill

G, P, R = 4, 3, 8


def groups(correct, lengths, *, buffer=4):
    """A drawn batch: one row per response, DAPO reward +-1 plus the overlong penalty over L = R."""
    correct = np.asarray(correct, bool)
    lengths = np.asarray(lengths, np.int32)
    n = len(correct)
    rewards = np.where(correct, 1.0, -1.0).astype(np.float32) + np.asarray(overlong_penalty(lengths, R, buffer))
    resp = (np.arange(R)[None] < lengths[:, None]).astype(np.float32)
    ids = np.arange(n * (P + R), dtype=np.int32).reshape(n, P + R)  # row-identifying tokens
    return Rollout(input_ids=ids, attn_mask=np.ones((n, P + R), bool), resp_mask=resp,
                   sampler_logp=-resp, rewards=rewards, correct=correct, lengths=lengths,
                   adv=np.zeros(n, np.float32), real=np.ones(n, bool))


def run(draws, num_prompts, *, dynamic=True, max_resample=3):
    it = iter(draws)
    return collect(lambda attempt: next(it), num_prompts=num_prompts, group_size=G, dynamic_sampling=dynamic,
                   max_resample=max_resample, std_normalize=True, prompt_len=P, resp_len=R, pad_id=0)


def test_dynamic_sampling_keeps_groups_with_some_but_not_all_correct():
    # Group 0: all wrong, one response in the overlong buffer (distinct shaped rewards: kept by a reward filter).
    # Group 1: mixed. Group 2: all correct, two long ones (A < 0 for correct answers under a reward filter).
    batch = groups([0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1], [3, 3, 3, 7, 2, 3, 4, 8, 2, 2, 7, 8])
    ro, stats = run([batch], num_prompts=3, max_resample=0)
    assert ro.num == 3 * G and int(ro.real.sum()) == G
    kept = ro.take(ro.real)
    np.testing.assert_array_equal(kept.input_ids, batch.input_ids[G:2 * G])  # exactly the mixed group
    # Advantages: the kept group's shaped rewards; fill rows 0.
    np.testing.assert_allclose(kept.adv, np.asarray(group_advantages(batch.rewards[G:2 * G], G)), rtol=1e-6)
    assert np.all(ro.adv[~ro.real] == 0) and np.all(ro.resp_mask[~ro.real] == 0)
    assert stats["dynamic_sampling/kept_groups_frac"] == pytest.approx(1 / 3)
    assert stats["dynamic_sampling/batch_fill"] == pytest.approx(1 / 3)
    assert stats["reward/accuracy"] == pytest.approx(6 / 12)  # over every drawn response


def test_resampling_fills_the_batch_in_draw_order():
    first = groups([0, 0, 0, 0, 1, 0, 0, 0], [2] * 8)
    second = groups([1, 1, 1, 1, 0, 1, 1, 1], [2] * 8)
    ro, stats = run([first, second], num_prompts=2)
    assert ro.real.all() and stats["dynamic_sampling/rollouts"] == 2
    np.testing.assert_array_equal(ro.input_ids[:G], first.input_ids[G:])
    np.testing.assert_array_equal(ro.input_ids[G:], second.input_ids[G:])


def test_without_dynamic_sampling_every_group_stays():
    batch = groups([0] * 8, [2, 3, 4, 8, 2, 2, 2, 2])
    ro, _ = run([batch], num_prompts=2, dynamic=False)
    assert ro.real.all() and np.any(ro.adv[:G] != 0) and np.all(ro.adv[G:] == 0)


@pytest.mark.parametrize("n_real,n_mini", [(6, 3), (2, 4), (0, 2), (12, 3), (5, 4)])
def test_spread_fill_balances_real_rows(n_real, n_mini):
    n = 12
    ro = groups([1] * n, [2] * n)
    ro = ro.take(np.arange(n))
    real = np.arange(n) < n_real
    ro = Rollout(**{**{f: getattr(ro, f) for f in ro.__dataclass_fields__}, "real": real})
    out = spread_fill(ro, n_mini)
    per = out.real.reshape(n_mini, -1).sum(1)
    assert per.sum() == n_real and per.max() - per.min() <= 1
    assert sorted(out.input_ids[:, 0].tolist()) == sorted(ro.input_ids[:, 0].tolist())  # a permutation
    np.testing.assert_array_equal(out.input_ids[out.real][:, 0], ro.input_ids[real][:, 0])  # real order kept
