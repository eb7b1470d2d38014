"""Compile the project's Mosaic GPU kernels for an NVIDIA H200 on a machine without a GPU and read what came out:
PTX, ptxas's report (registers, spills) and the SASS.

    python -m triage_jax.tools.gpu_kernels [--only fp4_gemm|quantize] [--json PATH]

A program holding a Mosaic GPU kernel, compiled for the compile-only H200 of tools/gpu_aot.py, has XLA:GPU's
custom call run Mosaic GPU's whole pipeline during the compile (not when the program loads): MLIR to PTX through
LLVM's NVPTX backend, then ptxas for sm_90a. With MOSAIC_GPU_DUMP_TO set it writes each kernel's PTX and ptxas's
report there (`compile_kernels`). The SASS comes from this machine's ptxas and nvdisasm on that PTX
(`sass_of`; nvdisasm from PyPI's nvidia-cuda-nvdisasm, which .ci/gpu_aot_plugin.sh puts in .gpu-aot/nvdisasm).

What it checks is what a GPU would otherwise be the first to find: that each kernel lowers and assembles for
Hopper at the shapes the sampler runs, with no register spills, wgmma (HGMMA) where the kernel multiplies, and, for
the quantizers, whose bits must be IEEE's, no instruction whose result may differ from the correctly rounded one
(`sass_inexact`: a fused multiply-add, a flush to zero, an approximate special function) and no multiply feeding
an add in the PTX that a ptxas may contract into an FMA (`contractible_float_ops`; docs/numerics.md, "GPU"). The
ptxas is this machine's (CUDA 13.0 here), not necessarily the GPU machine's.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from triage_jax.tools import gpu_aot as _gpu_aot

    _gpu_aot.use_plugin()

import collections  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402

from triage_jax.tools import gpu_aot  # noqa: E402

ARCH = "sm_90a"


def ptxas_path() -> str | None:
    """This machine's ptxas (on PATH or in /usr/local/cuda/bin), which Mosaic GPU's compile also needs."""
    cuda = "/usr/local/cuda/bin/ptxas"
    return shutil.which("ptxas") or (cuda if os.access(cuda, os.X_OK) else None)


def nvdisasm_path() -> str | None:
    """nvdisasm from .ci/gpu_aot_plugin.sh's install (<plugin dir>/nvdisasm), else from PATH."""
    mine = os.path.join(gpu_aot.plugin_dir(), "nvdisasm", "nvidia", "cu13", "bin", "nvdisasm")
    return mine if os.access(mine, os.X_OK) else shutil.which("nvdisasm")


@dataclasses.dataclass
class Kernel:
    """One Mosaic GPU kernel as compiled for the H200: its PTX, ptxas's report and (with nvdisasm) its SASS."""

    name: str
    ptx: str
    registers: int
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int
    notes: list[str]  # ptxas's numbered remarks, e.g. "C7519 warpgroup.arrive is injected ..."
    sass: str | None = None


def parse_ptxas_report(text: str) -> dict:
    """ptxas -v's report of one kernel: registers, spill bytes (stores + loads), stack frame bytes, remarks."""
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    if not (regs and spill and stack):
        raise ValueError(f"not a ptxas -v report: {text[:300]!r}")
    notes = [f"{code} {msg.strip()}" for code, msg in re.findall(r"\((C\d+)\)\s*([^\n]*)", text)]
    return {"registers": int(regs.group(1)), "spill_bytes": int(spill.group(1)) + int(spill.group(2)),
            "stack_bytes": int(stack.group(1)), "notes": notes}


def sass_of(ptx: str) -> str | None:
    """The SASS of `ptx` for sm_90a: this machine's ptxas, then nvdisasm (None without either)."""
    ptxas, nvdisasm = ptxas_path(), nvdisasm_path()
    if not (ptxas and nvdisasm):
        return None
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch={ARCH}", "-O3", src, "-o", cubin], check=True, capture_output=True)
        return subprocess.run([nvdisasm, cubin], check=True, capture_output=True, text=True).stdout


