"""Prompt batches through grain: shard per process, shuffle (reseeded every epoch), repeat, batch.

The iterator is grain's checkpointable DatasetIterator: `get_state()` returns a small JSON-able dict and
`set_state(state)` resumes exactly, so the trainer can save it with its checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain

from triage_jax.data.records import MathExample


def shard_indices(num_examples: int, shard_index: int, shard_count: int) -> range:
    """Example indices of one process: a strided slice, with the `num_examples % shard_count` tail dropped so every
    process sees the same number of examples (and therefore the same number of batches)."""
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, "
                         f"shard_count={shard_count}")
    per_shard = num_examples // shard_count
    return range(shard_index, per_shard * shard_count, shard_count)


def make_prompt_dataset(examples: Sequence[MathExample], *, batch_size: int, seed: int, shuffle: bool = True,
                        num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                        drop_remainder: bool = True) -> grain.MapDataset:
    """The grain MapDataset behind make_prompt_loader: element k is the k-th batch (a list of MathExample)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
    n = len(examples)
    idx = shard_indices(n, shard_index, shard_count)
    if len(idx) == 0:
        raise ValueError(f"{n} examples leave shard {shard_index} of {shard_count} empty")
    if drop_remainder and num_epochs is not None and len(idx) * num_epochs < batch_size:
        raise ValueError(f"batch_size={batch_size} exceeds the {len(idx) * num_epochs} examples this shard sees "
                         f"in {num_epochs} epoch(s); every batch would be dropped")
    ds = grain.MapDataset.source(examples)[idx.start:idx.stop:idx.step]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)


def make_prompt_loader(examples: Sequence[MathExample], *, batch_size: int, seed: int, shuffle: bool = True,
                       num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                       drop_remainder: bool = True) -> grain.DatasetIterator:
    """An iterator of prompt batches (lists of `batch_size` MathExamples), deterministic under `seed`, resumable
    through `get_state()`/`set_state()`; `num_epochs=None` repeats forever (batches then span epoch ends)."""
    ds = make_prompt_dataset(examples, batch_size=batch_size, seed=seed, shuffle=shuffle, num_epochs=num_epochs,
                             shard_index=shard_index, shard_count=shard_count, drop_remainder=drop_remainder)
    # Elements are in memory: reader threads would only contend for the GIL.
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
