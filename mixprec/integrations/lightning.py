"""mixprec inside Lightning: a precision plugin for ``Trainer`` and ``Fabric``, and a callback.

::

    import lightning as L
    from mixprec.integrations.lightning import MixprecCallback, MixprecPrecision

    trainer = L.Trainer(plugins=[MixprecPrecision("bf16-true")], callbacks=[MixprecCallback()])

Every precision decision is the plugin's :class:`mixprec.Precision` (``plugin.mixprec``), the
object ``fit()`` and a hand-written loop use; the plugin only maps Lightning's hooks onto it:

=========================  =========================================================================
Lightning hook             what runs
=========================  =========================================================================
``convert_module``         ``Precision.setup_module``: storage dtypes (norms, gates FP32), FP8 and
                           per-layer formats
``connect``                ``Precision.setup_optimizer``: FP32 masters for 16-bit parameters (the
                           schedulers are moved onto them); per-step schedulers wrapped so they do
                           not step after a skipped step
``forward_context``        ``Precision.autocast``
``pre_backward``           ``Precision.scale_loss`` (FP16 modes; others unchanged)
``clip_gradients``         remembered: ``Precision.step`` clips the unscaled (master) gradients
``optimizer_step``         the closure (training_step + backward), Lightning's
                           ``on_before_optimizer_step``, then ``Precision.step``: unscale once,
                           inf/NaN check, clip, step or skip, scale update
``state_dict``             ``Precision.state_dict`` (the loss scale and skip counts), in checkpoints
=========================  =========================================================================

:class:`MixprecCallback` adds what a plugin cannot: the audit at the start of ``fit``, a skipped
step replayed with hooks to name the layer that made the inf/NaN (console, ``callback.nonfinite``,
and with ``run_dir`` a mixprec run folder), the loss scale and skip count in Lightning's
loggers (``mixprec/loss_scale``, ``mixprec/skipped_steps``) and, with ``monitor_every``, per-layer
range statistics.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from mixprec.amp.grads import HasMasterGrads
from mixprec.precision import Precision
from mixprec.errors import ConfigError
from mixprec.integrations.common import (Host, RunRecord, StepIfTaken, as_precision, copy_hyperparameters,
                                         move_scheduler, route_to_masters)
from mixprec.monitor import NumericsMonitor, capture_rng_state

__all__ = ["MixprecPrecision", "MixprecFabricPrecision", "MixprecCallback"]


def _refuse_lbfgs(optimizer: Any) -> None:
    inner = getattr(optimizer, "optimizer", optimizer)       # a LightningOptimizer
    if isinstance(inner, torch.optim.LBFGS):
        raise ConfigError("LBFGS re-evaluates its closure inside step(), which a skipped step and "
                          "FP32 masters cannot follow; use another optimizer with mixprec's plugin")


class MixprecPrecision(TrainerPrecision):
    """Lightning ``Trainer`` precision plugin that delegates to :class:`mixprec.Precision`.

    Args:
        precision: a mode name (``"bf16-true"``, ``"16-mixed"``, ``"fp8-rowwise"``, the compact
            ``"p=f32,c=bf16,o=f32"`` form, ``"auto"``) or a ready :class:`mixprec.Precision`.
        overrides: per-layer formats ``{pattern: format}`` (not with a ready ``Precision``).
        **scaler_options: :class:`mixprec.amp.GradScaler` options (not with a ready ``Precision``).

    Gradient clipping: ``Trainer(gradient_clip_val=...)`` clips the unscaled FP32 gradients inside
    ``Precision.step`` (by norm; ``gradient_clip_algorithm="value"`` is refused).
    """

    def __init__(self, precision: Precision | str | bool = "auto", *, overrides: Any = None,
                 **scaler_options: Any) -> None:
        self.mixprec = as_precision(precision, owner="MixprecPrecision", overrides=overrides,
                                    **scaler_options)
        self.precision = self.mixprec.name       # what Lightning prints as trainer.precision
        self._clip: float | None = None
        self.num_steps = 0
        """Optimizer steps finished through this plugin (taken or skipped)."""
        self.measure_grad_norm = False
        """Measure the unscaled gradient norm on every step (``Precision.scaler.last_grad_norm``); the
        callback turns it on when it writes a run folder."""

    # --- set-up --------------------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.mixprec.setup_module(module)

    def connect(self, model: nn.Module, optimizers: list, lr_scheduler_configs: list
                ) -> tuple[nn.Module, list, list]:
        first = next(model.parameters(), None)
        if first is not None:
            self.mixprec.device = first.device             # the model is on its device now
        new = []
        for opt in optimizers:
            _refuse_lbfgs(opt)
            new.append(self.mixprec.setup_optimizer(opt, model))
        for config in lr_scheduler_configs:
            for old, wrapped in zip(optimizers, new):
                if wrapped is not old and getattr(config.scheduler, "optimizer", None) is old:
                    move_scheduler(config.scheduler, wrapped)   # the schedule sets the masters' lr
            if config.interval == "step" and not isinstance(config.scheduler, StepIfTaken):
                config.scheduler = StepIfTaken(config.scheduler, self.mixprec)
        return model, new, lr_scheduler_configs

    # --- the step ------------------------------------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.mixprec.autocast()

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:
        return super().pre_backward(self.mixprec.scale_loss(tensor), module)

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ConfigError("gradient_clip_algorithm='value' with mixprec's plugin: mixprec clips "
                              "the unscaled FP32 gradients by norm; use gradient_clip_algorithm='norm'")
        self._clip = float(clip_val)                      # applied inside Precision.step

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule,
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        if kwargs:
            raise ConfigError(f"optimizer.step({', '.join(kwargs)}=...) with mixprec's plugin: "
                              "Precision.step takes no optimizer arguments")
        _refuse_lbfgs(optimizer)
        result = closure()                                # training_step + backward
        self._after_closure(model, optimizer)             # on_before_optimizer_step, clipping value
        if result is None and model.automatic_optimization:
            self._clip = None
            return result                                 # training_step returned None: no step
        clip, self._clip = self._clip, None
        self.mixprec.step(optimizer, clip_grad_norm=clip,  # unscale, check, clip, step or skip
                          measure_grad_norm=self.measure_grad_norm)
        self.num_steps += 1
        return result

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.mixprec.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mixprec.load_state_dict(state_dict)


class MixprecFabricPrecision(FabricPrecision):
    """Lightning ``Fabric`` precision plugin that delegates to :class:`mixprec.Precision`.

    The standard Fabric loop works as it is::

        plugin = MixprecFabricPrecision("bf16-true", clip_grad_norm=1.0)
        fabric = Fabric(plugins=[plugin])
        model, optimizer = fabric.setup(model, optimizer)

    Fabric hands the plugin the model at ``setup`` but the optimizer only when stepping it, so in a
    mode that keeps FP32 masters they are made at the first ``optimizer.step()``, while the
    optimizer has no state yet (the first step is the same as with masters made earlier). From
    then on your optimizer is routed to them: its learning rates (a scheduler's too) are the
    masters', and its ``zero_grad``, ``state_dict`` and ``load_state_dict`` are theirs, so
    ``fabric.save`` writes the masters. ``fabric.setup(*plugin.setup(model, optimizer))`` makes
    them before ``fabric.setup`` instead: needed to load such a checkpoint before the first step
    (an optimizer that already has state but no masters is refused in one line).

    ``fabric.backward(loss)`` scales where the mode scales; ``optimizer.step()`` is
    ``Precision.step`` (unscale, check, clip to ``clip_grad_norm``, step or skip, scale update).
    ``fabric.clip_gradients`` is refused (pass ``clip_grad_norm``).
    """

    def __init__(self, precision: Precision | str | bool = "auto", *, overrides: Any = None,
                 clip_grad_norm: float | None = None, **scaler_options: Any) -> None:
        self.mixprec = as_precision(precision, owner="MixprecFabricPrecision", overrides=overrides,
                                    **scaler_options)
        self.precision = self.mixprec.name
        self.clip_grad_norm = clip_grad_norm
        self._modules: list[nn.Module] = []

    def setup(self, model: nn.Module, optimizer: Any = None) -> tuple[nn.Module, Any]:
        """``Precision.setup``: storage dtypes, formats, and the optimizer with FP32 masters."""
        model, optimizer = self.mixprec.setup(model, optimizer)
        self._modules.append(model)
        return model, optimizer

    def convert_module(self, module: nn.Module) -> nn.Module:
        module = self.mixprec.setup_module(module)          # idempotent after setup()
        self._modules.append(module)
        return module

    def _masters(self, optimizer: Any) -> Any:
        """What ``Precision.step`` steps for ``optimizer``: itself when it has masters or the mode
        keeps none, else its FP32-master optimizer, made now on its first step."""
        if not self.mixprec.recipe.keeps_masters or isinstance(optimizer, HasMasterGrads):
            return optimizer
        masters = getattr(optimizer, "_mixprec_masters", None)
        if masters is not None:
            copy_hyperparameters(optimizer, masters)           # a scheduler sets the user's groups
            return masters
        if optimizer.state:
            raise ConfigError(f"precision {self.mixprec.name} keeps FP32 master weights but this "
                              f"{type(optimizer).__name__} already has state (loaded from a checkpoint, or "
                              "stepped outside mixprec) and no masters; make them before loading: "
                              "model, optimizer = fabric.setup(*plugin.setup(model, optimizer))")
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        model = next((m for m in reversed(self._modules)
                      if any(id(p) in owned for p in m.parameters())), None)
        if model is None:
            raise ConfigError(f"this {type(optimizer).__name__} steps none of the parameters of the "
                              "model given to fabric.setup; build it over model.parameters()")
        masters = self.mixprec.setup_optimizer(optimizer, model)
        route_to_masters(optimizer, masters)
        return masters

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.mixprec.autocast()

    def convert_output(self, data: Any) -> Any:
        return self.mixprec.convert_output(data)

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.mixprec.scale_loss(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise ConfigError("optimizer.step(closure) with mixprec's plugin: compute the loss, "
                              "fabric.backward(loss), then optimizer.step()")
        _refuse_lbfgs(optimizer)
        taken = self.mixprec.step(self._masters(optimizer), clip_grad_norm=self.clip_grad_norm)
        optimizer._opt_called = True           # a torch LR scheduler on it: the optimizer stepped
        return bool(taken)                     # Fabric returns a bool: read here (one read)

    def unscale_gradients(self, optimizer: Any) -> None:
        raise ConfigError("fabric.clip_gradients with mixprec's plugin: mixprec clips the unscaled "
                          "FP32 gradients inside the step; pass MixprecFabricPrecision(..., "
                          "clip_grad_norm=MAX)")

    def state_dict(self) -> dict[str, Any]:
        return self.mixprec.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.mixprec.load_state_dict(state_dict)


@contextlib.contextmanager
def _no_logging(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing inside (a replay must not log twice)."""
    module.log = lambda *a, **k: None             # instance attributes shadow the methods
    module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        del module.log, module.log_dict


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, dict):
        return output.get("loss")
    return output


