r"""Mismatch probe: sample with the sampler's precision, recompute log-probs with the learner's, report the gap.

    python -m triage_jax.tools.mismatch --config=tiny --learner=bf16 --sampler=w4a4 [--kv=fp8] [--num_prompts=128]
        [--rules='last:0.15=bf16'] [--sampler_rules='mlp\.down_proj=w4a8'] [--learner_rules=...] [--exact]
        [--routing-replay]

--decompose starts from exact mode and adds one source at a time (probe.decomposition: sampler weight and
activation quantization, the learner's activation-scale granularity, an FP8 KV cache, the default learner path,
the default paths on both sides), one table row each, MoE routing flips counted on every row.

--config is a model preset (tiny, tiny_moe, qwen3_4b, ...) or a run config file (configs/tiny.py: its model
preset and compute dtype). --exact runs both sides in exact mode (docs/numerics.md#exact-mode): with one
precision on both sides, every delta is 0.0 ("max_abs_delta" in the JSON line).

delta = learner log-prob - sampler log-prob per response token (docs/rl_math.md#delta). Prompts are synthetic math
problems (character tokenizer; a checkpoint's own tokenizer.json with --checkpoint), or random token ids with
--prompts=random. Responses are scored with the DAPO reward and grouped (--group_size samples per prompt) to give
the advantages of the quadrant metrics; a random-init model answers nothing right, so those are NaN (empty
denominators) there, and random prompts (nothing to score) use advantage 1 for every response. Prints a table of
every diagnostic of `triage_jax.rl.mismatch_metrics` and one JSON line. The probe itself (sampling, recompute,
scoring, diagnostics) is `triage_jax.probe`; this module is its command line.

Per-layer dial: --rules (both sides), --sampler_rules and --learner_rules (one side, ahead of --rules) each take a
precision rule, repeatable: REGEX=PRESET on module paths ("layers.3.mlp.down_proj", "layers.0.attn.q_proj",
"lm_head"; see triage_jax/models/qwen3.py), or last:K=PRESET / first:K=PRESET for the last / first K decoder
layers, K a count or a fraction rounded up (quant.policy.parse_rule). The first matching rule wins, then the
high-precision defaults (embeddings, LM head, router, norms), then the preset.

MoE models: the sampler records each token's expert ids and the result reports `routing_flips` (the (token, MoE
layer) pairs, prompt and response, whose learner experts differ from the sampler's) and `routing_flip_frac`;
--routing-replay makes the learner replay the sampler's ids (R3), so its flips are 0 by construction.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from flax import nnx

from triage_jax import compile_cache, data, models, probe
from triage_jax.quant import PRESETS
from triage_jax.quant.policy import parse_rules
from triage_jax.sampler import SamplingConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m triage_jax.tools.mismatch", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="model preset (triage_jax.models.get_model_config)")
    p.add_argument("--checkpoint", default=None, help="HF checkpoint folder (config.json + safetensors)")
    p.add_argument("--learner", default="bf16", choices=sorted(PRESETS), help="learner precision preset")
    p.add_argument("--sampler", default="w4a4", choices=sorted(PRESETS), help="sampler precision preset")
    p.add_argument("--kv", default="bf16", choices=("bf16", "fp8"), help="sampler KV-cache format")
    for side in ("", "sampler_", "learner_"):
        p.add_argument(f"--{side}rules", action="append", default=[], metavar="REGEX=PRESET",
                       help=f"per-layer precision rule for {side[:-1] or 'both sides'} (repeatable; REGEX=PRESET, "
                            "last:K=PRESET, first:K=PRESET)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="compute dtype (default: the config file's, else bfloat16)")
    p.add_argument("--exact", action="store_true", help="exact mode on both sides (needs one precision)")
    p.add_argument("--decompose", action="store_true",
                   help="from exact mode to the default, one mismatch source per row (--sampler: the 4-bit preset)")
    p.add_argument("--num_prompts", type=int, default=128)
    p.add_argument("--group_size", type=int, default=2, help="responses per prompt (GRPO group)")
    p.add_argument("--prompts", default="synthetic", choices=("synthetic", "random"))
    p.add_argument("--prompt_len", type=int, default=32, help="length of random prompts")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--vocab_chunk", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing-replay", "--routing_replay", dest="routing_replay", action="store_true",
                   help="MoE: the learner replays the sampler's expert ids (R3)")
    args = p.parse_args(argv)
    for name in ("num_prompts", "group_size", "prompt_len", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.config.endswith(".py"):
        from triage_jax.config import load_config

        try:
            c = load_config(args.config)
        except (FileNotFoundError, OSError) as e:
            p.error(f"--config={args.config}: {e}")
        args.config, args.dtype = c.model.preset, args.dtype or c.model.dtype
    args.dtype = args.dtype or "bfloat16"
    if args.exact:
        if args.learner != args.sampler:
            p.error(f"--exact needs one precision on both sides; got --learner={args.learner} and "
                    f"--sampler={args.sampler}")
        if args.kv != "bf16":
            p.error(f"--exact needs --kv=bf16 (the compute dtype); got --kv={args.kv}")
        if args.sampler_rules != args.learner_rules:
            p.error("--exact needs the same per-layer rules on both sides; use --rules, not --sampler_rules / "
                    "--learner_rules")
    return args


def build_model(args):
    """The model in the compute dtype: random init from a preset, or an HF checkpoint."""
    if args.checkpoint:
        return models.from_pretrained(args.checkpoint, dtype=args.dtype)
    cfg = models.get_model_config(args.config, dtype=args.dtype)
    return models.Qwen3(cfg, rngs=nnx.Rngs(args.seed))


def _tokenizer(args, vocab_size: int):
    """The prompt tokenizer: the checkpoint's tokenizer.json, or characters for a preset; None if unusable."""
    if args.checkpoint:
        try:
            tok = data.load_tokenizer(args.checkpoint)
        except (FileNotFoundError, ValueError) as e:
            return None, f"no usable tokenizer in {args.checkpoint} ({e})"
    else:
        tok = data.CharTokenizer()
    if tok.vocab_size > vocab_size:
        return None, f"the tokenizer's vocabulary ({tok.vocab_size}) exceeds the model's ({vocab_size})"
    return tok, None


