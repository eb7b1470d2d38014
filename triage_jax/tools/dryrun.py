"""Memory dry-run: compile the learner step and one sampler decode step for a simulated mesh, print per-device memory.

    python -m triage_jax.tools.dryrun --config=configs/qwen3_4b.py --mesh=fsdp=8 [--hbm_gb=80,141,192]
        [--remat=config|none|full|save_dots|all] [--seq_len=20480] [--micro_batch=N] [--decode_batch=N]

Nothing is allocated: parameters and optimizer state are `jax.eval_shape`d and sharded by the logical-axis rules,
the step is lowered and compiled for the mesh on this CPU (`--xla_force_host_platform_device_count` simulates the
devices; it is set here before JAX starts), and `compiled.memory_analysis()` gives each device's arguments,
outputs and temporaries. A CPU compile sizes buffers as XLA's CPU backend schedules them, so the GPU/TPU figure
differs somewhat (fused kernels such as flash attention need less); the verdict keeps `--usable` of the HBM free
for the runtime.
"""

from __future__ import annotations

import os
import sys


def mesh_arg(argv: list[str]) -> str:
    """The --mesh value from argv (read before absl parses, to size the simulated device count)."""
    for i, a in enumerate(argv):
        if a.startswith("--mesh="):
            return a.split("=", 1)[1]
        if a == "--mesh" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


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
    """Ask XLA for as many host devices as the mesh needs: must run before JAX initializes its backend."""
    try:
        need = 1
        for v in parse_mesh(mesh_arg(argv)).values():
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
_DECODE = flags.DEFINE_integer("decode_batch", 0, "Sequences in the decode step (0: 8 per batch shard).")
_SCAN = flags.DEFINE_bool("scan_layers", True, "Compile the layers as one scanned body (fast compile, same memory "
                          "per layer); --noscan_layers unrolls them.")
_ATTN = flags.DEFINE_enum("attention", "xla", ["xla", "chunked"],
                          "Learner attention: the model's (xla: jax.nn.dot_product_attention, scores materialized) "
                          "or models.chunked_attention for sequences >= 4096 (flash-style blocks).")
_QCHUNK = flags.DEFINE_integer("q_chunk", 512, "Query block of --attention=chunked.")
_KCHUNK = flags.DEFINE_integer("k_chunk", 1024, "Key block of --attention=chunked.")
_DSCAN = flags.DEFINE_bool("decode_scan_layers", False, "Scan the layers in the decode step too (the trainer's "
                           "sampler runs them unrolled, updating the KV cache in place).")
_MOE_CHUNK = flags.DEFINE_integer("moe_chunk", 0, "Expert FFN over this many sorted assignment rows at a time "
                                  "(ModelConfig.moe_row_chunk; 0: all at once).")
_SKIP_DECODE = flags.DEFINE_bool("skip_decode", False, "Only the learner step.")

GB = 1e9


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


