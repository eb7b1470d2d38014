"""Grain prompt loader: deterministic batches, exact resume from saved state, per-process sharding."""

import json

import pytest

from triage_jax.data import make_prompt_loader, shard_indices, synthetic_examples

EXAMPLES = synthetic_examples(30, seed=0, template="short")


def _uids(batch):
    return [e.uid for e in batch]


def _take(it, n):
    return [_uids(next(it)) for _ in range(n)]


def test_same_seed_same_batches_other_seed_other_order():
    a = _take(make_prompt_loader(EXAMPLES, batch_size=4, seed=3), 10)
    assert a == _take(make_prompt_loader(EXAMPLES, batch_size=4, seed=3), 10)
    assert a != _take(make_prompt_loader(EXAMPLES, batch_size=4, seed=4), 10)
    assert all(len(b) == 4 for b in a)


def test_one_epoch_visits_every_example_once_and_epochs_reshuffle():
    epochs = list(make_prompt_loader(EXAMPLES, batch_size=5, seed=1, num_epochs=2))
    assert len(epochs) == 12
    first, second = sum(map(_uids, epochs[:6]), []), sum(map(_uids, epochs[6:]), [])
    assert sorted(first) == sorted(second) == sorted(e.uid for e in EXAMPLES)
    assert first != second


def test_no_shuffle_keeps_file_order_and_remainder_is_dropped():
    batches = list(make_prompt_loader(EXAMPLES, batch_size=7, seed=0, shuffle=False, num_epochs=1))
    assert [_uids(b) for b in batches] == [[e.uid for e in EXAMPLES[i:i + 7]] for i in range(0, 28, 7)]


@pytest.mark.parametrize("skip", [0, 3, 7, 13])  # 13 batches of 4 cross the 30-example epoch boundary
def test_resume_from_saved_state_gives_identical_next_batches(skip):
    it = make_prompt_loader(EXAMPLES, batch_size=4, seed=9)
    _take(it, skip)
    state = json.loads(json.dumps(it.get_state()))  # checkpoints store it as JSON
    expected = _take(it, 12)
    resumed = make_prompt_loader(EXAMPLES, batch_size=4, seed=9)
    _take(resumed, 2)  # a resumed iterator may have moved on before set_state
    resumed.set_state(state)
    assert _take(resumed, 12) == expected


def test_shards_partition_the_data_evenly():
    n_shards = 4  # 30 examples: 2 dropped so every process sees 7
    per_shard = [sum(map(_uids, make_prompt_loader(EXAMPLES, batch_size=7, seed=2, num_epochs=1,
                                                   shard_index=k, shard_count=n_shards)), [])
                 for k in range(n_shards)]
    assert all(len(s) == 7 for s in per_shard)
    union = set().union(*per_shard)
    assert len(union) == 28 and union <= {e.uid for e in EXAMPLES}
    assert shard_indices(30, 1, 4) == range(1, 28, 4)


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="shard_index"):
        make_prompt_loader(EXAMPLES, batch_size=2, seed=0, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="batch_size"):
        make_prompt_loader(EXAMPLES, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        make_prompt_loader(EXAMPLES, batch_size=31, seed=0, num_epochs=1)
    with pytest.raises(ValueError, match="empty"):
        make_prompt_loader(EXAMPLES[:2], batch_size=1, seed=0, shard_index=0, shard_count=3)


def test_iterator_state_round_trips_through_an_orbax_checkpoint(tmp_path):
    import grain
    import orbax.checkpoint as ocp

    it = make_prompt_loader(EXAMPLES, batch_size=4, seed=5)
    _take(it, 5)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        expected = _take(it, 6)
        resumed = make_prompt_loader(EXAMPLES, batch_size=4, seed=5)
        mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
    assert _take(resumed, 6) == expected
