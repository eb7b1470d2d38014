"""GPU rollout benchmarks: decode GEMMs with 4-bit weights against bf16, and the engine's decode speed, side by side.

    python experiments/bench_gpu.py [--parts gemm,engine,agree] [--models qwen3_0_6b,qwen3_4b] [--batches 64,256]
        [--json PATH] [--small]

Every ratio is measured in the same run (the sides interleaved: A, B, A, B, ...; best of --repeats after a warm-up
that compiles). GPU only; `--small` shrinks every size for a dry run on a CPU (numbers meaningless; HF
`generate` on torch's CPU, the first call at the small sizes).

(a) gemm: decode GEMMs at Qwen3-4B's MLP shapes (K, N) = (2560, 9728) and (9728, 2560), M in {1, 16, 64, 256},
    each timed in one jitted loop that rotates through --copies weight copies (> 100 MB, so nothing is served from
    the 50 MB L2): bf16 `jnp.dot`; fp8 (`qdot`, FP8 weights prequantized); w4a16 (NVFP4 weights prequantized,
    packed, bf16 activations); w4a16_int8 (the same weights as int8 2*e2m1 codes, backend xla_int8: the simplest
    layout XLA's GEMM fusion can read) and w4a16_int8sc (that layout with XLA's subchannel-dequantisation
    fusion); w4a16_fp4gemm (the same weights in kernels/fp4_gemm.py's layout, its Mosaic GPU kernel, backend
    fp4_gemm) and w4a16_fp4gemmreg (that kernel with wgmma's A from registers); w4a4 and
    w4a4_fp4gemm (NVFP4 weights, activations quantized token-wise inside the loop). Time per GEMM and effective
    TB/s of weight bytes (codes + scales), against the device's copy bandwidth measured here; the best layout per
    preset and M against the targets.
(b) engine: Qwen3-0.6B / 4B shapes (random init, bf16), batch 64 and 256, prompt 256, 256 new tokens: decode tok/s
    of the samplers of --samplers (batch x 255 / (t(256 tokens) - t(1 token))) and of HF `generate` (torch
    bf16 on the same GPU, the same weights); the fraction of the memory roofline (weight + KV bytes read per decode
    step / step time / copy bandwidth); the kernels one decode step launches (ops/step: the work instructions in
    the compiled decode loop's body, by kind: fusions, GEMM custom calls, copies); the first call's seconds
    (compile included) in a fresh process, with an empty and with a filled persistent compilation cache, for the
    samplers of --first_call_samplers (bf16 by default; the main config samples with w4a4).
    Engine-only samplers: `bf16_cbwhile` / `bf16_nocb` (the engine compiled with command buffers over its decode
    loop too / with none: is the step launch-bound, and do CUDA graphs fix it?), `bf16_exit` (decode rounds that
    exit early: a host round trip per step, the CPU's loop; every other sampler runs the GPU's fixed rounds),
    `bf16_scan` / `w4a4_scan` / `w4a4_fp4gemmscan` (the model with scan_layers=True, as sampler.scan_layers=True
    runs it: does scanning the layers slow the GPU's decode step?) and --first_call_scan (its compile).
(c) agree: greedy tokens of the w4a16 sampler on each weight-GEMM backend against the xla backend's.

Prints a table per part and one JSON line (`"bench": "gpu"`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from triage_jax.quant import PRESETS, prequantize, qdot  # noqa: E402

GEMM_SHAPES = ((2560, 9728), (9728, 2560))
GEMM_MS = (1, 16, 64, 256)
# <preset>[_<layout>]: w4a16_int8 = NVFP4 weights as int8 codes (backend xla_int8); *_fp4gemm = the Mosaic GPU
# 4-bit GEMM (backend fp4_gemm, kernels/fp4_gemm.py).
# --small: a 2-layer model of the same architecture (the dry run's sizes)
SMALL_MODEL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}
VARIANTS = ("bf16", "fp8", "w4a16", "w4a16_int8", "w4a16_int8sc", "w4a16_fp4gemm", "w4a16_fp4gemmreg", "w4a4",
            "w4a4_fp4gemm")
# fp4gemmreg: the same kernel with wgmma's A operand straight from registers (fp4_matmul(a_operand="registers"))
LAYOUT_BACKENDS = {"": "xla", "int8": "xla_int8", "int8sc": "xla_int8", "fp4gemm": "fp4_gemm",
                   "fp4gemmreg": "fp4_gemm", "scan": "xla", "scandsf": "xla", "fp4gemmscan": "fp4_gemm",
                   "cbwhile": "xla", "nocb": "xla", "exit": "xla"}
# int8sc (e.g. w4a16_int8sc): the int8 layout compiled with XLA's subchannel-dequantisation fusion, which can fuse
# the codes' bf16 decode (NVFP4Int8Tensor.block_values) into the Triton GEMM, so no decoded bf16 weight goes
# through HBM; an experimental XLA option (off by default), in the GEMM loops and the engine alike. Compiled for an
# H200 on the CPU (no autotuning), XLA fuses it at some M and takes cuBLAS with a decode kernel at others; the GPU's
# autotuner picks.
LAYOUT_XLA_OPTIONS = {"int8sc": (("xla_gpu_experimental_enable_subchannel_dequantisation_fusion", True),)}
# Engine-only layouts (the GEMM part has none of them): "scan" (e.g. bf16_scan) = the model with scan_layers=True
# (same shapes, its own random init), decoding with its stacked KV cache as the trainer's sampler.scan_layers=True
# runs it (no option of its own: XLA's dynamic-slice fusion, which it had, compiles the same program for an H200
# on the CPU, 2026-12-08, where bf16 copies each layer's weights out of the stack; the GPU's autotuner might pick
# library GEMMs that take the slice: `"scandsf"` adds it), "fp4gemmscan" the same with the fp4_gemm kernels (each
# reading its layer's view of the stacked weights); "cbwhile" / "nocb" = the engine's
# programs compiled with XLA's command buffers (CUDA graphs) also over while loops and conditionals, so a decode
# round runs as one graph with no host round trip per step / with no command buffers at all (EngineConfig
# .xla_options; XLA's default puts fusions and GEMMs in command buffers but not loops).
ENGINE_XLA_OPTIONS = {
    "cbwhile": (("xla_gpu_enable_command_buffer",
                 "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"),),
    "nocb": (("xla_gpu_enable_command_buffer", ""),),
    "scandsf": (("xla_gpu_enable_dynamic_slice_fusion", True),),
    **LAYOUT_XLA_OPTIONS,
}
# "exit" (e.g. bf16_exit) = decode rounds that stop once every slot is done (EngineConfig.round_loop="early_exit"):
# a data-dependent trip count, so XLA:GPU copies the loop condition to the host and waits for the device before
# every step. Every other sampler runs the GPU's default, a fixed round ("auto": a known trip count).
ENGINE_CONFIGS = {"exit": {"round_loop": "early_exit"}}
TARGETS = {"w4a16_m1_16": 2.5, "w4a16_m64": 1.5, "w4a16_m256": 1.0, "w4a4_m16": 2.0}


def _scanned(layout: str) -> bool:
    """Whether a sampler layout decodes with the model's layers scanned (scan, scandsf, fp4gemmscan)."""
    return layout.startswith("scan") or layout.endswith("scan")


