"""Dataset rows of a step's batch (pytorch/data.py) when the loader fetches ahead or a step takes several batches.

accelerate's ``DataLoaderShard`` fetches the next batch before it hands out the current one: the most
recently fetched batch is not the step's. A derived tensor's rows (``mask.float()``: matched by its first
dimension) named a row of the next batch (a NaN from dataset row 300 reported as row 302). The batch a
module call takes is now the step's; with gradient accumulation (two batches in one step) no dataset row is
named, since which batch a row belongs to is not known.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from nanguard.pytorch.data import DataHooks


def _ahead(loader):
    """Yield each batch after the next one was fetched (accelerate's DataLoaderShard)."""
    it = iter(loader)
    cur = next(it)
    for nxt in it:
        yield cur
        cur = nxt
    yield cur


def test_the_batch_a_module_call_takes_is_the_steps_not_the_one_fetched_ahead():
    ds = TensorDataset(torch.arange(40).long(), torch.randn(40, 3))
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    hooks = DataHooks()
    hooks.install()
    try:
        for ids, x in _ahead(dl):
            hooks.new_step()
            hooks.used((ids, x))   # the module call: token ids (an integer tensor) match the batch too
            want = [int(i) for i in ids]
            assert hooks.step_indices() == want
            assert hooks.rows_of(x.float() * 2) == want  # a derived tensor: the step's batch, not the next
            hooks.used({"features": x})  # model(**batch) (the Trainer): its keyword arguments
            assert hooks.step_indices() == want
    finally:
        hooks.uninstall()


def test_a_step_of_two_batches_names_no_dataset_rows():
    ds = TensorDataset(torch.randn(16, 3))
    dl = DataLoader(ds, batch_size=4)
    hooks = DataHooks()
    hooks.install()
    try:
        batches = iter(dl)
        hooks.new_step()
        hooks.used(next(batches))
        assert hooks.step_indices() == [0, 1, 2, 3]
        hooks.used(next(batches))  # a second micro-batch in the same step
        assert hooks.step_indices() is None
        hooks.new_step()
        hooks.used(next(batches))
        assert hooks.step_indices() == [8, 9, 10, 11]
    finally:
        hooks.uninstall()


def test_a_row_that_reads_finite_again_was_made_non_finite_by_the_collate_fn():
    """Speech commands: the collate_fn normalises each padded item by its length; an empty item (length 0) is
    finite in the dataset, NaN in the batch. The report said "dataset row(s) [541] of the input tensor hold
    NaN" with a fix for the source data."""
    from torch.utils.data import Dataset

    class Clips(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.ones(0 if i == 5 else 3, 2)

    def pad_collate(items):
        x = torch.nn.utils.rnn.pad_sequence(items, batch_first=True)
        n = torch.tensor([len(t) for t in items], dtype=torch.float32)
        return x / n[:, None, None]

    hooks = DataHooks()
    hooks.install()
    try:
        clips = Clips()  # (the hooks keep a weak reference to the dataset)
        batch = next(iter(DataLoader(clips, batch_size=8, collate_fn=pad_collate)))
        assert not torch.isfinite(batch).all()
        got = hooks.reread([5])
        assert got == {"rows": [5], "collate_fn": "test_a_row_that_reads_finite_again_was_made_non_finite_by_the_collate_fn.<locals>.pad_collate"}
        ds = TensorDataset(torch.tensor([[1.0], [float("nan")]]))
        next(iter(DataLoader(ds, batch_size=2)))
        assert hooks.reread([1]) is None  # the dataset's own row is NaN: not the batching's
    finally:
        hooks.uninstall()


def test_reading_the_items_again_leaves_the_random_streams_as_they_were():
    import random

    from torch.utils.data import Dataset

    class Noisy(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.rand(2) + random.random()

    hooks = DataHooks()
    hooks.install()
    try:
        ds = Noisy()
        next(iter(DataLoader(ds, batch_size=4)))
        before = (torch.get_rng_state(), random.getstate())
        assert hooks.reread([1, 2]) is not None
        assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    finally:
        hooks.uninstall()
