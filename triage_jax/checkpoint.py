"""Orbax checkpoints of the whole run state (params, optimizer, RNG, step) plus JSON metadata (data iterator).

Nothing lost, nothing poisoned:

- every save stores a fingerprint of the state in its metadata (two position-weighted 32-bit sums of every leaf's
  bits, exact and independent of the sharding) and refuses a state that is not finite;
- restoring walks back from the newest step; a checkpoint that fails to restore, lacks a required metadata field
  or whose fingerprint does not match is *unusable*: it is moved aside to `<directory>.unusable/` (renamed, never
  deleted) with a warning naming it, and the previous one is used, so nothing but the last interval is ever lost;
- when checkpoints exist but none is usable, `NoUsableCheckpointError` names the folder;
- saving a step that already exists replaces it atomically (written beside, then swapped in; an interrupted swap
  is completed on the next start), and a failed save (a full disk) raises one `CheckpointSaveError` saying what
  was needed, leaving no temporary folder behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

INTEGRITY_KEY = "_integrity"  # metadata field holding the state's fingerprint
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint problem a user can act on; the message names the folder."""


class NoUsableCheckpointError(CheckpointError):
    """Checkpoints exist under the folder but none restores (each was moved aside)."""


class CheckpointSaveError(CheckpointError):
    """A save failed (e.g. a full disk); nothing partial is left behind."""


class NonFiniteStateError(CheckpointError, FloatingPointError):
    """The state to save holds NaN or Inf: it is never written."""


