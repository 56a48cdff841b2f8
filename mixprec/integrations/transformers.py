"""mixprec inside the Hugging Face ``Trainer``: a callback, and the Trainer hook it needs.

::

    from mixprec.integrations.transformers import MixprecCallback, MixprecTrainer

    trainer = MixprecTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset,
                             callbacks=[MixprecCallback(precision="bf16-true")])
    trainer.train()

A ``TrainerCallback`` alone cannot change a step: it is never handed the loss, the backward or
the optimizer step. So the callback holds the :class:`mixprec.Precision` and does what callbacks
can (the model's set-up at ``on_init_end``, the audit, tracing a skipped step, the run folder), and
:class:`MixprecTrainer` (``transformers.Trainer`` plus :class:`MixprecTrainerMixin`, which you can
put in front of your own Trainer subclass) routes the precision-critical part of the step to it:

=================================  ===================================================================
Trainer method (overridden)        what runs instead
=================================  ===================================================================
``create_optimizer``               the Trainer's optimizer, given FP32 masters by
                                   ``Precision.setup_optimizer``; its ``step()`` is ``Precision.step``
                                   (unscale once, inf/NaN check, clip the unscaled FP32 gradients to
                                   ``max_grad_norm``, step or skip, scale update)
``create_scheduler``               the Trainer's scheduler, not stepped after a skipped step
``compute_loss_context_manager``   ``Precision.autocast``
``training_step``                  the Trainer's, with ``accelerator.backward`` scaling the loss in
                                   FP16 modes (``Precision.scale_loss``)
``_clip_grad_norm``,               nothing / the norm ``Precision.step`` measured (the Trainer
``_get_grad_norm``                 would clip the still-scaled 16-bit model gradients)
=================================  ===================================================================

A plain ``transformers.Trainer(callbacks=[MixprecCallback(...)])`` also works for a mode that does
not scale the loss: the callback sets the model up when training starts, autocasts its forward and
replaces the optimizer's step with ``Precision.step`` on FP32 masters. ``MixprecTrainer`` is needed
for FP16 loss scaling (refused in one line without it), master-gradient clipping, tracing a skipped
step and resuming from a Trainer checkpoint.

Leave ``TrainingArguments(bf16=False, fp16=False)``: mixprec owns the precision (asking for both
is refused). The optimizer's checkpoint (``optimizer.pt``) carries the loss scale, so
``trainer.train(resume_from_checkpoint=...)`` continues it. Tested with transformers 5.24.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import ConfigError
from mixprec.integrations.common import (Host, RunRecord, StepIfTaken, as_precision, copy_hyperparameters,
                                         move_scheduler, replace_step, route_to_masters)
from mixprec.monitor import NumericsMonitor, capture_rng_state

__all__ = ["MixprecCallback", "MixprecTrainerMixin", "MixprecTrainer", "PrecisionOptimizer"]

_STATE_KEY = "mixprec_precision"


class PrecisionOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer steps: ``step()`` is ``Precision.step(inner, clip_grad_norm=...)``.

    ``param_groups`` and ``state`` are the inner optimizer's own (the FP32 masters' when it keeps
    masters), so schedules reach it; ``state_dict()`` is the inner one's plus the precision's
    (loss scale, skip counts) under ``"mixprec_precision"``.
    """

    def __init__(self, inner: torch.optim.Optimizer, precision: Precision, *,
                 clip_grad_norm: float | None = None) -> None:
        self.inner = inner
        self.mixprec = precision
        self.clip_grad_norm = clip_grad_norm
        self.norm_out: torch.Tensor | None = None
        """Where the next step writes the gradient norm it measured (the Trainer logs it)."""
        self._constructing = True
        super().__init__(inner.param_groups, inner.defaults)
        self._constructing = False
        self.param_groups, self.state, self.defaults = inner.param_groups, inner.state, inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_constructing", True):
            super().add_param_group(param_group)
            return
        self.inner.add_param_group(param_group)
        self.param_groups = self.inner.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("optimizer.step(closure) with mixprec: the Trainer computes the loss "
                              "and backward before the step")
        self.mixprec.step(self.inner, clip_grad_norm=self.clip_grad_norm, measure_grad_norm=True)
        if self.norm_out is not None and self.mixprec.scaler.last_grad_norm is not None:
            self.norm_out.copy_(self.mixprec.scaler.last_grad_norm.detach().float())
        # The Trainer zeroes only the model's gradients; a skipped step's FP32 master gradients
        # must not be taken for the next step's.
        self.inner.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), _STATE_KEY: self.mixprec.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        precision = state.pop(_STATE_KEY, None)
        self.inner.load_state_dict(state)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        if precision is not None:
            self.mixprec.load_state_dict(precision)


