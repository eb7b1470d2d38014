"""Layers in a scan or unrolled: compile time of the first call and the warm call, for the rollout engine (a
generate) or, with --learner, for the trainer's learner (an update).

    python experiments/bench_scan.py [--layers 36] [--repeats 3] [--processes 2] [--learner]

A Qwen3-4B-deep model (36 layers by default) at a narrow width (hidden 256, so a CPU compiles and runs it in
seconds; the compile cost grows with the op count, which the depth sets), bf16, random init, the same weights in
both forms (save_pretrained, then from_pretrained with scan_layers=False / True; the scanned model's engine keeps
its KV cache stacked [L, ...], see models/kv_cache.py). Each form runs in --processes fresh processes, alternating
forms (this 2-core machine has shown a whole process running ~3x slow at random); each process's first generate
compiles from nothing (no persistent cache) and its warm generate is the best of --repeats; the table reports the
best process of each form. Greedy tokens of the two forms are compared. Prints a table and one JSON line
(`"bench": "scan"`). --learner times `Learner.update` (build.learner with the W4A4 learner of the paper configs,
remat "full", one mini-batch of LEARNER_ROWS responses in micro-batches of 2; the update is the trainer's
program) instead, and compares the first update's loss; JSON `"bench": "scan_learner"`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.loadavg import machine_load  # noqa: E402

WIDTH = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=1024, dtype="bfloat16", param_dtype="bfloat16")
SLOTS, PROMPT, NEW = 8, 32, 16

RUN = """
import json, sys, time
t0 = time.perf_counter()
import jax, numpy as np
from flax import nnx
from triage_jax import models
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model, sampler_policy
model = models.from_pretrained(sys.argv[1], scan_layers=sys.argv[2] == "scan", dtype="bfloat16",
                               param_dtype="bfloat16")
mode = sys.argv[4] if len(sys.argv) > 4 else "parallel"
policy = sampler_policy({sampler!r})  # the trainer's sampler for this preset: weights quantized once, at the sync
model = prepare_model(model, policy, unstack=False)  # the scanned form decodes scanned
jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
eng = Engine(SamplingConfig(max_new_tokens={new}, greedy=True),
             EngineConfig(max_slots={slots}, max_len={prompt} + {new}, max_prompt_len={prompt}, prefill_batch={slots},
                          parallel_compile=mode != "serial", compile_ahead=mode == "ahead"),
             policy=policy, model=model)
prompts = [np.random.default_rng(k).integers(2, {vocab}, {prompt}).tolist() for k in range({slots})]
t1 = time.perf_counter()
tokens = np.asarray(jax.block_until_ready(eng.generate(prompts, jax.random.key(0)).tokens))
first = time.perf_counter() - t1
warm = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    jax.block_until_ready(eng.generate(prompts, jax.random.key(1)).tokens)
    warm.append(time.perf_counter() - t)
print("RESULT", json.dumps({{"first_s": first, "warm_s": min(warm), "tokens": tokens.tolist()}}))
"""


LEARNER_ROWS, LEARNER_PROMPT, LEARNER_RESP = 4, 32, 96

LEARN = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from triage_jax import build, models
from triage_jax.config import base_config
from triage_jax.learner import RolloutBatch
c = base_config()
c.model.dtype, c.model.param_dtype, c.model.remat = "bfloat16", "float32", "full"
c.model.scan_layers = sys.argv[2] == "scan"
c.learner.precision = "w4a4"
c.rl.micro_batch, c.rl.mini_batch = 2, {rows}
model = models.from_pretrained(sys.argv[1], **build.model_config(c, 0).execution())
learner = build.learner(c, model)
rng = np.random.default_rng(0)
n, p, r = {rows}, {prompt}, {resp}
abstract = learner.abstract_batch(n, p, r)
values = dict(input_ids=rng.integers(2, {vocab}, (n, p + r)), attn_mask=np.ones((n, p + r), bool),
              resp_mask=np.ones((n, r)), adv=rng.choice([-1.0, 1.0], n), sampler_logp=-rng.random((n, r)) * 4,
              old_logp=-rng.random((n, r)) * 4, ref_logp=np.zeros((n, r)), weights=np.ones((n, r)),
              loss_mask=np.ones((n, r)), anchor_logp=-rng.random((n, r)) * 4)
batch = RolloutBatch(**{{k: jnp.asarray(v, getattr(abstract, k).dtype) for k, v in values.items()}})
t = time.perf_counter()
loss = float(jax.device_get(learner.update(batch))["loss"])
first = time.perf_counter() - t
warm = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    jax.block_until_ready(learner.update(batch))
    warm.append(time.perf_counter() - t)
print("RESULT", json.dumps({{"first_s": first, "warm_s": min(warm), "loss": loss}}))
"""


