"""Rollout assembly: DAPO dynamic sampling filters on correctness, advantages use the shaped rewards, fill rows
are spread over the mini-batches."""

import numpy as np
import pytest

from triage_jax.rl import group_advantages, overlong_penalty
from triage_jax.rollout import Rollout, collect, layout, prompt_width, spread_fill, trim_prompt_padding

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


def test_trim_prompt_padding_keeps_every_token_and_cuts_the_shared_left_padding():
    """The learner's rows lose only prompt columns that are padding in every row, down to the longest prompt's
    granule (multiples of 8 up to 64 columns, 4 widths per octave above); the response columns stay."""
    assert [prompt_width(n, 2048) for n in (0, 1, 8, 9, 13, 17, 64, 65, 100, 1500)] == \
        [8, 8, 8, 16, 16, 24, 64, 80, 112, 1536]
    assert prompt_width(13, 12) == 12
    prompts = [[1, 2, 3], [4] * 11, [5, 6]]
    tokens = np.arange(3 * R, dtype=np.int32).reshape(3, R) + 10
    mask = np.arange(R)[None] < np.array([[2], [8], [5]])
    ids, attn = layout(prompts, tokens, mask, prompt_len=32, pad_id=0)
    ro = Rollout(input_ids=ids, attn_mask=attn, resp_mask=mask.astype(np.float32), sampler_logp=-mask.astype(np.float32),
                 rewards=np.zeros(3, np.float32), correct=np.zeros(3, bool), lengths=mask.sum(1),
                 adv=np.zeros(3, np.float32), real=np.ones(3, bool),
                 routing=np.arange(3 * (32 + R), dtype=np.int8).reshape(3, 32 + R, 1, 1))
    out = trim_prompt_padding(ro)
    assert out.input_ids.shape == (3, 16 + R) and out.routing.shape == (3, 16 + R, 1, 1)
    np.testing.assert_array_equal(out.input_ids, ids[:, 16:])
    np.testing.assert_array_equal(out.attn_mask, attn[:, 16:])
    np.testing.assert_array_equal(out.routing, ro.routing[:, 16:])
    assert out.attn_mask.sum() == attn.sum() and out.resp_mask is ro.resp_mask
    assert trim_prompt_padding(out).input_ids.shape == out.input_ids.shape  # already trimmed
