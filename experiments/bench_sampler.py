"""Sampler throughput on the tiny model against HF transformers' `generate` on the same weights (CPU).

    python experiments/bench_sampler.py [--new_tokens=128] [--prompt_len=32] [--repeats=3]

Reports, per batch size (1, 8, 32): end-to-end tokens/s of `triage_jax.sampler.generate` and of HF `generate`
(same prompts, same length, sampling at T=1, no early stop), the JAX decode-loop-only tokens/s, and the speedup;
then the JAX per-token decode time at position 64 and at 1024 in one 2048-slot cache (attention always spans the
whole preallocated cache, so the two should match). Times are the best of `--repeats` runs after a warm-up
(compilation excluded). Prints the load average first (the table and the JSON line say "measured under load"
above 0.5 per core, experiments/loadavg.py), a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.loadavg import machine_load  # noqa: E402
from triage_jax import models  # noqa: E402
from triage_jax.quant import PrecisionPolicy  # noqa: E402
from triage_jax.sampler import SamplingConfig, decode, generate, prefill, prepare_batch  # noqa: E402


def best_of(fn, repeats):
    fn()  # warm-up (compilation)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def jax_generate_time(model, prompts, cfg, policy, repeats):
    gd, state = nnx.split(model)
    key = jax.random.key(0)

    def run():
        out = generate((gd, state), prompts, cfg, policy=policy, key=key, pad_id=0)
        jax.block_until_ready(out.tokens)
        assert int(out.lengths.min()) == cfg.max_new_tokens

    return best_of(run, repeats)


def jax_decode_time(model, prompts, cfg, policy, repeats, max_cache_len=None):
    """Seconds of the compiled decode loop alone (prefill excluded) for max_new_tokens - 1 steps."""
    gd, state = nnx.split(model)
    key = jax.random.key(0)
    batch = prepare_batch(prompts, pad_id=0, max_new_tokens=cfg.max_new_tokens, max_cache_len=max_cache_len)
    times = []
    for i in range(repeats + 1):
        dstate = jax.block_until_ready(prefill(gd, state, batch, cfg, policy=policy, key=key, pad_id=0))
        t0 = time.perf_counter()
        out = decode(gd, state, dstate, batch, cfg, policy=policy, key=key, pad_id=0)
        jax.block_until_ready(out.tokens)
        if i:  # the first run compiles
            times.append(time.perf_counter() - t0)
    return min(times)


def hf_generate_time(hf_model, prompts, new_tokens, repeats):
    import torch

    b, t = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p)
        mask[i, t - len(p):] = 1

    def run():
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                    top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                                    eos_token_id=None)
        assert out.shape[1] == t + new_tokens

    torch.manual_seed(0)
    return best_of(run, repeats)


def greedy_agrees_with_hf(model, hf_model, prompts, n=16):
    """Same weights, same greedy continuation (a check that both sides run the same model)."""
    import torch

    ours = generate(model, prompts, SamplingConfig(max_new_tokens=n, greedy=True), key=jax.random.key(0), pad_id=0)
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = hf_model.generate(input_ids=torch.tensor([p]), do_sample=False, max_new_tokens=n,
                                    min_new_tokens=n, pad_token_id=0, eos_token_id=None)[0, len(p):]
        if not np.array_equal(np.asarray(ours.tokens[i]), ref.numpy()):
            return False
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode_tokens", type=int, default=64, help="steps timed at positions 64 and 1024")
    ap.add_argument("--no_hf", action="store_true")
    args = ap.parse_args(argv)
    load = machine_load()
    print(load.line())

    cfg_model = models.get_model_config("tiny")
    model = models.Qwen3(cfg_model, rngs=nnx.Rngs(0))
    policy = PrecisionPolicy()  # float32, no quantization on both sides
    rng = np.random.default_rng(0)
    hf_model = None
    if not args.no_hf:
        import torch
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as d:
            models.save_pretrained(model, d)
            hf_model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        torch.set_num_threads(max(torch.get_num_threads(), 1))

    rows = []
    cfg = SamplingConfig(max_new_tokens=args.new_tokens)
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [rng.integers(2, cfg_model.vocab_size, args.prompt_len).tolist() for _ in range(b)]
        n_tok = b * args.new_tokens
        t_jax = jax_generate_time(model, prompts, cfg, policy, args.repeats)
        t_dec = jax_decode_time(model, prompts, cfg, policy, args.repeats)
        row = {"batch": b, "jax_tok_s": n_tok / t_jax, "jax_decode_tok_s": b * (args.new_tokens - 1) / t_dec}
        if hf_model is not None:
            t_hf = hf_generate_time(hf_model, prompts, args.new_tokens, args.repeats)
            row.update(hf_tok_s=n_tok / t_hf, speedup=t_hf / t_jax)
        rows.append(row)

    agree = None
    if hf_model is not None:
        agree = greedy_agrees_with_hf(model, hf_model, [rng.integers(2, cfg_model.vocab_size, 9).tolist()
                                                        for _ in range(2)])

    # Per-token decode time at two positions of one preallocated 2048-slot cache (batch 8).
    flat = {}
    dcfg = SamplingConfig(max_new_tokens=args.decode_tokens + 1)
    for pos in (64, 1024):
        prompts = [rng.integers(2, cfg_model.vocab_size, pos).tolist() for _ in range(8)]
        t = jax_decode_time(model, prompts, dcfg, policy, args.repeats, max_cache_len=2048)
        flat[f"ms_per_token_at_{pos}"] = 1e3 * t / args.decode_tokens

    print(f"tiny Qwen3 ({sum(x.size for x in jax.tree.leaves(nnx.state(model))) / 1e6:.1f}M params, float32), "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, {jax.devices()[0].platform}{load.tag()}")
    head = f"{'batch':>5} {'jax tok/s':>10} {'jax decode tok/s':>17} {'hf tok/s':>9} {'speedup':>8}"
    print(head)
    for r in rows:
        print(f"{r['batch']:>5} {r['jax_tok_s']:>10.0f} {r['jax_decode_tok_s']:>17.0f} "
              f"{r.get('hf_tok_s', float('nan')):>9.0f} {r.get('speedup', float('nan')):>7.1f}x")
    print(f"decode step, batch 8, 2048-slot cache: {flat['ms_per_token_at_64']:.2f} ms at position 64, "
          f"{flat['ms_per_token_at_1024']:.2f} ms at position 1024")
    print(f"greedy tokens identical to HF transformers on the same weights: {agree}")
    print(json.dumps({"bench": "sampler", "rows": rows, **flat, "greedy_matches_hf": agree, **load.fields()}))


if __name__ == "__main__":
    main()
