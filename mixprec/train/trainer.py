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
import dataclasses
import json
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from mixprec import hints
from mixprec.data.position import resumable
from mixprec.errors import (CheckpointError, ConfigError, RunInterrupted, TrainingDiverged, closest,
                            excerpt)
from mixprec.models.hf import is_hf_model, is_hf_spec, keep_run_config
from mixprec.models.objective import add_tokens, apply_loss_chunk, make_objective
from mixprec.amp import StuckLossScaleWarning
from mixprec.monitor import (NumericsMonitor, ScaleWatch, StuckScaleWarning, audit, audit_after_first_step,
                             locate_nonfinite)
from mixprec.monitor.guard import TrainingGuard
from mixprec.monitor.profile import StepProfiler
from mixprec.monitor.replan import LayerReplanner
from mixprec.monitor.trace import capture_rng_state, gather_origins
from mixprec.nn.fp8_activations import store_activations_in_fp8
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.optim.registry import find_optimizer_for
from mixprec.optim.schedule import restretch, warmup_cosine_scheduler
from mixprec.precision import Policy, Precision
from mixprec.runs import checkpoint as ckpt
from mixprec.runs.checkpointer import Checkpointer
from mixprec.runs.events import RunEvents
from mixprec.runs.metrics import MetricsLogger, is_finite_number, read_metrics
from mixprec.runs.read import read_run_config
from mixprec.runs.run_dir import claim_locked_run_dir, deleted_note
from mixprec.strategies import Strategy, get_strategy
from mixprec.train.config import (FitConfig, config_to_toml, given_settings,
                                  refuse_changes_to_ready_precision, refuse_two_modes)
from mixprec.train.health import RunHealth, seed_everything
from mixprec.train.hooks import (GuardHook, NumericsHook, ProfilerHook, ReplanHook, ScaleWatchHook,
                                 StepHook)
from mixprec.train.meter import IntervalMeter
from mixprec.train.schedules import move_scheduler
from mixprec.train.signals import StopRequest
from mixprec.train.step import Batch, PendingStep, StepOutput

__all__ = ["Trainer", "fit", "FitResult", "StepOutput"]



@dataclass
class FitResult:
    run_dir: Path | None
    steps: int
    skipped_steps: int
    final_loss: float | None
    final_val_loss: float | None
    policy: str
    """What ran (``Precision.ran``): the mode, ``32-true+plan (8 nvfp4, 1 fp32)`` for a plan, or
    ``fp8-tensorwise+switched (5 bf16)`` when layers changed format while training (the guard)."""


