"""The rollout engine against Google's Tunix sampler on the same HF checkpoint (CPU, greedy, identical weights).

    python -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix   # once, its own venv
    python experiments/bench_tunix.py [--venv=/tmp/tunix_venv] [--batches=8,32] [--repeats=3]

The tiny Qwen3 (random init, seed 0, float32) is exported with `triage_jax.models.save_pretrained`; Tunix loads that
directory with its own Qwen3 (`tunix.models.qwen3.params.create_model_from_safe_tensors`) and decodes it with
`tunix.generate.sampler.Sampler`, in a subprocess running the Tunix venv's python (Tunix is never installed into
this project's environment). Both sides: prompt 32 random ids, 128 new tokens, greedy, no stop (Tunix gets
eos_tokens=[-1], a token it never draws), a KV cache of exactly prompt + new tokens (160) slots for Tunix (it
attends over all of it) and the engine the trainer builds for those lengths (bench_sampler.engine_config: the same
160-token budget, its capacity following the held tokens), batch 8 and 32. The tiny config is used with rope_theta =
1e6: Tunix 0.1.7's Qwen3 never passes its config's rope_theta to `apply_rope` (whose default, 1e6, is what it always
applies), so with the tiny config's 1e4 it would run a different model (its greedy tokens then differ from HF's and
ours).

Timed per side and batch (best of --repeats after a warm-up that compiles): end to end (prefill + 128 tokens)
and the same call with 1 new token (prefill + first draw); decode tokens/s = batch x 127 / (difference). Tunix runs
in a persistent worker process that this script drives one call at a time, so the two sides' calls interleave
(engine, Tunix, engine, Tunix, ...) and a change of the machine's load hits both alike; the load average is read
at the start and at the end. The greedy tokens of
both sides are compared row by row. Beside them, interleaved the same way, the matmul-only ceiling at each batch
(`bench_sampler.ceiling_call`: the model's per-token matmuls alone, 128 tokens in one jitted loop - the XLA dots both
JAX samplers run): each side's decode tokens/s as a share of it, and the share 1.5x Tunix would ask of the engine.
Prints the load first, a table and one JSON line (`"bench": "tunix"`).

The worker half (`--worker`) imports only the standard library, numpy, jax and tunix, so it runs in the Tunix venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNIX_ROPE_THETA = 1_000_000.0  # the only RoPE base Tunix 0.1.7's Qwen3 applies (see main)


# ------------------------------------------------------------------------------------------ Tunix side (its venv)

class IdTokenizer:
    """Tunix's sampler takes strings: a prompt is its token ids joined by spaces. No BOS, pad 0."""

    def encode(self, text, **kw):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw):
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return None

    def eos_id(self):
        return -1

    def pad_id(self):
        return 0


