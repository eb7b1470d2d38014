"""Warm-up curve of a config's supervised warm-up: held-out avg@1 per synthetic level at snapshot steps.

    python experiments/organism_warmup.py --snapshots=75,100,125,150 --n_eval=64

Trains the config's warm-up once (warmup.train_sft: its schedule, batches and seed) and, at each snapshot,
samples one response per held-out problem of each level with the run's sampler precision at the run's
temperature, graded by the DAPO rule. The finished warm-up lands in the config's warm-up cache, so a following
`python -m triage_jax.main --config=...` with the same settings starts from it. Prints one JSON line per snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import common

from triage_jax import build, evaluation
from triage_jax.data.synthetic import held_out_source
from triage_jax.warmup import cache_path, warm_start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="organism")
    p.add_argument("--snapshots", default="", help="comma-separated warm-up steps to evaluate at (default: the end)")
    p.add_argument("--n_eval", type=int, default=32, help="held-out problems per level")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = p.parse_args(argv)
    c = common.absolute_paths(common.set_values(common.load_config(args.config), common.parse_overrides(p, args.set)))
    snaps = {int(s) for s in args.snapshots.split(",") if s} or {c.warmup.steps}
    tok, src = build.tokenizer(c), build.source(c)
    mc = build.model_config(c, tok.vocab_size)
    held = {lv: list(held_out_source(args.n_eval, seed=c.seed, levels=(lv,), template=c.data.template,
                                     style=c.data.style or None)) for lv in c.data.levels}
    clock = {"start": time.perf_counter(), "eval": 0.0}

    def on_step(k, model_at):
        if k not in snaps:
            return
        t0 = time.perf_counter()
        acc = {f"L{lv}": evaluation.evaluate(
            model_at(), tok, ex, n=1, ks=(1,), temperature=c.sampler.temperature, top_p=c.sampler.top_p,
            top_k=c.sampler.top_k, policy=build.sampler_policy(c), reward="dapo", batch=64, seed=0,
            max_prompt_len=c.sampler.max_prompt_len, max_new_tokens=c.sampler.max_new_tokens)["avg@1"]
            for lv, ex in held.items()}
        clock["eval"] += time.perf_counter() - t0
        sft_s = time.perf_counter() - clock["start"] - clock["eval"]
        print(json.dumps({"step": k, "sft_s": round(sft_s, 1), "avg@1": acc,
                          "eval_s": round(time.perf_counter() - t0, 1)}), flush=True)

    print(json.dumps({"config": args.config, "params": mc.num_params(), "vocab": tok.vocab_size,
                      "warmup": c.warmup.to_dict()}), flush=True)
    cached = cache_path(c, mc, tok, src)
    if os.path.exists(os.path.join(cached, "config.json")):
        raise SystemExit(f"already cached: {cached} (delete it to measure again)")
    warm_start(c, mc, tok, src, on_step=on_step)


if __name__ == "__main__":
    main()
