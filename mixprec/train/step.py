"""What the training loop passes around: a batch (grouped into the micro-batches of a step), what
one optimizer step produced, and a step whose outcome the host has not read yet."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.precision import StepTaken

__all__ = ["Batch", "micro_batch_groups", "StepOutput", "PendingStep"]

Batch = Any
"""What a loader yields: ``(inputs, targets)`` (mixprec's token loaders: both ``int64`` of shape
``(B, T)``, the targets already shifted by one token), a dict with ``labels``, or an object with
``.to()``; :mod:`mixprec.models.objective` turns it into a loss."""


def micro_batch_groups(loader: Any, k: int, *, epoch: int,
                       resumed: bool) -> Iterator[tuple[int, list[Batch]]]:
    """Endless ``(epoch, group of k micro-batches)``, advancing epochs as needed from ``epoch``;
    ``resumed``: the loader was restored and already knows its epoch and position."""
    while True:
        if hasattr(loader, "set_epoch") and not resumed:
            loader.set_epoch(epoch)
        resumed = False
        with torch.random.fork_rng(devices=[]):  # iterator creation must not shift the RNG
            it = iter(loader)
        group: list[Batch] = []
        for batch in it:
            group.append(batch)
            if len(group) == k:
                yield epoch, group
                group = []
        epoch += 1


class StepOutput:
    """What one optimizer step produced. Tensors stay on the device (no host sync), and so may
    the step's outcome: ``skipped`` is read when asked (``taken``: what ``Precision.step``
    returned, a ``bool`` or a :class:`~mixprec.precision.StepTaken`), once."""

    __slots__ = ("loss", "grad_norm", "scale_before", "tokens", "lr", "_skipped", "_taken")

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, skipped: bool | None,
                 scale_before: float, tokens: torch.Tensor | int | None, lr: Any = None, *,
                 taken: bool | StepTaken | None = None) -> None:
        if (skipped is None) == (taken is None):
            raise TypeError("StepOutput takes skipped= or taken= (what Precision.step returned), "
                            "one of them")
        self.loss = loss                  # mean loss over the micro-batches, fp32 scalar
        self.grad_norm = grad_norm        # unscaled global gradient norm (None when not computed)
        self.scale_before = scale_before  # loss scale used for this step
        self.tokens = tokens              # real (non-padding) tokens on this rank; None: not tokens
        self.lr = lr                      # the learning rate this step ran at (the first group's)
        self._skipped = skipped
        self._taken = taken

    @property
    def skipped(self) -> bool:
        """The optimizer step was skipped (non-finite gradients); a host read the first time it
        is asked for when the step was skipped (or not) on the device."""
        if self._skipped is None:
            self._skipped = not self._taken
        return self._skipped

    @property
    def known(self) -> bool:
        """Whether ``skipped`` is on the host already (asking for it costs no read)."""
        return self._skipped is not None or not isinstance(self._taken, StepTaken) or self._taken.known

    def __repr__(self) -> str:
        skipped = self.skipped if self.known else "<on the device>"
        return (f"StepOutput(loss={self.loss!r}, grad_norm={self.grad_norm!r}, skipped={skipped}, "
                f"scale_before={self.scale_before!r}, tokens={self.tokens!r}, lr={self.lr!r})")


@dataclass
class PendingStep:
    """A step whose outcome the host has not read yet: what :meth:`Trainer.conclude` needs to
    finish it (advance the LR schedule if it was taken; in ``fit()``, its health, the trace of a
    skip and the hooks' ``after_step``)."""

    step: int                 # its number (1-based)
    out: StepOutput
    batches: list[Batch]      # its micro-batches (the trace of a skip replays them)
    rng: Any                  # the RNG state before it (the trace replays the same dropout masks)