def tunix_worker(args):
    proto = os.fdopen(os.dup(1), "w")  # the replies; anything else printed to stdout goes to stderr
    os.dup2(2, 1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen3 import model as model_lib
    from tunix.models.qwen3 import params as params_lib

    with open(os.path.join(args.ckpt, "config.json")) as f:
        hf = json.load(f)
    cfg = model_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)), dtype=jnp.float32, param_dtype=jnp.float32)
    if float(hf["rope_theta"]) != TUNIX_ROPE_THETA:
        print(f"warning: rope_theta={hf['rope_theta']} but Tunix applies {TUNIX_ROPE_THETA}", file=sys.stderr)
    model = params_lib.create_model_from_safe_tensors(args.ckpt, cfg, dtype=jnp.float32)
    with open(args.prompts) as f:
        job = json.load(f)
    cache = sampler_lib.CacheConfig(cache_size=job["cache_size"], num_layers=cfg.num_layers,
                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
    try:
        from importlib.metadata import version

        tunix_version = version("google-tunix")
    except Exception:  # noqa: BLE001
        tunix_version = "?"
    texts = [[" ".join(str(t) for t in p) for p in prompts] for prompts in job["batches"]]
    reply = {"jax": jax.__version__, "backend": jax.devices()[0].platform, "tunix": tunix_version}
    print(json.dumps(reply), file=proto, flush=True)
    # One request per stdin line, {"batch": index, "n": new tokens}: run once, reply {"t": seconds, "tokens": ...}.
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        out = sampler(texts[req["batch"]], max_generation_steps=req["n"], max_prompt_length=job["prompt_len"],
                      temperature=0.0, eos_tokens=[-1], seed=0)
        toks = [np.asarray(t).tolist() for t in out.tokens]
        print(json.dumps({"t": time.perf_counter() - t0, "tokens": toks}), file=proto, flush=True)


class TunixWorker:
    """The Tunix venv's python running this file with --worker: it loads the checkpoint once, then times one
    sampler call per request."""

    def __init__(self, py, ckpt, job_path, log_path):
        self.log_path = log_path
        with open(log_path, "w") as log:  # a file, not a pipe: a chatty worker can never block on it
            self.proc = subprocess.Popen([py, os.path.abspath(__file__), "--worker", f"--ckpt={ckpt}",
                                          f"--prompts={job_path}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        self.info = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            with open(self.log_path) as f:
                err = f.read()
            raise SystemExit(f"the Tunix worker failed (exit {self.proc.wait()}):\n{err[-6000:]}")
        return json.loads(line)

    def call(self, batch_index, n):
        self.proc.stdin.write(json.dumps({"batch": batch_index, "n": n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------ engine side (this env)

def engine_call(model, prompts, n, prompt_len, new_tokens):
    """The engine the trainer builds for prompt_len + new_tokens (bench_sampler.engine_config), decoding n tokens."""
    import jax

    from experiments.bench_sampler import engine_config
    from triage_jax.sampler import Engine, SamplingConfig

    eng = Engine(SamplingConfig(max_new_tokens=n, greedy=True), engine_config(len(prompts), prompt_len, new_tokens),
                 pad_id=0, model=model)

    def run():
        t0 = time.perf_counter()
        out = eng.generate(prompts, jax.random.key(0))
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0, [list(map(int, row)) for row in out.tokens.tolist()]

    return run


def timed(fn):
    """fn as a call that returns (its seconds, None), like the two samplers' calls."""
    def run():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, None

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--venv", default=os.environ.get("TUNIX_VENV", "/tmp/tunix_venv"))
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return tunix_worker(args)

    sys.path.insert(0, ROOT)
    import numpy as np
    from flax import nnx

    from experiments.bench_sampler import ceiling_call
    from experiments.loadavg import ForeignCpu, machine_load
    from triage_jax import models

    load = machine_load().with_foreign(ForeignCpu.sample(1.0))
    print(load.line(), flush=True)
    meter = ForeignCpu()  # the Tunix worker is our child: its CPU counts as ours, not as competition
    py = os.path.join(args.venv, "bin", "python")
    if not os.path.exists(py):
        raise SystemExit(f"no Tunix venv at {args.venv}: python -m venv {args.venv} && "
                         f"{args.venv}/bin/pip install google-tunix")
    # rope_theta 1e6 (real Qwen3's): Tunix 0.1.7's Qwen3 ignores config.rope_theta (apply_rope is called with its
    # default 1_000_000), so the tiny config's 1e4 would give Tunix a different model than the checkpoint's.
    cfg_model = models.get_model_config("tiny", rope_theta=TUNIX_ROPE_THETA)
    model = models.Qwen3(cfg_model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batches = [int(x) for x in args.batches.split(",")]
    cache_size = args.prompt_len + args.new_tokens  # Tunix's KV cache: exactly the sequence, as the engine's budget
    prompt_sets = [[rng.integers(2, cfg_model.vocab_size, args.prompt_len).tolist() for _ in range(b)]
                   for b in batches]
    with tempfile.TemporaryDirectory() as d:
        models.save_pretrained(model, os.path.join(d, "ckpt"))
        with open(os.path.join(d, "job.json"), "w") as f:
            json.dump({"batches": prompt_sets, "prompt_len": args.prompt_len, "cache_size": cache_size}, f)
        worker = TunixWorker(py, os.path.join(d, "ckpt"), os.path.join(d, "job.json"), os.path.join(d, "worker.log"))
        tunix = worker.info
        # Per batch: engine and Tunix, new_tokens and 1 new token, and the matmul-only loop; a warm-up call each
        # (compiles), then the five calls in turn, --repeats times.
        meas = []
        for k, prompts in enumerate(prompt_sets):
            fns = [engine_call(model, prompts, n, args.prompt_len, args.new_tokens) for n in (args.new_tokens, 1)]
            fns += [lambda n=n, k=k: (lambda r: (r["t"], r["tokens"]))(worker.call(k, n)) for n in (args.new_tokens, 1)]
            fns.append(timed(ceiling_call(cfg_model, len(prompts), args.new_tokens)[0]))
            outs = [fn() for fn in fns]
            times = [[] for _ in fns]
            for _ in range(args.repeats):
                for j, fn in enumerate(fns):
                    t, toks = fn()
                    times[j].append(t)
                    outs[j] = (t, toks)
            meas.append(([min(t) for t in times], outs[0][1], outs[2][1]))
        worker.close()
    load_end = machine_load().with_foreign(meter.take())
    print(f"after: {load_end.line()}", flush=True)

    rows = []
    for b, (times, toks, ttoks) in zip(batches, meas):
        t_full, t_one, tt_full, tt_one, t_ceil = times
        dec = b * (args.new_tokens - 1)
        row = {"batch": b, "engine_tok_s": b * args.new_tokens / t_full,
               "engine_decode_tok_s": dec / max(t_full - t_one, 1e-9),
               "tunix_tok_s": b * args.new_tokens / tt_full,
               "tunix_decode_tok_s": dec / max(tt_full - tt_one, 1e-9),
               "ceiling_tok_s": b * args.new_tokens / t_ceil,
               "greedy_identical": toks == [r[:args.new_tokens] for r in ttoks]
               and all(len(r) == args.new_tokens for r in ttoks)}
        row["speedup"] = row["engine_tok_s"] / row["tunix_tok_s"]
        row["decode_speedup"] = row["engine_decode_tok_s"] / row["tunix_decode_tok_s"]
        row["engine_ceiling_fraction"] = row["engine_decode_tok_s"] / row["ceiling_tok_s"]
        row["tunix_ceiling_fraction"] = row["tunix_decode_tok_s"] / row["ceiling_tok_s"]
        rows.append(row)
    print(f"tiny Qwen3 float32, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, cache {cache_size}; "
          f"Tunix {tunix['tunix']} (jax {tunix['jax']}, {tunix['backend']}){load.tag() or load_end.tag()}")
    print(f"{'batch':>5} {'engine tok/s':>12} {'tunix tok/s':>11} {'e2e x':>6} {'engine dec tok/s':>16} "
          f"{'tunix dec tok/s':>15} {'decode x':>8} {'same tokens':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['engine_tok_s']:>12.0f} {r['tunix_tok_s']:>11.0f} {r['speedup']:>5.2f}x "
              f"{r['engine_decode_tok_s']:>16.0f} {r['tunix_decode_tok_s']:>15.0f} {r['decode_speedup']:>7.2f}x "
              f"{str(r['greedy_identical']):>11}")
    print("matmul-only ceiling (bench_sampler.ceiling_call: the model's per-token matmuls alone, the same XLA dots "
          "both samplers run), decode tok/s as a share of it:")
    for r in rows:
        print(f"{r['batch']:>5} ceiling {r['ceiling_tok_s']:>6.0f} tok/s: engine {100 * r['engine_ceiling_fraction']:.0f}%,"
              f" Tunix {100 * r['tunix_ceiling_fraction']:.0f}%; 1.5x Tunix needs "
              f"{150 * r['tunix_ceiling_fraction']:.0f}% of it")
    target = all(r["decode_speedup"] >= 1.5 for r in rows)
    print(f"target >= 1.5x Tunix decode tok/s at every batch: {'met' if target else 'NOT met'}")
    fields = load.fields()
    fields["loadavg_end"] = load_end.fields()["loadavg"]
    fields["foreign_cores"] = load_end.fields().get("foreign_cores")
    fields["measured_under_load"] = load.under_load or load_end.under_load
    print(json.dumps({"bench": "tunix", "tunix_version": tunix["tunix"],
                      "rows": rows,
                      "target_1_5x_met": target, **fields}))


if __name__ == "__main__":
    main()
