"""One iteration of :class:`mixprec.amp.GradScaler`: each optimizer's progress through it
(ready, unscaled, stepped; its non-finite flag, on the device and once read on the host) and the
skip counters the iterations add up to.

An iteration runs ``unscale_`` (at most once per optimizer), then ``step`` / ``decide`` /
``stepped_on_device`` (once per optimizer), then ``update()``, which ends it. A flag read on the
host (``decide``) is counted at once; one left on the device (``stepped_on_device``) is counted
when the host reads it (:mod:`mixprec.amp.host_flags`)."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mixprec.amp.unscale import optimizer_grads, unscale_grads, unscale_optimizer
from mixprec.errors import ConfigError

__all__ = ["NoGradientsError", "Counters", "Iteration"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(slots=True)
class _OptState:
    """Per-optimizer progress within one iteration (reset by ``update()``)."""

    stage: _Stage = _Stage.READY
    found_inf: Tensor | None = None      # 0-dim float32 on the grads' device; > 0 means non-finite
    found_inf_host: bool | None = None   # the same, once read on the host (in step())
    skipped: bool = False
    no_grads: bool = False               # unscale_ found no gradient at all
    counted: bool = False                # a skip of this step is in num_skipped_steps already

    @property
    def on_device(self) -> bool:
        """Stepped, with a flag the host has not read (the optimizer skipped on the device)."""
        return self.found_inf_host is None and self.found_inf is not None \
            and self.stage is _Stage.STEPPED


class NoGradientsError(ConfigError, AssertionError):
    """``step()`` found no gradient to check (torch raises AssertionError here; so do we)."""


@dataclass(slots=True)
class Counters:
    """What happened so far, as the host knows it."""

    last_step_skipped: bool = False   # an optimizer step of the latest iteration was skipped
    num_skipped_steps: int = 0        # ``optimizer.step()`` calls skipped
    num_overflows: int = 0            # iterations whose ``update()`` saw non-finite gradients


@dataclass(slots=True)
class Iteration:
    """The optimizers of the iteration still open, by ``id``, and whether one of them skipped."""

    states: dict[int, _OptState] = field(default_factory=dict)
    skipped: bool = False

    def state(self, optimizer: object) -> _OptState:
        st = self.states.get(id(optimizer))
        if st is None:
            st = self.states[id(optimizer)] = _OptState()
        return st

    def stage(self, optimizer: object) -> _Stage:
        return self.state(optimizer).stage

    def check_unscale(self, optimizer: object) -> _OptState:
        """``optimizer``'s state, refusing a second unscale in this iteration."""
        st = self.state(optimizer)
        if st.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() was already called for this optimizer in this iteration; "
                               "gradients are unscaled exactly once — call scaler.update() first")
        if st.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() called after step() for this optimizer; call "
                               "scaler.update() to end the iteration first")
        return st

    def unscale(self, optimizer: torch.optim.Optimizer,
                inv_scale_for: Callable[[torch.device], Tensor | None],
                home: torch.device | None, process_group: Any,
                grads: list[Tensor] | None = None, low: list[Tensor] | None = None) -> Tensor | None:
        """``GradScaler.unscale_``, once per iteration. torch's form (neither ``grads`` nor ``low``)
        asks the optimizer for its gradients (:func:`unscale.unscale_optimizer`, the grad protocol).
        Otherwise the caller asked it (``mixprec.Precision.step``) and hands the tensors over
        (:func:`unscale.unscale_grads`): ``grads`` its ``master_grads()`` (None: the ``.grad`` of
        its param groups), or with ``low`` (a split-master step's deferred model-dtype gradients,
        checked as they are) its own FP32 ones. Returns the factor the step must apply to ``low``:
        1/scale on their device, a snapshot a later update cannot change; None without ``low`` or
        without scaling."""
        st = self.check_unscale(optimizer)
        if grads is None and low is None:
            st.found_inf, st.no_grads = unscale_optimizer(optimizer, inv_scale_for, home, process_group)
        else:
            local = optimizer_grads(optimizer, grads) if low is None else grads or []
            st.found_inf, st.no_grads = unscale_grads(local, inv_scale_for, home, process_group, low=low)
        st.stage = _Stage.UNSCALED
        factor = inv_scale_for(low[0].device) if low else None
        return None if factor is None else factor.clone()

    def check_step(self, optimizer: torch.optim.Optimizer,
                   unscale: Callable[[torch.optim.Optimizer], None], scaling: bool) -> _OptState:
        """``optimizer``'s state, unscaled (by ``unscale`` if not yet) and checked, ready to be
        marked stepped: refuses a second step in this iteration, and (while ``scaling``) an
        optimizer without any gradient, as torch does."""
        st = self.state(optimizer)
        if st.stage is _Stage.STEPPED:
            raise RuntimeError("step() was already called for this optimizer in this iteration; "
                               "call scaler.update() once per iteration after stepping every optimizer")
        if st.stage is _Stage.READY:
            unscale(optimizer)
        assert st.found_inf is not None
        if st.no_grads and scaling:
            raise NoGradientsError("No inf checks were recorded for this optimizer: it has no "
                                   "gradients (was the scaled loss's backward() called, and do its "
                                   "parameters require grad?)")
        return st

    def decide(self, optimizer: torch.optim.Optimizer,
               unscale: Callable[[torch.optim.Optimizer], None], scaling: bool,
               counters: Counters) -> bool:
        """``GradScaler.decide``: read ``optimizer``'s flag (the one host sync), count a skip;
        True when the step is to be taken."""
        st = self.check_step(optimizer, unscale, scaling)
        self.record(st, bool(st.found_inf.item() > 0), counters)
        counters.last_step_skipped = self.skipped
        return not st.skipped

    def stepped(self, optimizer: torch.optim.Optimizer,
                unscale: Callable[[torch.optim.Optimizer], None], scaling: bool) -> Tensor:
        """``GradScaler.stepped_on_device``: mark ``optimizer`` stepped, its flag left unread."""
        st = self.check_step(optimizer, unscale, scaling)
        st.stage = _Stage.STEPPED
        return st.found_inf

    def record(self, st: _OptState, bad: bool, counters: Counters) -> None:
        """``st``'s flag, read on the host: a skip is counted once, and seen by the iteration."""
        st.found_inf_host = st.skipped = bad
        st.stage = _Stage.STEPPED
        st.counted = True
        self.skipped = self.skipped or bad
        counters.num_skipped_steps += bad

    def on_device(self) -> list[_OptState]:
        """The states of optimizers stepped on the device whose flags are not read yet."""
        return [st for st in self.states.values() if st.on_device]

    @property
    def any_stepped(self) -> bool:
        return any(st.stage is _Stage.STEPPED for st in self.states.values())

    def entries(self) -> tuple[list[tuple[Tensor | bool, bool, bool]], list[Tensor], bool]:
        """The iteration as the flag queue holds it (``host_flags.Entry`` per optimizer), its
        flags still on the device, and whether a flag the host read already was non-finite."""
        entries: list[tuple[Tensor | bool, bool, bool]] = []
        flags: list[Tensor] = []
        known_bad = False
        for st in self.states.values():
            stepped = st.stage is _Stage.STEPPED
            if st.found_inf_host is not None:
                entries.append((st.found_inf_host, stepped, st.counted))
                known_bad = known_bad or st.found_inf_host
            elif st.found_inf is not None:
                entries.append((st.found_inf, stepped, st.counted))
                flags.append(st.found_inf)
        return entries, flags, known_bad