class Trainer:
    """Trains any ``nn.Module`` whose forward returns a loss, a Hugging Face causal LM, or any
    model with ``loss_fn``. Every precision decision is the :class:`~mixprec.Precision`'s."""

    def __init__(self, model: nn.Module, *, config: FitConfig | None = None,
                 mixed_precision: str | Policy | Precision | bool | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                 strategy: Strategy | str | None = None, **overrides: Any) -> None:
        config = config or FitConfig()
        fields = {f.name for f in dataclasses.fields(config)}
        unknown = set(overrides) - fields
        if unknown:
            name = sorted(unknown)[0]
            raise ConfigError(f"fit() got an unknown argument '{name}'{closest(name, fields)}")
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.config.validate()
        self.strategy = get_strategy(strategy)
        self.device = self.strategy.device
        cfg = self.config
        choice = mixed_precision if mixed_precision is not None else cfg.precision
        given = given_settings(config, overrides)
        if isinstance(choice, Precision):           # a ready Precision keeps its own settings
            refuse_changes_to_ready_precision(choice, cfg, given)
            if cfg.micro_options:
                raise ConfigError("micro_options with a ready Precision: pass them to it, "
                                  "mixprec.Precision(mode, micro_options=...)")
        elif mixed_precision is not None and "precision" in given:
            refuse_two_modes(mixed_precision, cfg.precision, self.device)
        # An optimizer the user built for this model (docs/sources.md: build one, call fit()); one
        # that stores the parameters in 16 bits decides `auto` now, when the recipe is built.
        self._found_optimizer = find_optimizer_for(model.parameters()) if optimizer is None else None
        # Every precision choice of the run, fixed here (scaling only where the mode needs it).
        self.precision = choice if isinstance(choice, Precision) else Precision(
            cfg.recipe(choice, device=self.device, optimizer=optimizer or self._found_optimizer),
            device=self.device)
        self.loss_fn = loss_fn
        self.raw_model = model
        self._user_optimizer = optimizer
        self._user_scheduler = lr_scheduler
        self.step = 0
        self.epoch = 0
        self.run_dir: Path | None = None
        self._loader_resumed = False
        self._peak_refreshed = False
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
        self.hooks: list[StepHook] = []
        """The optional per-step helpers, in call order (mixprec.train.hooks)."""
        self.guard = None
        self.step_batches: list[Batch] = []
        """The micro-batches of the step just taken (for hooks that re-run its forward)."""
        self.step_event: Any = None
        """The traced inf/NaN origin of the step just taken (a ``NonFiniteEvent``), or None."""
        self.settle_each_step = False
        """True: ``fit()`` reads each step's outcome right after it, as a hook that needs it before
        the next forward makes it do (:attr:`outcome_lags`). False (the default): just before the
        next step's update, after that step's forward and backward were queued."""
        self.health: RunHealth | None = None
        """The verdict on the run ``fit()`` is training (skips counted as steps conclude)."""
        self._pending: PendingStep | None = None
        """The step whose outcome the host has not read yet (:meth:`conclude`)."""
        self._fitting = False
        """Inside ``fit()``: a step's conclusion includes the loop's bookkeeping and may lag."""
        self._step_rng: Any = None
        """The RNG state before the step ``fit()`` is taking (for the trace of a skip)."""

    @property
    def policy(self) -> Policy:
        return self.precision.policy

    @property
    def scaler(self):
        return self.precision.scaler

    @property
    def fp8_report(self):
        return self.precision.fp8_report

    # ------------------------------------------------------------------ set-up

    def prepare(self, total_steps: int) -> None:
        """Apply the precision to the model, wrap it, build optimizer and scheduler."""
        cfg, precision, strategy = self.config, self.precision, self.strategy
        if strategy.shards_parameters:     # refused before anything touches the model
            swaps = [(given, off) for given, off, on in (
                ("guard=true", "guard=false", cfg.guard),
                (f"replan_every={cfg.replan_every}", "replan_every=0", cfg.replan_every)) if on]
            if swaps:
                given, off = swaps[0]
                raise ConfigError(f"{given} swaps Linear modules while training and FSDP2 shards "
                                  f"them: use strategy=ddp or single, or {off}")
        model = self.raw_model.to(self.device)
        found = None
        if self._user_optimizer is None:
            found = self._user_optimizer = self._found_optimizer
        precision.recipe.check_optimizer(self._user_optimizer)   # a ready Precision's mode is its own
        asked = precision.recipe.resolved_from or precision.name
        if found is not None and strategy.is_main:   # one line: what was found, and what it changed
            change = (f"; it stores parameters in 16 bits, so precision {asked} -> {precision.name}"
                      if precision.name != asked else "")
            print(f"[mixprec] using the {type(found).__name__} built for this model (not passed to "
                  f"fit()){change}", file=sys.stderr)
        sharded = strategy.shards_parameters              # FSDP2: FP32 shards are the masters
        # Storage dtypes, FP32 exemptions (norms, gates), FP8 swap.
        precision.setup_module(model, sharded=sharded, optimizer=self._user_optimizer)
        apply_loss_chunk(model, cfg.loss_chunk, loss_fn=self.loss_fn)   # refused where it cannot act
        if cfg.loss_chunk:
            self._notes.append((f"loss: computed {cfg.loss_chunk} tokens at a time, each slice's head "
                                "and cross-entropy recomputed in backward (loss_chunk; docs/lean.md)",
                                "loss"))
        self.objective = make_objective(model, precision, self.loss_fn)
        self.model, _ = strategy.setup(model, precision=precision)  # DDP / FSDP wrapping (or none)
        if cfg.compile:
            strategy.unwrap(self.model).compile()     # the model's forward, not the loop
        self._group_settings = []
        if self._user_optimizer is not None:
            self.optimizer = precision.setup_optimizer(self._user_optimizer, self.model, sharded=sharded)
            sched = self._user_scheduler
            if sched is not None and getattr(sched, "optimizer", None) is self._user_optimizer \
                    and self.optimizer is not self._user_optimizer:
                # The optimizer now steps FP32 masters: the schedule must set their learning rate
                # (moved as torch would have built it: no warning about mixprec's own move).
                move_scheduler(sched, self.optimizer)
        else:
            decay, no_decay = [], []
            for p in self.model.parameters():
                if p.requires_grad:
                    (decay if p.dim() >= 2 else no_decay).append(p)
            groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}]
            # Master layout and moments: the recipe's (split_masters, moments).
            self.optimizer = precision.make_optimizer(groups, sharded=sharded, lr=cfg.lr,
                                                      betas=(cfg.beta1, cfg.beta2),
                                                      model=strategy.unwrap(self.model))
            # What a restore must not take from the checkpoint: this run's settings win (also
            # the kernel: a CPU run's checkpoint resumed on CUDA steps fused, and back).
            self._group_settings = [{k: g[k] for k in ("weight_decay", "betas", "fused", "foreach") if k in g}
                                    for g in self.optimizer.param_groups]
        if self._user_optimizer is not None:
            kind = type(self._user_optimizer).__name__
            self._notes.append((
                f"optimizer: your {kind}, with its own settings (the lr/weight_decay/beta1/beta2 "
                f"settings are not used; config.toml records the optimizer's)"
                + ("" if self._user_scheduler is not None else
                   f"; LR schedule: {cfg.warmup_steps} warm-up steps then cosine to "
                   f"{cfg.min_lr_ratio:g}x over its LRs (pass lr_scheduler= for your own)"),
                "optimizer"))
        # Warm-up step s (from 0) runs at (s + 1) / warmup_steps of the peak: a warm-up exactly as
        # long as the run reaches the peak at its last step; only a longer one never does.
        if self._user_scheduler is None and cfg.warmup_steps > total_steps:
            self._notes.append((f"warm-up ({cfg.warmup_steps} steps) is longer than the run ({total_steps} "
                                f"steps): the LR never reaches its peak; set warmup_steps= at most "
                                f"{total_steps}", "schedule"))
        self.scheduler = self._user_scheduler or warmup_cosine_scheduler(
            self.optimizer, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
            min_ratio=cfg.min_lr_ratio)
        # Watching the numbers: per-layer statistics on sampled steps, a stuck-scale watch.
        unwrapped = strategy.unwrap(self.model)
        self.monitor = (NumericsMonitor(unwrapped, every=cfg.monitor_every, compute_dtype=precision)
                        if cfg.monitor_every else None)
        floor = precision.scaler.config        # the Precision's own floor (fit()'s, or a ready one's)
        self.scale_watch = (ScaleWatch(floor.min_scale, on_stuck=floor.on_min_scale)
                            if precision.recipe.scales_loss else None)
        # The update of a taken step issued per module, overlapping the next forward (CUDA).
        if self.overlap is not None:
            self.overlap.close()
        self.overlap = (OverlappedUpdate(unwrapped, self.optimizer,
                                         per_module=False if cfg.compile else None)
                        if cfg.overlap_optimizer else None)
        # Settings accepted here that change nothing: said in one line at start, not left to be
        # found in a benchmark that shows no difference.
        if cfg.overlap_optimizer and strategy.device.type != "cuda":
            self._notes.append((f"overlap_optimizer=true does nothing on {strategy.device.type}: there is "
                                "no CUDA stream for the update to overlap on (it runs in order, the same "
                                "update)", "overlap"))
        compression = getattr(cfg, "grad_compression", None)
        compression = compression if compression not in (None, "none") else getattr(strategy, "grad_compression", None)
        if compression not in (None, "none") and not strategy.is_distributed:
            self._notes.append((f"grad_compression={compression} does nothing in one process: it compresses "
                                "what DDP sends between processes (launch with torchrun "
                                "--nproc_per_node=N)", "strategy"))
        # What Linear layers save for backward, kept in FP8 (opt-in; mixprec/nn/fp8_activations.py).
        if self.fp8_store is not None:
            self.fp8_store.remove()
        self.fp8_store = store_activations_in_fp8(unwrapped) if precision.recipe.fp8_activations else None
        if self.fp8_store is not None:
            self._notes.append((f"activations: what {len(self.fp8_store.modules)} Linear layers save "
                                "for backward kept in FP8 E4M3 with per-block scales, widened in "
                                "backward (fp8_activations; docs/lean.md)", "memory"))
        if cfg.replan_every:
            if precision.recipe.fp8_activations:
                raise ConfigError("replan_every swaps Linear modules, which drops the FP8-activation "
                                  "hooks on them; use fp8_activations=false or replan_every=0")
            self.replanner = LayerReplanner(precision, unwrapped, every=cfg.replan_every,
                                            window=cfg.replan_window)
        self.hooks = [ScaleWatchHook(self.scale_watch)] if self.scale_watch is not None else []
        if self.monitor is not None:
            self.hooks.append(NumericsHook(self.monitor))
        if self.replanner is not None:
            self.hooks.append(ReplanHook(self.replanner))
        if cfg.guard:
            self.guard = TrainingGuard(precision, unwrapped, self.optimizer, self.scheduler,
                                       config=cfg.guard_config(),   # ranks vote (MAX) alike
                                       agree=strategy.all_reduce_max if strategy.world_size > 1 else None)

        if self.guard is not None:
            self.hooks.append(GuardHook(self.guard))   # last: it may restore what others measured

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
        with self._around("around_forward", step):       # the hooks sample only on their steps
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
            with self._around("around_update", step):
                # Unscale once (fused inf/NaN check, agreed across ranks) -> clip the unscaled
                # gradients -> step the FP32 masters and copy back, or skip -> update the scale.
                taken = precision.step(opt, clip_grad_norm=self.config.clip_grad_norm,
                                       measure_grad_norm=logged, overlap=self.overlap)
        out = StepOutput(loss_sum, precision.scaler.last_grad_norm, None, scale_before, tokens, lr,
                         taken=taken)                    # taken: a bool, or still on the device
        self._pending = PendingStep(step, out, micro_batches, self._step_rng)
        if not self._fitting:
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
        read it (the flag's host copy; one read for everything queued), advance the LR schedule
        if the step was taken (a skipped step must not), and inside ``fit()`` trace a skip to its
        origin, record it, call the hooks' ``after_step`` and count it for the run's health.

        ``fit()`` calls it at the first of: the next step's pre-update point (in
        :meth:`train_step`, after that step's backward and before its update: the parameters are
        still the concluded step's, and the trace leaves the new gradients, the parameters and the
        RNG stream as they were), a log interval, an evaluation, a checkpoint, a stop, the end of
        the run; right after each step when :attr:`outcome_lags` is False. So every update runs
        at the LR it ran at before the lag, and the counters, rows and events are the same."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.out.skipped:          # the host read (of the flag's copy)
            self.scheduler.step()            # a skipped step must not advance the LR schedule
        if self._fitting:
            self._watch(pending.batches, pending.out, pending.rng)
            self.health.add(pending.step, pending.out.skipped)

    @property
    def outcome_lags(self) -> bool:
        """Whether ``fit()`` may read a step's outcome as late as just before the next step's
        update (True), not right after the step. False with :attr:`settle_each_step`, with a hook
        that needs the outcome before the next forward (``StepHook.needs_outcome_now``: the
        numerics monitor, the re-planner, the guard), and with delayed-scaling FP8 layers (the
        next forward moves their amax history, which the trace of a skip must replay as it was)."""
        return not (self.settle_each_step or any(h.needs_outcome_now for h in self.hooks)
                    or "fp8-delayed" in self.precision.layer_formats.values())

    def settle(self) -> None:
        """Wait (on the device, not the host) for an overlapped update still in flight; before
        anything outside the forward reads parameters or optimizer state."""
        if self.overlap is not None:
            self.overlap.wait()

    def _around(self, part: str, step: int) -> contextlib.ExitStack:
        """Every hook's ``part`` context (``around_step``/``_forward``/``_update``), in list order."""
        stack = contextlib.ExitStack()
        for hook in self.hooks:
            stack.enter_context(getattr(hook, part)(self, step))
        return stack

    def trace_nonfinite(self, micro_batches: list[Batch], out: StepOutput, rng_state: Any):
        """Replay a skipped step's batches with hooks to find the layer that made the inf/NaN.

        Runs on the unwrapped model (no gradient communication) with the RNG state of the original
        step, and leaves parameters, gradients and the RNG stream as they were.
        """
        self.settle()
        model = self.strategy.unwrap(self.model)
        n = len(micro_batches)

        def run_step() -> torch.Tensor:
            total = None
            for batch in micro_batches:
                loss, _ = self.batch_loss(model, batch, n)
                self.precision.backward(loss, scale=out.scale_before)   # the skipped step's scale
                total = loss.detach() if total is None else total + loss.detach()
            return total

        return locate_nonfinite(model, run_step, loss_scale=out.scale_before, step=self.step,
                                rng_state=rng_state)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, val_loader: Iterable[Batch], max_batches: int | None = None) -> float:
        """Mean validation loss over up to ``max_batches`` batches, reduced across ranks."""
        self.settle()
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        # Creating a loader iterator draws from the global RNG: keep training's stream untouched.
        with torch.random.fork_rng(devices=[]):
            for i, batch in enumerate(val_loader):
                if max_batches is not None and i >= max_batches:
                    break
                total += self.batch_loss(self.model, batch)[0]
                count += 1
        self.model.train()
        if count == 0:
            raise ConfigError("the validation data gave no batch; use more validation data or a "
                              "smaller batch_size/seq_len")
        return self.strategy.reduce_mean(total / count)

    # ------------------------------------------------------------------ the loop

    def _micro_batches(self, loader: Any) -> Iterator[list[Batch]]:
        """Endless groups of ``grad_accum_steps`` micro-batches, advancing epochs as needed."""
        k = self.config.grad_accum_steps
        resumed = self._loader_resumed  # a restored loader already knows its epoch and position
        while True:
            if hasattr(loader, "set_epoch") and not resumed:
                loader.set_epoch(self.epoch)
            resumed = False
            with torch.random.fork_rng(devices=[]):  # iterator creation must not shift the RNG
                it = iter(loader)
            group: list[Batch] = []
            for batch in it:
                group.append(batch)
                if len(group) == k:
                    yield group
                    group = []
            self.epoch += 1

    def _setup_run_dir(self, resume: bool, *, start_over: bool = False) -> None:
        """Rank 0 claims (and locks: one folder, one writer) the run folder; every rank learns
        which, or the one-line refusal. ``start_over``: the folder holds a run with no complete
        checkpoint, which a resume begins again from step 0 (its old files are replaced)."""
        cfg = self.config
        claim: tuple[str | None, str | None] = (None, None)
        if self.strategy.is_main:
            deleted: list[str] = []
            try:
                path, self._lock = claim_locked_run_dir(
                    cfg.run_dir, precision=self.precision.label, resume=resume and not start_over,
                    overwrite=cfg.overwrite or start_over, deleted=deleted)
                claim = (str(path), None)
                if not start_over and (said := deleted_note(path, deleted)):  # (a restart says its own)
                    self._notes.append((said, "overwrite"))
            except ConfigError as e:
                claim = (None, str(e))
        # Rank 0 picked (and made) the folder, or refused it: every rank learns which.
        path, error = self.strategy.broadcast_object(claim)
        if error is not None:
            raise ConfigError(error)
        self.run_dir = Path(path)
        hints.set_run_dir(self.run_dir)

    def _resume_into_its_run(self, resume: str | Path | bool | None) -> str | Path | bool | None:
        """``run_dir`` naming a run's checkpoint (``RUN/checkpoints/step-N``, or ``RUN/checkpoints``)
        with ``resume``: continue RUN from that checkpoint, as ``mixprec train --resume`` does,
        instead of writing a new run inside the checkpoint folder. Returns what to resume from."""
        cfg = self.config
        run = ckpt.run_of_checkpoint(cfg.run_dir) if resume and cfg.run_dir else None
        if run is None:
            return resume
        given = Path(cfg.run_dir)
        self.config = dataclasses.replace(cfg, run_dir=str(run))
        self._notes.append((f"run_dir={given} is a checkpoint of the run {run}: continuing that run "
                            f"from it (its metrics, events and checkpoints)", "checkpoint"))
        return given if resume is True else resume

    def _refuse_another_models_run(self, resume: str | Path | bool) -> None:
        """A ``fit()`` resume of a folder whose ``config.toml`` says ``fit()`` trained another
        model class there is another run, not this one: refused in one line naming both, before
        a restore fails on whatever differs first (the data's length, a weight's shape)."""
        if hasattr(self.config, "model"):        # mixprec train: its own config names the model
            return
        folder = self.run_dir if resume is True else (ckpt.run_of_checkpoint(resume) or Path(resume))
        recorded = read_run_config(folder).get("model")
        mine = _fit_model_name(self.raw_model)
        # By class name: the same class imported from another module (a script run as
        # __main__, then imported) is the same model.
        same = lambda a, b: a.rpartition(".")[2] == b.rpartition(".")[2]  # noqa: E731
        if isinstance(recorded, str) and recorded.startswith("fit: ") \
                and not same(recorded[len("fit: "):], mine):
            raise ConfigError(
                f"{folder} holds another run: fit() trained {recorded[len('fit: '):]} there "
                f"(its config.toml), this fit() trains {mine}; choose another run_dir, or pass "
                f"{hints.overwrite()} without resume to delete that run and start over")

    def _start_over(self, resume: str | Path | bool | None) -> bool:
        """A resume of a run folder that holds no complete checkpoint (the run stopped before its
        first save, or a second Ctrl-C aborted it): it starts again from step 0 with this run's
        settings, said in one line, instead of a refusal with no way out."""
        if not resume:
            return False
        folder = Path(self.config.run_dir) if resume is True and self.config.run_dir else (
            None if resume is True else Path(resume))
        if folder is None or not (folder / "config.toml").is_file() or ckpt.list_checkpoints(folder):
            return False
        # Saves are atomic (a temp folder renamed into place), so a step folder without its
        # meta.json was damaged after it was written: the run did save. Starting over would
        # replace its metrics and checkpoints; refuse and change nothing.
        damaged = sorted(p.name for p in (folder / "checkpoints").glob("step-*") if p.is_dir()) \
            if (folder / "checkpoints").is_dir() else []
        if damaged:
            raise CheckpointError(
                f"{folder} holds checkpoint folder(s) {', '.join(damaged)} but none is complete "
                f"({ckpt.META_FILE} missing): nothing was changed; restore the missing file, or pass "
                f"{hints.overwrite()} to delete this run and start over")
        self._notes.append((f"{folder} holds no complete checkpoint (the run stopped before its first "
                            "save): starting it over from step 0 with these settings; its old "
                            "metrics and events are replaced", "restart"))
        self.config = dataclasses.replace(self.config, run_dir=str(folder))
        return True

    def _total_steps(self, train_loader: Any) -> int:
        cfg = self.config
        try:
            steps_per_epoch = len(train_loader) // cfg.grad_accum_steps  # type: ignore[arg-type]
        except TypeError:
            steps_per_epoch = None
        if cfg.max_steps is not None:
            return cfg.max_steps
        if steps_per_epoch:
            return cfg.epochs * steps_per_epoch
        if steps_per_epoch is None:
            raise ConfigError("the training data has no length and max_steps is not set; set "
                              "max_steps")
        raise ConfigError(f"the training data gives no full step ({len(train_loader)} batches "
                          f"for grad_accum_steps={cfg.grad_accum_steps}); use more data or a "
                          "smaller batch")

    def _save(self, loader: Any) -> Path | None:
        self.conclude()           # the checkpoint holds the schedule and counters after the step
        self.settle()
        return self.checkpointer.save(step=self.step, epoch=self.epoch, model=self.model,
                                      optimizer=self.optimizer, precision=self.precision,
                                      scheduler=self.scheduler, loader=loader, config=self.config,
                                      replanner=self.replanner, guard=self.guard)

    def fit(self, train_loader: Iterable[Batch], val_loader: Iterable[Batch] | None = None, *,
            resume: str | Path | bool | None = None) -> FitResult:
        """Train for ``max_steps`` (or ``epochs``); ``resume``: True (the run folder's newest
        checkpoint), or a run folder / checkpoint folder to continue from. The settings of this
        call win over the checkpoint's: ``lr``, the schedule (``warmup_steps``, ``min_lr_ratio``)
        and ``max_steps`` re-stretch the LR schedule (see :meth:`_reschedule`)."""
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
        total = self._total_steps(train_loader)
        seed_everything(self.config.seed)          # dropout, data order of plain loaders
        self.prepare(total)
        resume = self._resume_into_its_run(resume)
        start_over = self._start_over(resume)
        if start_over:
            resume = None
        self._setup_run_dir(resume=bool(resume), start_over=start_over)
        cfg = self.config
        main = self.strategy.is_main
        self.checkpointer = Checkpointer(self.strategy, self.run_dir, keep_last=cfg.keep_last,
                                         export_hf=cfg.export_hf, model=self.model)
        if resume:
            self._refuse_another_models_run(resume)
            # This run's peak LR per group, as prepare() built the schedule (cfg.lr for mixprec's
            # optimizer; your optimizer's own LRs for one you passed).
            peaks = list(self.scheduler.base_lrs) if self._user_scheduler is None else []
            restored = self.checkpointer.load(
                self.run_dir if resume is True else Path(resume), model=self.model,
                optimizer=self.optimizer, precision=self.precision, scheduler=self.scheduler,
                loader=train_loader, replanner=self.replanner, guard=self.guard)
            self.step, self.epoch, self._loader_resumed = (restored.step, restored.epoch,
                                                           restored.loader_resumed)
            self._notes.extend((n, "checkpoint") for n in restored.notes)
            if self.step > total:
                raise ConfigError(f"the checkpoint is at step {self.step}, past max_steps={total}; "
                                  f"resume with max_steps={self.step} or more")
            if self.step == total and main:     # a finished run resumed as it was: say so
                self._notes.append((f"nothing to train: the run is already at step {self.step} of "
                                    f"max_steps={total}; to train on, give a larger max_steps: "
                                    f"{hints.resume(self.run_dir, max_steps=2 * self.step)}", "nothing"))
            if self._user_scheduler is None:
                self._reschedule(total, peaks, restored.saved_lr)
        try:
            logger = MetricsLogger(self.run_dir, enabled=main, resume_step=self.step if resume else None)
            if main:  # the resolved precision ("auto" means something else on another machine)
                # A plan's layers (plan:PATH, precision_overrides) are kept as the [overrides]
                # table beside its base mode: what a resume rebuilds the same Precision from.
                recipe = self.precision.recipe     # the [recipe] table below records all of it
                resolved = dataclasses.replace(cfg, precision=self.precision.name,
                                               precision_overrides=recipe.policy.overrides,
                                               micro_options=",".join(
                                                   f"{k}={'none' if v is None else v}"
                                                   for k, v in recipe.policy.micro_options),
                                               split_masters=recipe.split_masters, moments=recipe.moments,
                                               fp8_activations=recipe.fp8_activations,
                                               **_optimizer_settings(self._user_optimizer))
                mine = self._user_optimizer
                used = ("" if mine is None else
                        f"# optimizer: the caller's {type(mine).__name__}; lr, weight_decay and betas above are "
                        f"its own where all its groups agree ({', '.join(_optimizer_settings(mine)) or 'none'}), "
                        "the others were not used\n")
                ran = (f"# ran: {self.precision.ran()}\n"
                       if self.precision.has_plan or self.precision.switched else "")
                (self.run_dir / "config.toml").write_text(
                    config_to_toml(resolved, _what_fit_trained(cfg, self.raw_model, train_loader)) + used
                    + ran + "\n" + recipe.to_toml())
                if is_hf_spec(getattr(cfg, "model", "")):   # a resume needs it, not its old path
                    keep_run_config(cfg.model, self.run_dir)
        except OSError as e:
            fix = ("copy the run folder somewhere writable and resume from the copy" if resume else
                   "free some space or choose another run_dir=PATH")
            raise ConfigError(f"cannot write to the run folder {self.run_dir} ({e.strerror or e}); "
                              f"{fix}") from None
        events = self.events = RunEvents(self.strategy, self.precision, logger, progress=cfg.progress)
        unwrapped = self.strategy.unwrap(self.model)
        events.start(model=unwrapped, step=self.step, total=total, run_dir=self.run_dir,
                     fp8_report=self.fp8_report,
                     watching=[line for h in self.hooks if (line := h.describe())])
        for message, kind in self._notes:
            events.note(message, self.step, kind)
        self._notes.clear()
        if hasattr(train_loader, "notice"):
            events.data_position(train_loader.notice(resumed_at=self.step if resume else None), self.step)
        meter = IntervalMeter(self.strategy, self.precision, unwrapped, logger,
                              note=lambda message: events.note(message, self.step, "mfu"))
        health = self.health = RunHealth(cfg, start_step=self.step)
        self._pending = None
        last_val = None
        last_out: StepOutput | None = None
        self.model.train()
        groups = self._micro_batches(train_loader)
        if cfg.audit:
            events.findings(audit(unwrapped, precision=self.precision, optimizer=self.optimizer,
                                  device=self.device), self.step)
        first_step = self.step == 0
        compiling = cfg.compile                    # the first step of this process compiles
        self.profiler = (StepProfiler(cfg.profile, self.run_dir, device=self.device, write=main)
                         if cfg.profile else None)
        if self.profiler is not None:
            self.hooks.insert(0, ProfilerHook(self.profiler))
        events.open_progress(total, self.step)
        lags = self.outcome_lags

        def log_row(out: StepOutput, val_loss: float | None) -> None:
            """One metrics row of the steps since the last one (the meter's mean), and its line."""
            # The LR the row's last step ran at (the scheduler has moved on to the next one's).
            lr = float(out.lr) if out.lr is not None else self.scheduler.get_last_lr()[0]
            loss = meter.log(out, step=self.step, epoch=self.epoch, lr=lr, val_loss=val_loss)
            events.interval(self.step, total, loss=loss, val_loss=val_loss,
                            lr=lr, tokens_per_s=meter.last_tps,
                            samples_per_s=meter.last_sps,
                            steps=meter.last_steps, log_interval=cfg.log_interval)
        try:
            # A lost peer ends the job with one line, not a hang; Ctrl-C/SIGTERM saves, then stops.
            with self.strategy.guard(), StopRequest(announce=main) as stop, warnings.catch_warnings():
                if self.scale_watch is not None:
                    # The watch's hook reports a stuck scale (terminal once, events.jsonl each
                    # step): its own warning and the scaler's would repeat it as raw Python
                    # warnings, one per step, with a file path.
                    warnings.filterwarnings("ignore", category=StuckLossScaleWarning)
                    warnings.filterwarnings("ignore", category=StuckScaleWarning)
                self._fitting = True
                while self.step < total:
                    batches = next(groups)
                    self._step_rng = capture_rng_state() if cfg.trace_nonfinite else None  # to replay a skip
                    with self._around("around_step", self.step + 1):
                        out = last_out = (self._first_compiled_step(batches) if compiling
                                          else self.train_step(batches))
                    compiling = False
                    self.step += 1
                    if first_step and cfg.audit:
                        self.settle()
                        events.findings(audit_after_first_step(unwrapped), self.step)
                        first_step = False
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
                        log_row(out, last_val if do_eval else None)
                        self._stop_if_diverged(health.verdict(last_val if do_eval else None), last_out)
                    if saved:
                        self._save(train_loader)
                    events.advance()
                    # One process checks every step; ranks agree at log intervals (no extra sync).
                    signum = self._stop_agreed(stop, logged)
                    if signum and self.step < total:
                        self.conclude()
                        if not logged:      # the steps since the last row get theirs (`steps` says how many)
                            log_row(out, None)
                        self._stop_now(stop, signum, train_loader, saved)
                self.conclude()
            self.settle()
            for hook in self.hooks:
                hook.close()                              # the profiler: a run shorter than its steps
            self.checkpointer.export_final(self.model)    # a Hugging Face model: RUN_DIR/hf
            if (line := self._warmup_not_left()) is not None:
                events.note(line, self.step, "schedule")
        finally:
            self._fitting = False
            self._step_rng = None
            events.close()
            logger.close()
        if last_val is None and resume and self.run_dir is not None:
            # Resumed with nothing left to train (a finished run): its recorded final validation
            # loss, not "n/a".
            last_val = next((r["val_loss"] for r in reversed(read_metrics(self.run_dir))
                             if r.get("step") is not None and r["step"] <= self.step
                             and is_finite_number(r.get("val_loss"))), None)
        final_loss = float(last_out.loss) if last_out is not None else None
        return FitResult(self.run_dir, self.step, self.precision.scaler.num_skipped_steps, final_loss,
                         last_val, self.precision.ran())

    def _warmup_not_left(self) -> str | None:
        """One line when mixprec's schedule ended its run still in warm-up (its LR never reached
        the peak): a run shorter than ``warmup_steps``, or one whose steps were skipped (a skipped
        step does not advance the schedule, so a 16-mixed run that skipped every step stays at the
        first warm-up LR). None otherwise, and for a scheduler you passed."""
        cfg = self.config
        if self._user_scheduler is not None or cfg.warmup_steps <= 0 or self.step == 0:
            return None
        taken = int(getattr(self.scheduler, "last_epoch", cfg.warmup_steps))
        # warmup_steps=1 starts at the peak: there is no warm-up to stay in, even when every step
        # was skipped (it said "never left warm-up ... reached 100 % of the peak").
        if taken >= cfg.warmup_steps or cfg.warmup_steps == 1:
            return None
        skipped = self.precision.scaler.num_skipped_steps
        why = (f"{skipped} of its {self.step} steps were skipped, and a skipped step does not advance it"
               if skipped else f"the run ({self.step} steps) is shorter than warmup_steps={cfg.warmup_steps}")
        peak = self.scheduler.base_lrs[0]
        if taken == 0:      # no step taken: the LR was never reached by a step, it waits at the first
            lr = peak * self.scheduler.lr_lambdas[0](0)
            where = f"no step was taken; it stays at its first warm-up LR {lr:.3g}"
        else:
            lr = peak * self.scheduler.lr_lambdas[0](taken - 1)     # the last taken step's
            where = f"the LR reached {lr:.3g}"
        return (f"the LR never left warm-up: the schedule advanced {taken} of its {cfg.warmup_steps} "
                f"warm-up steps ({why}); {where}, {100 * lr / peak:.0f} % of the peak {peak:g}")

    def _reschedule(self, total: int, peaks: list[float], saved_lr: list[float]) -> None:
        """After a restore, this run's settings set the learning rate, not the checkpoint's.

        The schedule is a function of the optimizer steps taken: the checkpoint gives their count,
        this run's peak LR (``lr``, or the LRs of an optimizer you passed), ``warmup_steps``,
        ``min_lr_ratio`` and ``max_steps`` give the rest. The next step trains at the LR the new
        schedule has at the steps already taken, and the cosine ends at ``peak * min_lr_ratio`` at
        the new ``max_steps`` (a finished run extended with a larger ``max_steps`` goes back up the
        cosine to where the longer run would be). Unchanged settings give the checkpoint's LR bit
        for bit."""
        cfg = self.config
        lrs = restretch(self.scheduler, base_lrs=peaks, warmup_steps=cfg.warmup_steps,
                        total_steps=total, min_ratio=cfg.min_lr_ratio)
        # The optimizer's other settings come from this run's config too (they are not a state).
        if len(self._group_settings) == len(self.optimizer.param_groups):
            for group, settings in zip(self.optimizer.param_groups, self._group_settings):
                group.update(settings)
        if saved_lr and abs(lrs[0] - saved_lr[0]) > 1e-12 * max(abs(saved_lr[0]), 1e-30):
            self._notes.append((f"resumed schedule: lr {saved_lr[0]:.4g} -> {lrs[0]:.4g} at step "
                                f"{self.step} (lr={peaks[0]:g}, warmup_steps={cfg.warmup_steps}, "
                                f"min_lr_ratio={cfg.min_lr_ratio:g}, cosine to step {total})",
                                "schedule"))

    def _stop_agreed(self, stop: StopRequest, logged: bool) -> int:
        """The signal that asks every rank to stop (0: none): ranks agree at log intervals, on the
        largest signal number any of them got (SIGTERM over SIGINT)."""
        if self.strategy.world_size == 1:
            return stop.signum or 0
        return int(self.strategy.reduce_max(float(stop.signum or 0))) if logged else 0

    def _stop_now(self, stop: StopRequest, signum: int, loader: Any, saved: bool) -> None:
        """Save (unless this step just did), record the stop, and end the run."""
        path = self.checkpointer.run_dir
        if not saved:
            path = self._save(loader) or path
        stop.end()                  # saved: a later signal changes nothing (no abort mid-exit)
        why = signal.Signals(signum).name if stop.requested else \
            f"{signal.Signals(signum).name} on another rank"
        message = (f"stopped by {why} at step {self.step}; checkpoint saved in {path}; continue "
                   f"with: {hints.resume(self.run_dir)}")
        self.events.note(message, self.step, "interrupted", say=False)
        raise RunInterrupted(message, signum)

    def _stop_if_diverged(self, problem: str | None, last: StepOutput | None = None) -> None:
        if problem is None:
            return
        done = ckpt.list_checkpoints(self.run_dir) if self.run_dir is not None else []
        lower = float(f"{self.config.lr / 2:.3g}")
        where = (f"resume from the last checkpoint before it with a lower lr (the schedule follows "
                 f"it): {hints.resume(done[-1][1], checkpoint=True, lr=lower)}"
                 if done else "no checkpoint was written before it: start over with a lower lr")
        precision, cfg = self.precision, self.config
        loss_finite = last is not None and bool(torch.isfinite(torch.as_tensor(last.loss)).all())  # once
        scaler = precision.scaler.config        # the Precision's own (fit()'s, or a ready one's)
        health = self.health or RunHealth(cfg, start_step=self.step)
        cause = health.scaler_cause(scales_loss=precision.recipe.scales_loss, scale=precision.scaler.get_scale(),
                                    init_scale=scaler.init_scale, min_scale=scaler.min_scale,
                                    growth_interval=scaler.scale_window, hysteresis=scaler.hysteresis,
                                    loss_finite=loss_finite, skipped=precision.scaler.num_skipped_steps)
        if cause is not None:
            message = f"training stopped at step {self.step}: {problem}; {cause}"
            # not divergence: recorded (and plotted) as what it is; the exit status stays 3
            self.events.note(message, self.step, "loss_scale_stuck", say=False)
            raise TrainingDiverged(message)
        safer = "" if precision.recipe.compute_dtype == torch.float32 else ", or pick a safer precision"
        message = (f"training diverged at step {self.step}: {problem}; lower lr (now "
                   f"{cfg.lr:g}), keep clip_grad_norm on{safer}; {where}")
        self.events.note(message, self.step, "diverged", say=False)
        raise TrainingDiverged(message)

    def _first_compiled_step(self, batches: list[Batch]) -> StepOutput:
        """The first step compiles the model; if torch.compile cannot (say why), run eager."""
        try:
            return self.train_step(batches)
        except Exception as e:
            if not any(type(x).__module__.startswith(("torch._dynamo", "torch._inductor"))
                       for x in (e, e.__cause__) if x is not None):
                raise
            # The compile failed in the first forward, before any gradient or update: undo it.
            self.strategy.unwrap(self.model)._compiled_call_impl = None
            first = excerpt(e, 300)
            self.events.note(f"compile=true failed ({type(e).__name__}: {first}); training eager",
                             self.step, kind="compile")
            return self.train_step(batches)

    def _watch(self, batches: list[Batch], out: StepOutput, rng: Any) -> None:
        """When a step concludes (:meth:`conclude`): trace a skipped step to its origin, record
        it, then every step hook."""
        origin = event = None
        if out.skipped:
            # Every rank replays its own micro-batches; rank 0 learns which rank made the inf/NaN.
            event = (gather_origins(self.trace_nonfinite(batches, out, rng), self.strategy)
                     if self.config.trace_nonfinite else None)
            self.events.skip(self.step, out, event)
            if event is not None:
                origin = f"{event.module} (rank {event.rank})" if event.rank is not None else event.module
        self.step_batches, self.step_event = batches, event
        for hook in self.hooks:
            hook.after_step(self, self.step, out, origin)

    @torch.no_grad()
    def replay_forward(self) -> None:
        """The forward of the step just taken again, without backward (the guard's probe: its
        hooks measure it)."""
        self.settle()
        model = self.strategy.unwrap(self.model)
        for batch in self.step_batches:
            self.batch_loss(model, batch)


