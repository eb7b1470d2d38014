"""Checkpoints: exact round trip, fallback past an unusable newest checkpoint (moved aside, never a trap), the
fingerprint check, atomic replacement of an existing step, a full disk, and the refusal to save NaN."""

import errno
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triage_jax import checkpoint as ckpt_lib
from triage_jax.checkpoint import (Checkpointer, CheckpointSaveError, NoUsableCheckpointError, NonFiniteStateError,
                                   abstract_like, fingerprint)


def _state(v, n=4096):
    # Random values: incompressible, so the data file holds the raw bytes (a bit flip is not a decode error).
    w = jax.random.normal(jax.random.key(v), (n,), jnp.float32)
    return {"params": {"w": w}, "step": jnp.int32(v), "key": jax.random.key_data(jax.random.key(v))}


def _meta(v):
    return {"data": {"epoch": v}, "step": v}


def _biggest_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((f for f in step_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_round_trip_and_keep(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=2)
    for s in (1, 2, 3):
        ck.save(s, _state(s), _meta(s))
    assert ck.all_steps() == [2, 3]
    step, state, meta = ck.restore(abstract_like(_state(0)))
    assert step == 3 and meta == _meta(3)  # the fingerprint field is internal
    np.testing.assert_array_equal(state["params"]["w"], _state(3)["params"]["w"])
    ck.close()


def test_empty_directory_returns_none(tmp_path):
    assert Checkpointer(str(tmp_path / "none")).restore(abstract_like(_state(0))) is None


def _truncate_data(d):
    f = _biggest_file(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _delete_meta(d):
    (d / "meta" / "metadata").unlink()


def _garbage_meta(d):
    (d / "meta" / "metadata").write_bytes(b"\x00garbage{")


def _meta_without_data(d):
    (d / "meta" / "metadata").write_text(json.dumps({"step": 2}))


def _garbage_manifest(d):
    (d / "state" / "manifest.ocdbt").write_bytes(b"garbage" * 10)


def _flip_4k(d):
    f = _biggest_file(d)
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid - 2048: mid + 2048] = bytes(x ^ 0x5A for x in b[mid - 2048: mid + 2048])
    f.write_bytes(bytes(b))


def _garbage_everywhere(d):
    for f in d.rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")


# A corrupt checkpoint fails one of orbax's concurrent array reads; the others are abandoned, and when Python
# collects them their errors surface as "exception ignored in coroutine" (timing-dependent). Expected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("corrupt", [_truncate_data, _delete_meta, _garbage_meta, _meta_without_data,
                                     _garbage_manifest, _flip_4k, _garbage_everywhere])
def test_unusable_newest_is_moved_aside_and_never_traps(tmp_path, corrupt, caplog):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root), keep=3)
    ck.save(1, _state(1), _meta(1))
    ck.save(2, _state(2), _meta(2))
    corrupt(root / "2")
    ck = Checkpointer(str(root), keep=3)  # a fresh process
    # A reader (eval, tools) skips it and touches nothing: it could be racing the live run.
    assert ck.restore(abstract_like(_state(0)), required_meta=("data", "step"))[0] == 1
    assert (root / "2").exists() and not ck.unusable()
    step, state, meta = ck.restore(abstract_like(_state(0)), required_meta=("data", "step"), owner=True)
    assert step == 1 and meta == _meta(1) and int(state["step"]) == 1
    # Moved aside (renamed, not deleted), with a warning naming it; the step no longer exists ...
    assert not (root / "2").exists() and ck.all_steps() == [1]
    aside = list(pathlib.Path(ck.unusable_dir).iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("2-")
    assert any(str(aside[0]) in r.getMessage() for r in caplog.records)
    # ... so the resumed run saves step 2 again without a StepAlreadyExistsError, and it restores.
    ck.save(2, _state(2), _meta(2))
    step, state, _ = ck.restore(abstract_like(_state(0)))
    assert step == 2
    np.testing.assert_array_equal(state["params"]["w"], _state(2)["params"]["w"])


def _orbax_restore(ck, step, like):
    return ck._mngr.restore(step, args=ckpt_lib.ocp.args.Composite(
        state=ckpt_lib.ocp.args.StandardRestore(abstract_like(like)), meta=ckpt_lib.ocp.args.JsonRestore()))


def test_bit_flip_is_caught_by_the_fingerprint(tmp_path):
    """A 4 KB flip inside a raw (incompressible) data block restores without an orbax error: only the
    fingerprint tells (before it: the flipped weights trained on, NaN some steps later)."""
    root = tmp_path / "ck"
    big = {"params": {"w": jax.random.normal(jax.random.key(1), (65536,), jnp.float32)}, "step": jnp.int32(1)}
    ck = Checkpointer(str(root))
    ck.save(1, big, _meta(1))
    f = _biggest_file(root / "1")
    orig = f.read_bytes()
    silent = None
    for off in (100, len(orig) // 2, len(orig) // 3):  # past a zstd block header: the bytes are raw data
        b = bytearray(orig)
        b[off: off + 4096] = bytes(x ^ 0x5A for x in b[off: off + 4096])
        f.write_bytes(bytes(b))
        try:
            raw = _orbax_restore(Checkpointer(str(root)), 1, big).state
        except Exception:  # noqa: BLE001 - a header hit: orbax notices by itself
            continue
        if not np.array_equal(np.asarray(raw["params"]["w"]), np.asarray(big["params"]["w"])):
            silent = off
            break
    assert silent is not None, "no silent flip found"
    with pytest.raises(NoUsableCheckpointError, match="fingerprint"):
        Checkpointer(str(root)).restore(abstract_like(big), owner=True)


def test_empty_newer_step_folder(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root))
    ck.save(1, _state(1), _meta(1))
    (root / "2").mkdir()
    ck = Checkpointer(str(root))
    assert ck.restore(abstract_like(_state(0)), owner=True)[0] == 1
    assert not (root / "2").exists() and len(ck.unusable()) == 1
    ck.save(2, _state(2), _meta(2))
    assert ck.restore(abstract_like(_state(0)))[0] == 2


def test_all_unusable_is_a_clear_error(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root))
    ck.save(1, _state(1), _meta(1))
    ck.save(2, _state(2), _meta(2))
    _garbage_everywhere(root / "1")
    _garbage_everywhere(root / "2")
    with pytest.raises(NoUsableCheckpointError, match=str(root)):
        Checkpointer(str(root)).restore(abstract_like(_state(0)), owner=True)
    assert sorted(n.split("-")[0] for n in Checkpointer(str(root)).unusable()) == ["1", "2"]


