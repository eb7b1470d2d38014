"""The CLI: `python -m triage_jax.main --config=configs/NAME.py[:variant] [--config.a.b=value ...]`.

Validates the config (unknown keys and contradictory values fail here, before any compilation), warms up or
loads the model, runs GRPO, and prints a start-vs-end summary table.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/NAME.py).",
                                          lock_config=True)
_RESUME = flags.DEFINE_bool("resume", True, "Resume from the newest checkpoint in run_dir when one exists.")
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show the full traceback of a config, data or checkpoint error "
                               "instead of its one-line message.")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors a user acts on from their message alone: printed as one `error:` line (no traceback)."""
    from triage_jax.checkpoint import CheckpointError
    from triage_jax.config import ConfigError
    from triage_jax.data.records import DataError
    from triage_jax.models.hf_io import HFCheckpointError
    from triage_jax.trainer import NonFiniteError

    return ConfigError, DataError, CheckpointError, HFCheckpointError, NonFiniteError


def print_summary(summary: dict) -> None:
    """The run's summary as a table on the console."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"triage-jax: {summary['steps']} steps (mean of first / last {summary['window']})")
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    for k, v in summary["metrics"].items():
        table.add_row(k, f"{v['start']:.4f}", f"{v['end']:.4f}")
    for k, v in summary["mean_time_s"].items():
        table.add_row(f"{k} (s/step)", "", f"{v:.3f}")
    Console().print(table)


def _startup_sigterm(signum, frame):
    """SIGTERM before the trainer exists: nothing was written yet; exit cleanly (status 0) at once."""
    print(f"signal {signum} received during start-up: nothing saved, exiting", file=sys.stderr, flush=True)
    # Not sys.exit: a handler runs wherever the main thread is, and when that is a gc callback (jax registers one)
    # the SystemExit is printed as "Exception ignored" and the run goes on to train and save. Nothing is open yet.
    os._exit(0)


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from triage_jax.config import ConfigError, validate

    c = _CONFIG.value
    if c is None:
        raise app.UsageError("pass --config=configs/NAME.py")
    try:
        validate(c)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    from triage_jax import compile_cache, distributed

    distributed.initialize()  # multi-host: before any JAX work; a no-op on one host
    compile_cache.enable(c.compile_cache)
    from triage_jax.trainer import Interrupted, Trainer

    errors = _user_errors()
    try:
        trainer = Trainer(c)
        trainer.run(resume=_RESUME.value)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # saved; the start-up handler's message would be wrong now
    except Interrupted as e:
        print(f"{e}, exiting", file=sys.stderr)
        sys.exit(0)
    except errors as e:
        if _TRACEBACK.value:
            raise
        from triage_jax.config import ConfigError as _CE
        from triage_jax.data.records import DataError

        print(f"error: {e}", file=sys.stderr)
        print("(rerun with --traceback for the full traceback)", file=sys.stderr)
        sys.exit(2 if isinstance(e, (_CE, DataError)) else 1)
    s = trainer.summary()
    if s:
        print_summary(s)
        r = s["metrics"].get("reward/mean")
        if r:
            print(f"mean reward: start {r['start']:+.3f} -> end {r['end']:+.3f}")
        print(f"run dir: {trainer.run_dir} (tensorboard: {trainer.run_dir}/tb, checkpoints: "
              f"{trainer.ckpt.directory}, summary.json)")


def check_override_keys(argv: list[str]) -> None:
    """Name an unknown `--config.a.b=value` key clearly (config_flags would fail with a bare AttributeError)."""
    from triage_jax.config import MOVED_KEYS, base_config

    base = base_config()
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        key = arg[len("--config."):].split("=", 1)[0]
        if key in MOVED_KEYS:
            sys.exit(f"error: config key {key!r} (from {arg!r}) is gone: set config.{MOVED_KEYS[key]} instead")
        node = base
        for i, part in enumerate(key.split(".")):
            if not hasattr(node, "keys") or part not in node:
                parent = ".".join(key.split(".")[:i]) or "<top level>"
                valid = sorted(node.keys()) if hasattr(node, "keys") else []
                sys.exit(f"error: unknown config key {key!r} (from {arg!r}); keys under {parent}: {valid}")
            node = node[part]


def check_config_file(argv: list[str]) -> None:
    """A missing `--config` file says so (config_flags would fail with a long OSError chain)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg[len("--config="):]
        else:
            continue
        path = path.split(":", 1)[0]  # configs/NAME.py:variant
        if not path:
            sys.exit("error: --config is empty: pass --config=configs/NAME.py")
        if not os.path.isfile(path):
            sys.exit(f"error: config file {path!r} not found (pass --config=configs/NAME.py; shipped: "
                     f"{sorted(f for f in os.listdir('configs') if f.endswith('.py')) if os.path.isdir('configs') else []})")


def run() -> None:
    # From the first line on (loading the config file imports JAX, seconds on a busy machine) until the Trainer
    # takes over the signal while it is being built.
    signal.signal(signal.SIGTERM, _startup_sigterm)
    check_config_file(sys.argv[1:])
    check_override_keys(sys.argv[1:])
    app.run(main)


if __name__ == "__main__":
    run()
