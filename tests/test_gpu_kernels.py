"""The Mosaic GPU kernels built for an H200 on this CPU machine (triage_jax/tools/gpu_kernels.py): the compile a GPU
would otherwise be the first to run - Mosaic GPU's pipeline to PTX and ptxas to SASS for sm_90a - and what is in
the SASS. Needs jax's CUDA PJRT plugin (`bash .ci/gpu_aot_plugin.sh`, which also brings nvdisasm) and ptxas."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from triage_jax.tools import gpu_aot, gpu_kernels

needs_compiler = pytest.mark.skipif(
    not gpu_aot.plugin_installed() or gpu_kernels.ptxas_path() is None,
    reason="needs jax's CUDA PJRT plugin (bash .ci/gpu_aot_plugin.sh) and ptxas")

# A report as Mosaic GPU's dump holds it (ptxas -v, sm_90a).
PTXAS_REPORT = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 1548 by compiler to allow use of \
registers in GMMA in function 'kernel_mosaic_gpu_kernel'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kernel_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for kernel_mosaic_gpu_kernel
    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 48 registers, used 2 barriers, 1 bytes smem
"""


def test_ptxas_report_is_read():
    r = gpu_kernels.parse_ptxas_report(PTXAS_REPORT)
    assert (r["registers"], r["spill_bytes"], r["stack_bytes"]) == (48, 28, 8)
    assert [n.split()[0] for n in r["notes"]] == ["C7519"]
    with pytest.raises(ValueError, match="not a ptxas"):
        gpu_kernels.parse_ptxas_report("ptxas fatal   : Unresolved extern function")


def test_sass_inexact_names_what_may_round_otherwise_and_passes_integer_division():
    """FFMA (two roundings become one), a flushing float op and an approximate special function are named; the
    reciprocal estimate inside ptxas's exact unsigned division (I2F.U32.RP -> MUFU.RCP, then integer corrections)
    and a truncating conversion that flushes (a subnormal truncates to 0 anyway) are not; a MUFU.RCP of a float
    that came from float arithmetic is."""
    sass = """
        /*0d60*/                   I2F.U32.RP R29, R5 ;
        /*0db0*/                   MUFU.RCP R29, R29 ;
        /*0dd0*/                   VIADD R30, R29, 0xffffffe ;
        /*0de0*/                   F2I.FTZ.U32.TRUNC.NTZ R31, R30 ;
        /*0e00*/                   FMUL R7, R5, R31 ;
        /*0e10*/                   FADD R8, R7, R6 ;
        /*0e20*/                   FMNMX.NAN R8, R8, R6, !PT ;
        /*0e30*/               @P0 FFMA R9, R7, R6, R8 ;
        /*0e40*/                   FMUL.FTZ R10, R9, R9 ;
        /*0e50*/                   MUFU.EX2 R11, R10 ;
        /*0e60*/                   MUFU.RCP R12, R8 ;
        /*0e70*/                   HGMMA.64x16x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
    """
    assert gpu_kernels.sass_inexact(sass) == {"FFMA": 1, "FMUL.FTZ": 1, "MUFU.EX2": 1, "MUFU.RCP": 1}
    ops = gpu_kernels.sass_ops(sass)
    assert (ops["HGMMA"], ops["FMUL"], ops["MUFU"], sum(ops.values())) == (1, 2, 3, 12)


def test_contractible_float_ops_follows_a_product_into_an_add():
    """A mul.f32 feeding an add / sub (directly or through a move) is what ptxas may fuse, and an fma is one
    already; rounding modifiers on either side, a product that only feeds a compare or a max, or an integer
    multiply-add are safe."""
    ptx = """
\tmul.f32 \t%f1, %f2, %f3;
\tadd.f32 \t%f4, %f1, %f5;
\tmul.f32 \t%f6, %f2, %f3;
\tmov.f32 \t%f7, %f6;
\tsub.f32 \t%f8, %f5, %f7;
\tmul.rn.f32 \t%f9, %f2, %f3;
\tadd.f32 \t%f10, %f9, %f5;
\tmul.f32 \t%f11, %f2, %f3;
\tadd.rn.f32 \t%f12, %f11, %f5;
\tmax.NaN.f32 \t%f13, %f11, %f5;
\tadd.s32 \t%r1, %r2, %r3;
\tfma.rn.f32 \t%f14, %f2, %f3, %f5;
\tmad.lo.s32 \t%r4, %r2, %r3, %r1;
"""
    found = gpu_kernels.contractible_float_ops(ptx)
    assert [f.split()[1] for f in found] == ["%f4,", "%f8,", "%f14,"], found


@needs_compiler
def test_mosaic_kernels_assemble_for_hopper_without_spills_and_the_quantizers_round_exactly():
    """Each Pallas quantize kernel and the fused 4-bit GEMM at the 4B sampler's shapes (decode, prefill, A from
    registers, MXFP4, per expert) goes through Mosaic GPU's pipeline and ptxas for sm_90a on this machine: no
    spilled register (a spill turns a bandwidth-bound kernel into a local-memory-bound one), wgmma in every GEMM's
    SASS and a decode of few instructions per weight element; no kernel has an instruction in its SASS whose
    result may differ from IEEE's, and the quantizers, whose bits are TE's on every backend, no multiply feeding an
    add that another ptxas could contract (docs/numerics.md, "GPU"). A kernel that fails to lower or assemble fails
    here, not first on a GPU."""
    code = """
        import json
        from triage_jax.tools import gpu_aot
        gpu_aot.use_plugin()
        import jax
        jax.config.update("jax_enable_compilation_cache", False)
        from triage_jax.tools import gpu_kernels as gk
        keep = {"fp4_matmul qkv K=2560 N=6144 M=16 nvfp4", "fp4_matmul down K=9728 N=2560 M=256 nvfp4",
                "fp4_matmul gate_up K=2560 N=19456 M=16 nvfp4 a=registers",
                "fp4_matmul gate_up K=2560 N=19456 M=16 mxfp4", "fp4_grouped_matmul E=8 K=2048 N=768 M=64 nvfp4"}
        configs = [c for c in gk.fp4_gemm_configs() if c[0] in keep]
        rows = [gk.row(label, k) for label, fn, args in configs + gk.quantize_configs()
                for k in gk.kernels_of(fn, *args)]
        print(json.dumps({"rows": rows, "sass": gk.nvdisasm_path() is not None}))
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=gpu_aot.ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    gemms = [x for x in rows if x["kernel"].startswith("fp4_")]
    quant = [x for x in rows if x["kernel"].startswith("quantize_")]
    assert len(gemms) == 5 and len(quant) == 5, [x["kernel"] for x in rows]
    assert all(x["spill_bytes"] == 0 and x["stack_bytes"] == 0 for x in rows), rows
    assert all(x["ptx_contractible"] == 0 for x in quant), quant
    if out["sass"]:
        assert all(x["hgmma"] > 0 for x in gemms), gemms
        # No .FTZ anywhere: the GEMM's decode needs the float32 subnormal that E2M1 code 1 is before its 2^126.
        assert all(x["sass_inexact"] == {} for x in rows), rows
        # The decode's cost per weight element in the K loop (SASS instructions per thread): 11.0 at M = 16 with
        # the bit-placing decodes and the bf16x2 scale multiply, 18.9 with the field-by-field decodes.
        decode = next(x for x in gemms if x["kernel"] == "fp4_matmul qkv K=2560 N=6144 M=16 nvfp4")
        assert decode["k_loop_per_weight_element"] < 15, decode
