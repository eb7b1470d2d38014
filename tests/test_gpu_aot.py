"""XLA:GPU's own compile, on this CPU machine: programs compiled for a compile-only H200 (triage_jax/tools/gpu_aot.py,
jax's CUDA PJRT plugin) and read back as PTX and thunks. This reaches below StableHLO, where
tests/test_quant_ieee.py's export guard stops: what XLA:GPU's passes and LLVM's NVPTX backend make of the
quantizers' arithmetic, and what one decode step launches. The XLA is the installed jaxlib's (the GPU machine's may
be newer). Each compile runs the tool in a process of its own (the plugin is found when JAX starts its backends);
those tests skip without the plugin: `bash .ci/gpu_aot_plugin.sh` (CI installs it)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from triage_jax.tools import gpu_aot

needs_plugin = pytest.mark.skipif(
    not gpu_aot.plugin_installed(), reason=f"jax's CUDA PJRT plugin not in {gpu_aot.plugin_dir()}: bash .ci/gpu_aot_plugin.sh")

TESTS = os.path.dirname(os.path.abspath(__file__))


def _run(code: str) -> dict:
    """Runs `code` (which prints one JSON line last) with the plugin on the path and JAX held to the CPU."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([gpu_aot.plugin_dir(), TESTS]), "JAX_PLATFORMS": "cpu"}
    head = "import jax\njax.config.update('jax_enable_compilation_cache', False)\n"
    r = subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], env=env, cwd=gpu_aot.ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_inexact_float_ops_names_what_a_gpu_may_round_differently():
    """The PTX classifier itself (no compile): IEEE-exact forms pass (rounding modifiers named, compares, selects,
    conversions with a rounding, NaN-propagating max); float atomics, FMAs, contractible add / mul without a
    rounding modifier, flush-to-zero and approximate division are named, predicated or not."""
    ptx = """
\tadd.rn.f32 \t%r1, %r2, %r3;
\tmul.rn.f32 \t%r1, %r2, %r3;
\tcvt.rzi.u32.f32 \t%r1, %r2;
\tcvt.rni.f32.f32 \t%r1, %r2;
\tmax.NaN.f32 \t%r1, %r2, %r3;
\tsetp.ge.f32 \t%p1, %r2, %r3;
\tselp.f32 \t%r1, %r2, %r3, %p1;
\tld.global.nc.v2.f32 \t{%r1, %r2}, [%rd1];
\tdiv.u32 \t%r1, %r2, %r3;
\tred.global.add.f32 \t[%rd1], %r2;
\tfma.rn.f32 \t%r1, %r2, %r3, %r4;
\tadd.f32 \t%r1, %r2, %r3;
\tmul.rn.ftz.f32 \t%r1, %r2, %r3;
\t@%p1 div.full.f32 \t%r1, %r2, %r3;
\trcp.approx.f32 \t%r1, %r2;
"""
    assert gpu_aot.inexact_float_ops(ptx) == {"red.global.add.f32": 1, "fma.rn.f32": 1, "add.f32": 1,
                                              "mul.rn.ftz.f32": 1, "div.full.f32": 1, "rcp.approx.f32": 1}
    assert sum(gpu_aot.ptx_float_ops(ptx).values()) == 14  # div.u32 is not a float instruction


