"""Memory dry-run: compile the learner step and the trainer's rollout programs for a simulated mesh, print memory.

    python -m triage_jax.tools.dryrun --config=configs/qwen3_4b.py --mesh=fsdp=8 [--hbm_gb=80,141,192]
        [--remat=config|none|full|save_dots|all] [--seq_len=20480] [--micro_batch=N] [--decode_batch=N]
        [--prefill_batch=N] [--target=cpu|h200]

Nothing is allocated: parameters and optimizer state are `jax.eval_shape`d and sharded by the logical-axis rules,
the step is lowered and compiled for the mesh on this CPU, and `compiled.memory_analysis()` gives each device's
arguments, outputs and temporaries; the verdict keeps `--usable` of the HBM free for the runtime. `--target=cpu`
(default) compiles with XLA:CPU for simulated host devices (`--xla_force_host_platform_device_count`, set here
before JAX starts): XLA:CPU's buffer assignment, not a GPU's. `--target=h200` compiles with XLA:GPU itself for
compile-only H200s (jax's CUDA PJRT plugin, as tools/gpu_aot.py; no GPU needed): the GPU's fusions and buffer
assignment, without its autotuning (which picks among kernels, not buffers).
"""

from __future__ import annotations

import os
import sys

TARGETS = ("cpu", "h200")  # whose compiler sizes the buffers: XLA:CPU (simulated host devices), XLA:GPU (deviceless)


def flag_arg(argv: list[str], name: str, default: str = "") -> str:
    """The --name value from argv, read before absl parses them: --mesh sizes the simulated device count and
    --target=h200 loads XLA:GPU's plugin, both before JAX starts."""
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return default


def parse_mesh(spec: str) -> dict[str, int]:
    """'data=2,fsdp=4,expert=8' -> {'data': 2, 'fsdp': 4, 'expert': 8}; names are the mesh axes."""
    axes = ("data", "fsdp", "tensor", "expert")
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = part.partition("=")
        if not eq or name not in axes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh: {part!r} is not AXIS=SIZE with AXIS one of {axes} and SIZE >= 1")
        out[name] = int(value)
    return out


def _simulate_devices(argv: list[str]) -> None:
    """Ask XLA for as many host devices as the mesh needs, or (--target=h200) put jax's CUDA PJRT plugin on the
    path for compile-only H200s: must run before JAX initializes its backend."""
    if flag_arg(argv, "target", "cpu") == "h200":
        from triage_jax.tools import gpu_aot

        if gpu_aot.plugin_installed():  # else main says so, after the flags parse
            gpu_aot.use_plugin()
        return
    try:
        need = 1
        for v in parse_mesh(flag_arg(argv, "mesh")).values():
            need *= v
    except ValueError:
        return  # reported properly once flags are parsed
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and need > 1:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    _simulate_devices(sys.argv)

import dataclasses  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/NAME.py).",
                                          lock_config=True)
_MESH = flags.DEFINE_string("mesh", "", "Mesh AXIS=SIZE,... (data, fsdp, tensor, expert); default: config.mesh.")
_HBM = flags.DEFINE_list("hbm_gb", ["80", "141", "192"], "Accelerator memory sizes (GB) to give a verdict for.")
_USABLE = flags.DEFINE_float("usable", 0.9, "Fraction of the HBM the step may use (the rest: runtime, NCCL).")
_REMAT = flags.DEFINE_enum("remat", "config", ["config", "none", "full", "save_dots", "all"],
                           "Remat policy of the learner step; 'all' compiles and tabulates each.")
_SEQ = flags.DEFINE_integer("seq_len", 0, "Response length (0: config.sampler.max_new_tokens).")
_PROMPT = flags.DEFINE_integer("prompt_len", 0, "Prompt length (0: config.sampler.max_prompt_len).")
_MICRO = flags.DEFINE_integer("micro_batch", 0, "Responses in the compiled learner step (0: config.rl.micro_batch, "
                              "raised to the number of batch shards if smaller).")
_DECODE = flags.DEFINE_integer("decode_batch", 0, "Decode slots of the rollout programs (0: 8 per batch shard); "
                                "a second compile at twice that gives the per-slot cost.")
_SCAN = flags.DEFINE_bool("scan_layers", None, "Compile the learner's layers as one scanned body (fast compile, same "
                          "memory per layer); --noscan_layers unrolls them. Default: the config's model.scan_layers.")
