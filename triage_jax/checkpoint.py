"""Orbax checkpoints of the whole run state (params, optimizer, RNG, step) plus JSON metadata (data iterator).

Restoring walks back from the newest step: a checkpoint that fails to restore (a crash mid-write, a corrupt
file) is reported and the previous one is used, so nothing but the last interval is ever lost.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    """Keeps the newest `keep` checkpoints of a run under `directory`."""

    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        )

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Save synchronously: when this returns the checkpoint is complete on disk."""
        self._mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._mngr.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[int, Any, dict] | None:
        """Restore `step` (default: the newest that restores cleanly); None when there is no usable checkpoint."""
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        for s in steps:
            try:
                out = self._mngr.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                return s, out.state, dict(out.meta)
            except Exception as e:  # a corrupt or partial checkpoint: fall back to the previous one
                log.warning("checkpoint %d under %s failed to restore (%s: %s); trying an older one",
                            s, self.directory, type(e).__name__, str(e)[:200])
        return None

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree: Any) -> Any:
    """Shape/dtype/sharding skeleton of a pytree, for restoring into the same layout."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