def compile_kernels(compile_fn, *, sass: bool = True) -> list[Kernel]:
    """compile_fn() compiles a program for the compile-only H200 (a jax Compiled, e.g. jit(f).lower(...).compile());
    the Mosaic GPU kernels that its compile built, read from Mosaic GPU's dump. A kernel this process compiled
    before is not built again (nor dumped); with none built this raises rather than report nothing."""
    if ptxas_path() is None:
        raise RuntimeError("no ptxas on this machine: Mosaic GPU assembles its kernels with it")
    with tempfile.TemporaryDirectory() as d:
        # Mosaic GPU reads these when it builds a kernel; the process's environment is restored after.
        dump = {"MOSAIC_GPU_DUMP_TO": d, "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}
        with mock.patch.dict(os.environ, dump):
            compile_fn()
        kernels = []
        for path in sorted(glob.glob(os.path.join(d, "*.ptx"))):
            ptx = open(path).read()
            report = parse_ptxas_report(open(path[:-4] + ".ptxas").read())
            kernels.append(Kernel(name=os.path.basename(path)[:-4], ptx=ptx, **report,
                                  sass=sass_of(ptx) if sass else None))
    if not kernels:
        raise RuntimeError("the compile built no Mosaic GPU kernel (none in the program, or each built before in "
                           "this process, or a persistent-cache hit: disable jax_enable_compilation_cache)")
    return kernels


# One SASS instruction as nvdisasm prints it: /*address*/ [predicate] OPCODE.MODIFIERS operands ;
_SASS_LINE = re.compile(
    r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);", re.M)
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")
_FUSED = ("FFMA", "DFMA", "HFMA2", "HFMA", "FFMA2")
_NOT_FLOAT = ("FENCE", "FLO")  # F-opcodes that are not float arithmetic: a memory fence, find-leading-one


def sass_instructions(sass: str) -> list[tuple[str, list[str]]]:
    """(opcode with its modifiers, operands) of each SASS instruction, in order."""
    return [(op, [a.strip() for a in args.split(",") if a.strip()]) for op, args in _SASS_LINE.findall(sass)]


def sass_ops(sass: str) -> collections.Counter:
    """Opcodes (without modifiers) of the SASS, counted."""
    return collections.Counter(op.split(".")[0] for op, _ in sass_instructions(sass))


def sass_inexact(sass: str) -> dict[str, int]:
    """The SASS instructions whose float result may differ from the IEEE one of the program's own operations: fused
    multiply-adds (one rounding for two), float ops that flush subnormals (.FTZ; a truncating float-to-integer
    conversion is exempt: a subnormal truncates to 0 either way) and special-function approximations (MUFU), except
    the reciprocal estimate of ptxas's exact integer division (MUFU.RCP of an I2F.*.RP result, refined and
    corrected in integer arithmetic)."""
    bad = collections.Counter()
    writer = {}  # register -> the opcode that last wrote it
    for op, args in sass_instructions(sass):
        base = op.split(".")[0]
        if base.startswith(_FUSED):
            bad[op] += 1
        elif base == "MUFU":
            src = writer.get(args[1] if len(args) > 1 else "", "")
            if not (op == "MUFU.RCP" and src.startswith("I2F") and src.endswith(".RP")):
                bad[op] += 1
        elif ".FTZ" in op and base.startswith("F") and base not in _NOT_FLOAT:
            if not (base == "F2I" and ".TRUNC" in op):
                bad[op] += 1
        if args and re.fullmatch(r"U?R\d+", args[0]):
            writer[args[0]] = op
    return dict(bad)


def mma_loop(sass: str) -> dict | None:
    """The loop around a GEMM kernel's wgmmas (the K loop): the instructions from a backward branch's target to the
    branch that hold HGMMAs, per wgmma and per weight element each thread handles (a 64 x 16 weight tile per
    HGMMA over 128 threads: 8), and its opcodes; None without an HGMMA in a loop. A bandwidth-bound decode GEMM is
    only that while its threads issue few instructions per weight element (docs: experiments/results/
    mosaic_kernels.md)."""
    labels, lines = {}, []
    for line in sass.splitlines():
        m = _SASS_LABEL.match(line)
        if m:
            labels[m.group(1)] = len(lines)  # the index of the next instruction
            continue
        m = _SASS_LINE.match(line)
        if m:
            lines.append(m.groups())
    best = None
    for i, (op, args) in enumerate(lines):
        target = re.search(r"\((\.L_x_\d+)\)", args) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), i + 1) <= i:
            body = lines[labels[target.group(1)]:i + 1]
            ops = collections.Counter(o.split(".")[0] for o, _ in body)
            if ops["HGMMA"] and (best is None or len(body) > best["instructions"]):
                best = {"instructions": len(body), "hgmma": ops["HGMMA"],
                        "per_weight_element": round(len(body) / (8 * ops["HGMMA"]), 2),
                        "by_opcode": dict(ops.most_common())}
    return best


