"""Where a run is in its training data, for loaders that do not keep their own position.

mixprec's :class:`~mixprec.data.DistributedDataLoader` resumes mid-epoch exactly: it records
``(epoch, batches consumed)`` and, after ``load_state_dict``, its next pass leaves out the consumed
samples at the sampler, so no skipped batch is loaded. :func:`resumable` gives every other loader
the same interface (``set_epoch``, ``state_dict``, ``load_state_dict``) with the same mechanism:

* a ``torch.utils.data.DataLoader`` over a map-style dataset with the standard ``BatchSampler``
  (any ``batch_size``, with or without ``shuffle`` or a ``sampler``, any ``num_workers``): the
  position is ``(epoch, batches consumed, the sampler's generator state at the epoch's start)``.
  A shuffling sampler without a generator (``DataLoader(shuffle=True)``) would draw its order from
  the global RNG, which a resumed run cannot rewind; it gets a private generator seeded from the
  run's ``seed`` (so the order is reproducible, and drawing it leaves the training RNG alone). On
  resume the generator is put back to the epoch's start and the first ``consumed * batch_size``
  indices are dropped inside the batch sampler: the same order, continued from the next batch,
  nothing loaded for the skipped ones. A sampler with ``set_epoch`` (``DistributedSampler``) is
  told the epoch each pass.
* a list or tuple of batches: the position is the index of the next batch.
* anything else (a generator, an ``IterableDataset``, a custom batch sampler): the position cannot
  be restored. :attr:`Positioned.exact` is False and :attr:`Positioned.why` says why; ``fit()``
  says so at the start and at resume (the resumed run starts the epoch from its first batch, so
  its data order differs) and records it in ``events.jsonl`` and the checkpoint.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from mixprec.errors import ConfigError

__all__ = ["resumable", "Positioned"]


class _SkipStart:
    """Wraps a sampler: the next pass leaves out its first ``skip`` indices (then skips none)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        it = iter(self.sampler)
        for _ in range(skip):                  # indices only: nothing is loaded
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.sampler)


