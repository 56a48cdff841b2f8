"""DistributedDataLoader: a torch DataLoader that shards by rank and resumes mid-epoch exactly.

**Sharding.** Each epoch the sample indices ``0..N-1`` are permuted with a ``torch.Generator``
seeded by ``seed + epoch`` (the identity order when ``shuffle=False``); every rank computes the same
permutation and takes every ``world_size``-th entry starting at its rank. So ranks see disjoint
samples, and together they cover the epoch:

* ``drop_last=True`` (default): the permutation is cut to ``world_size * batch_size *
  (N // (world_size * batch_size))`` samples, so every rank runs the same number of full batches
  (ranks that run different step counts deadlock in their collectives). At most
  ``world_size * batch_size - 1`` samples per epoch are left out, and a different set each epoch.
* ``drop_last=False``: the permutation is padded with its own first entries up to a multiple of
  ``world_size``, so all samples are seen and every rank has the same number of batches; the last
  batch may be short, and up to ``world_size - 1`` samples appear twice.

**Epochs.** Finishing a pass advances the epoch by one, so the next pass is reshuffled even if
``set_epoch`` is never called; ``set_epoch(e)`` sets it explicitly (as with ``DistributedSampler``).

**Resume.** The loader counts batches handed to the caller (not batches prefetched by workers).
``state_dict()`` records ``(epoch, batches consumed)``; after ``load_state_dict()`` the next
``iter()`` starts by skipping exactly that many batches of this rank's shard, so the next batch is
the one an uninterrupted run would have seen, with or without workers. Without a loaded state a
new ``iter()`` starts the current epoch from its first batch.

Iterating never draws from the global torch RNG, so a resumed run's dropout masks and other
random draws match an uninterrupted run's.

Rank and world size come from ``torch.distributed`` when it is initialised, else from the
``RANK`` / ``WORLD_SIZE`` environment variables set by ``torchrun``, else 0 and 1.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from mixprec.errors import ConfigError

__all__ = ["DistributedDataLoader", "resolve_rank_world"]


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` from the arguments, else torch.distributed, else env vars, else (0, 1)."""
    if rank is None or world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            found = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        rank = found[0] if rank is None else rank
        world_size = found[1] if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not valid for world_size {world_size}; check RANK and WORLD_SIZE")
    return rank, world_size