def run_form(path: str, form: str, repeats: int, compile_mode: str = "parallel", *, prompt: int = PROMPT,
             new: int = NEW, sampler: str = "bf16") -> dict:
    """One fresh process per form: its first generate compiles from nothing (the persistent cache is off);
    compile_mode "serial" turns EngineConfig.parallel_compile off, "ahead" turns compile_ahead on too; `sampler`:
    the sampler's preset (its weights quantized before the clock starts, as the trainer's sync does)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": "", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    if compile_mode == "learner":
        code = LEARN.format(rows=LEARNER_ROWS, prompt=LEARNER_PROMPT, resp=LEARNER_RESP, vocab=WIDTH["vocab_size"])
    else:
        code = RUN.format(new=new, slots=SLOTS, prompt=prompt, vocab=WIDTH["vocab_size"], sampler=sampler)
    out = subprocess.run([sys.executable, "-c", code, path, form, str(repeats), compile_mode], cwd=root, env=env,
                         capture_output=True, text=True, timeout=1800)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"{form}: no result\n{out.stderr[-2000:]}")
    return json.loads(line[0][len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--learner", action="store_true", help="time the learner's update instead of a generate")
    args = ap.parse_args(argv)
    from flax import nnx

    from triage_jax import models

    load = machine_load()
    print(load.line())
    cfg = models.get_model_config("qwen3_4b", num_hidden_layers=args.layers, **WIDTH)
    with tempfile.TemporaryDirectory() as d:
        models.save_pretrained(models.Qwen3(cfg, rngs=nnx.Rngs(0)), d)
        runs = {"unrolled": [], "scan": []}
        for _ in range(args.processes):
            for form in runs:
                runs[form].append(run_form(d, form, args.repeats, "learner" if args.learner else "parallel"))
    if args.learner:
        return _learner_report(args, runs, load)
    tokens = {form: [r.pop("tokens") for r in rs] for form, rs in runs.items()}
    same = all(t == tokens["unrolled"][0] for ts in tokens.values() for t in ts)
    res = {form: {k: min(r[k] for r in rs) for k in ("first_s", "warm_s")} for form, rs in runs.items()}
    print(f"\n{args.layers} layers, width {WIDTH['hidden_size']}, bf16; {SLOTS} prompts x {PROMPT} tokens, "
          f"{NEW} new{load.tag()}")
    print(f"{'form':>9} {'first call s':>13} {'warm s':>8}")
    for form, r in res.items():
        print(f"{form:>9} {r['first_s']:>13.2f} {r['warm_s']:>8.3f}")
    out = {"bench": "scan", **_timings(args, res), "greedy_tokens_equal": same, **load.fields()}
    print(json.dumps(out))
    return out


def _timings(args, res: dict) -> dict:
    """The JSON fields of both forms' times and their ratios (scanned over unrolled)."""
    return {"layers": args.layers, "processes": args.processes,
            **{f"{f}_{k}": round(v, 4) for f, r in res.items() for k, v in r.items()},
            "compile_ratio_scan_vs_unrolled": round(res["scan"]["first_s"] / res["unrolled"]["first_s"], 3),
            "warm_ratio_scan_vs_unrolled": round(res["scan"]["warm_s"] / res["unrolled"]["warm_s"], 3)}


def _learner_report(args, runs: dict, load) -> dict:
    losses = {form: [r.pop("loss") for r in rs] for form, rs in runs.items()}
    res = {form: {k: min(r[k] for r in rs) for k in ("first_s", "warm_s")} for form, rs in runs.items()}
    print(f"\n{args.layers} layers, width {WIDTH['hidden_size']}; learner update, W4A4, remat full: "
          f"{LEARNER_ROWS} responses x ({LEARNER_PROMPT} + {LEARNER_RESP}) tokens, micro-batch 2{load.tag()}")
    print(f"{'form':>9} {'first update s':>15} {'warm update s':>14} {'loss':>10}")
    for form, r in res.items():
        print(f"{form:>9} {r['first_s']:>15.2f} {r['warm_s']:>14.3f} {losses[form][0]:>10.5f}")
    loss_u, loss_s = losses["unrolled"][0], losses["scan"][0]
    out = {"bench": "scan_learner", **_timings(args, res), "loss_unrolled": loss_u, "loss_scan": loss_s,
           "loss_rel_diff": abs(loss_s - loss_u) / max(abs(loss_u), 1e-30), **load.fields()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