def decode_step(c, model_cfg, mesh, batch: int, cache_len: int) -> Memory:
    """Compile one sampler decode step (one token for `batch` sequences against a cache of cache_len slots).

    The sampler's weights are a compute-dtype copy of the learner's, sharded alike and quantized on the fly under
    the sampler's policy (the prequantized copy the trainer keeps is smaller: this is an upper bound).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from triage_jax import sharding as shd
    from triage_jax.logprobs import lm_head_logits
    from triage_jax.models.kv_cache import init_kv_cache
    from triage_jax.sampler import sampler_policy

    policy = sampler_policy(c.sampler.precision, c.sampler.kv_cache)
    graphdef, params = nnx.split(abstract_model(model_cfg), nnx.Param)
    shardings = shd.state_shardings(params, mesh)
    dtype = jnp.dtype(model_cfg.dtype)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype, sharding=s), params, shardings)
    kv_format = policy.kv_cache
    cache = jax.eval_shape(lambda: init_kv_cache(model_cfg, batch, cache_len, kv_format=kv_format, dtype=dtype))

    def spec(x):
        names = {5: (None, "batch", None, "heads", "kv"), 2: ("batch", None)}.get(x.ndim, (None,) * x.ndim)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, shd.logical_to_mesh(names,
                                                                                                        mesh=mesh)))

    cache = jax.tree.map(spec, cache)
    tok = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=shd.batch_sharding(mesh, 1))
    temperature = float(c.sampler.temperature)

    def step(params, cache, tok_b, pos_b, index):
        model = nnx.merge(graphdef, params)
        h_b1d, cache = model(tok_b[:, None], pos_b[:, None], jnp.ones((tok_b.shape[0], 1), bool), policy=policy,
                             cache=cache, cache_index=index, return_hidden=True)
        logits_bv = lm_head_logits(h_b1d[:, 0], model.lm_head_kernel(), policy, temperature)
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32), cache

    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # what the sampler sees: MoE expert parallelism, no activation rules
        compiled = jax.jit(step, donate_argnums=(1,)).lower(params, cache, tok, tok,
                                                            jax.ShapeDtypeStruct((), jnp.int32)).compile()
    return memory_of("sampler decode step", compiled, params, {}, time.perf_counter() - t0)


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


def run(c, mesh_shape: dict[str, int], *, remats: list[str], seq_len: int, prompt_len: int, micro: int,
        decode_batch: int, scan_layers: bool, with_decode: bool, attention: str = "xla", q_chunk: int = 512,
        k_chunk: int = 1024, decode_scan_layers: bool | None = None, moe_chunk: int = 0, log=print) -> list[Memory]:
    """Compile the configured steps for the mesh and return their per-device memory."""
    import jax

    from triage_jax import models, sharding as shd
    from triage_jax.config import validate

    for k, v in mesh_shape.items():
        c.mesh[k] = v
    mesh = shd.make_mesh(c.mesh.to_dict())
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
        f"{base.dtype}), scan_layers={scan_layers}; mesh {dict(mesh.shape)} on {len(jax.devices())} simulated "
        f"{jax.devices()[0].platform} devices; learner: {n} responses x ({prompt_len} prompt + {seq_len} response) "
        f"tokens ({n // shards} per device), precision {c.learner.precision}, vocab_chunk {c.learner.vocab_chunk}")
    decode_scan = scan_layers if decode_scan_layers is None else decode_scan_layers
    rows = []
    for remat in remats:
        mc = base.replace(remat=remat)
        log(f"compiling the learner step, remat={remat} ...")
        rows.append(learner_step(c, mc, mesh, n, prompt_len, seq_len, attention, q_chunk, k_chunk,
                                 moe_chunk))
        log(f"  done in {rows[-1].compile_s:.0f}s")
    if with_decode:
        b = decode_batch or 8 * shards
        log(f"compiling one decode step: {b} sequences, cache {prompt_len + seq_len} slots, scan_layers="
            f"{decode_scan}, sampler {c.sampler.precision}, kv {c.sampler.kv_cache} ...")
        rows.append(decode_step(c, base.replace(scan_layers=decode_scan), mesh, b, prompt_len + seq_len))
        log(f"  done in {rows[-1].compile_s:.0f}s")
    return rows


def main(argv) -> None:
    del argv
    c = _CONFIG.value
    if c is None:
        raise app.UsageError("pass --config=configs/NAME.py")
    mesh_shape = parse_mesh(_MESH.value)
    remats = {"config": [c.model.remat], "all": ["none", "full", "save_dots"]}.get(_REMAT.value, [_REMAT.value])
    hbm = [float(h) for h in _HBM.value]
    t0 = time.perf_counter()
    rows = run(c, mesh_shape, remats=remats, seq_len=_SEQ.value or c.sampler.max_new_tokens,
               prompt_len=_PROMPT.value or c.sampler.max_prompt_len, micro=_MICRO.value,
               decode_batch=_DECODE.value, scan_layers=_SCAN.value, with_decode=not _SKIP_DECODE.value,
               attention=_ATTN.value, q_chunk=_QCHUNK.value, k_chunk=_KCHUNK.value,
               decode_scan_layers=_DSCAN.value, moe_chunk=_MOE_CHUNK.value)
    print(f"\nper-device memory (GB = 1e9 bytes; peak = args + temps + outputs not aliased to donated inputs; "
          f"fits: peak <= {_USABLE.value:g} x HBM)")
    print(format_table(rows, hbm, _USABLE.value))
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    app.run(main)
