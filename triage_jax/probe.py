r"""The mismatch probe: sample under the sampler's precision, recompute log-probs under the learner's, measure the gap.

The library side of `python -m triage_jax.tools.mismatch`, shared with the studies and notebooks in experiments/:

    out = sample_responses(model, prompts, cfg, sampler="w4a4", kv="bf16", seed=0, pad_id=tok.pad_id)
    learner_logp = recompute_logprobs(model, out, "bf16", temperature=1.0, vocab_chunk=vocab)
    delta = token_delta(learner_logp, out.logprobs, out.mask)       # from triage_jax.rl.delta (the one definition)
    adv, scored = advantages(out.tokens, out.mask, truths, tok, group_size)
    metrics = diagnostics(adv, delta, out.mask)

MoE routing replay (R3): `sample_responses(..., record_routing=True)` returns each token's expert ids
(`out.routing`); `recompute_logprobs(..., routing=out.routing)` replays them, and `routing_flips` counts the tokens
whose learner experts (`learner_routing`) differ from the sampler's.

Both sides take per-layer precision rules, (module-path regex, preset) pairs as `quant.policy.parse_rules` returns
them (`rules=`), ahead of the preset: e.g. (r"^layers\.(3)\.", "bf16") keeps layer 3 in BF16.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from triage_jax.data.rewards import score_batch
from triage_jax.logprobs import default_positions, response_logprobs, slot_aligned_hidden
from triage_jax.quant import PRESETS, LayerPrecision, PrecisionPolicy
from triage_jax.rl import group_advantages, mismatch_metrics
from triage_jax.rl.delta import token_delta
from triage_jax.sampler import SamplingConfig, generate, prepare_model, sampler_policy, token_wise_rules

__all__ = ["HEADLINE", "Step", "advantages", "decomposition", "diagnostics", "encode_examples", "learner_policy",
           "learner_routing", "measure_step", "random_prompts", "recompute_logprobs", "routing_flips",
           "sample_responses"]

# The metrics a report shows first (the rest of rl.mismatch_metrics follow in their own order).
HEADLINE = ("mean_abs_delta", "frac_small", "delta_q05", "delta_q50", "delta_q95", "kl_k1", "kl_k3", "chi2_token")


# ------------------------------------------------------------------------------------------------ prompts

def encode_examples(tok, examples) -> tuple[list[list[int]], list[str]]:
    """(token-id prompts, ground truths) of MathExamples under `tok`'s prompt encoding."""
    examples = list(examples)
    return [tok.encode_prompt(ex.prompt) for ex in examples], [ex.ground_truth for ex in examples]