_ATTN = flags.DEFINE_enum("attention", "xla", ["xla", "chunked"],
                          "Learner attention: the model's (xla: jax.nn.dot_product_attention, scores materialized) "
                          "or models.chunked_attention for sequences >= 4096 (flash-style blocks).")
_QCHUNK = flags.DEFINE_integer("q_chunk", 512, "Query block of --attention=chunked.")
_KCHUNK = flags.DEFINE_integer("k_chunk", 1024, "Key block of --attention=chunked.")
_MOE_CHUNK = flags.DEFINE_integer("moe_chunk", 0, "Expert FFN over this many sorted assignment rows at a time "
                                  "(ModelConfig.moe_row_chunk; 0: all at once).")
_PREFILL = flags.DEFINE_integer("prefill_batch", 0, "Prompts per device per prefill call of the rollout programs "
                                 "(0: config.sampler.prefill_batch).")
_SKIP_DECODE = flags.DEFINE_bool("skip_decode", False, "Only the learner step.")
_TARGET = flags.DEFINE_enum("target", "cpu", list(TARGETS),
                            "Whose compiler sizes the buffers: cpu (XLA:CPU on simulated host devices) or h200 "
                            "(XLA:GPU for compile-only H200s, jax's CUDA PJRT plugin: bash .ci/gpu_aot_plugin.sh).")

GB = 1e9
PAPER_RESPONSES = 8192  # 512 prompts x 16 samples per RL step


@dataclasses.dataclass
class Memory:
    """Per-device bytes of one compiled step."""

    name: str
    params: int  # sharded parameters (part of the arguments)
    opt_state: int  # sharded optimizer state (part of the arguments)
    arguments: int  # every input buffer, params and optimizer state included
    outputs: int
    aliased: int  # outputs written into donated inputs (counted once)
    temporaries: int  # activations, gradients and scratch
    compile_s: float
    # rollout rows: the slots' KV cache, slots per device, and each program's temporaries / peak (GB)
    kv: int = 0
    slots_per_device: int = 0
    parts: str = ""

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard, for uneven splits)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def memory_of(name: str, compiled, params, opt_state, compile_s: float) -> Memory:
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("this backend's compiled.memory_analysis() returned None")
    return Memory(name, per_device_bytes(params), per_device_bytes(opt_state), int(m.argument_size_in_bytes),
                  int(m.output_size_in_bytes), int(m.alias_size_in_bytes), int(m.temp_size_in_bytes), compile_s)