class _ScaleBy:
    """What ``accelerator.backward`` asks of a scaler: ``scale(loss)``."""

    def __init__(self, scale: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.scale = scale


class MixprecCallback(transformers.TrainerCallback):
    """mixprec's precision for a Hugging Face ``Trainer`` (with :class:`MixprecTrainerMixin`).

    Args:
        precision: a mode name (``"bf16-true"``, ``"16-mixed"``, ``"fp8-rowwise"``, ...), the
            compact form, ``"auto"``, or a ready :class:`mixprec.Precision`.
        overrides: per-layer formats ``{pattern: format}`` (not with a ready ``Precision``).
        run_dir: the mixprec run folder (default ``OUTPUT_DIR/mixprec``): ``config.toml``,
            ``metrics.csv`` (a row per Trainer log), ``events.jsonl``; ``mixprec report`` reads it.
            A script run again into the same ``output_dir`` finds the default folder holding the
            first run's record: it is kept, and the new run writes ``OUTPUT_DIR/mixprec-2`` (then
            ``-3``, ...), said in one line. A ``run_dir`` you name that holds a run is refused.
        overwrite: start over in a ``run_dir`` (or the default one) that holds a finished run.
        audit: run :func:`mixprec.monitor.audit` when training starts.
        trace_nonfinite: replay a skipped step (same batches, same RNG state, no optimizer step)
            with hooks and name the layer that made the inf/NaN.
        monitor_every: per-layer activation, gradient and update range statistics every this many
            steps (:class:`mixprec.monitor.NumericsMonitor`, into ``numerics.csv``); 0 = off.
        **scaler_options: :class:`mixprec.amp.GradScaler` options (not with a ready ``Precision``).
    """

    def __init__(self, precision: Precision | str | bool = "auto", *, overrides: Any = None,
                 run_dir: str | Path | None = None, overwrite: bool = False, audit: bool = True,
                 trace_nonfinite: bool = True, monitor_every: int = 0,
                 **scaler_options: Any) -> None:
        self.mixprec = as_precision(precision, owner="MixprecCallback", overrides=overrides,
                                    **scaler_options)
        self.run_dir = run_dir
        self.overwrite = overwrite
        self.audit = audit
        self.trace_nonfinite = trace_nonfinite
        self.monitor_every = int(monitor_every)
        self.monitor: NumericsMonitor | None = None
        self._sampling: contextlib.ExitStack | None = None
        self.record: RunRecord | None = None
        self._trainer: MixprecTrainerMixin | None = None
        self._group: list[tuple[Any, Any]] = []
        self._rng = None
        self._scale_before = 1.0
        self._last_log = time.perf_counter()
        self._stepped: Any = None
        """The optimizer ``Precision.step`` steps under a plain Trainer (the masters, or the Trainer's)."""

    @property
    def nonfinite(self) -> list:
        """The traced non-finite steps of the run (:class:`mixprec.monitor.NonFiniteEvent`)."""
        return self.record.nonfinite if self.record is not None else []

    def on_init_end(self, args, state, control, model: nn.Module | None = None, **kwargs: Any):
        for flag in ("bf16", "fp16"):
            if getattr(args, flag, False):
                raise ConfigError(f"TrainingArguments({flag}=True) with MixprecCallback: mixprec "
                                  f"owns the precision; leave {flag}=False and pass the mode to "
                                  "MixprecCallback(precision=...)")
        # The model is set up by MixprecTrainerMixin.__init__, once the Trainer is known to carry
        # mixprec's step; under a plain Trainer at on_train_begin (a mode that scales the loss is
        # refused there, before the user's model is changed).

    def on_train_begin(self, args, state, control, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any):
        if self._trainer is None:
            self._set_up_plain_trainer(model, optimizer, kwargs.get("lr_scheduler"))
        if self.record is not None:
            self.record.close()
        resume = state.global_step if state.global_step > 0 else None
        self.record = RunRecord(
            self.mixprec, Host(args.device, rank=args.process_index, world_size=args.world_size),
            run_dir=self.run_dir if self.run_dir is not None else Path(args.output_dir) / "mixprec",
            resume_step=resume, overwrite=self.overwrite, numbered=self.run_dir is None,
            overwrite_hint="MixprecCallback(overwrite=True)",
            config={"framework": "transformers", "model": type(model).__name__,
                    "max_steps": state.max_steps, "lr": args.learning_rate,
                    "clip_grad_norm": args.max_grad_norm or None,
                    "grad_accum_steps": args.gradient_accumulation_steps})
        inner = self._stepped or getattr(getattr(optimizer, "optimizer", optimizer), "inner", optimizer)
        self.monitor = (NumericsMonitor(model, every=self.monitor_every, compute_dtype=self.mixprec)
                        if self.monitor_every else None)
        self.record.start(model, step=state.global_step, total=state.max_steps, optimizer=inner,
                          run_audit=self.audit)
        self._last_log = time.perf_counter()

    def _set_up_plain_trainer(self, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
        """What MixprecTrainerMixin's overrides do, done from outside a plain ``transformers.Trainer``
        for a mode without loss scaling: the model's formats, its forward under
        ``Precision.autocast``, the optimizer's step replaced by ``Precision.step`` on FP32 masters
        (made now, the optimizer routed to them), the scheduler held on a skipped step. The Trainer
        keeps its own gradient clipping (on the model's unscaled 16-bit gradients). Loss scaling
        happens inside the Trainer's backward, out of a callback's reach: refused in one line."""
        precision = self.mixprec
        if precision.recipe.scales_loss:
            raise ConfigError(f"MixprecCallback(precision={precision.name!r}) scales the loss, inside the "
                              "Trainer's backward, which a callback cannot reach: build the trainer with "
                              "mixprec.integrations.transformers.MixprecTrainer(...) (or put "
                              "MixprecTrainerMixin in front of your Trainer subclass)")
        if self._stepped is not None:
            return                                            # train() called again: set up already
        inner = getattr(optimizer, "optimizer", optimizer)    # accelerate's wrapper
        if precision.recipe.keeps_masters and inner.state:
            raise ConfigError("MixprecCallback under a plain transformers.Trainer cannot resume a "
                              "checkpoint's FP32 masters (the Trainer loads the optimizer before a "
                              "callback sees it): resume with mixprec.integrations.transformers.MixprecTrainer")
        precision.setup_module(model)          # in place: the Trainer's optimizer keeps its parameters
        if precision.recipe.autocasts:
            forward = model.forward

            @functools.wraps(forward)
            def forward_in_precision(*args: Any, **kwargs: Any) -> Any:
                with precision.autocast():
                    return forward(*args, **kwargs)
            model.forward = forward_in_precision
        stepped = self._stepped = precision.setup_optimizer(inner, model)
        if stepped is inner:
            return          # no masters (FP32 parameters): the Trainer's own step is the mode's
        route_to_masters(inner, stepped)

        def step(closure: Callable[[], Any] | None = None) -> None:
            copy_hyperparameters(inner, stepped)        # the Trainer's scheduler sets inner's LRs
            precision.step(stepped, clip_grad_norm=None)
            stepped.zero_grad(set_to_none=True)         # a skipped step's master state goes too
        replace_step(inner, step)
        if scheduler is not None and not isinstance(scheduler, StepIfTaken):
            _hold_on_skipped_steps(scheduler, precision)

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self._group = []
        self._scale_before = self.mixprec.scaler.get_scale()
        self._rng = capture_rng_state() if self.trace_nonfinite else None
        step = state.global_step + 1
        if self.monitor is not None and self.monitor.should_sample(step):
            self._sampling = contextlib.ExitStack()          # hooks only on sampled steps
            self._sampling.enter_context(self.monitor.sample(step))

    def on_pre_optimizer_step(self, args, state, control, optimizer: Any = None, **kwargs: Any):
        if self._sampling is not None:                      # update statistics around the step
            inner = self._stepped or getattr(getattr(optimizer, "optimizer", optimizer), "inner", optimizer)
            self._sampling.enter_context(self.monitor.track_updates(inner))

    def micro_batch(self, inputs: Any, num_items_in_batch: Any) -> None:
        """A micro-batch of the current step (kept for the replay of a skipped step)."""
        if self.trace_nonfinite:
            self._group.append((inputs, num_items_in_batch))

    def on_step_end(self, args, state, control, model: nn.Module | None = None, **kwargs: Any):
        if self._sampling is not None:                      # the sampled step is over
            self._sampling.close()
            self._sampling = None
            self.record.logger.log_numerics(self.monitor.last_rows)
        if not self.mixprec.scaler.last_step_skipped:
            self._group = []
            return
        step, trainer = state.global_step, self._trainer
        if self.trace_nonfinite and self._group:
            self.record.trace_skip(trainer.model, trainer.mixprec_replay(self._group, self._scale_before),
                                   step=step, scale_before=self._scale_before, rng_state=self._rng)
        else:
            self.record.skip(step, self._scale_before, None)
        self._group = []

    def on_log(self, args, state, control, logs: dict | None = None, **kwargs: Any):
        if self.record is None or not logs:
            return
        now = time.perf_counter()
        precision = self.mixprec
        if "loss" in logs:
            norm = precision.scaler.last_grad_norm
            self.record.log(state.global_step, epoch=logs.get("epoch"), loss=logs["loss"],
                            lr=logs.get("learning_rate"), skipped=int(precision.scaler.last_step_skipped),
                            grad_norm=float(norm) if norm is not None else None,
                            time_s=now - self._last_log)
            self._last_log = now
        elif "eval_loss" in logs:
            self.record.log(state.global_step, epoch=logs.get("epoch"), val_loss=logs["eval_loss"])

    def on_train_end(self, args, state, control, **kwargs: Any):
        if self.record is not None:
            self.record.close()


def _hold_on_skipped_steps(scheduler: Any, precision: Precision) -> None:
    """The Trainer's own scheduler object, made not to step after a skipped step (the Trainer
    keeps its reference, so it cannot be swapped for :class:`StepIfTaken`). A subclass made for
    it, like Fabric's optimizer wrapper: an attribute on the instance would land in its
    ``state_dict()`` and break the Trainer's checkpoint."""
    cls = type(scheduler)

    def step(self: Any, *args: Any, **kwargs: Any) -> None:
        if not precision.scaler.last_step_skipped:
            cls.step(self, *args, **kwargs)

    scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})


