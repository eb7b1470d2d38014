"""Kernels, installed as `triage_jax.kernels`: `pallas_quant` (Pallas NVFP4 / MXFP8 quantize kernels and a fused
dequantize-matmul; the `pallas` backend) and `fp4_gemm` (the Mosaic GPU 4-bit weight GEMM; the `fp4_gemm`
backend), each registering its quantization backend when imported.

This folder is never the top-level package `kernels`. Where the repository root is on sys.path (`python -m ...`
from the root, the experiments and notebooks), a plain `import kernels` finds this folder before site-packages;
the PyPI package of that name (which transformers imports) must win. Imported under that name, this file hands
the import over to the installed `kernels`, or fails as if this folder were not there (docs/architecture.md).
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _hand_over() -> None:
        here = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # The path entries that do not resolve to this repository's root (the cwd is '' on sys.path).
        rest = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
        spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
        if spec is None or spec.loader is None:
            del sys.modules["kernels"]
            raise ModuleNotFoundError(
                "No module named 'kernels' (the repository's kernels/ folder is the package triage_jax.kernels)",
                name="kernels",
            )
        module = importlib.util.module_from_spec(spec)
        # The import statement returns what sys.modules holds once this file has run: the installed package.
        sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("kernels", None)
            raise

    _hand_over()