def test_compile_profile_names_where_a_compile_spends_its_time():
    """compile_profile (the tool's --passes) on a CPU compile, no plugin needed: the function's result passes through,
    XLA's and JAX's compile stages come back by name with non-negative self times (nested spans subtracted once), and
    nothing from Python (jit calls) is among them."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 256), jnp.float32)
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit would compile nothing
    try:
        compiled, seconds = gpu_aot.compile_profile(lambda: jax.jit(lambda a: jnp.sin(a) @ a.T).lower(x).compile())
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    assert compiled(x).shape == (64, 64)
    assert "backend_compile_and_load" in seconds, sorted(seconds)
    assert min(seconds.values()) >= -1e-9, seconds
    assert not [k for k in seconds if k.startswith(("$", "PjitFunction", "jit_"))], sorted(seconds)
    assert list(seconds.values()) == sorted(seconds.values(), reverse=True)  # longest first


_THUNKS = """\
001: kCustomKernel [source       | next=003 (2)] wrapped_iota grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
003: kWhile        [prev=002 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source       | next=010 (1)]
        005: kCustomKernel [source | sink] loop_select_fusion grid: [512, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
        009: kCopy         [source | sink] kCopy
    010: kWhile         [prev=000 (1) | next=000 (1)]
condition:
        011: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        012: kDynamicSliceFusion [source        | next=014 (1)] params=1, results=1
            013: kCopy [source | sink] kCopy
        021: kCustomKernel       [prev=019 (1)  | next=024 (2)] gemm_fusion_dot_23 grid: [8192, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
    054: kCustomKernel       [prev=027 (14) | sink        ] loop_add_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
060: kCustomKernel [source | sink] after_the_loop grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""


def test_loop_body_thunks_counts_one_iteration_of_the_step_loop():
    """The decode step's launches from a thunk dump (a scanned model's, trimmed): the top-level loop's body only
    (not its condition, not what follows the loop), a nested loop's condition and body once each, wrappers
    (command buffers, loops, dynamic-slice fusions) not counted but their contents, names without suffixes; the
    launches outside a command buffer counted apart."""
    r = gpu_aot.loop_body_thunks(_THUNKS)
    assert r["launches"] == 6 and r["command_buffers"] == 1 and r["nested_loops"] == 1, r
    assert r["outside_graphs"] == 4, r  # all but the command buffer's select and copy
    assert r["nested_launches"] == r["nested_outside_graphs"] == 3, r  # the layer loop's compare, copy and GEMM
    assert r["by_name"] == {"kCopy": 2, "loop_select_fusion": 1, "loop_compare_fusion": 1, "gemm_fusion_dot": 1,
                            "loop_add_fusion": 1}, r
    with pytest.raises(ValueError, match="no top-level while loop"):
        gpu_aot.loop_body_thunks(_THUNKS.split("003:")[0])


def test_copies_of_finds_a_layers_keys_and_values_written_anew():
    """gpu_aot.copies_of on optimized-HLO lines: a fusion writing a layer's K or V (or both, or transposed, in
    another dtype) is a copy; the in-place scatter into the stacked cache, a same-sized array of other dims (a
    decoded weight) and a smaller one are not."""
    hlo = "\n".join([
        "  %loop_slice_fusion = bf16[1,2,16,8,128,64]{5,4,3,2,1,0} fusion(%a, %i), kind=kLoop, calls=%f1",
        "  %input_transpose_fusion = f32[16,8,64,128]{3,2,1,0} fusion(%a, %i), kind=kInput, calls=%f2",
        "  ROOT %input_scatter_fusion = u16[4,2,16,8,128,64]{5,4,3,2,1,0} fusion(%a, %u), kind=kInput, calls=%f3",
        "  %input_concatenate_fusion = bf16[1024,1024]{1,0} fusion(%w), kind=kInput, calls=%f4",
        "  %fusion.7 = (f32[16,8,2,128]{3,2,1,0}, f32[16,8,2]{2,1,0}) fusion(%a, %q), kind=kCustom, calls=%f5",
        "  %loop_dynamic_update_slice_fusion = bf16[16,8,128,64]{3,2,1,0} fusion(%b, %r), kind=kLoop, calls=%f6"])
    assert gpu_aot.copies_of(hlo, (16, 8, 128, 64)) == ["input_transpose_fusion", "loop_slice_fusion"]
    assert gpu_aot.copies_of(hlo, (16, 8, 256, 64)) == []


@needs_plugin
def test_the_ptx_check_sees_what_it_guards_against():
    """XLA:GPU's float division is PTX div.full (<= 2 ulp), exp an approximation (ex2.approx.ftz, FMAs), and a
    float64 division of converted float32s is shrunk back to div.full.f32 (LLVM); the quantizers' division
    (ieee.div: div_wide on CUDA) compiles to div.rn.f64 and a round-to-nearest convert, the integer one
    (div_flushed: Pallas kernel bodies, other platforms) to integer arithmetic only."""
    out = _run("""
        import json, jax, jax.numpy as jnp
        from triage_jax.tools import gpu_aot
        from triage_jax.quant import ieee
        x = jnp.zeros((4, 256), jnp.float32)

        def by_convert(a, b):
            with jax.enable_x64(True):
                return (a.astype(jnp.float64) / b.astype(jnp.float64)).astype(jnp.float32)

        res = {}
        for name, fn in {"native": lambda a, b: (2688.0 / a, a / b, jnp.exp(a)), "by_convert": by_convert,
                         "div": lambda a, b: (ieee.div(2688.0, a), ieee.div(a, b)),
                         "div_flushed": lambda a, b: (ieee.div_flushed(2688.0, a), ieee.div_flushed(a, b))}.items():
            c = gpu_aot.compile_fn(fn, x, x)
            res[name] = {"inexact": gpu_aot.inexact_float_ops(c.ptx), "float_ops": gpu_aot.ptx_float_ops(c.ptx),
                         "ptx_chars": sum(len(p) for p in c.ptx)}
        print(json.dumps(res))
    """)
    assert out["native"]["inexact"].get("div.full.f32", 0) >= 2, out["native"]
    assert any(op.startswith("ex2.approx") for op in out["native"]["inexact"]), out["native"]
    assert out["by_convert"]["inexact"] == {"div.full.f32": 1}, out["by_convert"]
    assert out["div"]["inexact"] == {} and out["div"]["float_ops"].get("div.rn.f64", 0) >= 2, out["div"]
    assert out["div_flushed"]["inexact"] == {} and not any("div" in op for op in out["div_flushed"]["float_ops"])
    assert out["div_flushed"]["ptx_chars"] > 0, out["div_flushed"]  # the PTX was read


@needs_plugin
def test_every_quantizer_compiles_to_exactly_rounded_ptx():
    """Every quantizer and dequantizer of tests/quant_cases.py, compiled for the H200: no float instruction whose
    result is not IEEE's (no division or reciprocal but the correctly rounded kind, no FMA contraction, no
    flush-to-zero, no approximation). A failure names the op and the instructions."""
    out = _run("""
        import json, jax.numpy as jnp
        import quant_cases
        from triage_jax.tools import gpu_aot
        dev = gpu_aot.h200()
        x = jnp.zeros((64, 256), jnp.float32)
        res = {}
        for op, fn in quant_cases.OPS.items():
            c = gpu_aot.compile_fn(fn, x, device=dev)
            res[op] = {"inexact": gpu_aot.inexact_float_ops(c.ptx), "float_ops": sum(gpu_aot.ptx_float_ops(c.ptx).values())}
        print(json.dumps(res))
    """)
    assert set(out) == set(__import__("quant_cases").OPS)
    bad = {op: r["inexact"] for op, r in out.items() if r["inexact"]}
    assert not bad, bad
    assert all(r["float_ops"] > 0 for r in out.values()), out  # the PTX was read: float arithmetic is there


@needs_plugin
def test_a_decode_step_is_one_cuda_graph_on_the_h200():
    """The GPU's decode step (a fixed round's body, 2-layer Qwen3): every kernel of a bf16 step in one command buffer
    (one CUDA graph launch per token, not one launch per kernel) and no loop inside it (a while loop in the step
    would copy its condition to the host every iteration). The fp4_gemm sampler runs every projection through the
    Mosaic GPU kernel, q / k / v and gate / up merged (4 per layer: qkv, o, gate_up, down; 7 unmerged). An FP8 KV
    cache adds no launch to the step: its quantization fuses into the cache writes, its values convert inside the
    attention's GEMMs, its scales, set by the prefill, are not re-derived, and each layer's scale is a buffer of its
    own (a slice of an [L] array is copied out before a GEMM fusion reads it: two copies a layer). A layer's keys
    and values are written by one scatter (one buffer; 2 more scatters a step store the drawn tokens and log-probs).
    A scan_layers=True model decodes with its layers in a loop (prepare_model(unstack=False)): its per-step count
    runs the loop's launches once per layer, among them the copies of each layer's weights out of the stack. The
    tool's prefill compile (`--prefill`) builds the engine's first prefill program for the H200 too."""
    out = _run("""
        import json
        from triage_jax.tools import gpu_aot
        from experiments.bench_gpu import SMALL_MODEL as small  # bench_gpu's 2-layer Qwen3
        dev = gpu_aot.h200()
        rows, seconds = gpu_aot.compile_profile(lambda: [  # the tool's --passes: where the compiles went
            gpu_aot.decode_step("qwen3_0_6b", s, 16, capacity=128, prompt_len=32, device=dev, overrides=small,
                                kv_cache=kv)
            for s, kv in (("bf16", "bf16"), ("w4a16:fp4_gemm", "bf16"), ("bf16", "fp8"))])
        rows.append(gpu_aot.decode_step("qwen3_0_6b", "bf16", 16, capacity=128, prompt_len=32, device=dev,
                                        overrides=dict(small, scan_layers=True)))
        prefill = gpu_aot.prefill_step("qwen3_0_6b", "w4a4", 16, capacity=128, prompt_len=32, device=dev,
                                       overrides=small)  # the tool's --prefill: the first call's other program
        print(json.dumps({"rows": rows, "passes": sorted(seconds), "prefill": prefill}))
    """)
    bf16, fp4, fp8, scanned = out["rows"]
    assert out["prefill"]["prefill_rows"] == [8, 32] and out["prefill"]["prefill_compile_s"] > 0, out["prefill"]
    assert {"priority-fusion", "PTX->CUBIN"} <= set(out["passes"]), out["passes"]  # XLA:GPU's, by name
    assert fp8["command_buffers"] == 1 and fp8["outside_graphs"] == 0, fp8
    assert fp8["launches"] == bf16["launches"] and fp8["by_kind"] == bf16["by_kind"], (fp8, bf16)
    assert bf16["command_buffers"] == 1 and bf16["outside_graphs"] == 0 and bf16["nested_loops"] == 0, bf16
    assert bf16["launches"] == bf16["by_kind"]["kCustomKernel"] > 0, bf16  # every launch a kernel of the graph
    for step in (bf16, fp8, fp4, scanned):  # every step's attention reads the cache where it is
        assert step["kv_copies"] == [], step
    for step in (bf16, fp8):
        assert step["by_name"].get("input_scatter_fusion") == 2 + 2, step["by_name"]
    assert fp4["by_kind"].get("kCustomCall") == 4 * 2, fp4
    assert fp4["nested_loops"] == 0, fp4
    once = sum(n for k, n in scanned["by_kind"].items() if k not in gpu_aot._CONTROL)  # each thunk once
    assert scanned["nested_loops"] == 1 and scanned["layers"] == 2, scanned
    assert scanned["launches"] == once + scanned["nested_launches"] > bf16["launches"], (scanned, bf16)
    assert scanned["by_kind"]["kCopy"] > 0, scanned  # the weights copied out of the stack


@needs_plugin
def test_the_gpus_cached_attention_is_three_kernels():
    """The decode step's attention on the H200 (kv_cache.cached_attention at the 4B's heads: GQA 32 / 8, head dim
    128, batch 64, capacity 512) lowers to its GPU form, one softmax per row: the score GEMM, one softmax fusion and
    the value GEMM, against 6 kernels for the CPU's 64-slot blocks (a softmax over two axes: separate reductions).
    An FP8 cache takes the same 3: its values convert inside the GEMMs (no bf16 copy of the cache per step)."""
    out = _run(r"""
        import functools, json, re
        import jax.numpy as jnp
        from triage_jax.models import kv_cache as kvc
        from triage_jax.tools import gpu_aot
        dev = gpu_aot.h200()
        args = (jnp.zeros((64, 1, 32, 128), jnp.bfloat16), jnp.zeros((64, 8, 512, 128), jnp.bfloat16),
                jnp.zeros((64, 8, 512, 128), jnp.bfloat16), jnp.zeros((64, 1), jnp.int32))
        def kernels(f, *a):
            thunks = gpu_aot.compile_fn(functools.partial(f, scale=128**-0.5), *(a or args), device=dev).thunks
            return [m.group(1) for m in re.finditer(r"kCustomKernel\s+\[[^]]*\]\s*(\S+)", thunks)]
        fp8 = (args[0], args[1].astype(jnp.float8_e4m3fn), args[2].astype(jnp.float8_e4m3fn), args[3],
               jnp.float32(2.0), jnp.float32(0.5))
        print(json.dumps({"default": kernels(kvc.cached_attention), "blocks": kernels(kvc.attention_blocks),
                          "fp8": kernels(lambda q, k, v, sl, ks, vs, scale: kvc.cached_attention(
                              q, k, v, sl, scale, ks, vs), *fp8)}))
    """)
    for form in ("default", "fp8"):
        assert len(out[form]) == 3, out
        assert sum(k.startswith("gemm_fusion") for k in out[form]) == 2, out
    assert len(out["blocks"]) > 3, out


@needs_plugin
def test_the_xla_w4a16_gemm_writes_only_the_bf16_weight():
    """The xla backend's W4A16 GEMM on the H200 at the 4B's MLP shape (K, N) = (2560, 9728), decode rows: the
    4-bit weight is decoded into one bf16 copy (~50 MB) and nothing more goes through HBM before the GEMM. With E2M1
    codes decoded by a float compare chain and E4M3 scales by integer ops, XLA wrote both nibble planes in float32
    and the scales apart (155.6 MB, 2 kernels more): ~3x the traffic of the bf16 dot the W4A16 sampler is
    meant to beat. MXFP4 weights (w4a16_mx, one row) likewise: with their E8M0 scales flushed before the product,
    the scales were a kernel of their own for some weights. The bytes are the kernels' outputs in the optimized HLO
    (gpu_aot.fusion_outputs)."""
    out = _run("""
        import json, jax, jax.numpy as jnp
        from triage_jax.quant import PRESETS, prequantize, qdot
        from triage_jax.tools import gpu_aot
        dev = gpu_aot.h200()
        res = {}
        for preset, m in (("w4a16", 1), ("w4a16", 64), ("w4a16_mx", 1)):
            prec = PRESETS[preset]
            wq = jax.eval_shape(lambda w: prequantize(w, prec), jnp.zeros((2560, 9728), jnp.bfloat16))
            x = jnp.zeros((m, 2560), jnp.bfloat16)
            c = gpu_aot.compile_fn(lambda x, w: qdot(x, w, prec, backend="xla"), x, wq, device=dev)
            res[f"{preset} {m}"] = {"written": gpu_aot.fusion_outputs(c.hlo),
                                    "kernels": c.thunks.count("kCustomKernel")}
        print(json.dumps(res))
    """)
    weight_bf16 = 2560 * 9728 * 2
    for case, r in out.items():
        y = int(case.split()[1]) * 9728 * 4  # the float32 product (and split-K's partial sums: at most 8 of them)
        assert weight_bf16 <= sum(r["written"].values()) <= weight_bf16 + 8 * y, (case, r)
        assert r["kernels"] <= 3, (case, r)


@needs_plugin
def test_a_w4a4_decode_step_reduces_each_activation_once():
    """A W4A4 sampler's activation quantization on the H200 (2-layer Qwen3, fp4_gemm): with the block amaxes
    from slices (formats._amaxes_sliced, the GPU's branch) XLA fuses them into the kernels that follow, so each of
    the 4 quantized activations per layer takes one reduce kernel (its global amax) and the step launches fewer
    kernels than with the CPU's reduces (block amaxes, then the global amax from them)."""
    out = _run("""
        import json, jax
        from triage_jax.quant import formats as fmt
        from triage_jax.tools import gpu_aot
        from experiments.bench_gpu import SMALL_MODEL as small
        dev = gpu_aot.h200()
        step = lambda s: gpu_aot.decode_step("qwen3_0_6b", s, 16, capacity=128, prompt_len=32,
                                             device=dev, overrides=small)
        w4a16, sliced = step("w4a16:fp4_gemm"), step("w4a4:fp4_gemm")
        fmt.SLICED_AMAX_MAX_ELEMENTS = 0  # every activation through the reduce
        jax.clear_caches()  # the jitted quantizer's trace is cached
        print(json.dumps({"w4a16": w4a16, "sliced": sliced, "reduced": step("w4a4:fp4_gemm")}))
    """)
    layers, reduces = out["sliced"]["layers"], lambda r: r["by_name"].get("input_reduce_fusion", 0)
    assert out["sliced"]["by_name"].get("input_reduce_select_fusion") == 4 * layers, out["sliced"]  # global amaxes
    assert reduces(out["sliced"]) == reduces(out["w4a16"]), out  # no block-amax reduce
    assert reduces(out["reduced"]) >= reduces(out["w4a16"]) + 4 * layers, out  # block (and global) amaxes reduced
    assert out["reduced"]["launches"] > out["sliced"]["launches"], out
    assert out["sliced"]["by_kind"].get("kCustomCall") == 4 * layers, out["sliced"]


@needs_plugin
def test_a_scanned_w4a4_layer_loop_is_one_cuda_graph():
    """A scan_layers=True model's decode step on the H200 (2-layer Qwen3, W4A4, xla): the layer loop's body is one
    command buffer, with no copy of a slice outside it. Its small per-layer arrays (norm weights, the 4-bit
    weights' tensor scales) come from one masked reduction (kv_cache.layer_rows); a dynamic slice of each (a
    DynamicSliceFusion copy outside the graphs wherever a norm's Triton fusion reads it) split the body into 4
    graphs with 8 launches between them (the 4B's: 288 launches a step outside the graphs). Its attention reads
    the layer's keys and values in the stacked cache (kv_cache.attention_in_place): no kernel copies them out of
    the stack first, as one did before the GEMM form's fusions (a whole layer's K and V a step). With the fp4_gemm
    backend, the kernels read the stacked 4-bit weights in place too."""
    rows = _run("""
        import json
        from triage_jax.tools import gpu_aot
        from experiments.bench_gpu import SMALL_MODEL as small
        scanned = dict(small, scan_layers=True)
        print(json.dumps([gpu_aot.decode_step("qwen3_0_6b", s, 16, capacity=128, prompt_len=32, device=gpu_aot.h200(),
                                              overrides=scanned) for s in ("w4a4", "w4a4:fp4_gemm")]))
    """)
    out, kernel = rows
    # The fp4_gemm kernels read each layer's view of the stacked weights (FP4GemmWeight.layer_view): no copy of a
    # layer's codes and scales before a kernel (sliced, 7 DynamicSliceFusions and 7 copies a layer).
    assert kernel["by_kind"].get("kCustomCall") == 7 and "kDynamicSliceFusion" not in kernel["by_kind"], kernel
    assert kernel["kv_copies"] == [] and kernel["nested_loops"] == 1, kernel
    assert out["nested_loops"] == 1 and out["layers"] == 2, out
    assert "kDynamicSliceFusion" not in out["by_kind"], out["by_kind"]
    # Per layer: the loop condition's kernel outside the graphs, the body's kernels inside one.
    assert out["nested_outside_graphs"] == 1 and out["command_buffers"] == 2, out
    assert out["by_name"].get("loop_reduce_fusion", 0) + out["by_name"].get("input_reduce_fusion", 0) >= 1, out
    assert out["kv_copies"] == [], out


@needs_plugin
def test_exact_mode_matmuls_have_one_row_count_on_the_h200():
    """Exact mode's dots on a GPU (invariant.padded_rows): whatever the rows, the GEMM XLA:GPU compiles is the one
    for 64 rows, launched alike - so the sampler's and the learner's programs compute a row the same way. The
    plain dot's GEMM changes with the row count (64 rows: split-K, a kernel more; 1,000: neither)."""
    out = _run("""
        import json, jax, jax.numpy as jnp
        from triage_jax.models import invariant
        from triage_jax.tools import gpu_aot
        dev = gpu_aot.h200()
        w = jnp.zeros((256, 768), jnp.bfloat16)
        def gemms(c):  # the GEMM kernels' launch shapes (grid, threads, shared memory)
            return sorted({l[l.index("grid:"):].strip() for l in c.thunks.splitlines() if "gemm_fusion" in l})
        res = {}
        for m in (1, 64, 300, 1000):
            x = jnp.zeros((m, 256), jnp.bfloat16)
            dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
            exact = gpu_aot.compile_fn(lambda a, b: invariant.padded_rows(lambda r: dot(r, b), a), x, w, device=dev)
            plain = gpu_aot.compile_fn(dot, x, w, device=dev)
            res[m] = {"exact": gemms(exact), "plain_kernels": plain.thunks.count("kCustomKernel")}
        print(json.dumps(res))
    """)
    exact = {m: r["exact"] for m, r in out.items()}
    assert all(len(g) == 1 for g in exact.values()) and len({g[0] for g in exact.values()}) == 1, exact
    assert out["64"]["plain_kernels"] == 2 and out["1000"]["plain_kernels"] == 1, out  # split-K's sum at 64 rows


@pytest.mark.slow  # 57 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_the_learner_compile_tool_compiles_the_configs_learner_scanned_and_unrolled():
    """gpu_aot learner compiles the run config's learner update for a node of H200s with the layers scanned or
    unrolled, as asked: 4 unrolled layers make a program about 4 layer bodies long, the scanned one holds one."""
    out = _run("""
        import json
        from triage_jax.tools import gpu_aot
        rows = [gpu_aot.learner_step("configs/tiny.py", "w4a4", scan, devices=2, layers=4, prompt_len=16,
                                     resp_len=32) for scan in (True, False)]
        print(json.dumps(rows))
    """)
    scanned, unrolled = out
    assert (scanned["scan_layers"], unrolled["scan_layers"]) == (True, False)
    assert scanned["layers"] == unrolled["layers"] == 4 and scanned["devices"] == 2
    assert unrolled["hlo_instructions"] > 2 * scanned["hlo_instructions"], (scanned, unrolled)


@needs_plugin
def test_the_insertions_row_copy_on_an_h200_mesh_gathers_no_buffer():
    """The engine's insertion copies prompt rows of a prefill cache split over the batch devices into slots.
    XLA:GPU partitions a gather of one row of a split axis (jnp.take, dynamic_slice) as an all-gather of the whole
    buffer, in every step of the insertion's loop: on 64 H200s the 30B-A3B's insertion held every layer's whole
    prefill cache, 96 GB per device (tools/dryrun.py --target=h200). kv_cache.copy_rows fetches the row as a masked
    sum under such a mesh: each device reads its own rows, one all-reduce of a row, temporaries of a row."""
    out = _run("""
        import json
        import jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from triage_jax import sharding as shd
        from triage_jax.models import kv_cache
        from triage_jax.tools import gpu_aot

        mesh = shd.make_mesh({"fsdp": 4}, gpu_aot.h200s(4))
        rows = NamedSharding(mesh, shd.logical_to_mesh((None, "batch"), shd.DEFAULT_RULES, mesh))
        buf = jax.ShapeDtypeStruct((2, 16, 4, 256, 64), jnp.bfloat16, sharding=rows)  # combined [2, slots, ...]
        src = jax.ShapeDtypeStruct((2, 16, 4, 128, 64), jnp.bfloat16, sharding=rows)  # the prefill's rows, split
        idx = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=shd.replicated(mesh))
        with shd.activate(mesh):
            c = jax.jit(lambda b, s, sm, rm: kv_cache.copy_rows(b, s, sm, rm, lead=1), donate_argnums=0).lower(
                buf, src, idx, idx).compile()
        text = c.as_text()
        print(json.dumps({"all_gather": text.count("all-gather"), "all_reduce": text.count("all-reduce"),
                          "temp": c.memory_analysis().temp_size_in_bytes}))
    """)
    assert out["all_gather"] == 0 and out["all_reduce"] > 0, out
    assert out["temp"] < 2 * 16 * 4 * 128 * 64 * 2 // 4, out  # less than one device's share of the source


@needs_plugin
def test_the_tail_compaction_on_an_h200_mesh_keeps_its_slots_split():
    """The engine's tail compaction gathers the occupied slots into a smaller set. On a batch-split mesh XLA:GPU left
    the gathered slots replicated (every device holding the whole compacted KV cache: 19.33 GB per device for the 4B
    at 8 x 16 slots, capacity 4,096, where its share is 2.42 GB); Engine._take_program compiles it with the slots'
    own shardings, so each device holds its share of the output."""
    out = _run("""
        import json
        import jax, jax.numpy as jnp
        from triage_jax import models, sharding as shd, sampler as smp
        from triage_jax.tools import gpu_aot

        mesh = shd.make_mesh({"fsdp": 4}, gpu_aot.h200s(4))
        cfg = models.get_model_config("tiny", num_hidden_layers=2)
        engine = smp.Engine(smp.SamplingConfig(max_new_tokens=16), smp.EngineConfig(max_slots=32, max_len=256),
                            mesh=mesh)
        ab = jax.eval_shape(lambda: smp._empty_slots(cfg, 32, 256, engine.st, "bf16", jnp.bfloat16,
                                                     kv_combined=engine.kv_combined))
        ab = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), ab,
                          engine.slot_shardings(ab))
        k = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=shd.replicated(mesh))
        whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(smp._take_slots_fn, ab, k)))
        c = engine._take_program(ab, k).lower(ab, k).compile()
        print(json.dumps({"out": c.memory_analysis().output_size_in_bytes, "whole": whole}))
    """)
    assert out["out"] * 4 <= out["whole"] * 1.05, out  # a quarter of it per device (small replicated fields aside)