# ------------------------------------------------------------------------------------------------- fingerprint
def _as_u32(x: jax.Array) -> jax.Array:
    """The bits of x as a flat uint32 vector (any dtype; 64-bit leaves give two words per element)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32).reshape(-1)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    raise TypeError(f"cannot fingerprint dtype {x.dtype}")


@jax.jit
def _leaf_sums(leaves):
    out = []
    for x in leaves:
        b = _as_u32(x)
        i = jax.lax.iota(jnp.uint32, b.shape[0])
        # Integer sums wrap mod 2^32 and are associative: exact whatever the sharding or reduction order.
        # A flipped bit k at position i moves s1 by 2^k * (2i + 1) != 0 mod 2^32: always detected.
        s1 = jnp.sum(b * (2 * i + 1), dtype=jnp.uint32)
        s2 = jnp.sum((b ^ (i * jnp.uint32(0x9E3779B1))) * (i * jnp.uint32(0x85EBCA77) | 1), dtype=jnp.uint32)
        finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
        out.append((s1, s2, finite))
    return out


def fingerprint(state: Any) -> tuple[str, bool]:
    """(hex digest, all floating leaves finite) of a pytree of arrays."""
    paths_leaves = jax.tree_util.tree_leaves_with_path(state)
    leaves = [jnp.asarray(x) for _, x in paths_leaves]
    try:
        sums = jax.device_get(_leaf_sums(leaves))
    except ValueError:  # leaves committed to different devices: one call per leaf
        sums = [jax.device_get(_leaf_sums([x]))[0] for x in leaves]
    h = hashlib.sha256()
    finite = True
    for (path, x), (s1, s2, fin) in zip(paths_leaves, sums):
        h.update(f"{jax.tree_util.keystr(path)}|{tuple(x.shape)}|{x.dtype}|{int(s1)}|{int(s2)};".encode())
        finite &= bool(fin)
    return h.hexdigest(), finite


def is_finite(state: Any) -> bool:
    return fingerprint(state)[1]


def _nbytes(state: Any) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _is_disk_full(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "no space left on device" in str(e).lower() or "disk quota exceeded" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def _stderr_kept_on_failure(log_path: str, where: dict):
    """Hold what is written to fd 2 during a save: passed through on success; on failure (orbax's writer threads
    and tensorstore's callbacks print hundreds of tracebacks for one full disk) written to `log_path` instead,
    so the one CheckpointSaveError is what the user sees."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        buf = tempfile.TemporaryFile()
        os.dup2(buf.fileno(), 2)
    except (OSError, ValueError):  # no usable fd 2 (embedded): nothing to hold
        where["log"] = "stderr"
        yield
        return
    ok = False
    try:
        yield
        ok = True
    finally:
        if not ok:
            time.sleep(0.3)  # let the writer threads' late tracebacks land in the buffer
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        buf.seek(0)
        data = buf.read()
        buf.close()
        if ok:
            os.write(2, data)
        elif data:
            fallback = os.path.join(tempfile.gettempdir(), f"triage-checkpoint-save-error-{os.getpid()}.log")
            for path in (log_path, fallback):  # the run's disk may be the full one
                try:
                    with open(path, "ab") as f:
                        f.write(data)
                    where["log"] = path
                    break
                except OSError:
                    continue
            else:
                os.write(2, data[-4000:])
                where["log"] = "stderr above"


def _is_primary() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from orbax.checkpoint import multihost

        multihost.sync_global_processes(name)


# ------------------------------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Keeps the newest `keep` checkpoints of a run under `directory` (unusable ones under `directory.unusable`)."""

    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.unusable_dir = self.directory + ".unusable"
        self._staging = self.directory + ".staging"
        self._replaced = self.directory + ".replaced"
        self.keep = keep
        self._recovered = False
        self._mngr = self._manager(self.directory, keep)

    @staticmethod
    def _manager(directory: str, keep: int | None) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        )

    # -------------------------------------------------------------------------------------------- on disk
    def _step_dir(self, step: int, root: str | None = None) -> str:
        return os.path.join(root or self.directory, str(step))

    def recover(self) -> None:
        """The writer's start-up repair (its first save or owner restore; never a reader's, which could race a
        live run): finish a replacement interrupted between its two renames; drop staging and temporary
        leftovers of a killed save."""
        if self._recovered:
            return
        self._recovered = True
        if not _is_primary():
            _sync("triage_ckpt_recover")
            return
        if os.path.isdir(self._replaced):
            for name in os.listdir(self._replaced):
                target = self._step_dir(int(name)) if name.isdigit() else None
                staged = os.path.join(self._staging, name)
                if target and not os.path.exists(target):
                    # Crashed after moving the old copy out: the staged copy is complete (orbax renames it into
                    # place only when finished), else put the old one back.
                    src = staged if os.path.isdir(staged) and self._finalized(staged) else \
                        os.path.join(self._replaced, name)
                    os.rename(src, target)
                    log.warning("checkpoint step %s: completed an interrupted replacement", name)
            shutil.rmtree(self._replaced, ignore_errors=True)
        shutil.rmtree(self._staging, ignore_errors=True)
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if _TMP_MARK in name:  # a save killed mid-write: never a checkpoint
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        _sync("triage_ckpt_recover")
        self._mngr.reload()

    @staticmethod
    def _finalized(path: str) -> bool:
        return os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")) or \
            os.path.exists(os.path.join(path, "commit_success.txt"))

    def _stray_step_dirs(self) -> list[int]:
        """Integer-named folders orbax does not list as checkpoints (an empty or half-copied step folder)."""
        if not os.path.isdir(self.directory):
            return []
        listed = set(self._mngr.all_steps())
        return sorted(int(n) for n in os.listdir(self.directory)
                      if n.isdigit() and int(n) not in listed and os.path.isdir(self._step_dir(int(n))))

    def move_aside(self, step: int, reason: str) -> str:
        """Rename the step's folder into `directory.unusable/` (never deleted); returns the new path."""
        dest = os.path.join(self.unusable_dir, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
        if _is_primary():
            os.makedirs(self.unusable_dir, exist_ok=True)
            n = 1
            while os.path.exists(dest):
                dest = os.path.join(self.unusable_dir, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{n}")
                n += 1
            os.rename(self._step_dir(step), dest)
            log.warning("checkpoint step %d under %s is unusable (%s): moved aside to %s", step, self.directory,
                        reason, dest)
        _sync("triage_ckpt_move_aside")
        self._mngr.reload()
        return dest

    def unusable(self) -> list[str]:
        """Folders moved aside so far."""
        return sorted(os.listdir(self.unusable_dir)) if os.path.isdir(self.unusable_dir) else []

    # -------------------------------------------------------------------------------------------- api
    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Save synchronously: when this returns the checkpoint is complete on disk. A step that exists is
        replaced atomically; a non-finite state raises NonFiniteStateError and writes nothing."""
        self.recover()
        digest, finite = fingerprint(state)
        if not finite:
            raise NonFiniteStateError(f"refusing to save step {step} to {self.directory}: the state holds NaN/Inf")
        meta = {**meta, INTEGRITY_KEY: {"fingerprint": digest, "finite": True}}
        for s in self._stray_step_dirs():
            if s == step:
                self.move_aside(s, "a step folder orbax does not recognize as a checkpoint")
        replace = step in self._mngr.all_steps()
        mngr = self._manager(self._staging, None) if replace else self._mngr
        held = {"log": "none"}
        try:
            with _stderr_kept_on_failure(self.directory + ".save-error.log", held):
                mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
                mngr.wait_until_finished()
        except Exception as e:
            self._cleanup_failed_save(step, replace)
            needed = _nbytes(state)
            where = self.directory if os.path.isdir(self.directory) else os.path.dirname(self.directory)
            try:
                free = f", {_human(shutil.disk_usage(where).free)} free"
            except OSError:
                free = ""
            if _is_disk_full(e):
                raise CheckpointSaveError(
                    f"saving checkpoint step {step} to {self.directory} failed: no space left on device (the state "
                    f"needs about {_human(needed)}{free}); free space or set --config.run_dir elsewhere; "
                    f"no partial checkpoint was left behind (orbax's own output: {held['log']})") from e
            raise CheckpointSaveError(f"saving checkpoint step {step} to {self.directory} failed "
                                      f"({type(e).__name__}: {str(e)[:300]}); no partial checkpoint was left "
                                      f"behind (orbax's own output: {held['log']})") from e
        finally:
            if replace:
                mngr.close()
        if replace:
            self._swap_in(step)

    def _swap_in(self, step: int) -> None:
        """Staged copy -> the step's folder: old moved out, new moved in, old deleted (see `_recover`)."""
        if _is_primary():
            os.makedirs(self._replaced, exist_ok=True)
            os.rename(self._step_dir(step), self._step_dir(step, self._replaced))
            os.rename(self._step_dir(step, self._staging), self._step_dir(step))
            shutil.rmtree(self._replaced, ignore_errors=True)
            shutil.rmtree(self._staging, ignore_errors=True)
        _sync("triage_ckpt_swap")
        self._mngr.reload()

    def _cleanup_failed_save(self, step: int, replace: bool) -> None:
        if _is_primary():
            if replace:
                shutil.rmtree(self._staging, ignore_errors=True)
            elif os.path.isdir(self.directory):
                for name in os.listdir(self.directory):
                    if name.startswith(f"{step}.") and _TMP_MARK in name:
                        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        try:
            self._mngr.reload()
        except Exception:  # noqa: BLE001 - best effort: the save error is what matters
            pass

    def read_meta(self, step: int) -> dict | None:
        """The JSON metadata saved with `step` (without its state), or None where it cannot be read."""
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception:  # noqa: BLE001 - restore() itself reports (and sets aside) what is unreadable
            return None
        return dict(meta) if isinstance(meta, dict) else None

    def restore(self, abstract_state: Any, step: int | None = None, *, required_meta: Sequence[str] = (),
                owner: bool = False) -> tuple[int, Any, dict] | None:
        """Restore `step` (default: the newest usable one), verifying its fingerprint and `required_meta` fields.

        `owner=True` (the run that writes here, resuming): first `recover`, and move unusable checkpoints aside so
        they can never trap the run; a reader (`owner=False`: eval, tools) only skips them. Returns None when
        there is no checkpoint at all; raises NoUsableCheckpointError when there are some but none is usable
        (or `step` is not)."""
        move_aside = owner
        if owner:
            self.recover()
        for s in self._stray_step_dirs():
            if move_aside:
                self.move_aside(s, "a step folder orbax does not recognize as a checkpoint")
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            return None
        problems = []
        for s in steps:
            try:
                out = self._mngr.restore(
                    s, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                               meta=ocp.args.JsonRestore()))
                meta = out.meta
                if not isinstance(meta, dict):
                    raise ValueError(f"metadata is a {type(meta).__name__}, not a JSON object")
                meta = dict(meta)
                missing = [k for k in required_meta if k not in meta]
                if missing:
                    raise ValueError(f"metadata lacks {missing}")
                integrity = meta.pop(INTEGRITY_KEY, None)
                if integrity is not None:
                    digest, _ = fingerprint(out.state)
                    if not isinstance(integrity, dict) or integrity.get("fingerprint") != digest:
                        raise ValueError("the state does not match the fingerprint saved with it (corrupt data)")
                else:
                    log.warning("checkpoint %d under %s has no fingerprint (written by an older version): "
                                "restored unverified", s, self.directory)
                return s, out.state, meta
            except Exception as e:  # corrupt, partial or foreign: set it aside and try the previous one
                reason = f"{type(e).__name__}: {str(e)[:200]}"
                problems.append(f"step {s}: {reason}")
                if move_aside and os.path.isdir(self._step_dir(s)):
                    self.move_aside(s, reason)
                else:
                    log.warning("checkpoint %d under %s failed to restore (%s)", s, self.directory, reason)
        where = f" (moved aside to {self.unusable_dir})" if move_aside else ""
        raise NoUsableCheckpointError(f"no usable checkpoint under {self.directory}: {len(problems)} unusable"
                                      f"{where}: {'; '.join(problems)}")

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def abstract_like(tree: Any) -> Any:
    """Shape/dtype/sharding skeleton of a pytree, for restoring into the same layout."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
