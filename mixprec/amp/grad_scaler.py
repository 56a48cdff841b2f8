"""A drop-in for ``torch.amp.GradScaler`` with hysteresis, bounds, counters and a pure scale policy.

The loop users know works unchanged::

    scaler = GradScaler()                          # or GradScaler(init_scale=256, growth_interval=500)
    scaler.scale(loss).backward()                  # accumulate as many micro-batches as you like
    scaler.unscale_(optimizer)                     # optional: before clipping (see amp.clip)
    scaler.step(optimizer)                         # skips the step when a gradient is inf/NaN
    scaler.update()                                # moves the scale (DynamicLossScaler rules)

Where this differs from torch's, on purpose:

* The scale's policy is :func:`loss_scale.transition` (hysteresis, ``min_scale`` / ``max_scale``,
  a stuck-scale policy), kept on the host as Python values; after an optimizer stepped on the
  device the same rules run on the device too (see **Host syncs**), and the host values follow
  lazily. With its defaults ``GradScaler()`` follows
  torch's trajectory exactly: the bounds are float32's own (``[2**-126, 2**126]``, the widest that
  keep the scale and its reciprocal normal numbers; torch's scale would go on to subnormals, 0 or
  inf), and only an overflow at ``2**-126`` raises NumericsError. The stricter options are opt-in:
  ``min_scale`` / ``max_scale`` (e.g. ``[1, 2**24]``) and ``on_min_scale="raise"|"warn"`` when an
  overflow arrives with the scale already at ``min_scale``. ``GradScaler.from_policy`` (what
  ``fit()`` uses) turns them on: ``[1, 2**24]`` and ``"raise"`` unless told otherwise.
* **Host syncs.** ``step(optimizer)`` of any optimizer reads its ``found_inf`` flag to decide
  whether to call ``optimizer.step()`` (as torch's does). An optimizer that skips on the device
  (a mixprec master-weight optimizer, ``StepInputs(found_inf=...)``; a torch ``fused=True``
  optimizer handed the flag as its ``found_inf`` attribute, mixprec.optim.inputs) is marked with
  :meth:`stepped_on_device` instead: nothing is read. ``update()`` then moves the scale **on the
  device** (:mod:`mixprec.amp.device_scale`: torch's one-kernel ``_amp_update_scale_`` and a clamp
  where that is the host's rule exactly, i.e. without hysteresis; else the rules of
  :func:`loss_scale.transition` as elementwise ops in float64, rounded to float32 as the host
  does) and queues the iteration's flags; the host
  state (``get_scale()``, ``num_skipped_steps``, ``num_overflows``, ``last_step_skipped``,
  ``loss_scaler.state``, ``state_dict()``) is brought up to date lazily, when one of them is
  asked for, by one read of all queued flags and a replay of the pure transition: the same values,
  exactly. A stuck scale (``on_min_scale``) is raised or warned at that read, not at the step:
  the device keeps skipping the non-finite steps meanwhile, so no weight is harmed; ``fit()``
  reads each step's flag just before the next step's update (and at every log interval). The queue is read at the latest every 1024 iterations.
* ``enabled=False`` turns *scaling* off; the non-finite check still runs and still skips the step
  unless ``check_finite=False`` (one inf in BF16 would poison Adam's moments for good).
  ``state_dict()`` of such a scaler is ``{}`` (as torch's); the skip counters are kept only when
  scaling is on.
* As in torch: ``scale()`` of something that is not a tensor (or an iterable of tensors) raises
  ValueError, and ``step()`` of an optimizer without any gradient (while scaling is on) raises
  AssertionError ("No inf checks were recorded for this optimizer").
  ``GradScaler.from_policy(policy)`` enables scaling iff ``policy.loss_scaling``.
* FP16 gradients are unscaled in place rather than refused (pure-FP16 training is the user's
  choice); with mixprec's master-weight optimizers the scaler works on their FP32 master grads
  (``optimizer.master_grads()``, see docs/CONTRACTS.md).
* Unscale is fused with the non-finite check by ``torch._amp_foreach_non_finite_check_and_unscale_``
  per (device, dtype) group; where that kernel rejects a dtype (BF16 on some CUDA builds) a foreach
  fallback (``_foreach_mul_`` + ``_foreach_norm(inf)``) does the same without a host sync.
  Optimizers that can unscale inside their own fused kernel (torch's ``fused=True`` Adam/SGD) get
  already-unscaled grads (``grad_scale`` is not handed over: the check is one fused pass that
  unscales anyway, and clipping needs unscaled grads); ``step()`` skips them on the host, as every
  optimizer, while ``mixprec.Precision.step`` hands them the flag (their skip on the device).
* Under ``torch.distributed`` (initialised, world > 1) ``unscale_`` all-reduces ``found_inf`` with
  MAX over ``process_group`` so every rank skips together and the scales never diverge.
* Each optimizer takes its own skip decision (as in torch); ``update()`` backs off if any of them
  overflowed. ``last_step_skipped`` is True when any optimizer step of the latest iteration was
  skipped; ``num_skipped_steps`` counts skipped ``optimizer.step()`` calls; ``num_overflows`` counts
  iterations whose ``update()`` saw non-finite gradients.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import warnings
import weakref
from collections import abc
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch.profiler import record_function

from mixprec.amp import device_scale
from mixprec.amp.loss_scale import DynamicLossScaler, LossScaleConfig, LossScaleState, _to_f32
from mixprec.amp.unscale import check_and_unscale, deferred_grads, optimizer_grads
from mixprec.errors import CheckpointError, ConfigError, NumericsError
from mixprec.policy.policy import Policy, get_policy

__all__ = ["GradScaler"]

_T = TypeVar("_T")


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


# The widest bounds: the scale and 1/scale stay normal float32 numbers (torch's are unbounded).
_F32_MIN_SCALE = 2.0 ** -126
_F32_MAX_SCALE = 2.0 ** 126
# What GradScaler.from_policy (and so fit()) uses unless told otherwise: a stuck scale is an error.
_STRICT = {"min_scale": 1.0, "max_scale": 2.0 ** 24, "on_min_scale": "raise"}


class NoGradientsError(ConfigError, AssertionError):
    """``step()`` found no gradient to check (torch raises AssertionError here; so do we)."""


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


def _apply_scale(outputs: _T, scale_for) -> _T:
    if isinstance(outputs, Tensor):
        return outputs * scale_for(outputs.device)
    if isinstance(outputs, abc.Iterable) and not isinstance(outputs, (str, bytes)):
        mapped = [_apply_scale(o, scale_for) for o in outputs]
        return type(outputs)(mapped) if isinstance(outputs, (list, tuple)) else iter(mapped)
    # ValueError, as torch.amp.GradScaler.scale raises (ConfigError is a ValueError).
    raise ConfigError(f"outputs must be a Tensor or an iterable of Tensors; scale() got "
                      f"{type(outputs).__name__}")


# --- the scaler ---------------------------------------------------------------------------------

class GradScaler:
    """``torch.amp.GradScaler`` API plus ``hysteresis``, ``min_scale``, ``max_scale``,
    ``on_min_scale``, ``check_finite``, ``process_group`` and the counters ``last_step_skipped``,
    ``num_skipped_steps``, ``num_overflows``. ``device`` (first, like torch) is ``"auto"`` (the
    device of the first scaled loss), ``"cpu"``, ``"cuda"``, ...; see the module docstring.
    """

    _MAX_PENDING = 1024     # iterations queued before a forced read (bounds the queue's memory)

    def __init__(self, device: str | torch.device = "auto", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, hysteresis: int = 1,
                 min_scale: float = _F32_MIN_SCALE, max_scale: float = _F32_MAX_SCALE,
                 on_min_scale: Literal["raise", "warn"] = "raise", check_finite: bool = True,
                 process_group: Any = None) -> None:
        for name, flag in (("enabled", enabled), ("check_finite", check_finite)):
            if not isinstance(flag, bool):
                raise ConfigError(f"GradScaler {name} must be True or False, not {flag!r}")
        self._device: torch.device | None = None
        if device != "auto":
            try:
                self._device = torch.device(device)
            except (RuntimeError, TypeError):
                raise ConfigError(f"GradScaler device must be 'auto' or a torch device such as "
                                  f"'cpu' or 'cuda', not {device!r}") from None
            if self._device.type == "cuda" and enabled and not torch.cuda.is_available():
                warnings.warn("GradScaler(device='cuda') but CUDA is not available: loss scaling "
                              "is disabled (pass device='auto' or 'cpu')", stacklevel=2)
                enabled = False
        self._loss_scaler = DynamicLossScaler(init_scale, growth_factor, growth_interval,
                                              backoff_factor=backoff_factor, hysteresis=hysteresis,
                                              min_scale=min_scale, max_scale=max_scale,
                                              on_min_scale=on_min_scale)
        self._scaling = enabled
        self._check_finite = check_finite
        self._process_group = process_group
        self._opt_states: dict[int, _OptState] = {}
        self._cached_for: float | None = None               # scale the tensor caches were built for
        self._scale_t: dict[torch.device, Tensor] = {}
        self._inv_scale_t: dict[torch.device, Tensor] = {}
        self._iter_skipped = False
        self._last_step_skipped = False
        self.last_grad_norm: Tensor | None = None
        """The unscaled global gradient norm of the last ``Precision.step`` that clipped or measured
        it (``clip_grad_norm`` / ``measure_grad_norm``), a device tensor; None otherwise."""
        self._num_skipped_steps = 0
        self._num_overflows = 0
        # Lazy (device-side) bookkeeping: per iteration a list of (flag, stepped, counted) whose
        # flags are 0-dim device tensors not read yet; the device state [scale, clean, hyst]
        # (float64) is ahead of the host state by exactly these iterations.
        self._pending: list[list[tuple[Tensor | bool, bool, bool]]] = []
        self._dev_state: Tensor | None = None      # the general way (amp.device_scale)
        self._dev_tracker: Tensor | None = None    # the fused way: torch's int32 growth tracker
        self._dev_scale: Tensor | None = None      # float32 scale and 1/scale, moved on the device
        self._dev_inv: Tensor | None = None
        self._waiting: list[tuple[Tensor, Any]] = []   # (flag, StepTaken) told at the next read
        self._host_copies: dict[int, _HostCopy] = {}    # id(flag) -> its copy on the host

    @classmethod
    def from_policy(cls, policy: Policy | str | bool, device: str | torch.device = "auto",
                    **kwargs: Any) -> GradScaler:
        """A scaler for ``policy``: scaling on iff ``policy.loss_scaling`` (FP16); the non-finite
        check (and skip) stays on either way unless ``check_finite=False`` is passed. Unlike
        ``GradScaler()`` (torch's trajectory), the scale is kept in ``[1, 2**24]`` and an overflow
        at ``min_scale`` raises NumericsError, unless ``min_scale``, ``max_scale`` or
        ``on_min_scale`` say otherwise."""
        kwargs.setdefault("enabled", bool(get_policy(policy).loss_scaling))
        for name, value in _STRICT.items():
            kwargs.setdefault(name, value)
        return cls(device, **kwargs)

    # --- what happened ----------------------------------------------------------------------

    @property
    def last_step_skipped(self) -> bool:
        """True when an optimizer step of the latest iteration was skipped (non-finite grads)."""
        self.resolve()
        return self._last_step_skipped

    @property
    def num_skipped_steps(self) -> int:
        """``optimizer.step()`` calls skipped so far."""
        self.resolve()
        return self._num_skipped_steps

    @property
    def num_overflows(self) -> int:
        """Iterations whose ``update()`` saw non-finite gradients."""
        self.resolve()
        return self._num_overflows

    @property
    def counters(self) -> dict[str, int]:
        """``num_overflows`` and ``num_skipped_steps`` as a dict that :meth:`load_state_dict` reads
        (also with scaling off, whose ``state_dict()`` is torch's ``{}``)."""
        self.resolve()
        return {"num_overflows": self._num_overflows, "num_skipped_steps": self._num_skipped_steps}

    @property
    def loss_scaler(self) -> DynamicLossScaler:
        """The scale state machine (read-only use: inspect ``.state`` and ``.config``)."""
        self.resolve()
        return self._loss_scaler

    def is_enabled(self) -> bool:
        """Whether loss *scaling* is on (the non-finite check may run either way)."""
        return self._scaling

    @property
    def config(self) -> LossScaleConfig:
        """The loss scale's settings (``init_scale``, ``scale_window`` = growth interval,
        ``hysteresis``, ``min_scale``, ``max_scale``, ``on_min_scale``, ...); frozen, read-only."""
        return self._loss_scaler.config

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when scaling is off). A host read only when
        steps skipped on the device are still queued (see :meth:`resolve`)."""
        if not self._scaling:
            return 1.0
        self.resolve()
        return self._loss_scaler.scale

    def scale_tensor(self, device: torch.device | None = None) -> Tensor | None:
        """The current scale as a 0-dim float32 tensor (a copy, not read: no host sync), or None
        when scaling is off."""
        if not self._scaling:
            return None
        dev = device or self._device or torch.device("cpu")
        return self._tensors_for(torch.device(dev))[0].clone()

    @property
    def pending(self) -> int:
        """Iterations whose flags were not read on the host yet (0: the host state is current)."""
        return len(self._pending)

    def tell_when_read(self, flag: Tensor, taken: Any) -> None:
        """Set ``taken._value`` (not skipped) when :meth:`resolve` reads ``flag``."""
        self._waiting.append((flag, weakref.ref(taken)))

    def resolve(self) -> None:
        """Bring the host state up to date: read every queued flag in one host read and replay
        the scale's pure transition over them (raising or warning on a stuck scale, as ``update()``
        does eagerly), then read the flags of optimizers stepped on the device in the iteration
        still open. No-op (no read) when nothing is queued."""
        open_states = [st for st in self._opt_states.values()
                       if st.found_inf_host is None and st.found_inf is not None
                       and st.stage is _Stage.STEPPED]
        if not self._pending and not open_states:
            return
        pending, self._pending = self._pending, []
        tensors = [f for it in pending for f, _, _ in it if isinstance(f, Tensor)]
        tensors += [st.found_inf for st in open_states]
        copies = self._host_copies
        read_ids = {id(t) for t in tensors}       # copies of flags not read now stay (open iteration)
        self._host_copies = {k: c for k, c in copies.items() if k not in read_ids}
        with record_function("mixprec.found_inf_sync"):   # the step's one read, now when asked
            read = _read_flags(tensors, copies)
        waiting, self._waiting = self._waiting, []
        if waiting:
            by_id = {id(t): v for t, v in zip(tensors, read)}
            for flag, ref in waiting:
                taken = ref()
                if taken is not None and taken._value is None and id(flag) in by_id:
                    taken._value = not by_id[id(flag)] > 0
        values = iter(read[:len(read) - len(open_states)])
        error: NumericsError | None = None
        try:
            for it in pending:
                overflow = skipped = False
                for flag, stepped, counted in it:
                    bad = bool(next(values) > 0) if isinstance(flag, Tensor) else bool(flag)
                    overflow = overflow or bad
                    if stepped and bad:
                        skipped = True
                        if not counted:
                            self._num_skipped_steps += 1
                self._num_overflows += overflow
                self._last_step_skipped = skipped
                if self._scaling:
                    try:                               # raises/warns on a stuck scale
                        self._loss_scaler.update_scale(overflow)
                    except NumericsError as e:         # replay the rest, then raise the first
                        error = error or e
        finally:
            for st, v in zip(open_states, read[len(read) - len(open_states):]):
                st.found_inf_host = bool(v > 0)
                st.skipped = st.found_inf_host
                st.counted = True
                self._iter_skipped = self._iter_skipped or st.skipped
                self._num_skipped_steps += st.skipped
            if any(st.stage is _Stage.STEPPED for st in self._opt_states.values()):
                self._last_step_skipped = self._iter_skipped      # the open iteration's
        if error is not None:
            raise error

    @property
    def _active(self) -> bool:
        return self._scaling or self._check_finite

    # --- the step ---------------------------------------------------------------------------

    def _tensors_for(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._dev_scale is not None:     # the device state leads (or equals) the host's
            if self._dev_scale.device != device:
                return self._dev_scale.to(device), self._dev_inv.to(device)
            return self._dev_scale, self._dev_inv
        s = self._loss_scaler.scale
        if self._cached_for != s:
            self._scale_t.clear()
            self._inv_scale_t.clear()
            self._cached_for = s
        t = self._scale_t.get(device)
        if t is None:
            t = self._scale_t[device] = torch.full((), s, dtype=torch.float32, device=device)
            # 1/s computed in double, then rounded to float32 (as torch does).
            self._inv_scale_t[device] = torch.full((), _to_f32(1.0 / s), dtype=torch.float32,
                                                   device=device)
        return t, self._inv_scale_t[device]

    def scale(self, outputs: _T, *, value: float | None = None) -> _T:
        """Multiply a loss (or a list/tuple/iterable of them) by the current scale (``value``: by
        that scale instead, e.g. to replay an earlier step)."""
        if not self._scaling:
            return outputs
        if value is not None:
            return _apply_scale(outputs, lambda dev: torch.tensor(float(value), device=dev))
        if self._device is None and isinstance(outputs, Tensor):
            self._device = outputs.device
        return _apply_scale(outputs, lambda dev: self._tensors_for(dev)[0])

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptState:
        st = self._opt_states.get(id(optimizer))
        if st is None:
            st = self._opt_states[id(optimizer)] = _OptState()
        return st

    def grads_are_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients still carry the loss scale this iteration."""
        return self._scaling and self._state(optimizer).stage is _Stage.READY

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale and check them for inf/NaN, once per step.

        Call it before inspecting or clipping gradients; ``step()`` calls it otherwise. No host sync.
        """
        if not self._active:
            return
        st = self._state(optimizer)
        if st.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() was already called for this optimizer in this iteration; "
                               "gradients are unscaled exactly once — call scaler.update() first")
        if st.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() called after step() for this optimizer; call "
                               "scaler.update() to end the iteration first")
        inv_for = (lambda dev: self._tensors_for(dev)[1]) if self._scaling else (lambda dev: None)
        deferred = deferred_grads(optimizer)
        if deferred is None:
            grads = optimizer_grads(optimizer)
            st.no_grads = not grads
            found = check_and_unscale(grads, inv_for, self._device)
        else:   # split masters: check the BF16 grads as they are, scale inside the step
            st.no_grads = not deferred.entries
            found = check_and_unscale(deferred.low, lambda dev: None, self._device)
            found = torch.maximum(found, check_and_unscale(deferred.own, lambda dev: None,
                                                           self._device).to(found.device))
            deferred.scale_(inv_for)
        pg = self._process_group
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size(pg) > 1:
            # Every rank must take the same skip decision, or their weights and scales diverge.
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=pg)
        st.found_inf, st.stage = found, _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and run ``optimizer.step(*args, **kwargs)`` unless a gradient
        is inf/NaN; a skipped step leaves parameters and optimizer state untouched. Returns what
        ``optimizer.step`` returned, or None when skipped.
        """
        if not self._active:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("closures are not supported with GradScaler: compute the loss, "
                               "call scaler.scale(loss).backward(), then scaler.step(optimizer)")
        if not self.decide(optimizer):
            return None
        return optimizer.step(*args, **kwargs)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> Tensor | None:
        """The agreed non-finite flag of ``optimizer``'s gradients this iteration, as a 0-dim
        float32 device tensor (unscaling first if not done yet), **not** read: for an optimizer
        that skips on the device (``mixprec.optim.inputs.StepInputs``). Call :meth:`decide`
        afterwards for the counters. None when the scaler is inactive (nothing to check).

        The flag's copy to the host is issued here (non-blocking), before the caller queues the
        update, so that the lazy read later waits for the flag only, not for the update."""
        if not self._active:
            return None
        st = self._state(optimizer)
        if st.stage is _Stage.READY:
            self.unscale_(optimizer)
        if st.found_inf is not None and id(st.found_inf) not in self._host_copies:
            self._host_copies[id(st.found_inf)] = _HostCopy(st.found_inf)
        return st.found_inf

    def _checked(self, optimizer: torch.optim.Optimizer) -> _OptState:
        """``optimizer``'s state, unscaled and checked, ready to be marked stepped (once)."""
        st = self._state(optimizer)
        if st.stage is _Stage.STEPPED:
            raise RuntimeError("step() was already called for this optimizer in this iteration; "
                               "call scaler.update() once per iteration after stepping every optimizer")
        if st.stage is _Stage.READY:
            self.unscale_(optimizer)
        assert st.found_inf is not None
        if st.no_grads and self._scaling:
            raise NoGradientsError("No inf checks were recorded for this optimizer: it has no "
                                   "gradients (was the scaled loss's backward() called, and do its "
                                   "parameters require grad?)")
        return st

    def decide(self, optimizer: torch.optim.Optimizer) -> bool:
        """What :meth:`step` does, except calling ``optimizer.step()``: unscale (if not done yet),
        read the agreed non-finite flag (the one host sync), count a skip; True when the caller
        must now step the optimizer itself (e.g. in parts, mixprec.optim.overlap). Always True
        when the scaler is inactive (scaling and the check both off)."""
        if not self._active:
            return True
        st = self._checked(optimizer)
        st.found_inf_host = bool(st.found_inf.item() > 0)   # the one host sync of the step
        st.stage = _Stage.STEPPED
        st.skipped = st.found_inf_host
        self._iter_skipped = self._iter_skipped or st.skipped
        self._last_step_skipped = self._iter_skipped
        st.counted = True
        if st.skipped:
            self._num_skipped_steps += 1
        return not st.skipped

    def stepped_on_device(self, optimizer: torch.optim.Optimizer) -> Tensor | None:
        """What :meth:`decide` does for an optimizer that took the skip decision itself, on the
        device (``optimizer.step(inputs=StepInputs(found_inf=...))`` was called): mark it stepped,
        **without** reading the flag. The flag is read later, lazily (:meth:`resolve`). Returns
        the flag (None when the scaler is inactive: the step was always taken)."""
        if not self._active:
            return None
        st = self._checked(optimizer)
        st.stage = _Stage.STEPPED
        return st.found_inf

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the iteration: back the scale off if any optimizer saw inf/NaN, else count a clean
        step (growing after ``growth_interval`` of them). ``new_scale`` sets the scale directly.
        May raise NumericsError when the scale is stuck at ``min_scale`` (``on_min_scale``)."""
        if not self._active:
            return
        if not self._opt_states and new_scale is None:
            raise RuntimeError("update() called without unscale_() or step() since the last "
                               "update(); call scaler.step(optimizer) before scaler.update()")
        lazy = any(st.found_inf_host is None and st.stage is _Stage.STEPPED
                   for st in self._opt_states.values())
        if new_scale is not None or not lazy:
            self.resolve()           # the host state must be current before it moves on the host
        states, self._opt_states = self._opt_states, {}
        self._last_step_skipped = self._iter_skipped
        self._iter_skipped = False
        if new_scale is not None:
            if self._scaling:
                self._set_scale(new_scale)
            return
        if lazy:
            self._update_on_device(states)
            return
        if not self._pending:
            self._host_copies.clear()      # flags read eagerly: their host copies are not needed
        overflow = False
        for st in states.values():
            if st.found_inf_host is None and st.found_inf is not None:   # unscale_d, never stepped
                st.found_inf_host = bool(st.found_inf.item() > 0)
            overflow = overflow or bool(st.found_inf_host)
        self._num_overflows += overflow
        if self._scaling:
            self._drop_device_state()
            self._loss_scaler.update_scale(overflow)

    # --- the scale on the device ----------------------------------------------------------

    def _drop_device_state(self) -> None:
        """The host state moved (or was set): the device copy is rebuilt from it when needed."""
        assert not self._pending
        self._dev_state = self._dev_tracker = self._dev_scale = self._dev_inv = None

    def _device_state(self, device: torch.device) -> Tensor:
        if self._dev_state is None:
            st = self._loss_scaler.state
            self._dev_state = torch.tensor([st.scale, float(st.clean_steps),
                                            float(st.hysteresis_left)], dtype=torch.float64,
                                           device=device)
        return self._dev_state

    def _update_on_device(self, states: dict[int, _OptState]) -> None:
        """``update()`` without a host read: queue the iteration's flags; move the scale on the
        device by the rules of :func:`mixprec.amp.loss_scale.transition`."""
        entries: list[tuple[Tensor | bool, bool, bool]] = []
        flags: list[Tensor] = []
        known_bad = False
        for st in states.values():
            stepped = st.stage is _Stage.STEPPED
            if st.found_inf_host is not None:
                entries.append((st.found_inf_host, stepped, st.counted))
                known_bad = known_bad or st.found_inf_host
            elif st.found_inf is not None:
                entries.append((st.found_inf, stepped, st.counted))
                flags.append(st.found_inf)
        self._pending.append(entries)
        if flags and flags[0].device.type not in ("cpu", "cuda", "xpu"):   # no float64 there
            self.resolve()
            if self._scaling:
                self._drop_device_state()
            return
        if self._scaling and flags:
            dev = flags[0].device
            found = flags[0] if len(flags) == 1 else torch.stack([f.to(dev) for f in flags]).amax()
            cfg = self._loss_scaler.config
            if device_scale.fused_exact(cfg):       # torch's one-kernel update + one clamp
                if self._dev_tracker is None:
                    self._dev_tracker = device_scale.initial_tracker(
                        self._loss_scaler.state.clean_steps, cfg, dev)
                if known_bad:
                    found = torch.ones_like(found)
                scale = self._tensors_for(dev)[0]
                self._dev_scale, self._dev_inv = device_scale.fused_transition(
                    scale, self._dev_tracker, found, cfg)
            else:                                   # hysteresis: the general transition
                state = self._device_state(dev)
                overflow = (found > 0) | known_bad
                self._dev_state, self._dev_scale, self._dev_inv = device_scale.transition(
                    state, overflow, cfg)
        elif self._scaling and known_bad:    # only host-known flags: cannot happen via update()
            self.resolve()
            self._drop_device_state()
        if len(self._pending) >= self._MAX_PENDING:
            self.resolve()

    def _set_scale(self, new_scale: float | Tensor) -> None:
        if isinstance(new_scale, Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ConfigError("update(new_scale) takes a float or a 1-element tensor without "
                                  "requires_grad")
            new_scale = float(new_scale.item())
        if isinstance(new_scale, bool) or not isinstance(new_scale, (int, float)):
            raise ConfigError(f"update(new_scale) takes a float, not {type(new_scale).__name__}")
        cfg = self._loss_scaler.config
        if not (math.isfinite(new_scale) and cfg.min_scale <= new_scale <= cfg.max_scale):
            raise ConfigError(f"new scale {new_scale} must be finite and in [min_scale, max_scale] "
                              f"= [{cfg.min_scale}, {cfg.max_scale}]")
        self._drop_device_state()
        self._loss_scaler.state = dataclasses.replace(self._loss_scaler.state,
                                                      scale=_to_f32(float(new_scale)))

    # --- torch.amp.GradScaler getters/setters -----------------------------------------------

    def _reconfigure(self, **changes: Any) -> None:
        self.resolve()         # queued iterations were taken under the old settings
        self._loss_scaler.config = dataclasses.replace(self._loss_scaler.config, **changes)
        if self._scaling:      # rebuilt from the host state under the new settings (and way)
            self._drop_device_state()

    def get_growth_factor(self) -> float:
        return self._loss_scaler.config.scale_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._reconfigure(scale_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self._loss_scaler.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._reconfigure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self._loss_scaler.config.scale_window

    def set_growth_interval(self, new_interval: int) -> None:
        self._reconfigure(scale_window=new_interval)

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain Python values (safe for ``torch.load(weights_only=True)``). Contains torch's five
        keys, so ``torch.amp.GradScaler.load_state_dict`` reads it too, plus mixprec's extras.
        With scaling off it is ``{}``, as torch's. Call it after ``update()``."""
        if not self._scaling:
            return {}      # as torch's disabled scaler; see ``counters`` for the skip counts
        counters = self.counters      # reads what is queued (resolve)
        cfg, st = self._loss_scaler.config, self._loss_scaler.state
        return {"scale": st.scale, "growth_factor": cfg.scale_factor,
                "backoff_factor": cfg.backoff_factor, "growth_interval": cfg.scale_window,
                "_growth_tracker": st.clean_steps, "hysteresis": cfg.hysteresis,
                "_hysteresis_left": st.hysteresis_left, "min_scale": cfg.min_scale,
                "max_scale": cfg.max_scale, "on_min_scale": cfg.on_min_scale,
                "_scale_overflows": st.num_overflows, **counters}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (also accepts a ``torch.amp.GradScaler`` state dict)."""
        self.resolve()
        if self._scaling:
            self._drop_device_state()
        self._num_overflows = int(state_dict.get("num_overflows", self._num_overflows))
        self._num_skipped_steps = int(state_dict.get("num_skipped_steps", self._num_skipped_steps))
        if not self._scaling:
            return
        if "scale" not in state_dict:
            raise CheckpointError("the GradScaler state has no 'scale' (it was saved with scaling "
                                  "disabled); build this scaler with enabled=False or start afresh")
        names = {"growth_factor": "scale_factor", "backoff_factor": "backoff_factor",
                 "growth_interval": "scale_window", "hysteresis": "hysteresis",
                 "min_scale": "min_scale", "max_scale": "max_scale", "on_min_scale": "on_min_scale"}
        cfg = self._loss_scaler.config
        lo, hi = state_dict.get("min_scale", cfg.min_scale), state_dict.get("max_scale", cfg.max_scale)
        changes = {ours: state_dict[theirs] for theirs, ours in names.items() if theirs in state_dict}
        try:
            # init_scale only has to be valid under the new bounds; the loaded scale is checked below.
            self._reconfigure(**changes, init_scale=min(max(cfg.init_scale, lo), hi))
        except ConfigError as e:
            raise CheckpointError(f"the GradScaler state holds invalid settings: {e}") from None
        self._loss_scaler.load_state_dict(dataclasses.asdict(LossScaleState(
            scale=_to_f32(float(state_dict["scale"])),
            clean_steps=int(state_dict.get("_growth_tracker", 0)),
            hysteresis_left=int(state_dict.get("_hysteresis_left",
                                               self._loss_scaler.config.hysteresis)),
            num_overflows=int(state_dict.get("_scale_overflows", 0)))))

    def __repr__(self) -> str:
        self.resolve()
        mode = f"scale={self.get_scale():g}" if self._scaling else "scaling off"
        return (f"GradScaler({mode}, check_finite={self._check_finite}, "
                f"skipped={self._num_skipped_steps}, overflows={self._num_overflows})")