def interleaved(fns, repeats, errors=None):
    """Warm each fn up (compiles), then call them in turn `repeats` times: [best seconds]. With `errors` (a dict),
    a fn whose warm-up raises is left out (its time None, errors[index] the message) instead of ending the run:
    one kernel that does not compile on this GPU must not cost the other rows."""
    ok = []
    for k, fn in enumerate(fns):
        try:
            jax.block_until_ready(fn())
            ok.append(k)
        except Exception as e:
            if errors is None:
                raise
            errors[k] = f"{type(e).__name__}: {str(e)[:300]}"
    times = [[] for _ in fns]
    for _ in range(repeats):
        for k in ok:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k]())
            times[k].append(time.perf_counter() - t0)
    return [min(t) if t else None for t in times]


def _reraise(e: Exception):
    raise e


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the memory roofline's denominator."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0000001)  # one read, one write (a copy XLA cannot elide)
    (t,) = interleaved([lambda: f(x)], repeats)
    return 2 * x.nbytes / t


def weight_bytes(w) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(w))


def gemm_loop(variant: str, m: int, k: int, n: int, copies: int, iters: int):
    """A zero-argument call running `iters` GEMMs [m, k] x [k, n] in one jitted fori_loop over `copies` weight
    copies (each iteration reads the next copy), and the bytes of one copy's weights."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    ws = (jax.random.normal(kw, (copies, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    if variant == "bf16":
        stacked, dot = ws, (lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32))
    else:
        preset, _, layout = variant.partition("_")
        backend = LAYOUT_BACKENDS[layout]
        prec = PRESETS[preset]
        stacked = jax.vmap(lambda w: prequantize(w, prec, backend=backend))(ws)
        dot = (lambda a, w: qdot(a, w, prec, backend=backend))
        if layout == "fp4gemmreg":
            from triage_jax.kernels import fp4_gemm

            dot = (lambda a, w: fp4_gemm.fp4_matmul(a, w.q, a_operand="registers"))
    one = jax.tree.map(lambda a: a[0], stacked)

    def loop(x, stacked):
        def body(i, acc):
            w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i % copies, keepdims=False), stacked)
            return acc + dot(x, w).astype(jnp.float32)  # the whole output: no slice XLA could push into the dot
        return jax.lax.fori_loop(0, iters, body, jnp.zeros((m, n), jnp.float32))

    loop = jax.jit(loop, compiler_options=dict(LAYOUT_XLA_OPTIONS.get(variant.partition("_")[2], ())) or None)
    return (lambda: loop(x, stacked)), weight_bytes(one)


GEMM_HEADER = f"{'K':>5} {'N':>5} {'M':>4} {'variant':>14} {'us':>8} {'x bf16':>7} {'TB/s':>6} {'of copy':>7}"


def bench_gemm(args, bw: float) -> list[dict]:
    """Rows of the GEMM table, each printed as soon as its (K, N, M) group is measured (a time limit that cuts the
    run short keeps what was measured)."""
    rows = []
    print(f"\n(a) decode GEMMs, {args.copies} weight copies rotated, {args.iters} GEMMs per timed loop")
    print(GEMM_HEADER)
    for k, n in args.gemm_shapes:
        for m in args.gemm_ms:
            calls, sizes, errors = [], [], {}
            for v in VARIANTS:
                try:
                    fn, nbytes = gemm_loop(v, m, k, n, args.copies, args.iters)
                except Exception as e:  # e.g. a backend unavailable here: its warm-up re-raises it, recorded
                    fn, nbytes = functools.partial(_reraise, e), 0
                calls.append(fn)
                sizes.append(nbytes)
            times = interleaved(calls, args.repeats, errors)
            if times[0] is None:
                raise RuntimeError(f"the bf16 baseline failed: {errors[0]}")
            base = times[0] / args.iters
            for i, (v, t, nbytes) in enumerate(zip(VARIANTS, times, sizes)):
                if t is None:
                    rows.append({"k": k, "n": n, "m": m, "variant": v, "error": errors[i]})
                    print(f"{k:>5} {n:>5} {m:>4} {v:>14} FAILED {errors[i]}", flush=True)
                    continue
                per = t / args.iters
                r = {"k": k, "n": n, "m": m, "variant": v, "us": per * 1e6, "speedup_vs_bf16": base / per,
                     "weight_mb": nbytes / 1e6, "tb_s": nbytes / per / 1e12, "frac_copy_bw": nbytes / per / bw}
                rows.append(r)
                print(f"{k:>5} {n:>5} {m:>4} {v:>14} {r['us']:>8.1f} {r['speedup_vs_bf16']:>7.2f} {r['tb_s']:>6.2f} "
                      f"{r['frac_copy_bw']:>7.0%}", flush=True)
    return rows


def _engine_run(model, policy, batch: int, prompt_len: int, new_tokens: int, xla_options: tuple = (), **engine_kw):
    from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model

    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, model.cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
    prepared = prepare_model(model, policy, unstack=False)  # a scanned model (the *_scan samplers) stays scanned
    calls, engines = [], []
    for tokens in (new_tokens, 1):
        eng = Engine(SamplingConfig(max_new_tokens=tokens), EngineConfig(
            max_slots=batch, max_len=prompt_len + new_tokens, max_prompt_len=prompt_len, prefill_batch=batch,
            xla_options=xla_options, **engine_kw), policy=policy, model=prepared)
        calls.append(lambda e=eng: e.generate(prompts, jax.random.key(0)).tokens)
        engines.append(eng)
    return calls, prompts, engines[0]


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = .*?[\]\})] ([a-z][a-z0-9\-]*)\((.*)$")
# Instructions that launch no work (tuple plumbing, views, constants).
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier",
              "partition-id", "replica-id", "add-dependency"}


def step_ops(hlo: str, loop: str = "jit(_decode_round)/while") -> dict:
    """Instructions per iteration of the loop `loop` (its op_name) in optimized HLO text, by opcode: the
    kernels (fusions, GEMM custom calls, copies, ...) one decode step launches. A nested loop counts its body
    times its known trip count (once if unknown); a call counts its callee."""
    comps, body = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            body = comps[m.group(1)] = []
        elif line.startswith("}"):
            body = None
        elif body is not None:
            body.append(line)
    head = next((x for c in comps.values() for x in c if " while(" in x and f'op_name="{loop}"' in x), None)
    if head is None:
        raise ValueError(f"no while loop named {loop!r} in the HLO")
    ops = collections.Counter()

    def count(name, times):
        for line in comps[name]:
            m = _INSTRUCTION.match(line)
            if not m or m.group(1) in _NO_KERNEL:
                continue
            op, rest = m.groups()
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
                count(re.search(r"body=%?([\w.\-]+)", rest).group(1), times * (int(trips.group(1)) if trips else 1))
            elif op == "call":
                count(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1), times)
            else:
                ops[op] += times

    count(re.search(r"body=%?([\w.\-]+)", head).group(1), 1)
    return dict(ops.most_common())


def _hf_call(model, prompts, new_tokens):
    """HF `generate` (torch bf16, the same weights) on torch's GPU, or its CPU in a --small dry run: the calls for
    `new_tokens` and for 1 token. Each checks that it generated exactly that many tokens (no early stop)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from triage_jax import models

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as d:
        models.save_pretrained(model, d)
        hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor(prompts, dtype=torch.long, device=device)

    def run(tokens):
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              pad_token_id=0, eos_token_id=None)
        if device == "cuda":
            torch.cuda.synchronize()
        if out.shape != (ids.shape[0], ids.shape[1] + tokens):
            raise RuntimeError(f"HF generate returned {tuple(out.shape)}, not {ids.shape[1]} + {tokens} tokens")
        return jnp.zeros(())

    return [lambda: run(new_tokens), lambda: run(1)]