def _optimizer_settings(optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """The ``lr``/``weight_decay``/``beta1``/``beta2`` of a user's optimizer, for ``config.toml``
    (what ran, not the unused defaults): each where every param group agrees on it."""
    if optimizer is None:
        return {}
    groups = optimizer.param_groups
    found: dict[str, float] = {}
    for key, read in (("lr", lambda g: g.get("initial_lr", g.get("lr"))),
                      ("weight_decay", lambda g: g.get("weight_decay", 0.0)),
                      ("beta1", lambda g: (g.get("betas") or (None, None))[0]),
                      ("beta2", lambda g: (g.get("betas") or (None, None))[1])):
        values = {read(g) for g in groups}
        if len(values) == 1 and isinstance(value := values.pop(), (int, float)) \
                and not isinstance(value, bool):
            found[key] = float(value)
    return found


def _fit_model_name(model: nn.Module) -> str:
    """The model class a ``fit()`` run records in ``config.toml`` (``model = "fit: <this>"``)."""
    kind = type(model)
    return (f"transformers {kind.__name__} (its config.json: RUN_DIR/hf)" if is_hf_model(model)
            else f"{kind.__module__}.{kind.__qualname__}")


def _what_fit_trained(cfg: FitConfig, model: nn.Module, loader: Any) -> str:
    """For a ``fit()`` run (a config without ``model``): the model and, where the loader says, the
    batch shape, as ``config.toml`` lines, so a reader (and ``mixprec train --resume``) learns them."""
    if hasattr(cfg, "model"):
        return ""
    lines = [f"model = {json.dumps('fit: ' + _fit_model_name(model))}"]
    inner = getattr(loader, "loader", loader)
    seq_len = getattr(getattr(inner, "dataset", None), "max_length", None)
    for key, value in (("seq_len", seq_len), ("batch_size", getattr(inner, "batch_size", None))):
        if isinstance(value, int) and not isinstance(value, bool):
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


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
