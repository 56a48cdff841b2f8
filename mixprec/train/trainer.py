"""The training loop: ``fit()`` and the one readable ``train_step``.

Every precision decision of a step is visible in :meth:`Trainer.train_step`, in the order of
ARCHITECTURE.md: autocast -> loss in FP32 -> scale -> backward -> (the previous step concluded)
-> unscale once (fused with the non-finite check, agreed across ranks) -> clip -> step or skip on
the device -> scaler update on the device. The host learns whether the step was taken just before
the next step's update (:meth:`Trainer.conclude`): the scheduler moves only if it was, before
that update runs at it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from mixprec.data.position import resumable
from mixprec.models.objective import add_tokens
from mixprec.monitor import NumericsMonitor, ScaleWatch
from mixprec.monitor.guard import TrainingGuard
from mixprec.monitor.profile import StepProfiler
from mixprec.monitor.replan import LayerReplanner
from mixprec.monitor.trace import capture_rng_state
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.precision import Policy, Precision
from mixprec.runs.checkpointer import Checkpointer
from mixprec.runs.events import RunEvents
from mixprec.strategies import Strategy, get_strategy
from mixprec.train.checkpoints import save
from mixprec.train.config import FitConfig, given_settings
from mixprec.train.ending import stop_agreed, stop_if_diverged, stop_now
from mixprec.train.evaluation import evaluate
from mixprec.train.health import seed_everything
from mixprec.train.hooks import StepHook, around
from mixprec.train.outcome import Outcomes, outcome_lags, replay_forward, trace_nonfinite
from mixprec.train.run import (FitResult, audit_first_step, nothing_to_train, open_run, result, running,
                               total_steps)
from mixprec.train.setup import (activations_in_fp8, apply_precision, build_optimizer, build_scheduler,
                                 choose_precision, compiled_first_step, overlapped_update,
                                 refuse_swaps_when_sharded, step_hooks, watch_formats, watch_numbers,
                                 with_overrides)
from mixprec.train.step import Batch, StepOutput

__all__ = ["Trainer", "fit", "FitResult", "StepOutput"]


class Trainer:
    """Trains any ``nn.Module`` whose forward returns a loss, a Hugging Face causal LM, or any
    model with ``loss_fn``. Every precision decision is the :class:`~mixprec.Precision`'s; the
    parts the loop is built with and what a run writes are train/'s other modules' (setup.py,
    outcome.py, run.py, checkpoints.py, run_log.py, ending.py, evaluation.py)."""

    def __init__(self, model: nn.Module, *, config: FitConfig | None = None,
                 mixed_precision: str | Policy | Precision | bool | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                 strategy: Strategy | str | None = None, **overrides: Any) -> None:
        self.config = with_overrides(config, overrides)
        self.strategy = get_strategy(strategy)
        self.device = self.strategy.device
        # Every precision choice of the run, fixed here (an optimizer found may decide `auto`).
        self.precision, self._found_optimizer = choose_precision(
            model, self.config, given_settings(config, overrides), mixed_precision, optimizer,
            self.device)
        self.loss_fn = loss_fn
        self.raw_model = model
        self._user_optimizer = optimizer
        self._user_scheduler = lr_scheduler
        self.step = 0
        self.epoch = 0
        self.run_dir: Path | None = None
        self._group_settings: list[dict[str, Any]] = []
        """Per optimizer group, the settings of this run's config a restore puts back."""
        self._lock = None
        """Rank 0's lock on the run folder (mixprec/runs/lock.py), held while fit() runs."""
        self._notes: list[tuple[str, str]] = []
        """``(message, kind)`` said and recorded in events.jsonl once the run's events are open."""
        # Built by prepare() / fit(): every attribute a Trainer has is declared here.
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.objective: Callable | None = None
        self.checkpointer: Checkpointer | None = None
        self.events: RunEvents | None = None
        self.monitor: NumericsMonitor | None = None
        self.scale_watch: ScaleWatch | None = None
        self.overlap: OverlappedUpdate | None = None
        self.fp8_store = None
        self.profiler: StepProfiler | None = None
        self.replanner: LayerReplanner | None = None
        self.guard: TrainingGuard | None = None
        self.hooks: list[StepHook] = []
        """The optional per-step helpers, in call order (mixprec.train.hooks)."""
        self.step_batches: list[Batch] = []
        """The micro-batches of the step just taken (for hooks that re-run its forward)."""
        self.step_event: Any = None
        """The traced inf/NaN origin of the step just taken (a ``NonFiniteEvent``), or None."""
        self.settle_each_step = False
        """True: ``fit()`` reads each step's outcome right after it (:attr:`outcome_lags`); False
        (the default): just before the next step's update, after its forward and backward."""
        self.outcomes = Outcomes()
        """The step whose outcome the host has not read yet, and the run's health (outcome.py)."""

    # The run's Precision's parts, by the names the trainer always gave them.
    policy = property(lambda self: self.precision.policy)
    scaler = property(lambda self: self.precision.scaler)
    fp8_report = property(lambda self: self.precision.layers.fp8_report)

    # ------------------------------------------------------------------ set-up

    def prepare(self, total_steps: int) -> None:
        """Apply the precision to the model, wrap it, build optimizer and scheduler, and the
        watchers as step hooks (each part: train/setup.py)."""
        cfg, precision, strategy, notes = self.config, self.precision, self.strategy, self._notes
        refuse_swaps_when_sharded(cfg, strategy)    # before anything touches the model
        found = None
        if self._user_optimizer is None:
            found = self._user_optimizer = self._found_optimizer
        self.model, self.objective = apply_precision(self.raw_model, precision, strategy, cfg,
                                                     loss_fn=self.loss_fn, optimizer=self._user_optimizer,
                                                     found=found, notes=notes)
        self.optimizer, self._group_settings = build_optimizer(
            self.model, precision, strategy, cfg, optimizer=self._user_optimizer,
            scheduler=self._user_scheduler, notes=notes)
        self.scheduler = build_scheduler(self.optimizer, cfg, scheduler=self._user_scheduler,
                                         total_steps=total_steps, notes=notes)
        unwrapped = strategy.unwrap(self.model)
        self.monitor, self.scale_watch = watch_numbers(unwrapped, precision, cfg)
        self.overlap = overlapped_update(unwrapped, self.optimizer, strategy, cfg,
                                         replacing=self.overlap, notes=notes)
        self.fp8_store = activations_in_fp8(unwrapped, precision, cfg, replacing=self.fp8_store,
                                            notes=notes)
        self.replanner, self.guard = watch_formats(unwrapped, precision, strategy, cfg,
                                                   optimizer=self.optimizer, scheduler=self.scheduler)
        self.hooks = step_hooks(self.scale_watch, self.monitor, self.replanner, self.guard)

    # ------------------------------------------------------------------ the step

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        """One optimizer step over ``len(micro_batches)`` micro-batches (gradient accumulation).

        Its outcome (taken, or skipped for inf/NaN gradients) may stay on the device: inside
        ``fit()`` the host reads it just before the next step's update (:meth:`conclude`); called
        on its own, the step concludes before it returns (the LR schedule moves, as it always did)."""
        model, opt, precision = self.model, self.optimizer, self.precision
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        tokens: torch.Tensor | int | None = 0
        opt.zero_grad(set_to_none=True)                   # fresh gradients for this step
        if self.overlap is not None:
            self.overlap.begin_step()                     # FSDP2/compiled: wait for the update
        step = self.step + 1
        with around(self, "around_forward", step):       # the hooks sample only on their steps
            for i, batch in enumerate(micro_batches):
                # Gradients are all-reduced only in the last micro-batch's backward.
                sync = contextlib.nullcontext() if i == n - 1 else self.strategy.no_sync(model)
                with sync:
                    loss, count = self.batch_loss(model, batch, n)   # FP32, averaged over micro-batches
                    with record_function("mixprec.backward"):
                        precision.backward(loss)          # x loss scale (FP16) or x 1 (BF16/FP32)
                loss_sum += loss.detach()
                tokens = add_tokens(tokens, count)                    # non-padding tokens
            # The previous step's outcome, read now (fit() left it pending): its flag's host copy
            # was issued before its update, and this forward and backward were queued behind
            # that update, so on a GPU the read waits for nothing queued since. A taken step
            # advances the schedule before this update runs at it; a skipped one is traced while
            # the parameters are still those it saw.
            self.conclude()
            scale_before = precision.scaler.get_scale()  # this backward's (no read: concluded)
            lr = opt.param_groups[0]["lr"]               # what this update runs at (metrics' lr)
            logged = self.step % self.config.log_interval == self.config.log_interval - 1
            with around(self, "around_update", step):
                # Unscale once (fused inf/NaN check, agreed across ranks) -> clip the unscaled
                # gradients -> step the FP32 masters and copy back, or skip -> update the scale.
                taken = precision.step(opt, clip_grad_norm=self.config.clip_grad_norm,
                                       measure_grad_norm=logged, overlap=self.overlap)
        out = StepOutput(loss_sum, precision.scaler.last_grad_norm, None, scale_before, tokens, lr,
                         taken=taken)                    # taken: a bool, or still on the device
        self.outcomes.hold(step, out, micro_batches)
        if not self.outcomes.fitting:
            self.conclude()                              # the schedule moves now (no fit() loop)
        return out

    def batch_loss(self, model: nn.Module, batch: Batch, n: int = 1) -> tuple[torch.Tensor, Any]:
        """One batch -> ``(FP32 loss / n, tokens)``: to the device, the objective (decided once
        from model + batch, models/objective.py) under the mode's autocast (matmuls in the compute
        dtype), the loss in FP32. The step, the non-finite replay and evaluation all go through
        here. ``tokens``: the non-padding tokens (a device tensor when counted from an attention
        mask, None for inputs without token ids)."""
        batch = self.strategy.to_device(batch)
        with self.precision.autocast(), record_function("mixprec.forward"):
            loss = self.objective(model, batch)
        return loss.float() / n, self.objective.tokens(batch)

    def conclude(self) -> None:
        """Finish the step whose outcome the host has not read yet (a no-op when there is none):
        read it, advance the LR schedule if it was taken, and inside ``fit()`` trace a skip, record
        it, call the hooks' ``after_step`` and count it for the run's health. When ``fit()`` calls
        it, and why every update still runs at the LR it ran at before the lag: train/outcome.py."""
        self.outcomes.conclude(self)

    @property
    def outcome_lags(self) -> bool:
        """Whether ``fit()`` may read a step's outcome as late as just before the next step's
        update (True), not right after the step (when: train/outcome.py)."""
        return outcome_lags(self)

    def settle(self) -> None:
        """Wait (on the device, not the host) for an overlapped update still in flight; before
        anything outside the forward reads parameters or optimizer state."""
        if self.overlap is not None:
            self.overlap.wait()

    def trace_nonfinite(self, micro_batches: list[Batch], out: StepOutput, rng_state: Any):
        """Replay a skipped step's batches with hooks to find the layer that made the inf/NaN,
        leaving parameters, gradients and the RNG stream as they were (train/outcome.py)."""
        return trace_nonfinite(self, micro_batches, out, rng_state)

    def replay_forward(self) -> None:
        """The forward of the step just taken again, without backward (the guard's probe)."""
        replay_forward(self)

    @torch.no_grad()
    def evaluate(self, val_loader: Iterable[Batch], max_batches: int | None = None) -> float:
        """Mean validation loss over up to ``max_batches`` batches, reduced across ranks."""
        self.settle()
        return evaluate(self.model, val_loader, self.batch_loss, self.strategy, max_batches)

    # ------------------------------------------------------------------ the loop

    def fit(self, train_loader: Iterable[Batch], val_loader: Iterable[Batch] | None = None, *,
            resume: str | Path | bool | None = None) -> FitResult:
        """Train for ``max_steps`` (or ``epochs``); ``resume``: True (the run folder's newest
        checkpoint), or a run folder / checkpoint folder to continue from. The settings of this
        call win over the checkpoint's: ``lr``, the schedule (``warmup_steps``, ``min_lr_ratio``)
        and ``max_steps`` re-stretch the LR schedule (train/checkpoints.py: ``reschedule``)."""
        try:
            return self._fit(train_loader, val_loader, resume=resume)
        finally:
            if self._lock is not None:      # the run folder is free for the next writer
                self._lock.release()
                self._lock = None

    def _fit(self, train_loader: Iterable[Batch], val_loader: Iterable[Batch] | None, *,
             resume: str | Path | bool | None) -> FitResult:
        # A loader without its own position gets one (DataLoader, list), or fit() says it cannot.
        train_loader = resumable(train_loader, seed=self.config.seed)
        total = total_steps(train_loader, self.config)
        if (finished := nothing_to_train(self, total, resume)) is not None:
            return finished      # said in one line; nothing built or written (train/finished.py)
        seed_everything(self.config.seed)          # dropout, data order of plain loaders
        self.prepare(total)
        run = open_run(self, train_loader, total, resume)   # the folder, a restore, the logs
        cfg, events, meter, last_val, last_out = self.config, run.log.events, run.log.meter, None, None
        compiling = cfg.compile                    # the first step of this process compiles
        lags = self.outcome_lags
        with running(self, run):
            while self.step < total:
                self.epoch, batches = next(run.groups)
                self.outcomes.rng = capture_rng_state() if cfg.trace_nonfinite else None  # to replay a skip
                with around(self, "around_step", self.step + 1):
                    out = last_out = (compiled_first_step(self, batches) if compiling
                                      else self.train_step(batches))
                compiling = False
                self.step += 1
                if run.audit_first_step:
                    audit_first_step(self, run)           # what the first step changed
                do_eval = val_loader is not None and (
                    (cfg.eval_interval and self.step % cfg.eval_interval == 0) or self.step == total)
                logged = self.step % cfg.log_interval == 0 or self.step == total or do_eval
                saved = (cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0) or self.step == total
                if not lags or do_eval or logged or saved:
                    # The host learns the step's outcome now; in steady state only just before
                    # the next step's update (in train_step), when its flag is long done.
                    self.conclude()
                if do_eval:
                    with meter.evaluating():          # not training time: out of tokens/s
                        last_val = self.evaluate(val_loader, cfg.eval_batches)
                meter.add(out, batches)
                if logged:
                    run.log.row(out, step=self.step, epoch=self.epoch, val_loss=last_val if do_eval else None)
                    stop_if_diverged(self, run.health.verdict(last_val if do_eval else None), last_out)
                if saved:
                    save(self, train_loader)
                events.advance()
                # One process checks every step; ranks agree at log intervals (no extra sync).
                signum = stop_agreed(self, run.stop, logged)
                if signum and self.step < total:
                    self.conclude()
                    if not logged:      # the steps since the last row get theirs (`steps` says how many)
                        run.log.row(out, step=self.step, epoch=self.epoch, val_loss=None)
                    stop_now(self, run.stop, signum, None if saved else save(self, train_loader))
            self.conclude()
        return result(self, run, last_out, last_val)


