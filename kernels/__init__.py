"""Kernels, installed as `triage_jax.kernels`: `pallas_quant` (Pallas NVFP4 / MXFP8 quantize kernels and a fused
dequantize-matmul), which registers the `pallas` quantization backend when imported."""
