"""The lazy host reads of :class:`mixprec.amp.GradScaler`: the queue of non-finite flags left on
the device, their copies to host memory, and the replay of the host's scale transition over them
once they are read.

An optimizer that skips on the device leaves its flag there; ``update()`` queues the iteration's
flags (:class:`FlagQueue`) and moves the scale on the device (:mod:`mixprec.amp.device_scale`).
When the host state is asked for, every queued flag is read in one read (:meth:`FlagQueue.read`:
from its host copy where one was issued, :class:`_HostCopy`) and :func:`replay` runs the pure
transition (:func:`mixprec.amp.loss_scale.transition`) over them: the host then holds exactly what
eager reads would have given."""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from mixprec.amp import scaler_state
from mixprec.amp.device_scale import ScaleTensors
from mixprec.amp.iteration import Counters, Iteration, _OptState
from mixprec.amp.loss_scale import DynamicLossScaler
from mixprec.errors import CheckpointError, ConfigError, NumericsError

__all__ = ["FlagQueue", "replay", "LazyHost"]

Entry = tuple[Tensor | bool, bool, bool]
"""One optimizer of a queued iteration: its flag (a 0-dim device tensor, or a bool the host read
already), whether it stepped, whether its skip is counted already."""


class _HostCopy:
    """A flag's copy to host memory, issued (non-blocking, pinned on CUDA) right when the flag is
    final and *before* the optimizer update is queued; reading it waits for that copy only
    (a CUDA event), not for the update behind it: no pipeline drain."""

    __slots__ = ("flag", "host", "event")

    def __init__(self, flag: Tensor) -> None:
        self.flag, self.event = flag, None
        if flag.device.type == "cuda":
            self.host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flag.to("cpu", copy=True)

    def ready(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def _read_host_copies(copies: list[_HostCopy]) -> list[float]:
    """The values of host copies (waiting for each copy's event: no device sync)."""
    return torch.stack([c.ready().float() for c in copies]).tolist()


def _read_flags(flags: list[Tensor], copies: dict[int, _HostCopy] | None = None) -> list[float]:
    """All ``flags`` (0-dim tensors, any devices) in one host read per device; a flag with a host
    copy in ``copies`` (by ``id``) is read from it (no device sync)."""
    if not flags:
        return []
    copies = copies or {}
    by_dev: dict[torch.device | str, list[int]] = {}
    for i, f in enumerate(flags):
        c = copies.get(id(f))
        by_dev.setdefault("host" if c is not None and c.flag is f else f.device, []).append(i)
    out = [0.0] * len(flags)
    host = by_dev.pop("host", None)
    if host:
        for i, v in zip(host, _read_host_copies([copies[id(flags[i])] for i in host])):
            out[i] = v
    for dev, idx in by_dev.items():
        for i, v in zip(idx, torch.stack([flags[i].float() for i in idx]).tolist()):
            out[i] = v
    return out


class FlagQueue:
    """Iterations whose flags the host has not read yet, the flags' host copies, and the
    ``StepTaken`` outcomes to tell when they are read."""

    def __init__(self) -> None:
        self.iterations: list[list[Entry]] = []
        self._copies: dict[int, _HostCopy] = {}           # id(flag) -> its copy on the host
        self._waiting: list[tuple[Tensor, Any]] = []      # (flag, weakref to a StepTaken)

    def __len__(self) -> int:
        return len(self.iterations)

    def copy(self, flag: Tensor) -> None:
        """Issue ``flag``'s copy to the host now (once), before the update behind it is queued."""
        if id(flag) not in self._copies:
            self._copies[id(flag)] = _HostCopy(flag)

    def push(self, entries: list[Entry]) -> None:
        self.iterations.append(entries)

    def forget_copies(self) -> None:
        """The flags were read eagerly: their host copies are not needed."""
        self._copies.clear()

    def tell_when_read(self, flag: Tensor, taken: Any) -> None:
        """Set ``taken._value`` (not skipped) when :meth:`read` reads ``flag``."""
        self._waiting.append((flag, weakref.ref(taken)))

    def read(self, open_flags: list[Tensor]) -> tuple[list[list[Entry]], list[float], list[float]]:
        """Empty the queue: its iterations, the values of their device flags (in order) and the
        values of ``open_flags`` (the iteration still open), all in one host read."""
        pending, self.iterations = self.iterations, []
        tensors = [f for it in pending for f, _, _ in it if isinstance(f, Tensor)] + open_flags
        copies = self._copies
        read_ids = {id(t) for t in tensors}       # copies of flags not read now stay (open iteration)
        self._copies = {k: c for k, c in copies.items() if k not in read_ids}
        with record_function("mixprec.found_inf_sync"):   # the step's one read, now when asked
            read = _read_flags(tensors, copies)
        waiting, self._waiting = self._waiting, []
        if waiting:
            by_id = {id(t): v for t, v in zip(tensors, read)}
            for flag, ref in waiting:
                taken = ref()
                if taken is not None and taken._value is None and id(flag) in by_id:
                    taken._value = not by_id[id(flag)] > 0
        cut = len(read) - len(open_flags)
        return pending, read[:cut], read[cut:]


def replay(pending: list[list[Entry]], values: list[float], counters: Counters,
           loss_scaler: DynamicLossScaler | None) -> None:
    """Count the queued iterations' skips and overflows and move ``loss_scaler`` (None: scaling
    off) through them, as ``update()`` would have with eager reads. A stuck scale raises or warns
    as there; the first NumericsError is raised after the whole queue was replayed."""
    flags = iter(values)
    error: NumericsError | None = None
    for it in pending:
        overflow = skipped = False
        for flag, stepped, counted in it:
            bad = bool(next(flags) > 0) if isinstance(flag, Tensor) else bool(flag)
            overflow = overflow or bad
            if stepped and bad:
                skipped = True
                if not counted:
                    counters.num_skipped_steps += 1
        counters.num_overflows += overflow
        counters.last_step_skipped = skipped
        if loss_scaler is not None:
            try:                               # raises/warns on a stuck scale
                loss_scaler.update_scale(overflow)
            except NumericsError as e:         # replay the rest, then raise the first
                error = error or e
    if error is not None:
        raise error


class LazyHost:
    """The loss scale and the counters as the host knows them, and how far the device is ahead:
    the scale as device tensors (moved there by updates of optimizers that skipped on the
    device) and the queue of their flags; :meth:`resolve` brings the host up to date."""

    def __init__(self, loss_scaler: DynamicLossScaler, scaling: bool) -> None:
        self.loss_scaler, self.scaling = loss_scaler, scaling
        self.counters = Counters()
        self.tensors = ScaleTensors()
        self.queue = FlagQueue()

    def tensors_for(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The scale and 1/scale each step uses on ``device`` (the device's, where it leads)."""
        return self.tensors.for_device(device, self.loss_scaler.scale)

    def resolve(self, it: Iteration) -> None:
        """Read every queued flag and those of ``it``'s optimizers stepped on the device in one
        host read; replay the transition over the queue, then count ``it``'s skips."""
        open_states: list[_OptState] = it.on_device()
        if not self.queue and not open_states:
            return
        pending, values, open_values = self.queue.read([st.found_inf for st in open_states])
        try:
            replay(pending, values, self.counters, self.loss_scaler if self.scaling else None)
        finally:
            for st, v in zip(open_states, open_values):
                it.record(st, bool(v > 0), self.counters)
            if it.any_stepped:
                self.counters.last_step_skipped = it.skipped      # the open iteration's

    def drop(self) -> None:
        """The host state moved (or was set): the device copy is rebuilt from it when needed."""
        if self.scaling:
            assert not self.queue
            self.tensors.drop()

    def settle(self, it: Iteration, new_scale: float | Tensor | None) -> bool:
        """Before ``update(new_scale)`` ends ``it``: whether it ends on the device (an optimizer
        of it skipped there, no scale set), else the host state brought up to date first."""
        lazy = bool(it.on_device())
        if new_scale is not None or not lazy:
            self.resolve(it)         # the host state must be current before it moves on the host
        return lazy and new_scale is None

    def end(self, it: Iteration, new_scale: float | Tensor | None, lazy: bool, max_pending: int) -> None:
        """``GradScaler.update(new_scale)`` of the ended iteration ``it`` (after :meth:`settle`):
        on the device when ``lazy``, else on the host."""
        self.counters.last_step_skipped = it.skipped
        if new_scale is not None:
            if self.scaling:
                self.set_scale(new_scale)
        elif lazy:
            self.end_on_device(it, max_pending)
        else:
            self.end_on_host(it)

    def end_on_host(self, it: Iteration) -> None:
        """``update()`` with every flag read (or read now): the host's transition."""
        if not self.queue:
            self.queue.forget_copies()   # flags read eagerly: their host copies are not needed
        overflow = False
        for st in it.states.values():
            if st.found_inf_host is None and st.found_inf is not None:   # unscale_d, never stepped
                st.found_inf_host = bool(st.found_inf.item() > 0)
            overflow = overflow or bool(st.found_inf_host)
        self.counters.num_overflows += overflow
        if self.scaling:
            self.drop()
            self.loss_scaler.update_scale(overflow)

    def end_on_device(self, it: Iteration, max_pending: int) -> None:
        """``update()`` without a host read: queue the iteration's flags; move the scale on the
        device by the rules of :func:`mixprec.amp.loss_scale.transition` (read the queue when it
        holds ``max_pending`` iterations)."""
        entries, flags, known_bad = it.entries()
        self.queue.push(entries)
        if flags and flags[0].device.type not in ("cpu", "cuda", "xpu"):   # no float64 there
            self.resolve(Iteration())
            self.drop()
            return
        if self.scaling and flags:
            self.tensors.advance(flags, known_bad, self.loss_scaler.state, self.loss_scaler.config)
        elif self.scaling and known_bad:    # only host-known flags: cannot happen via update()
            self.resolve(Iteration())
            self.drop()
        if len(self.queue) >= max_pending:
            self.resolve(Iteration())

    def set_scale(self, new_scale: float | Tensor) -> None:
        """``update(new_scale)``: the scale set by hand (the host is current)."""
        value = scaler_state.checked_scale(new_scale, self.loss_scaler.config)
        self.drop()
        self.loss_scaler.state = dataclasses.replace(self.loss_scaler.state, scale=value)

    def reconfigure(self, it: Iteration, **changes: Any) -> None:
        self.resolve(it)       # queued iterations were taken under the old settings
        self.loss_scaler.config = dataclasses.replace(self.loss_scaler.config, **changes)
        self.drop()            # rebuilt from the host state under the new settings (and way)

    def load_state_dict(self, it: Iteration, sd: dict[str, Any]) -> None:
        """``GradScaler.load_state_dict``: counters, settings and scale state from ``sd``."""
        self.resolve(it)
        self.drop()
        c = self.counters
        c.num_overflows = int(sd.get("num_overflows", c.num_overflows))
        c.num_skipped_steps = int(sd.get("num_skipped_steps", c.num_skipped_steps))
        if not self.scaling:
            return
        if "scale" not in sd:
            raise CheckpointError("the GradScaler state has no 'scale' (it was saved with scaling "
                                  "disabled); build this scaler with enabled=False or start afresh")
        try:
            self.reconfigure(it, **scaler_state.settings(sd, self.loss_scaler.config))
        except ConfigError as e:
            raise CheckpointError(f"the GradScaler state holds invalid settings: {e}") from None
        self.loss_scaler.load_state_dict(dataclasses.asdict(
            scaler_state.loaded_state(sd, self.loss_scaler.config)))
