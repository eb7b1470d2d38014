"""Compile for an NVIDIA H200 on a machine without a GPU and read what XLA:GPU made of a program.

    python -m triage_jax.tools.gpu_aot decode [--models qwen3_0_6b] [--samplers bf16,w4a16,w4a16:xla_int8]
        [--batch 64] [--kv-cache bf16] [--scan-layers] [--xla-option NAME=VALUE ...] [--local] [--passes N]
        [--json PATH]
    python -m triage_jax.tools.gpu_aot learner [--config configs/qwen3_4b.py] [--precisions bf16,w4a4]
        [--scan true,false] [--devices 8] [--layers N] [--json PATH]

XLA compiles for a GPU it is only told about (deviceless AOT: jax.experimental.topologies with a target config,
the device description the compiler reads) through jax's CUDA PJRT plugin, which loads without a driver or CUDA
libraries. The program goes through every XLA:GPU pass (fusion, GEMM rewriting, command buffers, LLVM's NVPTX
backend); autotuning is skipped (GEMM tiles are the defaults). A Mosaic GPU kernel stays a custom call in the
thunks, but its compile runs too: Mosaic GPU's pipeline and this machine's ptxas build it for sm_90a during the
program's compile (tools/gpu_kernels.py reads its PTX, ptxas report and SASS). What comes back, per compile: the PTX
of every XLA kernel and the thunk sequence (the kernels, copies and loops the program launches, in order).

- `ptx_float_ops` / `inexact_float_ops`: the float instructions of the PTX, and those whose result is not the
  correctly rounded one or depends on the hardware (approximate division / reciprocal / transcendental, fused
  multiply-add, flush-to-zero): tests/test_gpu_aot.py holds every quantizer to none (docs/numerics.md, "GPU").
- `decode`: the kernels one decode step of the engine launches on the H200, per sampler, for the GPU's fixed
  decode rounds (--scan-layers: the model's stacked layers in a loop, whose launches count once per layer;
  bench_gpu's ops/step counts HLO ops on the GPU itself; `--local` on a GPU machine gives this table from its own
  XLA), and the seconds it took to trace, lower and compile it (this host's; no autotuning);
  `--passes N` adds the N compile stages and XLA passes that took longest (compile_profile).
- `learner`: the seconds to lower and compile the trainer's learner update of a run config for a node of H200s,
  with the layers scanned (model.scan_layers) or unrolled.

Needs the plugin off the default path (installed, it would make every jax import on a GPU-less machine print an
error): `bash .ci/gpu_aot_plugin.sh` puts jax-cuda13-pjrt / -plugin of the installed jaxlib's version into
.gpu-aot/ (or $TRIAGE_GPU_AOT). Run in its own process (the CLI): the plugin is found when JAX first starts its
backends, and they are held to the CPU. The XLA is jaxlib's here, not necessarily the GPU machine's.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plugin_dir() -> str:
    """Where .ci/gpu_aot_plugin.sh put jax's CUDA PJRT plugin ($TRIAGE_GPU_AOT, else <repo>/.gpu-aot)."""
    return os.environ.get("TRIAGE_GPU_AOT", os.path.join(ROOT, ".gpu-aot"))


def plugin_installed() -> bool:
    return os.path.isfile(os.path.join(plugin_dir(), "jax_plugins", "xla_cuda13", "xla_cuda_plugin.so"))


def use_plugin() -> None:
    """Put the plugin on the path and hold JAX's backends to the CPU. Call before JAX starts its backends."""
    if not plugin_installed():
        raise SystemExit(f"gpu_aot: jax's CUDA PJRT plugin is not in {plugin_dir()}; run bash .ci/gpu_aot_plugin.sh")
    sys.path.insert(0, plugin_dir())
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already (it read JAX_PLATFORMS then): its backends may not have started
        sys.modules["jax"].config.update("jax_platforms", "cpu")


if __name__ == "__main__" and "--local" not in sys.argv:
    use_plugin()

import collections  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from triage_jax.models.kv_cache import KV_FORMATS  # noqa: E402

# The device description XLA:GPU compiles against (stream_executor.GpuTargetConfigProto, text format): an H200
# SXM (Hopper, sm_90a) from NVIDIA's datasheet - 132 SMs at 1.98 GHz, 141 GB of HBM3e at 4.8 TB/s, 50 MiB of L2,
# 228 KiB of shared memory per SM (227 KiB to one block). The fields the compiler's heuristics read.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  shared_memory_per_block_optin: 232448  threads_per_core_limit: 2048
  core_count: 132  fpus_per_core: 128  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535
  block_dim_limit_z: 65535  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 151397597184  registers_per_core_limit: 65536  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def h200():
    """A compile-only H200 device (programs compile for it; nothing runs)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1").devices[0]


def abstract_on(tree, device):
    """The tree's arrays as abstract values placed on `device`."""
    on = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, sharding=on), tree)


