"""avg@n and pass@k of a policy on a set of math problems.

pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) over n samples per problem (Chen et al., 2021); avg@n
is the mean accuracy of all samples. The library side of `python -m triage_jax.tools.eval`, shared with the
studies in experiments/.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from triage_jax import sampler
from triage_jax.data.rewards import score_batch

__all__ = ["evaluate", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(model, tok, examples: Sequence, *, n: int, ks, temperature, top_p, top_k, policy, reward: str,
             batch: int, seed: int, max_prompt_len: int, max_new_tokens: int) -> dict:
    """Sample n responses per problem (MathExamples) under the sampler precision `policy` and score them with the
    `reward` rule ("math_verify" or "dapo"); returns {"problems", "n", "avg@n", "pass@k" for each k}."""
    scfg = sampler.SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k,
                                  max_new_tokens=max_new_tokens, stop_ids=tuple(tok.eos_ids))
    prepared = sampler.prepare_model(model, policy)
    rows = [(i, tok.encode_prompt(ex.prompt)) for i, ex in enumerate(examples) for _ in range(n)]
    correct = np.zeros(len(rows), bool)
    key = jax.random.key(seed)
    for start in range(0, len(rows), batch):
        chunk = rows[start: start + batch]
        out = sampler.generate(prepared, [p for _, p in chunk], scfg, policy=policy,
                               key=jax.random.fold_in(key, start), pad_id=tok.pad_id,
                               max_cache_len=max_prompt_len + max_new_tokens)
        toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        texts = [tok.decode(toks[j, : lens[j]]) for j in range(len(chunk))]
        truths = [examples[i].ground_truth for i, _ in chunk]
        correct[start: start + len(chunk)] = score_batch(texts, truths, reward=reward).accuracy
    c_per = correct.reshape(len(examples), n).sum(1)
    out = {"problems": len(examples), "n": n, f"avg@{n}": float(correct.mean())}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in c_per]))
    return out
