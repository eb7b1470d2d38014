"""Checkpoints: exact round trip of the run state, and fallback past a corrupt newest checkpoint."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from triage_jax.checkpoint import Checkpointer, abstract_like


def _state(v):
    return {"params": {"w": jnp.full((4, 3), v, jnp.float32)}, "step": jnp.int32(v), "key": jax.random.key_data(jax.random.key(v))}


def test_round_trip_and_keep(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=2)
    for s in (1, 2, 3):
        ck.save(s, _state(s), {"data": {"epoch": s}})
    assert ck.all_steps() == [2, 3]
    step, state, meta = ck.restore(abstract_like(_state(0)))
    assert step == 3 and meta == {"data": {"epoch": 3}}
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 3, np.float32))
    ck.close()


def test_corrupt_latest_falls_back(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=3)
    ck.save(1, _state(1), {"i": 1})
    ck.save(2, _state(2), {"i": 2})
    # Corrupt every file of the newest checkpoint.
    for f in pathlib.Path(tmp_path / "ck" / "2").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    step, state, meta = ck.restore(abstract_like(_state(0)))
    assert step == 1 and meta == {"i": 1}
    assert int(state["step"]) == 1


def test_empty_directory_returns_none(tmp_path):
    assert Checkpointer(str(tmp_path / "none")).restore(abstract_like(_state(0))) is None