def make_prompts(args, vocab_size: int):
    """(token-id prompts, ground truths or None, tokenizer or None, pad id, stop ids)."""
    if args.prompts == "synthetic":
        tok, why = _tokenizer(args, vocab_size)
        if tok is not None:
            prompts, truths = probe.encode_examples(tok, data.synthetic_examples(args.num_prompts, seed=args.seed))
            return prompts, truths, tok, tok.pad_id, tuple(tok.eos_ids)
        print(f"mismatch: {why}; using random prompts of {args.prompt_len} tokens", file=sys.stderr)
    return probe.random_prompts(vocab_size, args.num_prompts, args.prompt_len, seed=args.seed), None, None, 0, ()


def _setup(args):
    model = build_model(args)
    rules = {side: parse_rules(getattr(args, f"{side}_rules") + args.rules, model.cfg.num_hidden_layers)
             for side in ("sampler", "learner")}
    if any(rules.values()) and model.cfg.scan_layers:
        raise ValueError("--rules: per-layer precision rules need the layers unrolled (model scan_layers=False)")
    if args.routing_replay and not model.cfg.is_moe:
        raise ValueError(f"--routing-replay replays MoE expert routing, but {args.checkpoint or args.config!r} is a "
                         f"dense model (num_experts=0)")
    prompts, truths, tok, pad_id, stop_ids = make_prompts(args, model.cfg.vocab_size)
    prompts = [p for p in prompts for _ in range(args.group_size)]
    cfg = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         top_k=args.top_k, stop_ids=stop_ids)
    return model, rules, prompts, truths, tok, pad_id, cfg


def measure(args, setup, step: probe.Step) -> dict:
    """Sample under the step's sampler side, recompute under its learner side, and every diagnostic of the gap."""
    model, rules, prompts, truths, tok, pad_id, cfg = setup
    m = probe.measure_step(model, prompts, cfg, step, truths=truths, tok=tok, group_size=args.group_size,
                           seed=args.seed, pad_id=pad_id, temperature=args.temperature, vocab_chunk=args.vocab_chunk,
                           rules=rules, routing_replay=args.routing_replay)
    if m.pop("all_advantages_zero"):
        print("mismatch: every group scored alike, so all advantages are 0 and the advantage-weighted metrics "
              "(quadrant masses, rho_asym, tail shares) are NaN", file=sys.stderr)
    return m


def run(args) -> dict:
    setup = _setup(args)
    rules = setup[1]
    step = probe.Step("", args.sampler, args.learner, sampler_exact=args.exact, learner_exact=args.exact,
                      learner_act_scaling="row" if args.exact else None, kv=args.kv)
    return {
        "config": args.checkpoint or args.config, "learner": args.learner, "sampler": args.sampler, "kv": args.kv,
        "dtype": args.dtype, "sampler_rules": [f"{r}={p}" for r, p in rules["sampler"]],
        "learner_rules": [f"{r}={p}" for r, p in rules["learner"]], "exact": args.exact,
        **measure(args, setup, step),
    }


DECOMPOSE_COLUMNS = ("mean_abs_delta", "max_abs_delta", "delta_q05", "delta_q95", "rho_asym", "chi2_token",
                     "routing_flip_frac")


def decompose(args) -> dict:
    """`probe.decomposition(--sampler)`, one measured row per step, on the same prompts and seed."""
    setup = _setup(args)
    rows = []
    for step in probe.decomposition(args.sampler):
        m = measure(args, setup, step)
        rows.append({"step": step.name, **{k: m[k] for k in DECOMPOSE_COLUMNS if k in m},
                     "num_responses": m["num_responses"], "response_tokens": m["response_tokens"]})
        print(f"  {step.name}: mean |delta| {m['mean_abs_delta']:.3g}", file=sys.stderr)
    return {"config": args.checkpoint or args.config, "precision": args.sampler, "dtype": args.dtype,
            "decomposition": rows}


def format_decomposition(result: dict) -> str:
    cols = [c for c in DECOMPOSE_COLUMNS if any(c in r for r in result["decomposition"])]
    width = max(len(r["step"]) for r in result["decomposition"])
    lines = [f"{'step':<{width}}  " + "  ".join(f"{c:>17}" for c in cols)]
    for r in result["decomposition"]:
        lines.append(f"{r['step']:<{width}}  " + "  ".join(f"{r.get(c, float('nan')):>17.4g}" for c in cols))
    return "\n".join(lines)


def format_table(result: dict) -> str:
    width = max(len(k) for k in result)
    lines = []
    for k, v in result.items():
        if isinstance(v, float) and not math.isnan(v):
            v = f"{v:.6g}"
        lines.append(f"{k:<{width}}  {v}")
    return "\n".join(lines)


def _json_safe(v):
    """NaN (an empty denominator) as null, at any depth: the JSON line stays valid JSON."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def main(argv=None) -> int:
    args = parse_args(argv)
    compile_cache.enable()
    try:
        result = decompose(args) if args.decompose else run(args)
    except ValueError as e:
        if "precision rule" not in str(e) and "--rules" not in str(e) and "--routing-replay" not in str(e):
            raise
        print(f"mismatch: error: {e}", file=sys.stderr)
        return 2
    print(format_decomposition(result) if args.decompose else format_table(result))
    print(json.dumps(_json_safe(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