@dataclasses.dataclass
class Compiled:
    """What XLA:GPU made of one program: the PTX of its kernels (one text per LLVM module), its thunk sequence
    (after the thunk passes: command buffers shown) and its optimized HLO."""

    ptx: list[str]
    thunks: str
    hlo: str


def compile_dumped(compile_fn) -> Compiled:
    """compile_fn(compiler_options) -> a jax Compiled, run with XLA dumping into a fresh folder; the dump read.
    Needs the persistent compilation cache off (a cache hit writes no dump)."""
    with tempfile.TemporaryDirectory() as d:
        compiled = compile_fn({"xla_dump_to": d})
        ptx = [open(p).read() for p in sorted(glob.glob(os.path.join(d, "*.ptx")))]
        seq = sorted(glob.glob(os.path.join(d, "*thunk_sequence_after_thunk_passes.txt"))
                     or glob.glob(os.path.join(d, "*thunk_sequence.txt")))
        if not seq:  # jax's persistent cache keys programs without xla_dump_to: a hit compiles (and dumps) nothing
            raise RuntimeError(f"XLA wrote no thunk sequence (dump: {sorted(os.listdir(d))[:8]}); with the "
                               "persistent compilation cache on, run with JAX_ENABLE_COMPILATION_CACHE=false")
        thunks = open(seq[-1]).read()
    return Compiled(ptx=ptx, thunks=thunks, hlo=compiled.as_text())


def compile_fn(fn, *args, device=None) -> Compiled:
    """jit(fn) compiled for `device` (default: a compile-only H200) on abstract args placed there."""
    device = device or h200()
    lowered = jax.jit(fn).lower(*abstract_on(args, device))
    return compile_dumped(lambda opts: lowered.compile(opts))


def compile_profile(fn):
    """(fn(), {event name: self seconds}): fn run under JAX's profiler with host events only (no Python tracer), its
    events' self time (their span less the spans of the events inside them) summed by name, Python-level ones
    (jit calls, PjitFunction) left out: XLA's compile stages and HLO passes (priority-fusion, CompileModuleToLlvmIr,
    PTX->CUBIN, ...), jax's lowering. Where a compile's seconds go; the profiler is one per process."""
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level, opts.host_tracer_level = 0, 3
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True, profiler_options=opts)
        try:
            out = fn()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError("JAX's profiler wrote no perfetto trace")
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    own = collections.Counter()
    for spans in by_thread.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # the enclosing spans of the one being read
        for e in spans:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]["name"]] -= e["dur"]
            own[e["name"]] += e["dur"]
            stack.append(e)
    seconds = collections.Counter()
    for name, us in own.items():
        if not name.startswith(("$", "PjitFunction", "jit_")):
            seconds[name.split(":")[0]] += us / 1e6
    return out, dict(seconds.most_common())


_PTX_INSTR = re.compile(r"^\s*(?:@%?!?\w+\s+)?([a-z][a-z0-9]*(?:\.[A-Za-z0-9_:]+)*)\s", re.M)
_FLOAT_TYPE = re.compile(r"\.(f16|f16x2|bf16|bf16x2|f32|f64)(\.|$)")
# Float instructions whose result is IEEE's (correctly rounded or exact) whatever the hardware: add / sub / mul
# with an explicit rounding mode (ptxas never contracts those into an FMA), min / max, abs / neg, compares and
# selects, conversions with a named rounding mode, moves, loads and stores. Not float atomics (red / atom: their
# order of additions is the scheduler's).
_EXACT_FLOAT = re.compile(
    r"^(?:(?:add|sub|mul)\.r[nzmp]|(?:min|max)(?:\.NaN)?|abs|neg|setp\.\w+|selp|set\.\w+|testp\.\w+|copysign"
    r"|cvt(?:\.r[nzmp]i?)?(?:\.sat)?|mov|ld(?:\.\w+)*|st(?:\.\w+)*|shfl(?:\.\w+)*"
    r"|div\.rn|rcp\.rn|sqrt\.rn)"
    r"(?:\.(?:f16|f16x2|bf16|bf16x2|f32|f64|[subp](?:8|16|32|64)|b1|pred|global|shared|local|param|const|nc|v2|v4"
    r"|sync|down|up|bfly|idx|cta|gpu|sys|relaxed|acquire|release|add|min|max))*$")


