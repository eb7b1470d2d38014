"""Rollout assembly: sample G responses per prompt, score and shape them, lay them out for the learner, and fill
a batch with DAPO dynamic sampling (docs/rl_math.md#dynamic-sampling).

One container, `Rollout`, carries a batch from the sampler to the learner; its field names are the learner's
(`learner.RolloutBatch` adds the recomputed log-probs and the correction's weights to the same names).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from triage_jax import sampler as sampler_lib
from triage_jax.data.rewards import score_batch
from triage_jax.rl import grpo


@dataclasses.dataclass(frozen=True)
class Rollout:
    """N responses on the host, each row laid out as [left-padded prompt (P) | response (R)]."""

    input_ids: np.ndarray  # int32 [N, P + R]
    attn_mask: np.ndarray  # bool [N, P + R]: real prompt and response tokens
    resp_mask: np.ndarray  # float32 [N, R]: real response tokens
    sampler_logp: np.ndarray  # float32 [N, R] (0 on padding)
    rewards: np.ndarray  # float32 [N]: the reward the advantages use (correctness + overlong shaping)
    correct: np.ndarray  # bool [N]: what dynamic sampling filters on
    lengths: np.ndarray  # int32 [N] response tokens
    adv: np.ndarray  # float32 [N] group advantages (0 until `with_advantages`, always 0 for fill rows)
    real: np.ndarray  # bool [N]: False for fill rows (no token, no weight)
    # int8/16/32 [N, P + R, L_moe, k]: the sampler's MoE expert ids of each token (-1: none), for routing replay
    # (rl.routing_replay); None when not recorded.
    routing: np.ndarray | None = None

    @property
    def num(self) -> int:
        return self.input_ids.shape[0]

    def take(self, rows) -> "Rollout":
        """The rows `rows` (an index array or a boolean mask), in that order."""
        return Rollout(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                          for f in dataclasses.fields(self)})

    @staticmethod
    def concat(parts: Sequence["Rollout"]) -> "Rollout":
        def cat(name):
            arrays = [getattr(p, name) for p in parts]
            return None if any(a is None for a in arrays) else np.concatenate(arrays)

        return Rollout(**{f.name: cat(f.name) for f in dataclasses.fields(Rollout)})

    @staticmethod
    def fill_rows(n: int, prompt_len: int, resp_len: int, pad_id: int, routing_like: np.ndarray | None = None
                  ) -> "Rollout":
        """n rows that hold no token: they enter no sum and no denominator (routing -1, shaped like
        `routing_like`'s rows, when the other rows carry routing)."""
        s = prompt_len + resp_len
        routing = (None if routing_like is None
                   else np.full((n, s, *routing_like.shape[2:]), -1, routing_like.dtype))
        return Rollout(input_ids=np.full((n, s), pad_id, np.int32), attn_mask=np.zeros((n, s), bool),
                       resp_mask=np.zeros((n, resp_len), np.float32),
                       sampler_logp=np.zeros((n, resp_len), np.float32), rewards=np.zeros(n, np.float32),
                       correct=np.zeros(n, bool), lengths=np.zeros(n, np.int32), adv=np.zeros(n, np.float32),
                       real=np.zeros(n, bool), routing=routing)


def layout(prompts: Sequence[Sequence[int]], tokens_nr, mask_nr, *, prompt_len: int, pad_id: int):
    """(input_ids [N, P+R], attn_mask [N, P+R]) of left-padded prompts followed by their responses."""
    n, r = tokens_nr.shape
    ids = np.full((n, prompt_len + r), pad_id, np.int32)
    attn = np.zeros(ids.shape, bool)
    for i, p in enumerate(prompts):
        ids[i, prompt_len - len(p): prompt_len] = p
        attn[i, prompt_len - len(p): prompt_len] = True
    ids[:, prompt_len:] = np.where(mask_nr, tokens_nr, pad_id)
    attn[:, prompt_len:] = mask_nr
    return ids, attn


def sample_groups(engine: sampler_lib.Engine, examples, *, tok, group_size: int, prompt_len: int, key,
                  overlong_buffer: int = 0, overlong_factor: float = 1.0, reward: str = "dapo",
                  before_generate: Callable[[list[list[int]]], None] | None = None) -> tuple[Rollout, float]:
    """G sampled, scored responses of each example (rows grouped by prompt; each prompt prefilled once);
    returns (rollout, scoring seconds). `before_generate(prompts)` sees the tokenized prompts first (the trainer
    starts compiling the learner's programs for their width).

    The reward is the DAPO correctness reward plus, with a buffer, the overlong penalty over L =
    `engine.cfg.max_new_tokens`; `correct` keeps the bare correctness for dynamic sampling.
    """
    r = engine.cfg.max_new_tokens
    unique = [tok.encode_prompt(ex.prompt) for ex in examples]
    if max(map(len, unique)) > prompt_len:
        raise ValueError(f"a {max(map(len, unique))}-token prompt exceeds config.sampler.max_prompt_len={prompt_len}")
    if before_generate is not None:
        before_generate(unique)
    out = engine.generate(unique, key, n=group_size)
    prompts = [p for p in unique for _ in range(group_size)]
    tokens = np.asarray(out.tokens)[:, :r]
    mask = np.asarray(out.mask)[:, :r]
    logp = np.asarray(out.logprobs)[:, :r]
    lengths = mask.sum(-1).astype(np.int32)
    t0 = time.perf_counter()
    texts = [tok.decode(tokens[i, : lengths[i]]) for i in range(len(prompts))]
    truths = [ex.ground_truth for ex in examples for _ in range(group_size)]
    scored = score_batch(texts, truths, reward=reward)
    rewards = np.asarray(scored.rewards, np.float32)
    if overlong_buffer:
        rewards = rewards + np.asarray(grpo.overlong_penalty(lengths, r, overlong_buffer, overlong_factor))
    reward_s = time.perf_counter() - t0
    ids, attn = layout(prompts, tokens, mask, prompt_len=prompt_len, pad_id=tok.pad_id)
    n = len(prompts)
    routing = None
    if out.routing is not None:  # left-pad the engine's [P_out + R] layout to [prompt_len + R], like the ids
        got = np.asarray(out.routing)
        pad = prompt_len - out.prompt_tokens.shape[1]
        routing = np.concatenate([np.full((n, pad, *got.shape[2:]), -1, got.dtype), got], axis=1)
    return Rollout(input_ids=ids, attn_mask=attn, resp_mask=mask.astype(np.float32),
                   sampler_logp=np.where(mask, logp, 0.0).astype(np.float32), rewards=rewards,
                   correct=np.asarray(scored.accuracy, bool), lengths=lengths, adv=np.zeros(n, np.float32),
                   real=np.ones(n, bool), routing=routing), reward_s


def collect(draw: Callable[[int], Rollout], *, num_prompts: int, group_size: int, dynamic_sampling: bool,
            max_resample: int, std_normalize: bool, prompt_len: int, resp_len: int, pad_id: int
            ) -> tuple[Rollout, dict[str, float]]:
    """A batch of num_prompts groups: `draw(attempt)` yields one fresh batch of groups; with dynamic sampling,
    groups whose responses are all right or all wrong are dropped and up to `max_resample` more batches drawn.
    Groups still missing become fill rows. Advantages come from the kept groups' (shaped) rewards.
    Returns the rollout (real rows first) and its statistics over every drawn response."""
    want = num_prompts * group_size
    kept: list[Rollout] = []
    drawn: list[Rollout] = []
    n_groups = n_kept = 0
    for attempt in range(1 + (max_resample if dynamic_sampling else 0)):
        ro = draw(attempt)
        drawn.append(ro)
        keep = (np.asarray(grpo.dynamic_sampling_keep(ro.correct.astype(np.float32), group_size))
                if dynamic_sampling else np.ones(ro.num // group_size, bool))
        n_groups += len(keep)
        n_kept += int(keep.sum())
        kept.append(ro.take(np.repeat(keep, group_size)))
        if sum(k.num for k in kept) >= want:
            break
    ro = Rollout.concat(kept).take(np.arange(min(want, sum(k.num for k in kept))))
    n_real = ro.num
    if n_real < want:
        ro = Rollout.concat([ro, Rollout.fill_rows(want - n_real, prompt_len, resp_len, pad_id,
                                                   routing_like=drawn[0].routing)])
    adv = np.array(grpo.group_advantages(ro.rewards, group_size, std_normalize=std_normalize), np.float32)
    adv[~ro.real] = 0.0
    ro = dataclasses.replace(ro, adv=adv)
    every = Rollout.concat(drawn)
    stats = {
        "reward/mean": float(every.rewards.mean()), "reward/accuracy": float(every.correct.mean()),
        "response/length_mean": float(every.lengths.mean()),
        "response/truncated_frac": float((every.lengths >= resp_len).mean()),
        "dynamic_sampling/kept_groups_frac": n_kept / max(n_groups, 1),
        "dynamic_sampling/batch_fill": n_real / want, "dynamic_sampling/rollouts": float(len(drawn)),
    }
    return ro, stats


def prompt_width(longest: int, prompt_len: int) -> int:
    """The prompt columns the learner keeps: the longest prompt rounded up to a granule of >= 8 columns that
    doubles with each octave (<= 4 widths per octave, so few compiled shapes), at most `prompt_len`."""
    longest = max(int(longest), 1)
    granule = max(8, 1 << max(longest.bit_length() - 3, 0))
    return min(int(prompt_len), -(-longest // granule) * granule)


def trim_prompt_padding(ro: Rollout) -> Rollout:
    """The rollout without the prompt's leading columns that hold no token in any row (left padding past the
    longest prompt, see `prompt_width`): the learner's forwards cost what the prompts hold, not
    config.sampler.max_prompt_len. Every real token keeps its position (RoPE positions count real tokens), so
    only the padding that no query attends to goes."""
    resp = ro.resp_mask.shape[1]
    p = ro.input_ids.shape[1] - resp
    longest = int(ro.attn_mask[:, :p].sum(axis=1).max(initial=0))
    cut = p - prompt_width(longest, p)
    if cut <= 0:
        return ro
    return dataclasses.replace(ro, input_ids=ro.input_ids[:, cut:], attn_mask=ro.attn_mask[:, cut:],
                               routing=None if ro.routing is None else ro.routing[:, cut:])


def spread_fill(ro: Rollout, num_minibatches: int) -> Rollout:
    """Reorder rows so every mini-batch holds a near-equal share of the real rows (and of the fill rows).

    With fill rows at the end, the last mini-batches would hold no real token yet still be stepped on.
    """
    n = ro.num
    if n % num_minibatches:
        raise ValueError(f"{n} rows do not split into {num_minibatches} mini-batches")
    m = n // num_minibatches
    real = np.flatnonzero(ro.real)
    fill = np.flatnonzero(~ro.real)
    order, fi = [], 0
    for j in range(num_minibatches):
        share = real[j * len(real) // num_minibatches: (j + 1) * len(real) // num_minibatches]
        order += list(share) + list(fill[fi: fi + m - len(share)])
        fi += m - len(share)
    return ro.take(np.asarray(order, np.int64))