def random_prompts(vocab_size: int, num_prompts: int, prompt_len: int, *, seed: int) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_len` uniform token ids in [1, vocab_size) (id 0 is left for padding)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, prompt_len).tolist() for _ in range(num_prompts)]


# ------------------------------------------------------------------------------------------------ both sides

sampler_rules = token_wise_rules  # rules for the sampler side (and an exact learner): token-wise activation scales


def sample_responses(model, prompts, cfg: SamplingConfig, *, sampler: str, kv: str, seed: int, pad_id: int,
                     max_cache_len: int | None = None, rules=(), record_routing: bool = False,
                     exact: bool = False):
    """The sampler side: `prompts` answered under the `sampler` preset (weights quantized once) -> SampleOutput.
    `rules`: per-layer (regex, preset) pairs ahead of the preset (activations token-wise, as the preset's).
    record_routing: also each token's MoE expert ids (`out.routing`).
    exact: exact mode's batch-invariant numerics (pair it with `recompute_logprobs(..., exact=True)`)."""
    policy = sampler_policy(sampler, kv_cache=kv, rules=rules, exact=exact)
    return generate(prepare_model(model, policy), prompts, cfg, policy=policy, key=jax.random.key(seed),
                    pad_id=pad_id, max_cache_len=max_cache_len, record_routing=record_routing)


@functools.lru_cache(maxsize=None)
def _jitted_logprobs(temperature: float, vocab_chunk: int):
    return jax.jit(
        lambda gd, st, pol, *a, routing: response_logprobs(nnx.merge(gd, st), *a, policy=pol,
                                                           temperature=temperature, vocab_chunk=vocab_chunk,
                                                           routing_bslk=routing),
        static_argnums=(0, 2))


def learner_policy(learner, rules=(), *, exact: bool = False, act_scaling: str | None = None) -> PrecisionPolicy:
    """The learner side's policy; exact mode takes the sampler's token-wise activation scales and rules (unless
    `act_scaling` says otherwise: the decomposition's scaling-granularity step)."""
    if exact:
        rules = sampler_rules(rules) if act_scaling in (None, "row") else tuple(rules)
        return PrecisionPolicy.from_spec(learner, act_scaling=act_scaling or "row", rules=rules, exact=True)
    return PrecisionPolicy.from_spec(learner, act_scaling=act_scaling, rules=tuple(rules))


def recompute_logprobs(model, out, learner, *, temperature: float, vocab_chunk: int, rules=(),
                       routing=None, exact: bool = False, act_scaling: str | None = None) -> jax.Array:
    """The learner side: log-probs [N, T] of `out`'s sampled tokens in one teacher-forced pass under the `learner`
    preset and per-layer `rules` (one compilation per (temperature, vocab_chunk, model structure, policy));
    routing (`out.routing`, or None) replays the sampler's MoE expert ids."""
    graphdef, state = nnx.split(model)
    return _jitted_logprobs(float(temperature), int(vocab_chunk))(
        graphdef, state, learner_policy(learner, rules, exact=exact, act_scaling=act_scaling), out.prompt_tokens,
        out.prompt_mask,
        out.tokens, out.mask, routing=routing)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _learner_experts(graphdef, state, policy, seq_bs, real_bs, prompt_mask_bp, routing):
    model = nnx.merge(graphdef, state)
    if policy.exact:  # the recompute's slot-aligned layout, mapped back to the left-padded columns
        n = seq_bs.shape[1] - prompt_mask_bp.shape[1]
        _, aux = slot_aligned_hidden(model, seq_bs, real_bs, prompt_mask_bp, n, policy, routing)
        ex_btlk = aux["experts_btlk"]
        pad_b = prompt_mask_bp.shape[1] - jnp.sum(prompt_mask_bp, axis=1, dtype=jnp.int32)
        src_bt = jnp.arange(ex_btlk.shape[1], dtype=jnp.int32)[None, :] - pad_b[:, None]
        back = jnp.take_along_axis(ex_btlk, jnp.maximum(src_bt, 0)[:, :, None, None], axis=1)
        return jnp.where((src_bt >= 0)[:, :, None, None], back, -1)
    _, aux = model(seq_bs[:, :-1], default_positions(real_bs)[:, :-1], real_bs[:, :-1], policy=policy,
                   return_hidden=True, return_aux=True, routing_btlk=None if routing is None else routing[:, :-1])
    return aux["experts_btlk"]


def learner_routing(model, out, learner, *, rules=(), routing=None) -> jax.Array:
    """The MoE expert ids [N, P + T - 1, L_moe, k] the learner's teacher-forced pass over `out` uses (its own,
    or `routing` replayed): one position per fed token, laid out like `out.routing[:, :-1]`."""
    graphdef, state = nnx.split(model)
    seq_bs = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    real_bs = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    policy = learner if isinstance(learner, PrecisionPolicy) else PrecisionPolicy.from_spec(learner, rules=tuple(rules))
    return _learner_experts(graphdef, state, policy, seq_bs, real_bs, out.prompt_mask, routing)


def routing_flips(learner_bslk, sampler_bslk) -> tuple[int, int]:
    """(flipped, recorded): of the (token, MoE layer) pairs the sampler recorded (ids >= 0), how many the learner
    routes to a different set of experts (order within the top-k ignored)."""
    learner_bslk, sampler_bslk = np.asarray(learner_bslk), np.asarray(sampler_bslk)[:, :learner_bslk.shape[1]]
    recorded_bsl = np.all(sampler_bslk >= 0, axis=-1)
    same_bsl = np.all(np.sort(learner_bslk, axis=-1) == np.sort(sampler_bslk, axis=-1), axis=-1)
    return int(np.sum(recorded_bsl & ~same_bsl)), int(np.sum(recorded_bsl))


# ------------------------------------------------------------------------------------------------ measurement

def advantages(responses_bn, mask_bn, truths: Sequence[str] | None, tok, group_size: int):
    """(GRPO group advantages [N], BatchRewards) of the responses scored with the DAPO reward against `truths` (one
    per prompt; responses come `group_size` per prompt, in order). Without truths (random prompts: nothing to score)
    every advantage is 1, so every token counts as positive-advantage in the quadrant metrics, and scored is None."""
    n = responses_bn.shape[0]
    if truths is None:
        return jnp.ones((n,), jnp.float32), None
    texts = [tok.decode(r[m]) for r, m in zip(np.asarray(responses_bn), np.asarray(mask_bn))]
    scored = score_batch(texts, [t for t in truths for _ in range(group_size)])
    # A group of one has no spread to normalize by (Dr. GRPO centering only; its advantage is then 0).
    return group_advantages(scored.rewards, group_size, std_normalize=group_size > 1), scored


def diagnostics(adv_n, delta_bn, mask_bn) -> dict[str, float]:
    """Every diagnostic of `rl.mismatch_metrics` as floats, the HEADLINE metrics first."""
    m = {k: float(v) for k, v in mismatch_metrics(adv_n, delta_bn, jnp.asarray(mask_bn).astype(jnp.float32)).items()}
    return {**{k: m[k] for k in HEADLINE if k in m}, **{k: v for k, v in m.items() if k not in HEADLINE}}


# ------------------------------------------------------------------------------------------------ decomposition

@dataclasses.dataclass(frozen=True)
class Step:
    """One row of the mismatch decomposition: the two sides' precision, KV format, numerics path and scaling."""

    name: str
    sampler: LayerPrecision | str
    learner: LayerPrecision | str
    sampler_exact: bool = True
    learner_exact: bool = True
    learner_act_scaling: str = "row"
    kv: str = "bf16"


def decomposition(precision: str = "w4a4") -> tuple[Step, ...]:
    """From exact mode (delta = 0) to the trainer's default, one source of mismatch at a time: each "+" row adds
    one source to the zero row above it (not to the row before), the last two rows combine them.

    The sources, in order: the sampler's weight quantization, its activation quantization, then the same 4-bit
    format on both sides (quantization itself cancels), the learner's per-tensor activation scales (scaling
    granularity), the sampler's FP8 KV cache, the default (non-exact) learner path (reduction orders that follow
    the batch), the default path on both sides, and both defaults at once: the trainer's W4A4/W4A4 without exact
    mode. MoE routing flips are counted on every row (`routing_flip_frac`)."""
    q = PRESETS[precision]
    if not q.quantized:
        raise ValueError(f"decomposition: --sampler={precision!r} is not a quantized preset")
    weights = LayerPrecision(weight=q.weight, weight_scaling=q.weight_scaling)
    return (
        Step("exact bf16/bf16", "bf16", "bf16"),
        Step(f"+ sampler weights {q.weight}", weights, "bf16"),
        Step(f"+ sampler activations {q.act}", precision, "bf16"),
        Step(f"{precision} on both sides", precision, precision),
        Step("+ learner act scales per tensor", precision, precision, learner_act_scaling="tensor"),
        Step("+ sampler fp8 KV cache", precision, precision, kv="fp8"),
        Step("+ default learner path", precision, precision, learner_exact=False),
        Step("default paths on both sides", precision, precision, sampler_exact=False, learner_exact=False),
        Step("trainer default (tensor scales)", precision, precision, sampler_exact=False, learner_exact=False,
             learner_act_scaling="tensor"),
    )


def measure_step(model, prompts, cfg: SamplingConfig, step: Step, *, truths, tok, group_size: int, seed: int,
                 pad_id: int, temperature: float, vocab_chunk: int, rules=None, routing_replay: bool = False,
                 max_cache_len: int | None = None) -> dict:
    """One measured row: `prompts` (each repeated `group_size` times, in order) sampled under the step's sampler
    side, recomputed under its learner side; every diagnostic of the gap, max |delta|, MoE routing flips, timings.
    rules: {"sampler": ..., "learner": ...} per-layer rules (default none); truths None: random prompts."""
    rules = rules or {"sampler": (), "learner": ()}
    t0 = time.perf_counter()
    out = sample_responses(model, prompts, cfg, sampler=step.sampler, kv=step.kv, seed=seed, pad_id=pad_id,
                           rules=rules["sampler"], record_routing=model.cfg.is_moe, exact=step.sampler_exact,
                           max_cache_len=max_cache_len)
    out.tokens.block_until_ready()
    t_sample = time.perf_counter() - t0
    t0 = time.perf_counter()
    replay = out.routing if routing_replay else None
    learner_logp = recompute_logprobs(model, out, step.learner, temperature=temperature, vocab_chunk=vocab_chunk,
                                      rules=rules["learner"], routing=replay, exact=step.learner_exact,
                                      act_scaling=step.learner_act_scaling)
    learner_logp.block_until_ready()
    t_learn = time.perf_counter() - t0
    routing = {}
    if model.cfg.is_moe:
        policy = learner_policy(step.learner, rules["learner"], exact=step.learner_exact,
                                act_scaling=step.learner_act_scaling)
        flips, recorded = routing_flips(learner_routing(model, out, policy, routing=replay), out.routing)
        routing = {"routing_flips": flips, "routing_flip_frac": flips / max(recorded, 1)}
    delta = token_delta(learner_logp, out.logprobs, out.mask)
    adv, scored = advantages(out.tokens, out.mask, truths, tok, group_size)
    return {
        "routing_replay": routing_replay, **routing, "all_advantages_zero": not bool(jnp.any(adv != 0)),
        "num_responses": len(prompts), "response_tokens": int(out.mask.sum()),
        "max_abs_delta": float(jnp.max(jnp.abs(delta) * out.mask)),
        "mean_response_len": float(out.lengths.mean()),
        "accuracy": None if scored is None else float(scored.accuracy.mean()),
        "sample_s": round(t_sample, 3), "learner_s": round(t_learn, 3), **diagnostics(adv, delta, out.mask),
    }