def ptx_float_ops(ptx: str | list[str]) -> collections.Counter:
    """Instruction forms (opcode with its modifiers) of the PTX that operate on a float type, counted."""
    text = ptx if isinstance(ptx, str) else "\n".join(ptx)
    return collections.Counter(m for m in _PTX_INSTR.findall(text) if _FLOAT_TYPE.search(m))


def inexact_float_ops(ptx: str | list[str]) -> dict[str, int]:
    """The float instructions whose result may differ from IEEE's correctly rounded one or between GPUs: e.g.
    div.full / div.approx / rcp.approx (XLA's float division), fma / mad (two roundings become one), any .ftz
    (subnormals flushed), ex2 / lg2 / sin / cos / tanh .approx, float atomics."""
    return {op: n for op, n in ptx_float_ops(ptx).items() if ".ftz" in op or not _EXACT_FLOAT.match(op)}


_THUNK = re.compile(r"^(\s*)(?:\d+: )?(k\w+)\s")
_CONTROL = {"kWhile", "kConditional", "kCommandBuffer", "kSequential", "kDynamicSliceFusion"}  # wrappers


def loop_body_thunks(thunks: str) -> dict:
    """The thunks of the body of the program's first top-level while loop (the decode round's step loop), by
    kind: launches (kernels, GEMM library calls, copies, memsets; control thunks not counted), the number of
    command buffers (CUDA graphs) they are grouped into and the launches outside any (each its own launch), and
    nested loops, their condition and body counted once (a scanned model's layer loop runs them once per layer):
    `nested_launches` / `nested_outside_graphs` are the part of launches / outside_graphs inside nested loops."""
    lines = thunks.splitlines()
    start = next((i for i, x in enumerate(lines) if re.match(r"\d+: kWhile\s", x)), None)  # unindented: top level
    if start is None:
        raise ValueError("no top-level while loop in the thunk sequence")
    body = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "body:")
    depth = len(lines[body]) - len(lines[body].lstrip())
    kinds, names = collections.Counter(), collections.Counter()
    graph_indent, outside = None, 0  # the command buffer being read (its thunks are indented below it)
    loop_indent, nested, nested_outside = None, 0, 0  # the nested while loop being read
    for line in lines[body + 1:]:
        m = _THUNK.match(line)
        if m and len(m.group(1)) <= depth:
            break  # the loop's body ended (a nested loop's condition: / body: labels are not thunks)
        if m:
            indent, kind = len(m.group(1)), m.group(2)
            if graph_indent is not None and indent <= graph_indent:
                graph_indent = None
            if loop_indent is not None and indent <= loop_indent:
                loop_indent = None
            kinds[kind] += 1
            if kind == "kCommandBuffer":
                graph_indent = indent
            elif kind == "kWhile":
                loop_indent = indent if loop_indent is None else loop_indent
            elif kind not in _CONTROL:
                outside += graph_indent is None
                nested += loop_indent is not None
                nested_outside += loop_indent is not None and graph_indent is None
                fields = line.split("]", 1)[-1].split()
                names[re.sub(r"(_\d+)+$", "", fields[0]) if fields else kind] += 1
    launches = sum(n for k, n in kinds.items() if k not in _CONTROL)
    return {"launches": launches, "command_buffers": kinds["kCommandBuffer"], "outside_graphs": outside,
            "nested_loops": kinds["kWhile"], "nested_launches": nested, "nested_outside_graphs": nested_outside,
            "by_kind": dict(kinds.most_common()), "by_name": dict(names.most_common())}