_PTX_DEF = re.compile(r"^\s*(?:@%?!?\w+\s+)?([a-z][a-z0-9]*(?:\.[A-Za-z0-9_:]+)*)\s+(%[\w]+)\s*,\s*([^;]*);", re.M)


def contractible_float_ops(ptx: str) -> list[str]:
    """PTX float FMAs (LLVM contracted a multiply and an add already) and float adds / subtracts without a rounding
    modifier fed by a multiply without one (through moves): the pairs a ptxas may contract into one FMA (add.rn /
    mul.rn it never contracts)."""
    from_mul = set()
    found = []
    for op, dst, args in _PTX_DEF.findall(ptx):
        parts = op.split(".")
        srcs = re.findall(r"%\w+", args)
        is_float = any(p in ("f16", "f16x2", "bf16", "bf16x2", "f32", "f64") for p in parts)
        if is_float and parts[0] in ("fma", "mad"):
            found.append(f"{op} {dst}, {args}")
        if is_float and parts[0] == "mul" and not any(p.startswith("r") and len(p) == 2 for p in parts[1:]):
            from_mul.add(dst)
            continue
        if is_float and parts[0] in ("add", "sub") and len(parts) == 2 and any(s in from_mul for s in srcs):
            found.append(f"{op} {dst}, {args}")
        if parts[0] == "mov" and any(s in from_mul for s in srcs):
            from_mul.add(dst)
        else:
            from_mul.discard(dst)
    return found


# --- the project's kernels at the shapes the sampler runs ------------------------------------------------------

# Qwen3-4B's decode GEMMs as the sampler's copy holds them (q / k / v and gate / up merged): (K, N).
GEMM_SHAPES_4B = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}


def _weight(n: int, k: int, fmt_name: str = "nvfp4", experts: int | None = None):
    import jax
    import jax.numpy as jnp

    from triage_jax.kernels import fp4_gemm
    from triage_jax.quant import formats as fmt

    quantize = fmt.quantize_nvfp4 if fmt_name == "nvfp4" else fmt.quantize_mxfp4
    prep = lambda w: fp4_gemm.prepare_weight(quantize(w))  # noqa: E731
    shape = (n, k) if experts is None else (experts, n, k)
    return jax.eval_shape(prep if experts is None else jax.vmap(prep), jax.ShapeDtypeStruct(shape, jnp.float32))


def kernels_of(fn, *args, sass: bool = True) -> list[Kernel]:
    """The Mosaic GPU kernels of jit(fn) on abstract args, compiled for the compile-only H200 as a GPU runs them."""
    import jax

    from triage_jax.kernels import mosaic

    device = gpu_aot.h200()
    placed = gpu_aot.abstract_on(args, device)

    def compile_():
        with mosaic.lowering_for_gpu():
            return jax.jit(fn).lower(*placed).compile()

    return compile_kernels(compile_, sass=sass)


def fp4_gemm_configs() -> list[tuple[str, object, tuple]]:
    """(label, fn, abstract args) of the fused 4-bit GEMM as the 4B sampler and bench_gpu run it: each merged
    projection at decode (M = 16: M = 1..16 pad to one kernel) and M = 64, 256; the registers-A variant; MXFP4;
    the per-expert form."""
    import jax
    import jax.numpy as jnp

    from triage_jax.kernels import fp4_gemm

    bf16 = lambda m, k: jax.ShapeDtypeStruct((m, k), jnp.bfloat16)  # noqa: E731
    out = []
    for proj, (k, n) in GEMM_SHAPES_4B.items():
        for m in (16, 64, 256):
            out.append((f"fp4_matmul {proj} K={k} N={n} M={m} nvfp4", fp4_gemm.fp4_matmul, (bf16(m, k), _weight(n, k))))
    k, n = GEMM_SHAPES_4B["gate_up"]
    regs = lambda x, w: fp4_gemm.fp4_matmul(x, w, a_operand="registers")  # noqa: E731
    for m in (16, 64):
        out.append((f"fp4_matmul gate_up K={k} N={n} M={m} nvfp4 a=registers", regs, (bf16(m, k), _weight(n, k))))
    out.append((f"fp4_matmul gate_up K={k} N={n} M=16 mxfp4", fp4_gemm.fp4_matmul,
                (bf16(16, k), _weight(n, k, "mxfp4"))))
    out.append(("fp4_grouped_matmul E=8 K=2048 N=768 M=64 nvfp4", fp4_gemm.fp4_grouped_matmul,
                (bf16(64, 2048), _weight(768, 2048, experts=8), jax.ShapeDtypeStruct((8,), jnp.int32))))
    return out


