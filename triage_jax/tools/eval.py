"""avg@k and pass@k of a policy on an eval set.

  python -m triage_jax.tools.eval --config=configs/tiny.py [--checkpoint_step=N] [--eval_set=gsm8k
      --eval_path=test.jsonl] --n=32 --k=1,8,32 --temperature=1.0 --top_p=0.7

The policy is the newest (or given) checkpoint of the config's run_dir, else config.model.hf_path. pass@k uses
the unbiased estimator 1 - C(n-c, k) / C(n, k) over n samples per problem (Chen et al., 2021); avg@n is the
mean accuracy of all samples. Correctness is judged by math-verify (`--reward=dapo` for the training rule).
The synthetic set is the run's held-out split (`build.held_out`). The estimators and the sampling loop are
`triage_jax.evaluation`; this module is its command line.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags


def main(argv) -> None:
    del argv
    from triage_jax import build, sampler
    from triage_jax.config import validate
    from triage_jax.data.sources import load_eval_set
    from triage_jax.evaluation import evaluate

    c = _CONFIG.value
    if c is None:
        raise app.UsageError("pass --config=configs/NAME.py")
    ks = [int(k) for k in _K.value]
    if any(k > _N.value for k in ks):
        sys.exit(f"error: every --k must be <= --n={_N.value}, got {ks}")
    validate(c)
    from triage_jax import compile_cache

    compile_cache.enable(c.compile_cache)
    if _SET.value == "synthetic":
        examples = list(build.held_out(c, _LIMIT.value or 500))  # problems training never sees
    else:
        if not _PATH.value:
            sys.exit(f"error: --eval_set={_SET.value} needs --eval_path=FILE")
        examples = load_eval_set(_SET.value, _PATH.value, template=c.data.template,
                                 limit=_LIMIT.value or None).examples
    model, tok, step = build.load_policy(c, step=_STEP.value)
    res = evaluate(model, tok, examples, n=_N.value, ks=ks, temperature=_TEMP.value, top_p=_TOP_P.value,
                   top_k=_TOP_K.value, policy=sampler.sampler_policy(_PRECISION.value), reward=_REWARD.value,
                   batch=_BATCH.value, seed=_SEED.value, max_prompt_len=c.sampler.max_prompt_len,
                   max_new_tokens=c.sampler.max_new_tokens)
    res.update({"eval_set": _SET.value, "checkpoint_step": step})
    print(json.dumps(res))


def define_flags() -> None:
    """Register the CLI flags (only when run as a program, so importing this module defines none)."""
    global _CONFIG, _STEP, _SET, _PATH, _LIMIT, _N, _K, _TEMP, _TOP_P, _TOP_K, _PRECISION, _REWARD, _BATCH, _SEED
    _CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
    _STEP = flags.DEFINE_integer("checkpoint_step", None, "Checkpoint step to evaluate (default: newest).")
    _SET = flags.DEFINE_string("eval_set", "synthetic", "synthetic, gsm8k, math500, aime2024, aime2025 or amc2023.")
    _PATH = flags.DEFINE_string("eval_path", "", "Local file of the eval set (not needed for synthetic).")
    _LIMIT = flags.DEFINE_integer("limit", 64, "Number of problems (0: all).")
    _N = flags.DEFINE_integer("n", 8, "Samples per problem.")
    _K = flags.DEFINE_list("k", ["1", "8"], "k values of pass@k (each <= n).")
    _TEMP = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (DAPO: 1.0).")
    _TOP_P = flags.DEFINE_float("top_p", 0.7, "Nucleus sampling (DAPO eval: 0.7).")
    _TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k (0: off).")
    _PRECISION = flags.DEFINE_string("precision", "bf16", "Sampler precision preset.")
    _REWARD = flags.DEFINE_string("reward", "math_verify", "Correctness rule: math_verify or dapo.")
    _BATCH = flags.DEFINE_integer("batch", 64, "Responses per generate call.")
    _SEED = flags.DEFINE_integer("seed", 1234, "Sampling seed.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