_FUSION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(?[a-z][a-z0-9]*\[[^=]*?) fusion\(", re.M)
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def fusion_shapes(hlo: str) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Each fusion's output parts (dtype, dims) in an optimized HLO module, by name (a tuple's parts in order)."""
    return {name: [(dtype, tuple(int(d) for d in dims.split(",") if d))
                   for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", shape)]
            for name, shape in _FUSION.findall(hlo)}


def fusion_outputs(hlo: str) -> dict[str, int]:
    """Bytes each fusion of an optimized HLO module writes (its output shapes; a tuple's parts summed), by name:
    what a program's kernels put in memory for the next one to read back. An in-place update (a scatter into the
    KV cache) counts its whole buffer, though it writes only the updated slots."""
    return {name: sum(math.prod(dims) * _BYTES.get(dtype, 4) for dtype, dims in parts)
            for name, parts in fusion_shapes(hlo).items()}


def copies_of(hlo: str, dims: tuple[int, ...]) -> list[str]:
    """The fusions of an optimized HLO module that write an array with the elements of `dims` (or twice as many)
    and each of its dims among theirs, other than in-place updates (scatters, dynamic-update-slices: their output
    is the buffer they update): with a layer's KV buffer [B, KVH, S, Dh], its keys and / or values copied (sliced
    out of a stacked cache, transposed, converted) before a kernel reads them."""
    n, want = math.prod(dims), collections.Counter(dims)

    def match(shape):
        return math.prod(shape) in (n, 2 * n) and not want - collections.Counter(shape)

    return sorted(name for name, parts in fusion_shapes(hlo).items()
                  if "scatter" not in name and "dynamic_update_slice" not in name
                  and any(match(shape) for _, shape in parts))


def _engine(model_name: str, sampler: str, batch: int, capacity: int, prompt_len: int, kv_cache: str,
            overrides: dict | None, xla_options: tuple):
    """(engine, model config) of decode_step / prefill_step: the model config `model_name` (random init, bf16,
    abstract weights; `overrides` of its fields), the sampler <preset>[:<backend>] (default backend xla)."""
    from flax import nnx

    from triage_jax import models
    from triage_jax import sampler as sm

    preset, _, backend = sampler.partition(":")
    policy = sm.sampler_policy(preset, backend=backend or "xla", kv_cache=kv_cache)
    cfg = models.get_model_config(model_name, dtype="bfloat16", param_dtype="bfloat16", **(overrides or {}))
    model = nnx.eval_shape(lambda: sm.prepare_model(models.Qwen3(cfg, rngs=nnx.Rngs(0)), policy, unstack=False))
    engine = sm.Engine(sm.SamplingConfig(max_new_tokens=capacity - prompt_len),
                       sm.EngineConfig(max_slots=batch, max_len=capacity, max_prompt_len=prompt_len,
                                       xla_options=tuple(xla_options)),
                       policy=policy, model=model)
    return engine, cfg


def decode_step(model_name: str, sampler: str, batch: int, capacity: int = 512, prompt_len: int = 256,
                device=None, overrides: dict | None = None, kv_cache: str = "bf16", xla_options: tuple = ()) -> dict:
    """The kernels one decode step of the engine launches on `device` (default: a compile-only H200), for the
    model config `model_name` (random init, bf16; nothing materialized: the weights stay abstract; `overrides`
    of its fields, e.g. scan_layers=True), the sampler `sampler`: <preset>[:<backend>] (a sampler preset, a
    quantization backend; default xla), the KV cache format `kv_cache` and the engine's `xla_options`."""
    from triage_jax.kernels import mosaic

    device = device or h200()
    engine, cfg = _engine(model_name, sampler, batch, capacity, prompt_len, kv_cache, overrides, xla_options)
    t0 = time.perf_counter()
    with mosaic.lowering_for_gpu():  # the fp4_gemm backend's kernel, as a GPU runs it
        out = compile_dumped(lambda opts: engine.compile_decode(batch, capacity, jax.random.key(0), device=device,
                                                                compiler_options=opts))
    compile_s = time.perf_counter() - t0
    steps = engine.config.steps_per_round
    body = loop_body_thunks(out.thunks)
    if cfg.scan_layers:  # the layer loop's launches run once per layer: per step, count them that often
        if body["nested_loops"] != 1:
            raise ValueError(f"a scanned decode step with {body['nested_loops']} nested loops, not the layer loop")
        extra = cfg.num_hidden_layers - 1
        body["launches"] += extra * body["nested_launches"]
        body["outside_graphs"] += extra * body["nested_outside_graphs"]
    # Kernels writing a whole layer's keys or values (a copy of the cache: attention reads it in place).
    kv_copies = copies_of(out.hlo, (batch, cfg.num_key_value_heads, capacity, cfg.head_dim))
    return {"model": model_name, "sampler": sampler, "kv_cache": kv_cache, "batch": batch,
            "layers": cfg.num_hidden_layers, "scan_layers": cfg.scan_layers, "xla_options": dict(xla_options),
            "steps_per_round": steps, "compile_s": round(compile_s, 1), "kv_copies": kv_copies, **body,
            "launches_per_layer": round(body["launches"] / cfg.num_hidden_layers, 1)}