def bench_engine(args, bw: float) -> list[dict]:
    from flax import nnx

    from triage_jax import models
    from triage_jax.sampler import sampler_policy

    rows = []
    for name in args.models:
        cfg = models.get_model_config(name, dtype="bfloat16", param_dtype="bfloat16",
                                      **(SMALL_MODEL if args.small else {}))
        model = models.Qwen3(cfg, rngs=nnx.Rngs(0))
        scanned = (models.Qwen3(cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))
                   if any(_scanned(s.partition("_")[2]) for s in args.samplers) else None)
        params_b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        for b in args.batches:
            sides, labels, engines = [], [], {}
            for label in args.samplers:
                preset, _, layout = label.partition("_")
                try:
                    policy = sampler_policy(preset, backend=LAYOUT_BACKENDS[layout])
                    calls, prompts, engine = _engine_run(
                        scanned if _scanned(layout) else model, policy, b, args.prompt_len, args.new_tokens,
                        ENGINE_XLA_OPTIONS.get(layout, ()), **ENGINE_CONFIGS.get(layout, {}))
                    engines[label] = engine
                except Exception as e:  # recorded as this sampler's error by interleaved
                    calls = [functools.partial(_reraise, e)] * 2
                sides += calls
                labels.append(label)
            if args.hf:
                try:
                    sides += _hf_call(model, prompts, args.new_tokens)
                except Exception as e:  # HF's model or generate not there: its error row, the samplers' rows kept
                    sides += [functools.partial(_reraise, e)] * 2
                labels.append("hf")
            errors = {}
            times = interleaved(sides, args.repeats, errors)
            kv_per_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16 K and V
            mean_ctx = args.prompt_len + args.new_tokens / 2
            for i, label in enumerate(labels):
                t_full, t_one = times[2 * i], times[2 * i + 1]
                if t_full is None or t_one is None:
                    if label == "bf16":
                        raise RuntimeError(f"the bf16 engine failed: {errors}")
                    rows.append({"model": name, "batch": b, "sampler": label,
                                 "error": errors.get(2 * i, errors.get(2 * i + 1))})
                    continue
                step = max(t_full - t_one, 1e-9) / (args.new_tokens - 1)
                wbytes = params_b if label.split("_")[0] == "bf16" or label == "hf" else None
                row = {"model": name, "batch": b, "sampler": label, "decode_tok_s": b / step, "step_ms": step * 1e3}
                if wbytes is not None:
                    moved = wbytes + b * mean_ctx * kv_per_tok
                    row["roofline_frac"] = moved / step / bw
                if label in engines:
                    row.update(_decode_ops(engines[label]))
                rows.append(row)
            base = next(r for r in rows if r["model"] == name and r["batch"] == b and r["sampler"] == "bf16")
            for r in rows:
                if r["model"] == name and r["batch"] == b:
                    if "error" not in r:
                        r["vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
                    _print_engine_row(r)  # as measured: a time limit on the run keeps the batches done
    return rows


def _decode_ops(engine) -> dict:
    """The kernels one decode step of this (warm) engine launches, from its first round's compiled program (the
    compile cache's: nothing compiles again): ops_step (total) and ops_by_kind."""
    try:
        hlo = engine.compile_decode(engine.slot_counts[0], engine.capacities[0], jax.random.key(0)).as_text()
        ops = step_ops(hlo)
    except Exception as e:  # a diagnostic only: never costs the row
        return {"ops_error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"ops_step": sum(ops.values()), "ops_by_kind": ops}


def _print_engine_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['model']:>12} {r['batch']:>5} {r['sampler']:>12} FAILED {r['error']}", flush=True)
        return
    rf, ops = r.get("roofline_frac"), r.get("ops_by_kind")
    top = ", ".join(f"{k} {v}" for k, v in list(ops.items())[:4]) if ops else r.get("ops_error", "")
    print(f"{r['model']:>12} {r['batch']:>5} {r['sampler']:>12} {r['decode_tok_s']:>9.0f} {r['step_ms']:>8.2f} "
          f"{r['vs_bf16']:>7.2f} {'-' if rf is None else f'{rf:.0%}':>8} {r.get('ops_step', '-'):>8}  {top}",
          flush=True)


FIRST_CALL = """
import time, jax, numpy as np
t0 = time.perf_counter()
from flax import nnx
from triage_jax import models
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model, sampler_policy
cfg = models.get_model_config({name!r}, dtype="bfloat16", param_dtype="bfloat16", scan_layers={scan}, **{overrides!r})
model = models.Qwen3(cfg, rngs=nnx.Rngs(0))
policy = sampler_policy({preset!r}, backend={backend!r})
eng = Engine(SamplingConfig(max_new_tokens={new}), EngineConfig(max_slots={b}, max_len={plen} + {new},
             max_prompt_len={plen}, prefill_batch={b}), policy=policy,
             model=prepare_model(model, policy, unstack=False))  # a scanned model stays scanned
rng = np.random.default_rng(0)
prompts = [rng.integers(2, cfg.vocab_size, {plen}).tolist() for _ in range({b})]
t1 = time.perf_counter()
jax.block_until_ready(eng.generate(prompts, jax.random.key(0)).tokens)
print("FIRST_CALL_S", time.perf_counter() - t1)
"""


def first_call(name: str, b: int, plen: int, new: int, scan: bool = False, overrides: dict | None = None,
               sampler: str = "bf16") -> dict:
    """The engine's first generate in a fresh process: compile included, with an empty and a filled cache (keys
    cold_s / cached_s; scan_cold_s / scan_cached_s for a scan_layers=True model; prefixed with the sampler's label
    for any sampler but bf16, e.g. w4a4_cold_s). `overrides`: model config fields (--small's sizes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    preset, _, layout = sampler.partition("_")
    prefix = "" if sampler == "bf16" else sampler + "_"
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for label in ("scan_cold", "scan_cached") if scan else ("cold", "cached"):
            env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
            label = prefix + label
            code = FIRST_CALL.format(name=name, b=b, plen=plen, new=new, scan=scan, overrides=overrides or {},
                                     preset=preset, backend=LAYOUT_BACKENDS[layout])
            r = subprocess.run([sys.executable, "-c", code],
                               cwd=root, env=env, capture_output=True, text=True, timeout=600)
            line = [x for x in r.stdout.splitlines() if x.startswith("FIRST_CALL_S")]
            out[label + "_s"] = float(line[0].split()[1]) if line else None
            if not line:
                out[label + "_error"] = r.stderr[-500:]
    return out


def agree(args) -> dict:
    """Greedy tokens of the w4a16 sampler on each available non-xla backend vs the xla backend's (rows equal)."""
    from flax import nnx

    from triage_jax import models
    from triage_jax.quant import backends
    from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, prepare_model, sampler_policy

    name = args.models[0]
    cfg = models.get_model_config(name, dtype="bfloat16", param_dtype="bfloat16",
                                  **(SMALL_MODEL if args.small else {}))
    model = models.Qwen3(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    b, new = 8, 16 if args.small else 64
    prompts = [rng.integers(2, cfg.vocab_size, args.prompt_len).tolist() for _ in range(b)]

    def greedy(backend):
        policy = sampler_policy("w4a16", backend=backend)
        eng = Engine(SamplingConfig(max_new_tokens=new, greedy=True),
                     EngineConfig(max_slots=b, max_len=args.prompt_len + new, max_prompt_len=args.prompt_len),
                     policy=policy, model=prepare_model(model, policy))
        return np.asarray(eng.generate(prompts, jax.random.key(0)).tokens)

    ref = greedy("xla")
    out = {}
    for name_b, (ok, why) in backends.available_backends().items():
        if name_b == "xla":
            continue
        if not ok:
            out[name_b] = f"unavailable: {why}"
            continue
        try:
            got = greedy(name_b)
        except NotImplementedError as e:  # BackendUnsupportedError: the backend declares the op missing
            out[name_b] = f"unsupported: {e}"
            continue
        except Exception as e:  # a kernel that does not compile here: say so, check the rest
            out[name_b] = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
            continue
        out[name_b] = f"{int((got == ref).all(axis=1).sum())}/{b} rows identical to xla over {new} greedy tokens"
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="gemm,engine,first_call,agree")
    ap.add_argument("--models", default="qwen3_0_6b,qwen3_4b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt_len", type=int, default=256)
    ap.add_argument("--new_tokens", type=int, default=256)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--iters", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samplers", default="bf16,w4a16,w4a16_int8,w4a16_fp4gemm,w4a4,w4a4_fp4gemm",
                    help="engine samplers, <preset>[_<layout>] as the GEMM variants (bf16 first: the baseline)")
    ap.add_argument("--no_hf", dest="hf", action="store_false")
    ap.add_argument("--first_call_samplers", default="bf16",
                    help="first_call for these samplers (<preset>[_<layout>]; the main config's is w4a4)")
    ap.add_argument("--first_call_scan", action="store_true",
                    help="first_call also for the model with scan_layers=True (its compile time vs unrolled)")
    ap.add_argument("--json", default=None, help="also write the JSON line's object to this file")
    ap.add_argument("--small", action="store_true", help="tiny sizes: a dry run anywhere (numbers meaningless)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.models = [m for m in args.models.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.samplers = [s for s in args.samplers.split(",") if s]
    if args.samplers[0] != "bf16":
        ap.error("--samplers must start with bf16 (every ratio is against it)")
    args.gemm_shapes, args.gemm_ms = GEMM_SHAPES, GEMM_MS
    if args.small:
        args.gemm_shapes, args.gemm_ms, args.copies, args.iters, args.repeats = ((256, 512),), (1, 16), 2, 2, 1
        args.batches, args.prompt_len, args.new_tokens, args.models = [4], 16, 8, args.models[:1]
    elif jax.default_backend() != "gpu":
        ap.error(f"a GPU benchmark; this process has {jax.default_backend()} (use --small for a dry run)")
    dev = jax.devices()[0]
    res = {"bench": "gpu", "device": dev.device_kind, "jax": jax.__version__, "small": args.small}
    bw = copy_bandwidth(64 << 20 if args.small else 2 << 30, args.repeats)
    res["copy_tb_s"] = bw / 1e12
    print(f"device {dev.device_kind}, jax {jax.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s")
    if "gemm" in args.parts:
        rows = bench_gemm(args, bw)
        res["gemm"] = rows

        def best(preset, ms):
            """(the slowest speed-up over `ms`, variant) of the best layout of `preset` (its worst M counts)."""
            ok = [r for r in rows if "error" not in r and r["m"] in ms and r["variant"].split("_")[0] == preset]
            # a layout counts only where it ran at every M of `ms`; (None, None): none did
            full = {v for v in {r["variant"] for r in ok} if {r["m"] for r in ok if r["variant"] == v} == set(ms)}
            return max(((min(r["speedup_vs_bf16"] for r in ok if r["variant"] == v), v) for v in full),
                       default=(None, None))

        def met(preset, ms, target):
            speed = best(preset, ms)[0]
            return None if speed is None or not all(m in args.gemm_ms for m in ms) else speed >= target
        res["gemm_best"] = {f"{p}_m{'_'.join(map(str, ms))}": best(p, ms) for p, ms in
                            (("w4a16", (1, 16)), ("w4a16", (64,)), ("w4a16", (256,)), ("w4a4", (1, 16)))}
        res["gemm_targets"] = {
            "w4a16_2.5x_at_m1_16": met("w4a16", (1, 16), TARGETS["w4a16_m1_16"]),
            "w4a16_1.5x_at_m64": met("w4a16", (64,), TARGETS["w4a16_m64"]),
            "w4a16_not_slower_at_m256": met("w4a16", (256,), TARGETS["w4a16_m256"]),
            "w4a4_2x_at_m_le_16": met("w4a4", (1, 16), TARGETS["w4a4_m16"])}
        print(f"best layouts: {res['gemm_best']}; targets: {res['gemm_targets']}")
    if "engine" in args.parts:
        print(f"\n(b) engine decode, prompt {args.prompt_len}, {args.new_tokens} new tokens, random init, bf16")
        print(f"{'model':>12} {'batch':>5} {'sampler':>12} {'tok/s':>9} {'ms/step':>8} {'x bf16':>7} {'roofline':>8} "
              f"{'ops/step':>8}  (most: kind count)",
              flush=True)
        res["engine"] = bench_engine(args, bw)
    if "first_call" in args.parts:
        name = args.models[-1]
        fc = {}
        for sampler in args.first_call_samplers.split(","):
            for scan in (False, True) if args.first_call_scan else (False,):
                fc.update(first_call(name, args.batches[0], args.prompt_len, args.new_tokens, scan,
                                     SMALL_MODEL if args.small else None, sampler))
        res["first_call"] = {"model": name, **fc}
        print(f"\nfirst rollout call in a fresh process ({name}): {fc}")
    if "agree" in args.parts:
        res["agree"] = agree(args)
        print(f"\n(c) {res['agree']}")
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