class MixprecCallback(pl.Callback):
    """The audit at start, skipped steps traced to their layer, scale and skips in the loggers.

    Needs :class:`MixprecPrecision` in ``Trainer(plugins=[...])``.

    Args:
        audit: run :func:`mixprec.monitor.audit` when training starts (findings printed, and in
            ``events.jsonl`` with ``run_dir``).
        trace_nonfinite: replay a skipped step's batches (same RNG state, ``self.log`` silenced,
            no optimizer step) with hooks and name the layer that made the inf/NaN.
        run_dir: also write a mixprec run folder there (``mixprec report RUN_DIR`` reads it).
        log_every: rows of ``metrics.csv`` every this many steps (with ``run_dir``).
        monitor_every: per-layer activation, gradient and update range statistics every this many
            steps (:class:`mixprec.monitor.NumericsMonitor`; ``numerics.csv`` with ``run_dir``,
            ``callback.monitor.last_rows``); 0 = off.
    """

    def __init__(self, *, audit: bool = True, trace_nonfinite: bool = True,
                 run_dir: str | Path | None = None, log_every: int = 1,
                 monitor_every: int = 0) -> None:
        self.monitor_every = int(monitor_every)
        self.monitor: NumericsMonitor | None = None
        self._sampling: contextlib.ExitStack | None = None
        self.audit = audit
        self.trace_nonfinite = trace_nonfinite
        self.run_dir = run_dir
        self.log_every = max(1, int(log_every))
        self.record: RunRecord | None = None
        self._plugin: MixprecPrecision | None = None
        self._group: list[tuple[Any, int]] = []          # this step's micro-batches
        self._rng = None
        self._scale_before = 1.0
        self._steps_seen = 0

    @property
    def nonfinite(self) -> list:
        """The traced non-finite steps of the run (:class:`mixprec.monitor.NonFiniteEvent`)."""
        return self.record.nonfinite if self.record is not None else []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixprecPrecision):
            raise ConfigError("MixprecCallback needs mixprec's precision plugin: "
                              "Trainer(plugins=[MixprecPrecision(mode)], callbacks=[MixprecCallback()])")
        self._plugin = plugin
        self._steps_seen = plugin.num_steps
        plugin.measure_grad_norm = plugin.measure_grad_norm or self.run_dir is not None
        resume = trainer.global_step if trainer.global_step > 0 else None
        self.record = RunRecord(plugin.mixprec, Host(trainer.strategy.root_device,
                                                     rank=trainer.global_rank,
                                                     world_size=trainer.world_size),
                                run_dir=self.run_dir, resume_step=resume,
                                config={"framework": "lightning",
                                        "model": type(pl_module).__name__})
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else \
            int(trainer.estimated_stepping_batches)
        self.monitor = (NumericsMonitor(pl_module, every=self.monitor_every,
                                        compute_dtype=plugin.mixprec) if self.monitor_every else None)
        self.record.start(pl_module, step=trainer.global_step, total=total,
                          optimizer=trainer.optimizers[0] if trainer.optimizers else None,
                          run_audit=self.audit)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if not self._group:                                # the first micro-batch of a step
            self._scale_before = self._plugin.mixprec.scaler.get_scale()
            self._rng = capture_rng_state() if self.trace_nonfinite else None
            step = trainer.global_step + 1
            if self.monitor is not None and self._sampling is None and self.monitor.should_sample(step):
                self._sampling = contextlib.ExitStack()     # hooks only on sampled steps
                self._sampling.enter_context(self.monitor.sample(step))
        if self.trace_nonfinite:
            self._group.append((batch, batch_idx))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = self._plugin
        if plugin.num_steps == self._steps_seen:           # accumulating: no step yet
            if not self.trace_nonfinite:
                self._group = []
            return
        self._steps_seen = plugin.num_steps
        precision = plugin.mixprec
        step = trainer.global_step
        if self._sampling is not None:                     # the sampled step is over
            self._sampling.close()
            self._sampling = None
            self.record.logger.log_numerics(self.monitor.last_rows)
        if precision.scaler.last_step_skipped:
            if self.trace_nonfinite:
                self.record.trace_skip(pl_module, self._replay(trainer, pl_module), step=step,
                                       scale_before=self._scale_before, rng_state=self._rng)
            else:
                self.record.skip(step, self._scale_before, None)
        self._group = []
        pl_module.log("mixprec/skipped_steps", float(precision.scaler.num_skipped_steps))
        if precision.recipe.scales_loss:
            pl_module.log("mixprec/loss_scale", precision.scaler.get_scale())
        if step % self.log_every == 0:
            loss = _loss_of(outputs)
            self.record.log(step, epoch=trainer.current_epoch, skipped=int(precision.scaler.last_step_skipped),
                            loss=float(loss) if isinstance(loss, torch.Tensor) else None,
                            lr=_first_lr(trainer),
                            grad_norm=(float(precision.scaler.last_grad_norm)
                                       if precision.scaler.last_grad_norm is not None else None))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        if self._sampling is not None:                     # update statistics around the step
            self._sampling.enter_context(
                self.monitor.track_updates(getattr(optimizer, "_optimizer", optimizer)))

    def _replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[], Any]:
        precision, group = self._plugin.mixprec, list(self._group)
        accumulate, scale = trainer.accumulate_grad_batches, self._scale_before

        def run_step() -> torch.Tensor | None:
            total = None
            with _no_logging(pl_module):
                for batch, batch_idx in group:
                    with precision.autocast():
                        loss = _loss_of(pl_module.training_step(batch, batch_idx))
                    if loss is None:
                        continue
                    loss = loss.float() / accumulate
                    (loss * scale).backward()
                    total = loss.detach() if total is None else total + loss.detach()
            return total

        return run_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.record is not None:
            self.record.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self.record is not None:
            self.record.close()


def _first_lr(trainer: pl.Trainer) -> float | None:
    if not trainer.optimizers:
        return None
    return float(trainer.optimizers[0].param_groups[0]["lr"])
