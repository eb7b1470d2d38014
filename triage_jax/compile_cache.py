"""The persistent XLA compilation cache, on by default for the trainer and the tools: a second process loads the
programs an earlier one compiled (the learner's update, the engine's prefill and decode rounds) instead of
compiling them again.

Where: `config.compile_cache` ("auto": $JAX_COMPILATION_CACHE_DIR when set, else $XDG_CACHE_HOME/triage_jax/xla,
~/.cache/triage_jax/xla by default; "" turns it off; any other value is the folder). Every program is cached
(no minimum compile time): on a CPU most of ours compile in under JAX's default threshold of 1 s, yet together
they are most of a short run's start-up. JAX keys each entry by the program, the backend and the compile
options, so one folder serves every config, device and version side by side.
"""

from __future__ import annotations

import os

ENV = "JAX_COMPILATION_CACHE_DIR"


def default_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR, else the per-user cache folder."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "triage_jax", "xla")


def enable(setting: str = "auto") -> str | None:
    """Turn JAX's persistent compilation cache on as `setting` says (see the module docstring); returns the folder,
    or None when it is off. Call it before the first compilation."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    if setting == "":
        return None
    path = default_dir() if setting == "auto" else os.path.abspath(os.path.expanduser(setting))
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        cc.reset_cache()  # JAX opens its cache once per process: forget a folder opened before
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