class Positioned:
    """A loader with a position: ``set_epoch``, ``state_dict``, ``load_state_dict`` (module doc)."""

    def __init__(self, loader: Any, *, seed: int = 0) -> None:
        self.loader = loader
        self.epoch = 0
        self._consumed = 0          # batches of the current epoch handed out
        self._resume = False        # the next pass continues from _consumed
        self._generator: torch.Generator | None = None
        self._epoch_state: torch.Tensor | None = None   # the generator at the epoch's start
        self._skipper: _SkipStart | None = None
        self.kind, self.exact, self.why = self._classify(loader, seed)

    def _classify(self, loader: Any, seed: int) -> tuple[str, bool, str]:
        name = type(loader).__name__
        if isinstance(loader, (list, tuple)):
            return "sequence", True, ""
        if not isinstance(loader, DataLoader):
            return name, False, f"the training data is a {name}, whose position mixprec cannot restore"
        if isinstance(loader.dataset, IterableDataset):
            return "DataLoader", False, ("the training data is a DataLoader over an IterableDataset, "
                                         "whose position mixprec cannot restore")
        batches = loader.batch_sampler
        if type(batches) is not BatchSampler:
            what = type(batches).__name__ if batches is not None else "batch_size=None"
            return "DataLoader", False, (f"the DataLoader's batches come from {what}, whose position "
                                         "mixprec cannot restore")
        sampler = batches.sampler
        if isinstance(sampler, _SkipStart):     # fit() was called with this loader before
            self._skipper, sampler = sampler, sampler.sampler
        else:
            self._skipper = _SkipStart(sampler)
            batches.sampler = self._skipper
        if hasattr(sampler, "generator"):       # RandomSampler, SubsetRandomSampler, Weighted...
            if sampler.generator is None:
                sampler.generator = torch.Generator().manual_seed(seed)
            self._generator = sampler.generator
        elif not (isinstance(sampler, SequentialSampler) or hasattr(sampler, "set_epoch")):
            return "DataLoader", False, (f"the DataLoader's sampler {type(sampler).__name__} draws its "
                                         "order in a way mixprec cannot replay")
        return "DataLoader", True, ""

    def notice(self, *, resumed_at: int | None = None) -> str | None:
        """What ``fit()`` says about a position it cannot restore (None when it can)."""
        if self.exact:
            return None
        if resumed_at is None:
            return (f"{self.why}: a resumed run starts its epoch again from the first batch, in "
                    "another data order than an uninterrupted run; for exact resume pass a torch "
                    "DataLoader over a map-style dataset, a list of batches, or "
                    "mixprec.data.DistributedDataLoader")
        return (f"resumed at step {resumed_at}, but {self.why}: epoch {self.epoch} starts again "
                "from its first batch, so the data order differs from an uninterrupted run")

    @property
    def batch_size(self) -> int:
        return self.loader.batch_sampler.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """The next pass is epoch ``epoch``, from its first batch."""
        self.epoch, self._consumed, self._resume = int(epoch), 0, False
        sampler = self._skipper.sampler if self._skipper is not None else None
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        if not self._resume:
            self._consumed = 0
            if self._generator is not None:
                self._epoch_state = self._generator.get_state()
        elif self._generator is not None and self._epoch_state is not None:
            self._generator.set_state(self._epoch_state)      # replay the epoch's order
        self._resume = False
        if self.kind == "sequence":
            source: Any = self.loader[self._consumed:]
        else:
            if self._skipper is not None and self.exact:
                self._skipper.skip = self._consumed * self.batch_size
            source = self.loader
            if not self.exact:
                self._consumed = 0       # the pass starts at the first batch whatever was saved
        # A DataLoader draws its workers' base seed from the global RNG when its iterator is made,
        # which happens here, at the first batch: keep the training RNG (dropout) out of it.
        with torch.random.fork_rng(devices=[]):
            it = iter(source)
        for batch in it:
            self._consumed += 1
            yield batch
        self.epoch += 1
        self._consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the batches consumed in it, and what is needed to replay its order."""
        state: dict[str, Any] = {"kind": self.kind, "exact": self.exact, "epoch": self.epoch,
                                 "batches_consumed": self._consumed}
        if not self.exact:
            state["why"] = self.why
            return state
        if self._generator is not None and self._epoch_state is not None:
            state["generator_state"] = self._epoch_state.clone()
        if self.kind == "DataLoader":
            state["batch_size"] = self.batch_size
            state["num_samples"] = len(self.loader.dataset)  # type: ignore[arg-type]
        else:
            state["num_batches"] = len(self.loader)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` on the next pass (same loader settings, or one line)."""
        if state.get("kind") != self.kind:
            raise ConfigError(f"the checkpoint's data position is that of a {state.get('kind', 'mixprec loader')}, "
                              f"this run's training data is a {self.kind}; resume with the same data loader")
        self.epoch = int(state["epoch"])
        if not self.exact or not state.get("exact", False):
            self._consumed, self._resume = 0, False   # fit() has said the order will differ
            return
        consumed = int(state.get("batches_consumed", 0))
        mine = self.state_dict()
        diff = [f"{k}={state.get(k)!r} (now {mine[k]!r})" for k in ("batch_size", "num_samples", "num_batches")
                if k in mine and state.get(k) != mine[k]]
        if diff and consumed:
            raise ConfigError("cannot resume the training data mid-epoch: it was saved with "
                              f"{', '.join(diff)}; use the same data and batch size")
        if "generator_state" in state and self._generator is not None:
            self._epoch_state = state["generator_state"].clone()
        self._consumed, self._resume = consumed, True
        sampler = self._skipper.sampler if self._skipper is not None else None
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)


def resumable(loader: Any, *, seed: int = 0) -> Any:
    """``loader`` itself when it keeps its own position (``state_dict`` / ``load_state_dict``:
    mixprec's loaders), else a :class:`Positioned` view of it (module docstring)."""
    if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
        return loader
    return Positioned(loader, seed=seed)