def prefill_step(model_name: str, sampler: str, batch: int, capacity: int = 512, prompt_len: int = 256,
                 device=None, overrides: dict | None = None, kv_cache: str = "bf16", xla_options: tuple = ()) -> dict:
    """Seconds to trace, lower and compile (as decode_step's compile_s) the prefill a generate runs first (the
    engine's prefill_batch prompts of `prompt_len` tokens; arguments as decode_step's) for `device`. A generate's
    first call compiles it beside the decode round, on threads of its own (`Engine._first_round_programs`): the
    first call waits for the slower of the two."""
    from triage_jax.kernels import mosaic

    device = device or h200()
    engine, _ = _engine(model_name, sampler, batch, capacity, prompt_len, kv_cache, overrides, xla_options)
    t0 = time.perf_counter()
    with mosaic.lowering_for_gpu():  # the fp4_gemm backend's kernel, as a GPU runs it
        engine.compile_prefill(prompt_len, device)
    seconds = round(time.perf_counter() - t0, 1)
    return {"prefill_rows": [engine.prefill_batch, prompt_len], "prefill_compile_s": seconds}


def h200s(count: int) -> list:
    """`count` compile-only H200s (one node's NVLink topology)."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="cuda", target_config=H200, topology=f"1x1x{count}").devices)


def learner_step(config: str, precision: str, scan_layers: bool, *, devices: int = 8, layers: int = 0,
                 responses: int = 0, prompt_len: int = 256, resp_len: int = 1024) -> dict:
    """Seconds to lower and compile the trainer's learner update (one mini-batch: forward, backward, optimizer)
    of the config file `config` (e.g. configs/qwen3_4b.py; abstract weights) for `devices` compile-only H200s on
    its mesh's fsdp axis, at learner.precision `precision`, with the layers scanned or unrolled. The sequence
    lengths barely move the compile time (the op count does); responses default to one per device."""
    import importlib.util

    from triage_jax import build
    from triage_jax import sharding as shd
    from triage_jax.config import validate
    from triage_jax.tools.dryrun import abstract_model

    spec = importlib.util.spec_from_file_location("run_config", config)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    n = responses or devices
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = 1, devices, 1, 1
    c.learner.precision, c.model.scan_layers = precision, scan_layers
    c.rl.micro_batch = c.rl.mini_batch = c.rl.num_prompts = n
    c.rl.group_size, c.rl.std_normalize, c.rl.dynamic_sampling = 1, False, False  # shapes only
    c.sampler.max_prompt_len, c.sampler.max_new_tokens = prompt_len, resp_len
    c.rl.overlong_buffer = min(c.rl.overlong_buffer, resp_len - 1)
    if layers:
        c.model.num_hidden_layers = layers
    validate(c, check_paths=False)
    model_cfg = build.model_config(c, 0)
    learner = build.learner(c, abstract_model(model_cfg), mesh=shd.make_mesh(c.mesh.to_dict(), h200s(devices)),
                            abstract=True)
    t0 = time.perf_counter()
    lowered = learner.lower_update(n, prompt_len, resp_len)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t1
    return {"config": os.path.basename(config), "precision": precision, "scan_layers": scan_layers,
            "layers": model_cfg.num_hidden_layers, "devices": devices, "responses": n,
            "tokens": prompt_len + resp_len, "lower_s": round(t1 - t0, 1), "compile_s": round(compile_s, 1),
            "hlo_instructions": compiled.as_text().count(" = ")}  # of the optimized program (per device)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["decode", "learner"])
    ap.add_argument("--models", default="qwen3_0_6b")
    ap.add_argument("--samplers", default="bf16,w4a16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv-cache", default="bf16", choices=KV_FORMATS, help="decode: the KV cache format")
    ap.add_argument("--scan-layers", action="store_true",
                    help="decode: the model with scan_layers=True (its decode step loops over the stacked layers)")
    ap.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                    help="decode: an XLA option the engine's programs compile with (repeatable; as "
                         "sampler.xla_options)")
    ap.add_argument("--config", default="configs/qwen3_4b.py", help="learner: the run config")
    ap.add_argument("--precisions", default="bf16,w4a4", help="learner: learner.precision values")
    ap.add_argument("--scan", default="true,false", help="learner: model.scan_layers values")
    ap.add_argument("--devices", type=int, default=8, help="learner: H200s on the fsdp axis")
    ap.add_argument("--layers", type=int, default=0, help="learner: another depth (0: the config's)")
    ap.add_argument("--local", action="store_true",
                    help="compile for this process's first device instead (on a GPU machine: its own XLA; no plugin)")
    ap.add_argument("--passes", type=int, default=0,
                    help="decode: also the N compile stages / XLA passes that took longest (JAX's profiler)")
    ap.add_argument("--prefill", action="store_true",
                    help="decode: also compile the prefill a generate runs first (its first call compiles it beside "
                         "the decode round and waits for the slower)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only programs: nothing to reuse
    if args.passes < 0:
        ap.error(f"--passes {args.passes}: a count of passes, >= 0")
    if args.what == "learner":
        if args.passes or args.scan_layers or args.xla_option or args.prefill:
            ap.error("--passes, --scan-layers, --xla-option and --prefill are for decode (learner: --scan)")
        if args.local:
            ap.error("learner compiles for compile-only H200s (--devices of them); --local is for decode")
        return _learner_table(args)
    from triage_jax.config import parse_xla_options
    from triage_jax.sampler import check_xla_options

    try:
        options = check_xla_options(parse_xla_options(args.xla_option))
    except ValueError as e:
        ap.error(f"--xla-option: {e}")
    device = jax.devices()[0] if args.local else h200()
    if device.platform != "gpu":
        ap.error(f"--local compiles for this process's device, and it is a {device.platform}, not a GPU")
    where = (f"{device.device_kind} (this process's device)" if args.local else
             f"{H200.split('device_description_str: ')[1].strip()} (deviceless)")
    rows = []
    print(f"decode step on {where}, XLA of jaxlib {_jaxlib_version()}, {args.kv_cache} KV cache: kernels "
          "launched per step")
    print(f"{'model':>12} {'sampler':>14} {'batch':>5} {'launches':>8} {'/layer':>6} {'graphs':>6} {'ungraphed':>9}"
          f" {'kv copies':>9} {'compile s':>9}" + (f" {'prefill s':>9}" if args.prefill else "") + "  most")
    for name in args.models.split(","):
        for sampler in args.samplers.split(","):
            step = lambda: decode_step(name, sampler, args.batch, device=device, kv_cache=args.kv_cache,  # noqa: E731
                                       overrides={"scan_layers": True} if args.scan_layers else None,
                                       xla_options=options)
            if args.passes:
                r, seconds = compile_profile(step)
                r["slowest_passes_s"] = {k: round(v, 2) for k, v in list(seconds.items())[:args.passes]}
            else:
                r = step()
            if args.prefill:
                r.update(prefill_step(name, sampler, args.batch, device=device, kv_cache=args.kv_cache,
                                      overrides={"scan_layers": True} if args.scan_layers else None,
                                      xla_options=options))
            rows.append(r)
            top = ", ".join(f"{k} {v}" for k, v in list(r["by_name"].items())[:5])
            pre = f" {r['prefill_compile_s']:>9}" if args.prefill else ""
            print(f"{name:>12} {sampler:>14} {args.batch:>5} {r['launches']:>8} {r['launches_per_layer']:>6} "
                  f"{r['command_buffers']:>6} {r['outside_graphs']:>9} {len(r['kv_copies']):>9} {r['compile_s']:>9}"
                  f"{pre}  {top}", flush=True)
            if args.passes:
                print(" " * 13 + "slowest: " + ", ".join(f"{k} {v} s" for k, v in r["slowest_passes_s"].items()))
    return _emit("decode", rows, args.json)


def _learner_table(args) -> int:
    print(f"learner update of {args.config} on {args.devices} compile-only H200s (fsdp), XLA of jaxlib "
          f"{_jaxlib_version()}: seconds to lower and compile (this host's; no autotuning)")
    print(f"{'precision':>9} {'scan_layers':>11} {'layers':>6} {'lower s':>7} {'compile s':>9}")
    rows = []
    for precision in args.precisions.split(","):
        for scan in args.scan.split(","):
            if scan not in ("true", "false"):
                raise SystemExit(f"--scan: {scan!r} is not true or false")
            r = learner_step(args.config, precision, scan == "true", devices=args.devices, layers=args.layers)
            rows.append(r)
            print(f"{precision:>9} {str(r['scan_layers']):>11} {r['layers']:>6} {r['lower_s']:>7} "
                  f"{r['compile_s']:>9}", flush=True)
    return _emit("learner", rows, args.json)


def _emit(what: str, rows: list[dict], path: str | None) -> int:
    """The table's final JSON line (and the rows to `path`)."""
    print(json.dumps({"tool": "gpu_aot", "jaxlib": _jaxlib_version(), what: rows}))
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
