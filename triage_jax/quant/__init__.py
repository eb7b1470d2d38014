"""Low-precision core: NVFP4/MXFP4/MXFP8/FP8 formats, precision policies, the one quantized dot, backends."""

from triage_jax.quant.backends import (
    BackendUnavailableError,
    BackendUnsupportedError,
    available_backends,
    get_backend,
    register_backend,
    resolve_backend,
)
from triage_jax.quant.debug import nonfinite_mode_from_env
from triage_jax.quant.formats import (
    FP8Tensor,
    MXFP4Tensor,
    MXFP8Tensor,
    NVFP4Tensor,
    e2m1_codes,
    hadamard16,
    pack_fp4,
    quantize_fp8,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    rht16,
    unpack_fp4,
)
from triage_jax.quant.policy import PRESETS, LayerPrecision, PrecisionPolicy
from triage_jax.quant.qdot import QuantizedWeight, concat_prequantized, prequantize, qdot, qragged_dot

__all__ = [
    "BackendUnavailableError", "BackendUnsupportedError", "available_backends", "get_backend", "register_backend",
    "resolve_backend", "nonfinite_mode_from_env",
    "FP8Tensor", "MXFP4Tensor", "MXFP8Tensor", "NVFP4Tensor", "e2m1_codes", "hadamard16", "pack_fp4", "quantize_fp8",
    "quantize_mxfp4", "quantize_mxfp8", "quantize_nvfp4", "rht16", "unpack_fp4", "PRESETS", "LayerPrecision", "PrecisionPolicy",
    "QuantizedWeight", "concat_prequantized", "prequantize", "qdot", "qragged_dot",
]