def batch_shards(mesh) -> int:
    from triage_jax import sharding as shd

    spec = shd.logical_to_mesh(("batch",), shd.DEFAULT_RULES, mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def abstract_model(model_cfg):
    """The model as ShapeDtypeStructs (its variables carry the logical-axis metadata); nothing is allocated."""
    from flax import nnx

    from triage_jax import models

    return nnx.eval_shape(lambda: models.Qwen3(model_cfg, rngs=nnx.Rngs(0)))


def learner_step(c, model_cfg, mesh, n: int, prompt_len: int, resp_len: int, attention: str = "xla",
                 q_chunk: int = 512, k_chunk: int = 1024, moe_chunk: int = 0) -> Memory:
    """Compile one mini-batch update of n responses (one micro-batch when n == micro_batch) for the mesh."""
    import contextlib

    from triage_jax import build
    from triage_jax.models.chunked_attention import long_sequence_attention

    if moe_chunk:
        model_cfg = model_cfg.replace(moe_row_chunk=moe_chunk)
    learner = build.learner(c, abstract_model(model_cfg), mesh=mesh, abstract=True)
    t0 = time.perf_counter()
    ctx = long_sequence_attention(q_chunk=q_chunk, k_chunk=k_chunk) if attention == "chunked" else \
        contextlib.nullcontext()
    with ctx:
        lowered = learner.lower_update(n, prompt_len, resp_len)
    compiled = lowered.compile()
    name = f"learner remat={model_cfg.remat} attn={attention}" + (f" moe_chunk={moe_chunk}" if moe_chunk else "")
    return memory_of(name, compiled, learner.params,
                     learner.opt_state, time.perf_counter() - t0)


def rollout_step(c, model_cfg, mesh, slots: int, cache_len: int) -> Memory:
    """Compile the trainer's own rollout programs for `slots` decode slots (split over the batch axes) with a
    cache of cache_len slots: one decode round (sampler.steps_per_round tokens), the prefill of a batch of prompts
    (its peak plus the slots, which stay in memory beside it) and the insertion of prefilled prompts into slots;
    returns the largest footprint of the three.

    The weights are the sampler's prequantized copy (`sampler.prepare_model`) and weights and slots are placed as
    the engine places them (`Engine.state_shardings`, `Engine.slot_shardings`: tensor-parallel weights, slots
    over the batch axes).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from triage_jax import build, models, sharding as shd
    from triage_jax import sampler as smp

    policy = build.sampler_policy(c)
    tok = type("Tok", (), {"eos_ids": (0,), "pad_id": 0})()
    engine = build.engine(c, tok, mesh=mesh)
    st = engine.st
    prepared = nnx.eval_shape(lambda: models.prequantize_model(models.Qwen3(model_cfg, rngs=nnx.Rngs(0)), policy,
                                                               mesh=mesh, rules=engine.rules))
    graphdef, state = nnx.split(prepared)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         engine.state_shardings(state))
    dtype = jnp.dtype(model_cfg.dtype)
    cache_len = -(-cache_len // smp.MIN_BUCKET) * smp.MIN_BUCKET  # the engine's largest capacity bucket
    abstract_slots = jax.eval_shape(lambda: smp._empty_slots(model_cfg, slots, cache_len, st, policy.kv_cache, dtype,
                                                     kv_combined=engine.kv_combined))
    abstract_slots = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_slots,
                                  engine.slot_shardings(abstract_slots))
    f32, i32 = jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    stop = jax.ShapeDtypeStruct((1,), jnp.int32)
    t0 = time.perf_counter()
    opts = engine.xla_options
    with engine._context():
        decode = smp._decode_round.with_options(opts).lower(graphdef, state, abstract_slots, key, f32, f32, stop,
                                                            policy=policy, st=st,
                                                            steps=c.sampler.steps_per_round,
                                                            fixed=engine.fixed_rounds).compile()
        pb, p = engine.prefill_batch, min(smp.bucket_length(c.sampler.max_prompt_len), cache_len)
        pre = jax.eval_shape(lambda: smp._prefill(graphdef, state, jnp.zeros((pb, p), jnp.int32),
                                                  jnp.ones((pb, p), bool), jnp.zeros((model_cfg.num_hidden_layers,)),
                                                  jnp.zeros((model_cfg.num_hidden_layers,)), jnp.float32(1.0),
                                                  policy=policy, capacity=p, kv_format=policy.kv_cache,
                                                  kv_combined=engine.kv_combined))
        pre = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
            shd.batch_sharding(mesh, x.ndim) if x.ndim and x.shape[0] == pb else shd.replicated(mesh))), pre)
        if engine.kv_combined:  # the prefill cache's [2, rows, ...] buffers: split by rows (axis 1), as the slots'
            rows = jax.sharding.NamedSharding(mesh, shd.logical_to_mesh((None, "batch"), shd.DEFAULT_RULES, mesh))
            pre = (pre[0].replace(kv=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows),
                                                  pre[0].kv)), *pre[1:])
        vec = jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=shd.replicated(mesh))
        insert = smp._insert.with_options(opts).lower(abstract_slots, pre[0], pre[1], vec, vec, vec, key, f32, stop,
                                                      st=st).compile()
        # The prefill, with its prompts as the engine passes them (host arrays: replicated), beside the slots.
        ids, mask, scales = (jax.ShapeDtypeStruct(shape, dt, sharding=shd.replicated(mesh)) for shape, dt in (
            ((pb, p), jnp.int32), ((pb, p), bool), ((model_cfg.num_hidden_layers,), jnp.float32)))
        prefill = smp._prefill.with_options(opts).lower(graphdef, state, ids, mask, scales, scales, f32,
                                                        policy=policy, capacity=p, kv_format=policy.kv_cache,
                                                        record_routing=engine.record_routing,
                                                        kv_combined=engine.kv_combined).compile()
    secs = time.perf_counter() - t0
    rows = [memory_of(f"rollout decode ({slots // batch_shards(mesh)} slots/device)", decode, state, {}, secs),
            memory_of(f"rollout insert ({slots // batch_shards(mesh)} slots/device)", insert, state, {}, secs),
            memory_of(f"rollout prefill ({pb // batch_shards(mesh)} prompts/device)", prefill, state, {}, secs)]
    rows[2].arguments += per_device_bytes(abstract_slots)  # the slots stay in HBM while the engine prefills
    best = max(rows, key=lambda r: r.peak)
    best.parts = ", ".join(f"{r.name.split()[1]} {r.temporaries / GB:.2f} / {r.peak / GB:.2f}" for r in rows)
    best.name = f"rollout {slots // batch_shards(mesh)} slots/device, cache {cache_len}"
    best.kv = per_device_bytes(abstract_slots.cache)
    return best


def pick_slots(rows: list[Memory], hbm_gb: list[float], usable: float, responses: int, shards: int) -> list[str]:
    """From two compiled slot counts, the per-slot cost (linear in slots: KV + per-slot activations); the largest
    slots per device that fit each HBM size and the waves `responses` take at that size."""
    (s0, a), (s1, b) = rows
    per_slot = (b.peak - a.peak) / (s1 - s0)
    fixed = a.peak - per_slot * s0
    out = []
    for h in hbm_gb:
        budget = h * GB * usable - fixed
        n = int(budget // per_slot) if per_slot > 0 else 0
        n = min(1 << (n.bit_length() - 1) if n >= 1 else 0, -(-responses // shards))  # no more than needed
        waves = -(-responses // (n * shards)) if n else float("inf")
        out.append(f"{h:g}GB: {n} slots/device ({n * shards} in all), {waves} wave(s) for {responses} responses"
                   if n else f"{h:g}GB: not even one slot fits")
    return out


def format_table(rows: list[Memory], hbm_gb: list[float], usable: float) -> str:
    head = ["step", "params", "opt state", "args", "temps", "outputs", "peak", "compile s"]
    head += [f"fits {h:g}GB" for h in hbm_gb]
    lines = [head]
    for r in rows:
        cells = [r.name] + [f"{v / GB:.2f}" for v in (r.params, r.opt_state, r.arguments, r.temporaries,
                                                      r.outputs - r.aliased, r.peak)]
        cells.append(f"{r.compile_s:.0f}")
        cells += ["yes" if r.peak <= h * GB * usable else "NO" for h in hbm_gb]
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


TARGET_NAMES = {"cpu": "cpu", "h200": "H200 (compile-only)"}


def target_devices(target: str, mesh_shape: dict[str, int]) -> list | None:
    """The devices a mesh of `mesh_shape` compiles for: None (jax's own: the simulated host devices) on the CPU,
    as many compile-only H200s (one NVLink domain) for "h200"."""
    if target not in TARGETS:
        raise ValueError(f"--target={target!r}: expected one of {TARGETS}")
    if target == "cpu":
        return None
    from triage_jax.tools import gpu_aot

    if not gpu_aot.plugin_installed():
        raise ValueError(f"--target=h200 needs jax's CUDA PJRT plugin in {gpu_aot.plugin_dir()}: "
                         "bash .ci/gpu_aot_plugin.sh")
    from triage_jax import sharding as shd

    n = 1
    for a in shd.MESH_AXES:  # the mesh's axes only (the config's mesh also holds sampler_devices)
        n *= int(mesh_shape.get(a, 1))
    return gpu_aot.h200s(n)


def run(c, mesh_shape: dict[str, int], *, remats: list[str], seq_len: int, prompt_len: int, micro: int,
        decode_batch: int, scan_layers: bool, with_decode: bool, attention: str = "xla", q_chunk: int = 512,
        k_chunk: int = 1024, moe_chunk: int = 0, target: str = "cpu", log=print) -> list[Memory]:
    """Compile the configured steps for the mesh (on `target`'s devices: TARGETS) and return their per-device
    memory."""
    import contextlib

    from triage_jax import models, sharding as shd
    from triage_jax.config import validate
    from triage_jax.kernels import mosaic

    for k, v in mesh_shape.items():
        c.mesh[k] = v
    mesh = shd.make_mesh(c.mesh.to_dict(), target_devices(target, c.mesh.to_dict()))
    shards = batch_shards(mesh)
    n = micro or max(c.rl.micro_batch, shards)
    if n % shards:
        raise ValueError(f"--micro_batch={n} does not split over the {shards} batch shards of mesh "
                         f"{dict(mesh.shape)} (batch rule: data x fsdp x expert)")
    c.rl.micro_batch = c.rl.mini_batch = n
    c.rl.num_prompts, c.rl.group_size = n, 1
    c.rl.std_normalize = c.rl.dynamic_sampling = False  # a one-response "group": only the shapes matter here
    c.sampler.max_new_tokens = seq_len
    c.rl.overlong_buffer = min(c.rl.overlong_buffer, seq_len - 1)  # shapes only: keep the config valid
    validate(c, check_paths=False)
    overrides = {"dtype": c.model.dtype, "param_dtype": c.model.param_dtype, "scan_layers": scan_layers}
    if c.model.vocab_size:
        overrides["vocab_size"] = c.model.vocab_size
    base = models.get_model_config(c.model.preset, **overrides)
    log(f"model {c.model.preset}: {base.num_params() / 1e9:.2f}B params (param {base.param_dtype}, compute "
        f"{base.dtype}), scan_layers={scan_layers}; mesh {dict(mesh.shape)} on {mesh.devices.size} simulated "
        f"{TARGET_NAMES[target]} devices; learner: {n} responses x ({prompt_len} prompt + {seq_len} response) "
        f"tokens ({n // shards} per device), precision {c.learner.precision}, vocab_chunk {c.learner.vocab_chunk}")
    rows = []
    for remat in remats:
        mc = base.replace(remat=remat)
        log(f"compiling the learner step, remat={remat} ...")
        rows.append(learner_step(c, mc, mesh, n, prompt_len, seq_len, attention, q_chunk, k_chunk,
                                 moe_chunk))
        log(f"  done in {rows[-1].compile_s:.0f}s")
    if with_decode:
        # The trainer's rollout programs at two slot counts: their difference is the per-slot cost.
        s0 = decode_batch or 8 * shards
        for slots in (s0, 2 * s0):
            c.sampler.max_slots = slots
            log(f"compiling the rollout programs: {slots} slots ({slots // shards} per device), cache "
                f"{prompt_len + seq_len} slots, sampler {c.sampler.precision}, kv {c.sampler.kv_cache}, prefill "
                f"{c.sampler.prefill_batch} prompts/device ...")
            # On the H200 a kernel backend's Mosaic GPU calls lower as on a GPU (the interpreter's are host code).
            with mosaic.lowering_for_gpu() if target == "h200" else contextlib.nullcontext():
                row = rollout_step(c, base.replace(scan_layers=False), mesh, slots, prompt_len + seq_len)
            row.name += f", KV {row.kv / GB:.2f} GB"
            row.slots_per_device = slots // shards
            rows.append(row)
            log(f"  done in {row.compile_s:.0f}s (temporaries / peak GB per device: {row.parts})")
    return rows


def main(argv) -> None:
    del argv
    c = _CONFIG.value
    if c is None:
        raise app.UsageError("pass --config=configs/NAME.py")
    mesh_shape = parse_mesh(_MESH.value)
    if _PREFILL.value:
        c.sampler.prefill_batch = _PREFILL.value
    from triage_jax import compile_cache

    compile_cache.enable(c.compile_cache)
    remats = {"config": [c.model.remat], "all": ["none", "full", "save_dots"]}.get(_REMAT.value, [_REMAT.value])
    hbm = [float(h) for h in _HBM.value]
    t0 = time.perf_counter()
    rows = run(c, mesh_shape, remats=remats, seq_len=_SEQ.value or c.sampler.max_new_tokens,
               prompt_len=_PROMPT.value or c.sampler.max_prompt_len, micro=_MICRO.value,
               decode_batch=_DECODE.value,
               scan_layers=bool(c.model.scan_layers) if _SCAN.value is None else _SCAN.value,
               with_decode=not _SKIP_DECODE.value,
               attention=_ATTN.value, q_chunk=_QCHUNK.value, k_chunk=_KCHUNK.value,
               moe_chunk=_MOE_CHUNK.value, target=_TARGET.value)
    print(f"\nper-device memory (GB = 1e9 bytes; peak = args + temps + outputs not aliased to donated inputs; "
          f"fits: peak <= {_USABLE.value:g} x HBM)")
    print(format_table(rows, hbm, _USABLE.value))
    roll = [(r.slots_per_device, r) for r in rows if r.name.startswith("rollout")]
    if len(roll) == 2:
        shards = batch_shards(__import__("triage_jax.sharding", fromlist=["make_mesh"]).make_mesh(
            c.mesh.to_dict(), target_devices(_TARGET.value, c.mesh.to_dict())))
        print(f"rollout slots (per-slot cost from the two rollout rows), for the paper's {PAPER_RESPONSES} "
              f"responses per step:")
        for line in pick_slots(roll, hbm, _USABLE.value, PAPER_RESPONSES, shards):
            print("  " + line)
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    app.run(main)
