"""Task data: synthetic math, DAPO-Math and eval-set sources, prompt templates, tokenizers, rewards, grain loader."""

from triage_jax.data.pipeline import make_prompt_dataset, make_prompt_loader, shard_indices
from triage_jax.data.records import DataError, LoadResult, LoadStats, MathExample
from triage_jax.data.rewards import (BatchRewards, dapo_reward, get_reward_fn, math_verify_reward,
                                     normalize_final_answer, score_batch)
from triage_jax.data.sources import EVAL_SETS, load_dapo_math, load_eval_set
from triage_jax.data.synthetic import (ArithmeticProblem, SyntheticMathSource, held_out_source, solution_text,
                                      synthetic_examples)
from triage_jax.data.templates import TEMPLATES, apply_template, get_template
from triage_jax.data.tokenizers import CharTokenizer, HFTokenizer, Tokenizer, left_pad, load_tokenizer

__all__ = [
    "ArithmeticProblem", "BatchRewards", "CharTokenizer", "DataError", "EVAL_SETS", "HFTokenizer", "LoadResult",
    "LoadStats", "MathExample", "SyntheticMathSource", "TEMPLATES", "Tokenizer", "apply_template", "dapo_reward",
    "get_reward_fn", "get_template", "held_out_source", "left_pad", "load_dapo_math", "load_eval_set", "load_tokenizer",
    "make_prompt_dataset", "make_prompt_loader", "math_verify_reward", "normalize_final_answer", "score_batch",
    "shard_indices", "solution_text", "synthetic_examples",
]
