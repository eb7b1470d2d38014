"""Debug switch that reports non-finite quantizer inputs instead of letting the spec's saturation hide them.

The spec (numerics.md) makes a NaN element quantize to +6 and drops NaN from amax, like TE. That keeps runs going
but hides bugs, so `set_debug_nonfinite(True)` (or env TRIAGE_JAX_DEBUG_NONFINITE=1) makes every quantizer and
quantized dot traced afterwards count NaN/Inf in its input at run time and raise (default) or log a message naming
the op, the layer and the shape. The switch is read at trace time: re-jit after changing it.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

logger = logging.getLogger("triage_jax.quant")

_MODES = (False, "raise", "log")
_mode: str | bool | None = None  # None: not set in code, fall back to the environment variable


def set_debug_nonfinite(mode: bool | str = True) -> None:
    """Turn the non-finite check on (True or "raise": raise FloatingPointError; "log": log a warning) or off."""
    global _mode
    if mode is True:
        mode = "raise"
    if mode not in _MODES:
        raise ValueError(f"set_debug_nonfinite: mode {mode!r}; expected True, False, 'raise' or 'log'")
    _mode = mode


def debug_nonfinite_mode() -> str | bool:
    """The active mode: False, "raise" or "log" (env TRIAGE_JAX_DEBUG_NONFINITE=1|raise|log when not set in code)."""
    if _mode is not None:
        return _mode
    env = os.environ.get("TRIAGE_JAX_DEBUG_NONFINITE", "").strip().lower()
    if env in ("", "0", "false", "off"):
        return False
    return "log" if env == "log" else "raise"


def report_nonfinite(x: jax.Array, op: str, name: str = "") -> None:
    """If the switch is on, check x at run time and report NaN/Inf counts naming op, layer and shape."""
    mode = debug_nonfinite_mode()
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