def test_saving_an_existing_step_replaces_it(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root))
    ck.save(1, _state(1), _meta(1))
    ck.save(1, _state(7), _meta(7))  # before: StepAlreadyExistsError
    step, state, meta = Checkpointer(str(root)).restore(abstract_like(_state(0)))
    assert step == 1 and meta == _meta(7)
    np.testing.assert_array_equal(state["params"]["w"], _state(7)["params"]["w"])
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging / replaced leftovers


def test_interrupted_replacement_is_completed(tmp_path):
    """A kill between the two renames of a replacement: the next start puts a complete copy back."""
    root = tmp_path / "ck"
    ck = Checkpointer(str(root))
    ck.save(1, _state(1), _meta(1))
    real_rename = os.rename

    def dying_rename(a, b):
        real_rename(a, b)
        if os.fspath(a) == str(root / "1"):
            raise KeyboardInterrupt  # "killed" right after moving the old copy out

    ck_lib_os = ckpt_lib.os
    ck_lib_os.rename = dying_rename
    try:
        with pytest.raises(KeyboardInterrupt):
            ck.save(1, _state(7), _meta(7))
    finally:
        ck_lib_os.rename = real_rename
    assert not (root / "1").exists()
    step, _, meta = Checkpointer(str(root)).restore(abstract_like(_state(0)), owner=True)
    assert step == 1 and meta == _meta(7)  # the staged copy was complete


def test_nonfinite_state_is_never_saved(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"))
    bad = _state(1)
    bad["params"]["w"] = bad["params"]["w"].at[3].set(jnp.nan)
    with pytest.raises(NonFiniteStateError):
        ck.save(1, bad, _meta(1))
    assert ck.all_steps() == []


def test_full_disk_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A writer that fails with ENOSPC mid-save: one CheckpointSaveError naming the folder and the size, and no
    temporary folder left behind."""
    import orbax.checkpoint._src.handlers.json_checkpoint_handler as jh

    root = tmp_path / "ck"
    ck = Checkpointer(str(root))
    ck.save(1, _state(1), _meta(1))
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jh.JsonCheckpointHandler, "async_save", full, raising=True)
    with pytest.raises(CheckpointSaveError, match=r"no space left on device.*needs about .*KiB") as e:
        ck.save(2, _state(2), _meta(2))
    assert str(root) in str(e.value)
    assert sorted(os.listdir(root)) == ["1"]
    monkeypatch.undo()
    ck.save(2, _state(2), _meta(2))
    assert ck.all_steps() == [1, 2]


def test_fingerprint_is_exact_and_sharding_free():
    s = _state(3)
    d1, f1 = fingerprint(s)
    d2, _ = fingerprint(jax.tree.map(np.asarray, s))
    assert d1 == d2 and f1
    t = jax.tree.map(lambda x: x, s)
    t["params"]["w"] = s["params"]["w"].at[17].set(-s["params"]["w"][17])  # one sign bit
    assert fingerprint(t)[0] != d1