class MixprecTrainerMixin:
    """Put in front of ``transformers.Trainer`` (or your subclass of it) to let the
    :class:`MixprecCallback` in ``callbacks=[...]`` own the precision of the step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        found = [c for c in self.callback_handler.callbacks if isinstance(c, MixprecCallback)]
        if len(found) != 1:
            raise ConfigError(f"{type(self).__name__} needs exactly one MixprecCallback in "
                              f"callbacks=[...], got {len(found)}")
        self.mixprec_callback = found[0]
        self.mixprec_callback._trainer = self
        self.mixprec.setup_module(self.model)   # storage dtypes, norms FP32, FP8/per-layer swap

    @property
    def mixprec(self) -> Precision:
        return self.mixprec_callback.mixprec

    def create_optimizer(self, model: nn.Module | None = None):
        optimizer = super().create_optimizer(model)
        if isinstance(optimizer, PrecisionOptimizer):
            return optimizer
        inner = self.mixprec.setup_optimizer(optimizer, model if model is not None else self.model)
        wrapped = PrecisionOptimizer(inner, self.mixprec, clip_grad_norm=self.args.max_grad_norm or None)
        if self.lr_scheduler is not None and getattr(self.lr_scheduler, "optimizer", None) is optimizer:
            move_scheduler(self.lr_scheduler, wrapped)   # a schedule passed in sets the masters' lr
        self.optimizer = wrapped
        return wrapped

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, (StepIfTaken, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            self.lr_scheduler = StepIfTaken(scheduler, self.mixprec)
        return self.lr_scheduler

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        stack.enter_context(self.mixprec.autocast())
        return stack

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None):
        self.mixprec_callback.micro_batch(inputs, num_items_in_batch)
        with self._scaled_backward(self.mixprec.scale_loss):
            return super().training_step(model, inputs, num_items_in_batch)

    @contextlib.contextmanager
    def _scaled_backward(self, scale: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
        """``accelerator.backward(loss)`` multiplies by the loss scale inside (FP16 modes only)."""
        if not self.mixprec.recipe.scales_loss:
            yield
            return
        accelerator, saved = self.accelerator, self.accelerator.scaler
        accelerator.scaler = _ScaleBy(scale)
        try:
            yield
        finally:
            accelerator.scaler = saved

    def _clip_grad_norm(self, model: nn.Module):
        return None                       # Precision.step clips the unscaled FP32 gradients

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None):
        # Filled by the coming Precision.step with the unscaled norm it measured (before clipping).
        norm = torch.full((), float("nan"))
        for opt in (self.optimizer, getattr(self.optimizer, "optimizer", None)):  # accelerate wraps it
            if isinstance(opt, PrecisionOptimizer):
                opt.norm_out = norm
        return norm

    def mixprec_replay(self, micro_batches: list[tuple[Any, Any]], scale: float) -> Callable[[], Any]:
        """``run_step`` for :func:`mixprec.monitor.locate_nonfinite`: the Trainer's own forward and
        backward of a skipped step's micro-batches on the unwrapped model, at the step's scale."""
        step = super().training_step

        def run_step() -> torch.Tensor | None:
            total = None
            with self._scaled_backward(lambda loss: loss * scale):
                for inputs, n in micro_batches:
                    loss = step(self.model, inputs, n)
                    total = loss if total is None else total + loss
            return total

        return run_step


class MixprecTrainer(MixprecTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose step's precision is the :class:`MixprecCallback`'s."""
