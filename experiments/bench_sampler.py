"""Rollout-engine throughput on the tiny model (CPU): against HF transformers, on a skewed workload, by position,
and against the matmul-only ceiling, side by side in one run.

    python experiments/bench_sampler.py [--repeats=3] [--skew_slots=64] [--quick]

Every engine is configured as the trainer builds it (`build.engine_config` over the base config: its cache budget
max_prompt_len + max_new_tokens, a prefill as wide as the prompt bucket, 8 steps per round), except where a section
names a setting. Four measurements. Times are the best of --repeats after a warm-up call that compiles; the calls a
ratio compares run interleaved (A, B, A, B, ...), so a change of the machine's load hits both sides alike. The load
average is printed at the start, and each section is judged by the CPU other processes used while it ran (the load
average would count this benchmark's own threads); a loaded start or section flags the table and the JSON line
(experiments/loadavg.py).

1. **vs HF `generate`** - the tiny Qwen3 (random init, seed 0, float32, no quantization) is exported with
   `models.save_pretrained` and loaded with transformers' `Qwen3ForCausalLM` (identical weights). Prompt 32 random
   ids, 128 new tokens, sampling at T=1 without early stop, batch 8 and 32; the engine gets one slot per request
   (`generate`'s default). End-to-end tokens/s of both (prefill included); the engine's decode tokens/s is
   batch x 127 / (t(128 tokens) - t(1 token)). `speedup` = engine / HF end to end. Greedy tokens of both sides
   over the same 128 tokens are compared row by row (batch 8).
2. **skewed workload** - 256 requests whose response lengths follow a DAPO-like long tail: 97% lognormal
   (median 40, sigma 0.8, clipped to [4, 512]) and 3% uniform in [256, 512] (one exactly 512), shuffled. The stops
   are forced exactly at the drawn lengths by a *countdown model*: the tiny architecture (vocab widened to 576,
   untied head) with o_proj and down_proj set to zero, so every layer still runs all its matmuls and attention
   but the residual stream is the token embedding; the head maps token c_k to c_{k-1} and c_1 to the stop id, so
   a prompt ending in c_L yields exactly L tokens (c_{L-1} ... c_1, stop) under greedy decoding. Useful tokens/s
   = sum of the drawn lengths / wall time, for the engine (continuous, `--skew_slots` slots) and for "today's one
   static batch" (`EngineConfig(continuous=False, max_slots=256)`: every slot decoded until the longest ends).
   Both must return exactly the drawn lengths (checked).
3. **decode cost by position** - batch 8, `EngineConfig(max_len=2048)` (the 2048-slot budget), prompts of 64 and of
   1024 tokens: ms per decode step = (t(1 + 64 tokens) - t(1 token)) / 64.
4. **matmul-only ceiling** - batch 32: the model's per-token matmuls alone (q, k, v, o, gate, up, down of every
   layer and the LM head, with one RMS normalization per step to keep values bounded), 128 steps in one jitted
   fori_loop, interleaved with the engine's and HF's decode tokens/s at batch 32 (measured as in 1, on other
   prompts): what fraction of the matmul time each adds, and so what a speedup over HF asks of the engine.

Prints the load first, a table and one JSON line (`"bench": "sampler"`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.loadavg import ForeignCpu, machine_load  # noqa: E402
from triage_jax import build, models  # noqa: E402
from triage_jax.config import base_config  # noqa: E402
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig  # noqa: E402

STOP = 1  # the countdown model's stop id
TARGETS = {"hf_speedup": 2.0, "skewed_ratio": 3.0, "cost_64_over_1024": 0.5, "ceiling_fraction": 0.40}


def timed(fn, repeats):
    """(best seconds of `repeats` calls after a warm-up call, the last result); repeats=0 times the warm-up call
    itself (compilation included)."""
    (t,), (out,) = interleaved([fn], repeats)
    return t, out


def interleaved(fns, repeats):
    """Warm every fn up (compiles), then call them in turn `repeats` times: ([best seconds], [last results]).
    Alternating the sides spreads any change of the machine's load over all of them alike."""
    times, outs = [[] for _ in fns], []
    for k, fn in enumerate(fns):
        t0 = time.perf_counter()
        outs.append(fn())
        if not repeats:
            times[k].append(time.perf_counter() - t0)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[k] = fn()
            times[k].append(time.perf_counter() - t0)
    return [min(t) for t in times], outs


