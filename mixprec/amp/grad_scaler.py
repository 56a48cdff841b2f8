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

import warnings
from collections import abc
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

from mixprec.amp import scaler_state
from mixprec.amp.host_flags import LazyHost
from mixprec.amp.iteration import Counters, Iteration, _Stage
from mixprec.amp.loss_scale import DynamicLossScaler, LossScaleConfig
from mixprec.errors import ConfigError
from mixprec.policy.policy import Policy, get_policy

__all__ = ["GradScaler"]

_T = TypeVar("_T")

# The widest bounds: the scale and 1/scale stay normal float32 numbers (torch's are unbounded).
_F32_MIN_SCALE = 2.0 ** -126
_F32_MAX_SCALE = 2.0 ** 126
# What GradScaler.from_policy (and so fit()) uses unless told otherwise: a stuck scale is an error.
_STRICT = {"min_scale": 1.0, "max_scale": 2.0 ** 24, "on_min_scale": "raise"}


def _apply_scale(outputs: _T, scale_for) -> _T:
    if isinstance(outputs, Tensor):
        return outputs * scale_for(outputs.device)
    if isinstance(outputs, abc.Iterable) and not isinstance(outputs, (str, bytes)):
        mapped = [_apply_scale(o, scale_for) for o in outputs]
        return type(outputs)(mapped) if isinstance(outputs, (list, tuple)) else iter(mapped)
    # ValueError, as torch.amp.GradScaler.scale raises (ConfigError is a ValueError).
    raise ConfigError(f"outputs must be a Tensor or an iterable of Tensors; scale() got "
                      f"{type(outputs).__name__}")


def _home(device: str | torch.device, enabled: bool, check_finite: bool
          ) -> tuple[torch.device | None, bool]:
    """``GradScaler(device=..., enabled=..., check_finite=...)`` checked: the device (None for
    ``"auto"``) and whether scaling stays enabled (not on a CUDA device that is not there)."""
    for name, flag in (("enabled", enabled), ("check_finite", check_finite)):
        if not isinstance(flag, bool):
            raise ConfigError(f"GradScaler {name} must be True or False, not {flag!r}")
    if device == "auto":
        return None, enabled
    try:
        home = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"GradScaler device must be 'auto' or a torch device such as "
                          f"'cpu' or 'cuda', not {device!r}") from None
    if home.type == "cuda" and enabled and not torch.cuda.is_available():
        warnings.warn("GradScaler(device='cuda') but CUDA is not available: loss scaling "
                      "is disabled (pass device='auto' or 'cpu')", stacklevel=3)
        enabled = False
    return home, enabled


# --- the scaler ---------------------------------------------------------------------------------