class _ShardSampler(Sampler[int]):
    """This rank's sample indices for one epoch, starting after ``skip`` already-consumed samples."""

    def __init__(self, num_samples: int, *, rank: int, world_size: int, batch_size: int, shuffle: bool,
                 seed: int, drop_last: bool) -> None:
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.epoch = 0
        self.skip = 0  # samples of this rank's shard to leave out at the start of the next pass

    @property
    def shard_size(self) -> int:
        if self.drop_last:
            return self.num_samples // (self.world_size * self.batch_size) * self.batch_size
        return -(-self.num_samples // self.world_size)

    def shard(self) -> list[int]:
        """This rank's full list of indices for the current epoch."""
        n = self.num_samples
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=gen)
        else:
            order = torch.arange(n)
        total = self.shard_size * self.world_size
        if total > n:  # drop_last=False: pad with the first entries, repeated as needed
            order = torch.cat([order, order.repeat(-(-(total - n) // n))[: total - n]])
        return order[self.rank:total:self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.skip:])

    def __len__(self) -> int:
        return self.shard_size - self.skip


def _stack_pairs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = zip(*samples)
    return torch.stack(inputs), torch.stack(targets)  # (B, T), (B, T)


def _carry_position(diff: dict[str, tuple[Any, Any]], consumed: int, epoch: int
                    ) -> tuple[int, int, str | None]:
    """``(batches consumed, epoch, note)`` where a mid-epoch position saved with other loader
    settings (``diff``: name -> (saved, now)) continues, or a one-line refusal with a fix that works.

    * ``batch_size`` alone: the epoch's sample order does not depend on it, so the position
      carries over exactly when the samples consumed are a whole number of new batches;
    * ``num_samples`` (``seq_len`` or the data changed; ``batch_size`` may change with it): the
      saved epoch's order means nothing for the new samples, so training goes on from the start
      of the next epoch, and says so;
    * ``seed``, ``shuffle``, ``world_size``, ``drop_last``: refused (the order itself differs).
    """
    if not diff:
        return consumed, epoch, None
    fixed = [f"{k}={old!r} (now {new!r})" for k, (old, new) in diff.items()
             if k not in ("batch_size", "num_samples")]
    if fixed:
        raise ConfigError("cannot resume the data loader mid-epoch: it was saved with "
                          f"{', '.join(fixed)}, which change the order of the samples; use the "
                          "settings it was saved with")
    if "num_samples" in diff:
        old, new = diff["num_samples"]
        return 0, epoch + 1, (f"the data gives {new} samples now, {old} when saved (seq_len or the "
                              f"data changed): the saved position means nothing for them, so training "
                              f"goes on from the start of epoch {epoch + 1}")
    old_bs, new_bs = diff["batch_size"]
    samples = consumed * old_bs
    if samples % new_bs:
        fits = [b for b in range(2, min(samples, 64) + 1) if samples % b == 0 and b != old_bs][:4]
        raise ConfigError(
            f"batch_size={new_bs} cannot continue this epoch exactly: {samples} samples of it were "
            f"consumed ({consumed} batches of {old_bs}), not a whole number of batches of {new_bs}; "
            f"resume with batch_size={old_bs}" + (f" or one that divides {samples} "
                                                  f"({', '.join(map(str, fits))})" if fits else ""))
    return samples // new_bs, epoch, (f"batch_size {old_bs} -> {new_bs}: the data position carries "
                                      f"over exactly (sample {samples} of epoch {epoch})")


class DistributedDataLoader:
    """Batches of ``(inputs, targets)`` (``int64``, ``(B, T)``), sharded by rank, resumable.

    Args:
        dataset: a map-style dataset whose items are ``(inputs, targets)`` pairs, e.g. a
            :class:`~mixprec.data.TokenDataset`.
        batch_size: samples per batch on each rank.
        num_workers: worker processes for loading (0: load in the main process). Workers are kept
            alive across epochs.
        pin_memory: page-lock batches for faster host-to-GPU copies; ignored without CUDA.
        shuffle: permute samples each epoch (deterministically from ``seed`` and the epoch).
        seed: base seed of the permutation; must be the same on every rank.
        drop_last: cut the epoch to whole batches on every rank (see the module docs).
        rank, world_size: override what torch.distributed / the environment say.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_workers: int = 0, pin_memory: bool = False,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        if not isinstance(dataset, Sized):
            raise ConfigError("DistributedDataLoader needs a map-style dataset with __len__ and __getitem__")
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        n = len(dataset)
        if drop_last and n < batch_size * self.world_size:
            raise ConfigError(f"the dataset has {n} samples, fewer than batch_size*world_size = "
                              f"{batch_size}*{self.world_size}; lower batch_size or pass drop_last=False")
        if n == 0:
            raise ConfigError("the dataset is empty; nothing to load")
        self.sampler = _ShardSampler(n, rank=self.rank, world_size=self.world_size, batch_size=batch_size,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._batch_sampler = BatchSampler(self.sampler, batch_size, drop_last=drop_last)
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())
        self._loader = DataLoader(dataset, batch_sampler=self._batch_sampler, num_workers=num_workers,
                                  collate_fn=_stack_pairs, pin_memory=self.pin_memory,
                                  persistent_workers=num_workers > 0, generator=self._private_generator(seed))
        self._consumed = 0       # batches of the current epoch handed to the caller
        self.resume_note: str | None = None
        """What the last load_state_dict() changed about the saved position (None: nothing)."""
        self._resume = False     # next iter() continues from _consumed instead of batch 0

    @staticmethod
    def _private_generator(seed: int) -> torch.Generator:
        # torch's DataLoader draws a worker base seed from its generator at every iter(); with the
        # default (global) generator that would shift the training RNG (dropout, ...) depending on
        # where a run was resumed. Samples never use this seed: the order comes from _ShardSampler.
        gen = torch.Generator()
        gen.manual_seed(seed)
        return gen

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next pass uses (starting at its first batch)."""
        self.sampler.epoch = int(epoch)
        self._consumed, self._resume = 0, False

    def __len__(self) -> int:
        """Batches per full epoch on this rank."""
        size = self.sampler.shard_size
        return size // self.batch_size if self._batch_sampler.drop_last else -(-size // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self._resume:
            self._consumed = 0
        self._resume = False
        self.sampler.skip = self._consumed * self.batch_size
        for inputs, targets in self._loader:  # pin_memory turns the pair into a list; hand out a tuple
            self._consumed += 1
            yield inputs, targets
        self.sampler.epoch += 1  # a finished pass moves to the next permutation
        self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and the number of batches consumed in it."""
        s = self.sampler
        epoch, consumed = s.epoch, self._consumed
        if consumed >= len(self):  # the last batch was taken: the next one is the next epoch's first
            epoch, consumed = epoch + 1, 0
        return {"epoch": epoch, "batches_consumed": consumed, "seed": s.seed, "shuffle": s.shuffle,
                "batch_size": self.batch_size, "world_size": self.world_size, "num_samples": s.num_samples,
                "drop_last": s.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next ``iter()``; the loader settings must match the saved ones."""
        s = self.sampler
        mine = {"seed": s.seed, "shuffle": s.shuffle, "batch_size": self.batch_size,
                "world_size": self.world_size, "num_samples": s.num_samples, "drop_last": s.drop_last}
        self.resume_note = None
        consumed = int(state.get("batches_consumed", 0))
        epoch = int(state["epoch"])
        if consumed:
            diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
            consumed, epoch, self.resume_note = _carry_position(diff, consumed, epoch)
        if consumed > len(self):
            raise ConfigError(f"loader state says {consumed} batches were consumed but an epoch has {len(self)}")
        s.epoch = epoch
        self._consumed, self._resume = consumed, True
