"""Debug check that reports non-finite quantizer inputs instead of letting the spec's saturation hide them.

The spec (numerics.md) makes a NaN element quantize to +6 and drops NaN from amax, like TE. That keeps runs going
but hides bugs, so a debug mode ("raise": raise FloatingPointError; "log": log a warning) makes a quantizer or
quantized dot count NaN/Inf in its input at run time and report them naming the op, the layer and the shape.

The mode is never module state: it is an explicit value that becomes part of the compiled program's key.
- Quantized dots read `LayerPrecision.debug_nonfinite`; `PrecisionPolicy.debug_nonfinite` sets it for every layer.
  Both are fields of the hashable static arguments of the jitted functions, so a program traced under one mode is
  never reused under another.
- The quantizers (formats.quantize_nvfp4, ...) take it as their `debug=` argument.
- The environment variable TRIAGE_JAX_DEBUG_NONFINITE=1|raise|log is read once, when a PrecisionPolicy is built
  without an explicit mode (`nonfinite_mode_from_env`).
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

logger = logging.getLogger("triage_jax.quant")

NONFINITE_MODES = (False, "raise", "log")
NONFINITE_ENV = "TRIAGE_JAX_DEBUG_NONFINITE"


def check_nonfinite_mode(mode: bool | str, what: str = "debug_nonfinite") -> bool | str:
    """The canonical mode (False, "raise" or "log") of `mode`; True means "raise". Anything else is an error."""
    if mode is True:
        return "raise"
    if mode is False or mode is None:
        return False
    if mode not in NONFINITE_MODES:
        raise ValueError(f"{what}={mode!r}; expected True, False, 'raise' or 'log'")
    return mode


def nonfinite_mode_from_env() -> bool | str:
    """The mode env TRIAGE_JAX_DEBUG_NONFINITE asks for: unset/0/false/off -> False, "log" -> "log", else "raise"."""
    env = os.environ.get(NONFINITE_ENV, "").strip().lower()
    if env in ("", "0", "false", "off"):
        return False
    return "log" if env == "log" else "raise"


def report_nonfinite(x: jax.Array, op: str, name: str = "", mode: bool | str = False) -> None:
    """If `mode` is on, check x at run time and report NaN/Inf counts naming op, layer and shape."""
    mode = check_nonfinite_mode(mode)
    if not mode:
        return
    where = f"{op}" + (f" in layer {name!r}" if name else "")
    shape, dtype = tuple(x.shape), x.dtype

    def _report(n_nan, n_inf):
        if int(n_nan) or int(n_inf):
            msg = (
                f"non-finite input to {where}: {int(n_nan)} NaN and {int(n_inf)} Inf in an array of shape {shape} "
                f"({dtype}); NVFP4 saturates NaN to +6 and drops it from amax (spec), which hides this"
            )
            if mode == "raise":
                raise FloatingPointError(msg)
            logger.warning(msg)

    jax.debug.callback(_report, jnp.sum(jnp.isnan(x)), jnp.sum(jnp.isinf(x)))