class GradScaler:
    """``torch.amp.GradScaler`` API plus ``hysteresis``, ``min_scale``, ``max_scale``,
    ``on_min_scale``, ``check_finite``, ``process_group`` and the counters ``last_step_skipped``,
    ``num_skipped_steps``, ``num_overflows``. ``device`` (first, like torch) is ``"auto"`` (the
    device of the first scaled loss), ``"cpu"``, ``"cuda"``, ...; see the module docstring."""

    _MAX_PENDING = 1024     # iterations queued before a forced read (bounds the queue's memory)

    def __init__(self, device: str | torch.device = "auto", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, hysteresis: int = 1,
                 min_scale: float = _F32_MIN_SCALE, max_scale: float = _F32_MAX_SCALE,
                 on_min_scale: Literal["raise", "warn"] = "raise", check_finite: bool = True,
                 process_group: Any = None) -> None:
        self._device, enabled = _home(device, enabled, check_finite)
        loss_scaler = DynamicLossScaler(
            init_scale, growth_factor, growth_interval, backoff_factor=backoff_factor,
            hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale, on_min_scale=on_min_scale)
        self._scaling, self._check_finite, self._process_group = enabled, check_finite, process_group
        self._iteration = Iteration()                   # the optimizers of the iteration still open
        self._host = LazyHost(loss_scaler, enabled)     # the scale, counters, the device's lead
        self.last_grad_norm: Tensor | None = None
        """The unscaled global gradient norm of the last ``Precision.step`` that clipped or measured
        it (``clip_grad_norm`` / ``measure_grad_norm``), a device tensor; None otherwise."""

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

    last_step_skipped = property(lambda self: self._known().last_step_skipped, doc=(
        "True when an optimizer step of the latest iteration was skipped (non-finite grads)."))
    num_skipped_steps = property(lambda self: self._known().num_skipped_steps,
                                 doc="``optimizer.step()`` calls skipped so far.")
    num_overflows = property(lambda self: self._known().num_overflows,
                             doc="Iterations whose ``update()`` saw non-finite gradients.")

    @property
    def counters(self) -> dict[str, int]:
        """``num_overflows`` and ``num_skipped_steps`` as a dict that :meth:`load_state_dict` reads
        (also with scaling off, whose ``state_dict()`` is torch's ``{}``)."""
        c = self._known()
        return {"num_overflows": c.num_overflows, "num_skipped_steps": c.num_skipped_steps}

    @property
    def loss_scaler(self) -> DynamicLossScaler:
        """The scale state machine (read-only use: inspect ``.state`` and ``.config``)."""
        self.resolve()
        return self._host.loss_scaler

    def is_enabled(self) -> bool:
        """Whether loss *scaling* is on (the non-finite check may run either way)."""
        return self._scaling

    @property
    def config(self) -> LossScaleConfig:
        """The loss scale's settings (``init_scale``, ``scale_window`` = growth interval,
        ``hysteresis``, ``min_scale``, ``max_scale``, ``on_min_scale``, ...); frozen, read-only."""
        return self._host.loss_scaler.config

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when scaling is off). A host read only when
        steps skipped on the device are still queued (see :meth:`resolve`)."""
        if not self._scaling:
            return 1.0
        self.resolve()
        return self._host.loss_scaler.scale

    def scale_tensor(self, device: torch.device | None = None) -> Tensor | None:
        """The current scale as a 0-dim float32 tensor (a copy, not read: no host sync), or None
        when scaling is off."""
        if not self._scaling:
            return None
        return self._tensors_for(torch.device(device or self._device or "cpu"))[0].clone()

    @property
    def pending(self) -> int:
        """Iterations whose flags were not read on the host yet (0: the host state is current)."""
        return len(self._host.queue)

    def tell_when_read(self, flag: Tensor, taken: Any) -> None:
        """Set ``taken._value`` (not skipped) when :meth:`resolve` reads ``flag``."""
        self._host.queue.tell_when_read(flag, taken)

    def resolve(self) -> None:
        """Bring the host state up to date: one host read of every queued flag (and those of the
        open iteration), the scale's transition replayed over them (raising or warning on a stuck
        scale, as ``update()`` does eagerly). No-op (no read) when nothing is queued."""
        self._host.resolve(self._iteration)

    def _known(self) -> Counters:
        self.resolve()
        return self._host.counters

    @property
    def _active(self) -> bool:
        return self._scaling or self._check_finite

    # --- the step ---------------------------------------------------------------------------

    def _tensors_for(self, device: torch.device) -> tuple[Tensor, Tensor]:   # scale, 1/scale
        return self._host.tensors_for(device)

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

    def _stage(self, optimizer: torch.optim.Optimizer) -> _Stage:
        """Where ``optimizer`` is in this iteration (UNSCALED when the scaler is inactive)."""
        return self._iteration.stage(optimizer) if self._active else _Stage.UNSCALED

    def grads_are_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients still carry the loss scale this iteration."""
        return self._scaling and self._iteration.stage(optimizer) is _Stage.READY

    def unscale_(self, optimizer: torch.optim.Optimizer, grads: list[Tensor] | None = None, *,
                 low: list[Tensor] | None = None) -> Tensor | None:
        """Divide ``optimizer``'s grads by the scale and check them for inf/NaN, once per step.
        Call it before inspecting or clipping gradients; ``step()`` calls it otherwise. No host sync.
        ``grads``/``low``: the gradients ``mixprec.Precision.step`` asked the optimizer for (so the
        scaler calls nothing of the optimizer's): :meth:`Iteration.unscale`, which returns ``low``'s factor."""
        if not self._active:
            return None
        inv_for = (lambda dev: self._tensors_for(dev)[1]) if self._scaling else (lambda dev: None)
        return self._iteration.unscale(optimizer, inv_for, self._device, self._process_group, grads, low)

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
        afterwards for the counters. None when the scaler is inactive (nothing to check). The
        flag's copy to the host is issued here, before the update is queued (host_flags)."""
        if not self._active:
            return None
        if self._iteration.stage(optimizer) is _Stage.READY:
            self.unscale_(optimizer)
        flag = self._iteration.state(optimizer).found_inf
        if flag is not None:
            self._host.queue.copy(flag)
        return flag

    def decide(self, optimizer: torch.optim.Optimizer) -> bool:
        """What :meth:`step` does, except calling ``optimizer.step()``: unscale (if not done yet),
        read the agreed non-finite flag (the one host sync), count a skip; True when the caller
        must now step the optimizer itself (e.g. in parts, mixprec.optim.overlap). Always True
        when the scaler is inactive (scaling and the check both off)."""
        if not self._active:
            return True
        return self._iteration.decide(optimizer, self.unscale_, self._scaling, self._host.counters)

    def stepped_on_device(self, optimizer: torch.optim.Optimizer) -> Tensor | None:
        """What :meth:`decide` does for an optimizer that took the skip decision itself, on the
        device (``optimizer.step(inputs=StepInputs(found_inf=...))`` was called): mark it stepped,
        **without** reading the flag. The flag is read later, lazily (:meth:`resolve`). Returns
        the flag (None when the scaler is inactive: the step was always taken)."""
        if not self._active:
            return None
        return self._iteration.stepped(optimizer, self.unscale_, self._scaling)

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the iteration: back the scale off if any optimizer saw inf/NaN, else count a clean
        step (growing after ``growth_interval`` of them). ``new_scale`` sets the scale directly.
        May raise NumericsError when the scale is stuck at ``min_scale`` (``on_min_scale``)."""
        if not self._active:
            return
        if not self._iteration.states and new_scale is None:
            raise RuntimeError("update() called without unscale_() or step() since the last "
                               "update(); call scaler.step(optimizer) before scaler.update()")
        lazy = self._host.settle(self._iteration, new_scale)   # (a stuck scale raises here)
        it, self._iteration = self._iteration, Iteration()
        self._host.end(it, new_scale, lazy, self._MAX_PENDING)

    # The device's way (tests look): the general way's float64 state, the fused way's int32 tracker.
    _dev_state = property(lambda self: self._host.tensors.state)
    _dev_tracker = property(lambda self: self._host.tensors.tracker)

    # --- torch.amp.GradScaler getters/setters -----------------------------------------------

    def _reconfigure(self, **changes: Any) -> None:
        self._host.reconfigure(self._iteration, **changes)

    def get_growth_factor(self) -> float:
        return self.config.scale_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._reconfigure(scale_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._reconfigure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self.config.scale_window

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
        return scaler_state.state_dict(self.config, self._host.loss_scaler.state, counters)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (also accepts a ``torch.amp.GradScaler`` state dict)."""
        self._host.load_state_dict(self._iteration, state_dict)

    def __repr__(self) -> str:
        mode = f"scale={self.get_scale():g}" if self._scaling else "scaling off"
        return (f"GradScaler({mode}, check_finite={self._check_finite}, "
                f"skipped={self.num_skipped_steps}, overflows={self.num_overflows})")
