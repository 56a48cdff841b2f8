"""A step skipped on the device (``found_inf`` set) without a host sync (mixprec.optim.flat): what
the update is about to change is kept before it (a fixed number of ops per chunk:
:meth:`SkipMask.keep`) and put back after it where the flag is set (``torch.where``:
:meth:`SkipMask.restore`); the 8-bit codes and scales through one flat byte copy
(:class:`Bytes`). The twin's step counter lives on the host: where the flag is on a device, the
counter is stepped back later, when :meth:`SkipMask.settle` reads a host copy of the flag queued
at the step, before anything reads the counters again."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mixprec.optim.flat_chunk import Chunk

__all__ = ["Bytes", "SkipMask"]


def _queues_copy(step: Tensor, skip: Tensor) -> bool:
    """Whether stepping ``step`` (a host counter) back by the device flag ``skip`` must wait for
    the flag: then the step queues a host copy and :meth:`SkipMask.settle` reads it later."""
    return step.device != skip.device


class Bytes:
    """The bytes of a list of tensors (8-bit codes, their scales, FP32 vector moments) as views
    made once, to keep and restore them with a fixed number of ops: one foreach copy into a flat
    byte buffer, and ``torch.where`` over it."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.views = [t.view(-1).view(torch.uint8) for t in tensors]
        self.sizes = [v.numel() for v in self.views]
        self.device = tensors[0].device

    def copy(self) -> Tensor:
        """The bytes now, in a fresh flat buffer (transient: the step's lifetime)."""
        out = torch.empty(sum(self.sizes), dtype=torch.uint8, device=self.device)
        torch._foreach_copy_(list(out.split(self.sizes)), self.views)
        return out

    def restore_where(self, old: Tensor, skip: Tensor) -> None:
        """Where ``skip`` is set, the bytes ``old`` (a :meth:`copy`) back into the tensors."""
        now = self.copy()
        torch.where(skip, old, now, out=now)
        torch._foreach_copy_(self.views, list(now.split(self.sizes)))


class SkipMask:
    """Keep and restore a chunk's values, the ``twin``'s flat state and 8-bit ``moments``' bytes
    around a step skipped on the device; the host step counters it still owes (:meth:`settle`)."""

    def __init__(self, twin: torch.optim.Optimizer, moments: str | None) -> None:
        self.twin, self.moments = twin, moments
        self._pending: list[tuple[Tensor, tuple[Tensor, Tensor, Any]]] = []   # counters to step back
        self._copies: dict[int, tuple[Tensor, Tensor, Any]] = {}                # (see settle)

    def keep(self, chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]], values: bool = True) -> dict[str, Any]:
        """Copies of what the step is about to change (a masked step; fixed ops per chunk).
        ``values=False``: the fused kernel writes nothing where the flag is set, so only the 8-bit
        codes (encoded again after it) need keeping."""
        kept: dict[str, Any] = {"W": chunk.param.clone()} if values else {}
        st = self.twin.state.get(chunk.param)
        if st and not self.moments and values:
            kept.update({k: v.clone() for k, v in st.items()
                         if isinstance(v, Tensor) and v.dim() == 1 and v.numel() == chunk.numel})
        if self.moments:
            if chunk.stored is None:
                chunk.stored = Bytes(self._stored_tensors(chunk, inner_state))
            kept["bytes"] = chunk.stored.copy()
        return kept

    def restore(self, chunk: Chunk, kept: dict[str, Any], skip: Tensor) -> None:
        """Where ``skip`` is set, put back what :meth:`keep` kept and step the chunk's counter back
        (at once on a CPU; else queued for :meth:`settle`)."""
        if "W" in kept:
            torch.where(skip, kept["W"], chunk.param, out=chunk.param)
        st = self.twin.state[chunk.param]
        for k, old in kept.items():
            if k in st:
                torch.where(skip, old, st[k], out=st[k])
        if "bytes" in kept:
            assert chunk.stored is not None
            chunk.stored.restore_where(kept["bytes"], skip)
        step = st.get("step")
        if isinstance(step, Tensor):
            if _queues_copy(step, skip):               # settled before the counter is read again
                self._pending.append((step, self._host_flag(skip)))
            else:                                      # a CPU run: no copy, no wait
                step.sub_(skip.to(dtype=step.dtype))

    def _host_flag(self, skip: Tensor) -> tuple[Tensor, Tensor, Any]:
        """A host copy of the device flag ``skip``, queued without waiting (pinned memory and an
        event on CUDA), one per flag and step."""
        got = self._copies.get(id(skip))
        if got is None:
            host = torch.empty((), dtype=torch.bool, pin_memory=skip.is_cuda)
            host.copy_(skip, non_blocking=skip.is_cuda)
            event = torch.cuda.Event() if skip.is_cuda else None
            if event is not None:
                event.record()
            got = self._copies[id(skip)] = (skip, host, event)     # holds skip: its id stays unique
        return got

    def settle(self) -> None:
        """Step back the counters of chunks whose last step was skipped on an accelerator.

        torch's AdamW keeps ``step`` on the host; the flag is on the device. Stepping the counter
        back at once would copy the flag to the host and wait for it: a sync every step. So the
        masked step queues a host copy of its flag (``_host_flag``) and this reads it before
        anything reads the counters again (the owner calls it at the start of its next step and
        of ``state_dict()``). The copy was queued before the step's update, so by then it waits for
        nothing queued since (``fit()`` reads its own copy of the same flag at the same point,
        ``Trainer.conclude``)."""
        for step, (_, host, event) in self._pending:
            if event is not None:
                event.synchronize()
            if bool(host):
                step.sub_(1)
        self._pending.clear()
        self._copies.clear()

    @staticmethod
    def _stored_tensors(chunk: Chunk, inner_state: dict[Tensor, dict[str, Any]]) -> list[Tensor]:
        """Every tensor of the chunk's masters' state but the step counter: 8-bit codes, their
        scales, FP32 vector moments."""
        out = []
        for m in chunk.masters:
            for k, v in inner_state[m].items():
                if k != "step" and isinstance(v, Tensor):
                    out.append(v)
        return out