def fit(model: nn.Module, train_loader: Iterable[Batch], *, val_loader: Iterable[Batch] | None = None,
        epochs: int | None = None, strategy: Strategy | str | None = None,
        mixed_precision: str | Policy | Precision | bool | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None, loss_fn: Callable | None = None,
        resume: str | Path | bool | None = None, config: FitConfig | None = None,
        **kwargs: Any) -> FitResult:
    """Train ``model`` on ``train_loader``; the source article's ``model.fit(loader, epochs=10,
    strategy=strategy, mixed_precision=True)`` (docs/sources.md) lands here. Other keyword
    arguments are :class:`FitConfig` fields (``max_steps``, ``lr``, ``grad_accum_steps``,
    ``clip_grad_norm``, ``run_dir``, ...).

    Without an ``optimizer``, ``fit()`` builds AdamW with language-model defaults, not torch's:
    ``betas=(0.9, 0.95)`` (torch's and ``mixprec.optim.AdamW``'s beta2 is 0.999) and
    ``weight_decay=0.1`` (torch's 0.01); ``config.toml`` records the values it trained with. An
    ``optimizer`` you pass keeps its own settings, and ``config.toml`` records those.

    ``mixed_precision`` (or the ``precision`` field; default ``auto``, the best safe mode) is a
    mode name, a ``Policy``, or a ready :class:`~mixprec.Precision`, which keeps its own settings:
    ``init_scale``, ``growth_interval``, ``hysteresis``, ``min_scale``, ``on_stuck_scale``,
    ``precision`` and ``precision_overrides`` that would change them are refused in one line
    (pass them to the ``Precision``).

    A process group that ``fit()`` itself created (``strategy`` given by name, or chosen under
    ``torchrun``) for data parallelism is destroyed when training ends, after a barrier: nothing
    else can end it, and a group still alive at interpreter exit can abort or hang the process
    (:meth:`Strategy.teardown`). A group held by a strategy object you pass is torn down by an exit
    hook when the script ends (or earlier by your ``strategy.teardown()``); a group you created
    yourself is left to you, and so is an FSDP group, which your sharded model still needs."""
    if epochs is not None:
        kwargs["epochs"] = epochs
    trainer = Trainer(model, config=config, mixed_precision=mixed_precision, optimizer=optimizer,
                      lr_scheduler=lr_scheduler, loss_fn=loss_fn, strategy=strategy, **kwargs)
    result = trainer.fit(train_loader, val_loader, resume=resume)
    made = trainer.strategy
    if not isinstance(strategy, Strategy) and not made.shards_parameters:
        del trainer          # it holds the DDP wrapper, which holds the group
        made.teardown()      # only a group this strategy created; a no-op in one process
    return result