def quantize_configs() -> list[tuple[str, object, tuple]]:
    """(label, fn, abstract args) of each Pallas quantize kernel (kernels/pallas_quant.py; "row" scaling runs the
    "tensor" kernel with per-row scales)."""
    import jax
    import jax.numpy as jnp

    from triage_jax.kernels import pallas_quant as pk

    x = jax.ShapeDtypeStruct((96, 512), jnp.float32)
    return [("quantize_nvfp4 tensor", lambda a: pk.quantize_nvfp4(a, interpret=False), (x,)),
            ("quantize_nvfp4 tile2d", lambda a: pk.quantize_nvfp4(a, scaling="tile2d", interpret=False), (x,)),
            ("quantize_nvfp4_kn tensor", lambda a: pk.quantize_nvfp4_kn(a, interpret=False), (x,)),
            ("quantize_mxfp8", lambda a: pk.quantize_mxfp8(a, interpret=False), (x,)),
            ("quantize_mxfp8_kn", lambda a: pk.quantize_mxfp8_kn(a, interpret=False), (x,))]


def row(label: str, k: Kernel) -> dict:
    """A kernel's line of the table / JSON."""
    ops = sass_ops(k.sass) if k.sass is not None else None
    loop = mma_loop(k.sass) if k.sass is not None else None
    return {"kernel": label, "name": k.name, "registers": k.registers, "spill_bytes": k.spill_bytes,
            "stack_bytes": k.stack_bytes, "ptxas_notes": sorted({n.split()[0] for n in k.notes}),
            "hgmma": None if ops is None else ops["HGMMA"],
            "sass_instructions": None if ops is None else sum(ops.values()),
            "sass_inexact": None if k.sass is None else sass_inexact(k.sass),
            "ptx_contractible": len(contractible_float_ops(k.ptx)),
            "k_loop_instructions": None if loop is None else loop["instructions"],
            "k_loop_per_weight_element": None if loop is None else loop["per_weight_element"]}


def main(argv: list[str] | None = None) -> int:
    import argparse

    import jax

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["fp4_gemm", "quantize"], default=None)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit builds (and dumps) no kernel
    if ptxas_path() is None:
        raise SystemExit("gpu_kernels: no ptxas on this machine (Mosaic GPU assembles its kernels with it)")
    configs = ([] if args.only == "quantize" else fp4_gemm_configs()) + \
              ([] if args.only == "fp4_gemm" else quantize_configs())
    print(f"Mosaic GPU kernels compiled for an H200 ({ARCH}) on this CPU machine, jaxlib {gpu_aot._jaxlib_version()}"
          f", ptxas {ptxas_path()}, SASS {'by ' + nvdisasm_path() if nvdisasm_path() else 'not read (no nvdisasm)'}")
    print(f"{'kernel':<58} {'regs':>4} {'spill B':>7} {'HGMMA':>5} {'SASS':>5} {'inexact':>7} {'contract':>8} "
          f"{'/elt':>5} {'s':>5}  ptxas notes")
    rows = []
    for label, fn, fn_args in configs:
        t0 = time.perf_counter()
        for k in kernels_of(fn, *fn_args):
            r = {**row(label, k), "compile_s": round(time.perf_counter() - t0, 1)}
            rows.append(r)
            inexact = "-" if r["sass_inexact"] is None else sum(r["sass_inexact"].values())
            hgmma = "-" if r["hgmma"] is None else r["hgmma"]
            print(f"{label:<58} {r['registers']:>4} {r['spill_bytes']:>7} {hgmma:>5} {r['sass_instructions'] or '-':>5}"
                  f" {inexact:>7} {r['ptx_contractible']:>8} {r['k_loop_per_weight_element'] or '-':>5}"
                  f" {r['compile_s']:>5}  "
                  f"{','.join(r['ptxas_notes'])}", flush=True)
    print(json.dumps({"tool": "gpu_kernels", "jaxlib": gpu_aot._jaxlib_version(), "arch": ARCH, "kernels": rows}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
