"""DistributedDataLoader: disjoint covering shards, deterministic shuffles, exact mid-epoch resume."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from mixprec.data import DistributedDataLoader, TokenDataset, write_token_file
from mixprec.errors import ConfigError


class _Ids(Dataset):
    """Sample i is (i, i, i) -> (i+1, ...): a batch says which samples it holds."""

    def __init__(self, n: int, t: int = 3) -> None:
        self.n, self.t = n, t

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((self.t,), i, dtype=torch.int64)
        return x, x + 1


def _ids(batches) -> list[list[int]]:
    return [b[0][:, 0].tolist() for b in batches]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_shards_are_disjoint_equal_and_cover_the_epoch(world):
    n, batch = 103, 4
    shards = [sum(_ids(DistributedDataLoader(_Ids(n), batch, rank=r, world_size=world, seed=5)), [])
              for r in range(world)]
    flat = sum(shards, [])
    assert len(flat) == len(set(flat))                                   # disjoint
    assert len(flat) == world * batch * (n // (world * batch))           # all but < world*batch samples
    assert len({len(s) for s in shards}) == 1                            # same number of steps on every rank
    assert len(DistributedDataLoader(_Ids(n), batch, rank=0, world_size=world)) == len(shards[0]) // batch

    padded = [sum(_ids(DistributedDataLoader(_Ids(n), batch, rank=r, world_size=world, drop_last=False)), [])
              for r in range(world)]
    assert set(sum(padded, [])) == set(range(n))                         # every sample seen
    assert len({len(s) for s in padded}) == 1 and len(sum(padded, [])) - n < world
    loader = DistributedDataLoader(_Ids(n), batch, rank=0, world_size=world, drop_last=False)
    assert len(loader) == len(list(iter(loader)))


def test_shuffle_is_deterministic_per_seed_and_epoch():
    def order(seed, epoch, shuffle=True):
        loader = DistributedDataLoader(_Ids(64), 8, seed=seed, shuffle=shuffle, rank=0, world_size=1)
        loader.set_epoch(epoch)
        return sum(_ids(loader), [])

    assert order(0, 0) == order(0, 0) and order(3, 2) == order(3, 2)
    assert order(0, 0) != order(0, 1) != order(0, 2)
    assert order(1, 0) != order(2, 0)
    assert sorted(order(0, 1)) == list(range(64))
    assert order(0, 0, shuffle=False) == order(9, 4, shuffle=False) == list(range(64))


def test_finished_pass_advances_epoch_and_matches_set_epoch():
    loader = DistributedDataLoader(_Ids(40), 4, seed=1, rank=0, world_size=1)
    first, second = _ids(loader), _ids(loader)
    assert loader.epoch == 2 and first != second
    ref = DistributedDataLoader(_Ids(40), 4, seed=1, rank=0, world_size=1)
    ref.set_epoch(1)
    assert _ids(ref) == second


def _reference(make, epochs):
    loader = make()
    out = []
    for _ in range(epochs):
        out += _ids(loader)
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_gives_the_exact_next_batch(tmp_path, num_workers):
    path = write_token_file(tmp_path / "a.tokens", np.arange(3000) % 1000, vocab_size=1000)

    def make():
        return DistributedDataLoader(TokenDataset(path, max_length=7), 5, num_workers=num_workers, seed=11,
                                     rank=1, world_size=2)

    per_epoch = len(make())
    ref = _reference(make, 2)
    for stop in (3, per_epoch - 1, per_epoch + 2):
        loader = make()
        seen, it = [], iter(loader)
        for _ in range(stop):
            try:
                seen.append(next(it))
            except StopIteration:  # crossing into the next epoch, as a training loop would
                it = iter(loader)
                seen.append(next(it))
        state = loader.state_dict()
        del it, loader
        resumed = make()
        resumed.load_state_dict(state)
        rest = _ids(resumed)
        if state["epoch"] == 0:
            rest += _ids(resumed)
        assert _ids(seen) + rest == ref, f"resume after {stop} batches with {num_workers} workers"


def test_state_after_the_last_batch_points_to_next_epoch():
    loader = DistributedDataLoader(_Ids(16), 4, rank=0, world_size=1)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batches_consumed"] == 0


def test_new_iteration_without_loaded_state_restarts_the_epoch():
    loader = DistributedDataLoader(_Ids(32), 4, seed=2, rank=0, world_size=1)
    it = iter(loader)
    first = next(it)
    next(it)
    assert torch.equal(next(iter(loader))[0], first[0])


def test_resume_with_different_settings_is_refused():
    state = DistributedDataLoader(_Ids(32), 4, rank=0, world_size=2).state_dict() | {"batches_consumed": 2}
    with pytest.raises(ConfigError, match=r"world_size=2 \(now 1\)"):
        DistributedDataLoader(_Ids(32), 4, rank=0, world_size=1).load_state_dict(state)
    # batch_size alone does not change the order: 8 samples consumed are one batch of 8 ...
    wider = DistributedDataLoader(_Ids(32), 8, rank=0, world_size=2)
    wider.load_state_dict(state)
    assert "batch_size 4 -> 8" in wider.resume_note
    # ... but not a whole number of batches of 3: refused with the sizes that work.
    with pytest.raises(ConfigError, match=r"batch_size=3 cannot continue.*resume with batch_size=4"):
        DistributedDataLoader(_Ids(32), 3, rank=0, world_size=2).load_state_dict(state)


def test_batches_are_int64_pairs_and_pin_memory_is_silent_without_cuda(tmp_path):
    ds = TokenDataset(write_token_file(tmp_path / "a.tokens", np.arange(600) % 256, vocab_size=256), max_length=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = DistributedDataLoader(ds, 8, pin_memory=True, rank=0, world_size=1)
        x, y = next(iter(loader))
    assert isinstance(x, torch.Tensor) and x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert loader.pin_memory == torch.cuda.is_available()


def test_rank_and_world_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = DistributedDataLoader(_Ids(30), 2)
    assert (loader.rank, loader.world_size) == (1, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError, match="rank 3 is not valid for world_size 3"):
        DistributedDataLoader(_Ids(30), 2)


def test_too_few_samples_and_bad_arguments():
    with pytest.raises(ConfigError, match="fewer than batch_size\\*world_size"):
        DistributedDataLoader(_Ids(7), 4, rank=0, world_size=2)
    assert len(DistributedDataLoader(_Ids(7), 4, rank=0, world_size=2, drop_last=False)) == 1
    with pytest.raises(ConfigError, match="batch_size must be a positive integer"):
        DistributedDataLoader(_Ids(7), 0)
    with pytest.raises(ConfigError, match="num_workers"):
        DistributedDataLoader(_Ids(7), 1, num_workers=-1)


def test_iterating_does_not_move_the_global_rng():
    loader = DistributedDataLoader(_Ids(32), 4, seed=3, rank=0, world_size=1)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for _ in range(2):
        list(loader)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


def test_resume_with_a_short_last_batch_and_drop_last_false():
    def make():
        return DistributedDataLoader(_Ids(23), 4, seed=4, drop_last=False, rank=0, world_size=2)

    ref = _ids(make())
    assert [len(b) for b in ref] == [4, 4, 4]  # shard of ceil(23 / 2) = 12 samples
    odd = DistributedDataLoader(_Ids(23), 5, seed=4, drop_last=False, rank=1, world_size=2)
    full = _ids(odd)
    assert [len(b) for b in full] == [5, 5, 2]
    loader = DistributedDataLoader(_Ids(23), 5, seed=4, drop_last=False, rank=1, world_size=2)
    it = iter(loader)
    first = [next(it)[0][:, 0].tolist() for _ in range(2)]
    resumed = DistributedDataLoader(_Ids(23), 5, seed=4, drop_last=False, rank=1, world_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert first + _ids(resumed) == full