def engine_config(slots: int, prompt_len: int, new_tokens: int, **overrides) -> EngineConfig:
    """The EngineConfig the trainer would build (`build.engine_config`) for rollouts of `slots` responses of
    prompt_len + new_tokens tokens: its cache budget, prefill width, steps per round and tail compaction."""
    c = base_config()
    c.sampler.max_slots, c.sampler.max_prompt_len, c.sampler.max_new_tokens = slots, prompt_len, new_tokens
    return dataclasses.replace(build.engine_config(c), **overrides)


def engine_call(model, prompts, cfg: SamplingConfig, config: EngineConfig, key=0):
    """A zero-argument call of one Engine's generate (blocks until the tokens are ready), and the engine."""
    engine = Engine(cfg, config, pad_id=0, model=model)

    def run():
        out = engine.generate(prompts, jax.random.key(key))
        jax.block_until_ready(out.tokens)
        return out

    return run, engine


# ------------------------------------------------------------------------------------------ 1. vs HF

def hf_call(hf_model, prompts, new_tokens, greedy=False):
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)

    def run():
        with torch.inference_mode():
            out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, **kw)
        assert out.shape[1] == ids.shape[1] + new_tokens
        return out[:, ids.shape[1]:].numpy()

    return run


def bench_vs_hf(model, hf_model, batches, prompt_len, new_tokens, repeats, rng, vocab):
    """Per batch, interleaved: engine and HF with new_tokens and with 1 new token."""
    import torch

    torch.manual_seed(0)
    rows = []
    for b in batches:
        prompts = [rng.integers(2, vocab, prompt_len).tolist() for _ in range(b)]
        config = engine_config(b, prompt_len, new_tokens)
        fns = [engine_call(model, prompts, SamplingConfig(max_new_tokens=n), config)[0] for n in (new_tokens, 1)]
        if hf_model is not None:
            fns += [hf_call(hf_model, prompts, n) for n in (new_tokens, 1)]
        times, outs = interleaved(fns, repeats)
        assert int(np.asarray(outs[0].lengths).min()) == new_tokens
        t_full, t_one = times[:2]
        row = {"batch": b, "engine_tok_s": b * new_tokens / t_full,
               "engine_decode_tok_s": b * (new_tokens - 1) / max(t_full - t_one, 1e-9)}
        if hf_model is not None:
            t_hf, t_hf1 = times[2:]
            row.update(hf_tok_s=b * new_tokens / t_hf, hf_decode_tok_s=b * (new_tokens - 1) / max(t_hf - t_hf1, 1e-9))
            row["speedup"] = t_hf / t_full
            row["decode_speedup"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
        rows.append(row)
    return rows


def greedy_rows_match(model, hf_model, prompt_len, new_tokens, rng, vocab, b=8):
    prompts = [rng.integers(2, vocab, prompt_len).tolist() for _ in range(b)]
    out = engine_call(model, prompts, SamplingConfig(max_new_tokens=new_tokens, greedy=True),
                      engine_config(b, prompt_len, new_tokens))[0]()
    ref = hf_call(hf_model, prompts, new_tokens, greedy=True)()
    ours = np.asarray(out.tokens)
    return int(sum(np.array_equal(ours[i], ref[i]) for i in range(b))), b


# ------------------------------------------------------------------------------------------ 2. skewed workload

def draw_lengths(n, max_new, rng):
    """DAPO-like long tail: 97% lognormal (median 40, sigma 0.8) clipped to [4, max_new], 3% uniform in
    [max_new / 2, max_new] with one exactly max_new; shuffled."""
    n_long = max(1, round(0.03 * n))
    short = np.clip(np.round(np.exp(rng.normal(np.log(40), 0.8, n - n_long))), 4, max_new)
    long = rng.integers(max_new // 2, max_new + 1, n_long)
    long[0] = max_new
    lengths = np.concatenate([short, long]).astype(int)
    rng.shuffle(lengths)
    return lengths


def countdown_model(max_new: int, seed: int = 0):
    """The tiny architecture whose greedy response to a prompt ending in token c_L (= L + 1) is exactly L tokens:
    c_{L-1}, ..., c_1, STOP. o_proj and down_proj are zero (all matmuls and attention still run), so the final
    hidden state is the last token's embedding; the untied head maps c_k's embedding to c_{k-1} and c_1's to STOP
    (a margin of ~hidden_size logits over any other token). Tokens above c_{max_new} are prompt filler."""
    vocab = 64 * (-(-(max_new + 2 + 32) // 64))
    cfg = models.get_model_config("tiny", vocab_size=vocab, tie_word_embeddings=False)
    m = models.Qwen3(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((vocab, cfg.hidden_size)).astype(np.float32)
    head = np.zeros((cfg.hidden_size, vocab), np.float32)
    head[:, STOP] = emb[2]  # c_1 = 2 -> STOP
    for k in range(2, max_new + 1):  # c_k = k + 1 -> c_{k-1} = k
        head[:, k] = emb[k + 1]
    m.embed.embedding[...] = jnp.asarray(emb)
    m.lm_head.kernel[...] = jnp.asarray(head)
    for layer in m.layers:
        layer.attn.o_proj.kernel[...] = jnp.zeros_like(layer.attn.o_proj.kernel[...])
        layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])
    return m, vocab


def bench_skewed(n, max_new, prompt_len, slots_list, repeats, rng):
    lengths = draw_lengths(n, max_new, rng)
    m, vocab = countdown_model(max_new)
    prompts = [rng.integers(max_new + 2, vocab, prompt_len - 1).tolist() + [int(L) + 1] for L in lengths]
    cfg = SamplingConfig(max_new_tokens=max_new, greedy=True, stop_ids=(STOP,))
    useful = int(lengths.sum())

    configs = [engine_config(n, prompt_len, max_new, continuous=False)]
    configs += [engine_config(s, prompt_len, max_new) for s in slots_list]
    calls = [engine_call(m, prompts, cfg, c) for c in configs]
    times, outs = interleaved([c[0] for c in calls], repeats)
    for out in outs:
        got = np.asarray(out.lengths)
        if not np.array_equal(got, lengths):
            bad = np.flatnonzero(got != lengths)[:5]
            raise AssertionError(f"countdown model: lengths {got[bad].tolist()} != drawn {lengths[bad].tolist()}")
    t_static, rounds_static = times[0], calls[0][1].rounds
    engines = [{"slots": s, "seconds": t, "rounds": c[1].rounds, "tok_s": useful / t}
               for s, t, c in zip(slots_list, times[1:], calls[1:])]
    best = engines[0]
    return {"requests": n, "useful_tokens": useful, "mean_len": float(lengths.mean()),
            "median_len": float(np.median(lengths)), "max_len": int(lengths.max()),
            "n_at_least_256": int((lengths >= max_new // 2).sum()), "vocab": vocab,
            "static_slots": n, "static_s": t_static, "static_rounds": rounds_static,
            "static_tok_s": useful / t_static, "engine_slots": best["slots"], "engine_s": best["seconds"],
            "engine_tok_s": best["tok_s"], "ratio": best["tok_s"] / (useful / t_static),
            "engines": engines}


# ------------------------------------------------------------------------------------------ 3. by position

def bench_positions(model, repeats, rng, vocab, steps=64, budget=2048, b=8):
    out, calls = {}, []
    config = EngineConfig(max_slots=b, max_len=budget)
    for pos in (64, 1024):
        prompts = [rng.integers(2, vocab, pos).tolist() for _ in range(b)]
        calls += [engine_call(model, prompts, SamplingConfig(max_new_tokens=n), config) for n in (steps + 1, 1)]
    times, outs = interleaved([c[0] for c in calls], repeats)
    for k, pos in enumerate((64, 1024)):
        assert int(np.asarray(outs[2 * k].lengths).min()) == steps + 1
        out[f"ms_per_token_at_{pos}"] = 1e3 * max(times[2 * k] - times[2 * k + 1], 0.0) / steps
        out[f"capacity_at_{pos}"] = sorted(set(calls[2 * k][1].capacities))
    return out


# ------------------------------------------------------------------------------------------ 4. matmul ceiling

def ceiling_call(cfg, batch, steps):
    """A zero-argument call of the model's per-token matmuls alone (float32) for `steps` tokens in one jitted loop
    (blocks until done), and the FLOPs of one call: what decoding costs with every other op removed, in the same
    XLA dots every JAX sampler here runs."""
    d, i_, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, kvh = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    key = jax.random.key(0)
    shapes = [(d, nh), (d, kvh), (d, kvh), (nh, d), (d, i_), (d, i_), (i_, d)]
    layers = [[0.02 * jax.random.normal(jax.random.fold_in(key, 10 * li + j), s, jnp.float32)
               for j, s in enumerate(shapes)] for li in range(cfg.num_hidden_layers)]
    head = 0.02 * jax.random.normal(jax.random.fold_in(key, 999), (d, v), jnp.float32)
    flops = 2 * batch * (sum(a * b for a, b in shapes) * cfg.num_hidden_layers + d * v)

    @jax.jit
    def loop(x, layers, head):
        def step(_, x):
            h = x
            for wq, wk, wv, wo, wg, wu, wd in layers:
                q, k, vv = h @ wq, h @ wk, h @ wv
                h = h + q @ wo + 1e-6 * (k.sum(-1, keepdims=True) + vv.sum(-1, keepdims=True))
                h = h + ((h @ wg) * (h @ wu)) @ wd
            logits = h @ head
            h = h + 1e-6 * logits.max(-1, keepdims=True)
            return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

        return jax.lax.fori_loop(0, steps, step, x)

    x = jax.random.normal(key, (batch, d), jnp.float32)
    return (lambda: jax.block_until_ready(loop(x, layers, head))), flops * steps


def matmul_ceiling(cfg, batch, steps, repeats, model=None, prompt_len=32, hf_model=None):
    """Tokens/s and GFLOP/s of the per-token matmuls alone (`ceiling_call`); with a model, also the engine's decode
    tokens/s at this batch (steps and 1 new token), and with an HF model HF's, interleaved with the loop (None where
    not measured)."""
    ceiling, flops = ceiling_call(cfg, batch, steps)
    fns = [ceiling]
    if model is not None:
        prompts = [np.random.default_rng(1).integers(2, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
        config = engine_config(batch, prompt_len, steps)
        fns += [engine_call(model, prompts, SamplingConfig(max_new_tokens=n), config)[0] for n in (steps, 1)]
        if hf_model is not None:
            fns += [hf_call(hf_model, prompts, n) for n in (steps, 1)]
    times, _ = interleaved(fns, repeats)
    engine = batch * (steps - 1) / max(times[1] - times[2], 1e-9) if model is not None else None
    hf = batch * (steps - 1) / max(times[3] - times[4], 1e-9) if model is not None and hf_model is not None else None
    return batch * steps / times[0], flops / times[0] / 1e9, engine, hf


# ------------------------------------------------------------------------------------------ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skew_requests", type=int, default=256)
    ap.add_argument("--skew_max_new", type=int, default=512)
    ap.add_argument("--skew_slots", default="64", help="engine slot counts for the skewed workload (first is headline)")
    ap.add_argument("--skew_repeats", type=int, default=1)
    ap.add_argument("--no_hf", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test (numbers meaningless)")
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens, args.batches, args.repeats = 8, "2", 1
        args.skew_requests, args.skew_max_new, args.skew_slots, args.skew_repeats = 16, 32, "4", 0
    load = machine_load().with_foreign(ForeignCpu.sample(1.0))
    print(load.line(), flush=True)
    loads = {"start": load}
    meter, current = ForeignCpu(), [None]

    def section(name):
        """Start section `name` (None: the end); the one it ends is judged by other processes' CPU use during it."""
        foreign = meter.take()
        if current[0] is not None:
            loads[current[0]] = machine_load().with_foreign(foreign)
            print(f"[{current[0]}] {loads[current[0]].line()}", flush=True)
        current[0] = name

    cfg_model = models.get_model_config("tiny")
    model = models.Qwen3(cfg_model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    hf_model = None
    if not args.no_hf:
        import torch
        from transformers import Qwen3ForCausalLM

        with tempfile.TemporaryDirectory() as d:
            models.save_pretrained(model, d)
            hf_model = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    batches = [int(x) for x in args.batches.split(",")]
    section("vs_hf")
    rows = bench_vs_hf(model, hf_model, batches, args.prompt_len, args.new_tokens, args.repeats, rng,
                       cfg_model.vocab_size)
    agree = None
    if hf_model is not None:
        n_same, n_rows = greedy_rows_match(model, hf_model, args.prompt_len, args.new_tokens, rng,
                                           cfg_model.vocab_size, b=min(8, max(batches)))
        agree = n_same == n_rows

    section("skewed")
    skew = bench_skewed(args.skew_requests, args.skew_max_new, args.prompt_len,
                        [int(x) for x in args.skew_slots.split(",")], args.skew_repeats, rng)

    section("positions")
    pos = bench_positions(model, args.repeats, rng, cfg_model.vocab_size,
                          steps=8 if args.quick else 64, budget=2048)

    section("ceiling")
    cb = 32 if 32 in batches else max(batches)
    ceil_tok_s, gflops, eng_dec, hf_dec = matmul_ceiling(cfg_model, cb, args.new_tokens, args.repeats, model,
                                                         args.prompt_len, hf_model)
    ceiling = {"batch": cb, "matmul_tok_s": ceil_tok_s, "matmul_gflop_s": gflops, "engine_decode_tok_s": eng_dec,
               "fraction": eng_dec / ceil_tok_s, "hf_decode_tok_s": hf_dec,
               "hf_fraction": None if hf_dec is None else hf_dec / ceil_tok_s}
    section(None)

    under = any(x.under_load for x in loads.values())
    tag = " [measured under load]" if under else ""
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print()
    print(f"1. tiny Qwen3 ({n_params / 1e6:.1f}M params, float32), prompt {args.prompt_len}, {args.new_tokens} new "
          f"tokens, T=1, {jax.devices()[0].platform}, one slot per request{tag}")
    print(f"{'batch':>5} {'engine tok/s':>12} {'hf tok/s':>9} {'speedup':>8} {'engine decode':>13} "
          f"{'hf decode':>9} {'decode x':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['engine_tok_s']:>12.0f} {r.get('hf_tok_s', float('nan')):>9.0f} "
              f"{r.get('speedup', float('nan')):>7.2f}x {r['engine_decode_tok_s']:>13.0f} "
              f"{r.get('hf_decode_tok_s', float('nan')):>9.0f} {r.get('decode_speedup', float('nan')):>7.2f}x")
    if hf_model is not None:
        print(f"   greedy tokens identical to HF on the same weights: {n_same}/{n_rows} rows x {args.new_tokens} tokens")
    s = skew
    print(f"2. skewed: {s['requests']} requests, lengths mean {s['mean_len']:.0f} / median {s['median_len']:.0f} / "
          f"max {s['max_len']} ({s['n_at_least_256']} >= {args.skew_max_new // 2}), {s['useful_tokens']} useful "
          f"tokens (countdown model, vocab {s['vocab']}){tag}")
    print(f"   static batch of {s['static_slots']}: {s['static_s']:.2f} s, {s['static_tok_s']:.0f} useful tok/s")
    for e in s["engines"]:
        print(f"   engine, {e['slots']} slots, continuous: {e['seconds']:.2f} s, {e['tok_s']:.0f} useful tok/s "
              f"({e['tok_s'] / s['static_tok_s']:.2f}x)")
    print(f"3. decode step, batch 8, 2048-slot budget: {pos['ms_per_token_at_64']:.2f} ms at position 64 (capacity "
          f"{pos['capacity_at_64']}), {pos['ms_per_token_at_1024']:.2f} ms at 1024 (capacity {pos['capacity_at_1024']})"
          f"; ratio {pos['ms_per_token_at_64'] / max(pos['ms_per_token_at_1024'], 1e-9):.2f}")
    print(f"4. matmul-only ceiling, batch {cb}: {ceil_tok_s:.0f} tok/s ({gflops:.0f} GFLOP/s); engine decode "
          f"{eng_dec:.0f} tok/s = {100 * ceiling['fraction']:.0f}% of it"
          + ("" if hf_dec is None else f"; HF decode {hf_dec:.0f} tok/s = {100 * ceiling['hf_fraction']:.0f}% of it "
             f"(2x HF needs the engine at {200 * ceiling['hf_fraction']:.0f}%)"))
    met = {
        "hf_2x_at_every_batch": None if hf_model is None else all(r["speedup"] >= TARGETS["hf_speedup"] for r in rows),
        "greedy_identical_to_hf": agree,
        "skewed_ratio_3x": s["ratio"] >= TARGETS["skewed_ratio"],
        "cost_64_le_half_1024": pos["ms_per_token_at_64"] <= TARGETS["cost_64_over_1024"] * pos["ms_per_token_at_1024"],
        "ceiling_40pct": ceiling["fraction"] >= TARGETS["ceiling_fraction"],
    }
    print("targets: " + ", ".join(f"{k} {'met' if v else ('n/a' if v is None else 'NOT met')}" for k, v in met.items()))
    fields = load.fields()
    fields["measured_under_load"] = under
    fields["loadavg_by_section"] = {k: x.fields()["loadavg"] for k, x in loads.items()}
    fields["foreign_cores_by_section"] = {k: x.fields().get("foreign_cores") for k, x in loads.items() if k != "start"}
    print(json.dumps({"bench": "sampler", "rows": rows, "greedy_matches_hf": agree, "skewed": skew, **pos,
                      "ceiling": ceiling, "targets_met": met, **fields}))


if __name__ == "__main__":
    main()
