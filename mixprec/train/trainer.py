"""The training loop: ``fit()`` and the one readable ``train_step``.

Every precision decision of a step is visible in :meth:`Trainer.train_step`, in the order of
ARCHITECTURE.md: autocast -> loss in FP32 -> scale -> backward -> unscale once (fused with the
non-finite check, agreed across ranks) -> clip -> step or skip -> scaler update -> scheduler only
if the step was taken.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.amp import GradScaler, clip_grad_norm_
from mixprec.errors import ConfigError
from mixprec.monitor import NumericsMonitor, ScaleWatch, audit_after_first_step
from mixprec.monitor.trace import capture_rng_state
from mixprec.optim import AdamW
from mixprec.optim.registry import find_optimizer_for
from mixprec.precision import Policy, autocast, cast_module, get_policy
from mixprec.precision.peak import peak_flops
from mixprec.strategies import Strategy, get_strategy
from mixprec.train.config import FitConfig, config_to_toml
from mixprec.train.events import RunEventsMixin
from mixprec.train.metrics import MetricsLogger
from mixprec.train.resume import CheckpointMixin
from mixprec.train.schedule import warmup_cosine_scheduler

__all__ = ["Trainer", "fit", "FitResult", "StepOutput"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepOutput:
    """What one optimizer step produced. Tensors stay on the device (no host sync)."""

    loss: torch.Tensor          # mean loss over the micro-batches, fp32 scalar
    grad_norm: torch.Tensor | None  # unscaled global gradient norm (None when not computed)
    skipped: bool               # the optimizer step was skipped (non-finite gradients)
    scale_before: float         # loss scale used for this step
    tokens: int                 # tokens processed on this rank


@dataclass
class FitResult:
    run_dir: Path | None
    steps: int
    skipped_steps: int
    final_loss: float | None
    final_val_loss: float | None
    policy: str


def _extract_loss(out: Any) -> torch.Tensor:
    """Find the loss in a model's output: a scalar tensor, ``(logits, loss)``, ``{"loss": ...}``
    or an object with ``.loss``."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[-1], torch.Tensor) and out[-1].dim() == 0:
        return out[-1]
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    if getattr(out, "loss", None) is not None:
        return out.loss
    raise ConfigError("the model's forward did not return a loss (a scalar tensor, (logits, loss) "
                      "or {'loss': ...}); pass loss_fn=... to fit()")


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Trainer(CheckpointMixin, RunEventsMixin):
    """Trains any ``nn.Module`` whose forward returns a loss (or with ``loss_fn``)."""

    def __init__(self, model: nn.Module, *, config: FitConfig | None = None,
                 mixed_precision: str | Policy | bool | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 lr_scheduler: Any = None,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                 strategy: Strategy | str | None = None, **overrides: Any) -> None:
        config = config or FitConfig()
        fields = {f.name for f in dataclasses.fields(config)}
        unknown = set(overrides) - fields
        if unknown:
            from mixprec.errors import closest
            name = sorted(unknown)[0]
            raise ConfigError(f"fit() got an unknown argument '{name}'{closest(name, fields)}")
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.config.validate()
        self.strategy = get_strategy(strategy)
        self.device = self.strategy.device
        choice = mixed_precision if mixed_precision is not None else self.config.precision
        self.policy = get_policy(True if choice == "auto" else choice, device=self.device)
        self.loss_fn = loss_fn
        self.raw_model = model
        self._user_optimizer = optimizer
        self._user_scheduler = lr_scheduler
        self.step = 0
        self.epoch = 0
        self.run_dir: Path | None = None
        self.fp8_report = None
        self._loader_resumed = False
        self._peak_refreshed = False
        self.monitor = None
        self.scale_watch = None

    # ------------------------------------------------------------------ set-up

    def _prepare(self, total_steps: int) -> None:
        """Apply the policy to the model, wrap it, and build optimizer, scheduler and scaler."""
        cfg, policy = self.config, self.policy
        model = self.raw_model.to(self.device)
        # FSDP2 keeps FP32 shards as the masters and casts to the compute dtype itself.
        sharded = getattr(self.strategy, "name", "") == "fsdp"
        if not sharded:
            cast_module(model, policy)                   # storage dtype of every parameter
        if policy.fp8_recipe:                            # FP8 GEMMs for eligible Linear layers
            from mixprec.fp8 import prepare_fp8
            self.fp8_report = prepare_fp8(model, policy)
        params = inspect.signature(model.forward).parameters.values()
        self._forward_takes_targets = sum(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params) >= 2
        self.model, _ = self.strategy.setup(model, policy=policy)  # DDP / FSDP wrapping (or none)
        if self._user_optimizer is None:
            # An optimizer the user built for this model (seed 002 builds one, then calls fit()).
            self._user_optimizer = find_optimizer_for(model.parameters())
            if self._user_optimizer is not None and self.strategy.is_main:
                print(f"[mixprec] using the {type(self._user_optimizer).__name__} built for this "
                      "model", file=sys.stderr)
        if self._user_optimizer is not None:
            self.optimizer = self._user_optimizer
        else:
            decay, no_decay = [], []
            for p in self.model.parameters():
                if p.requires_grad:
                    (decay if p.dim() >= 2 else no_decay).append(p)
            groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                      {"params": no_decay, "weight_decay": 0.0}]
            # cast_module already stored params in policy.param_dtype (norms stay FP32); AdamW
            # keeps an FP32 master for every low-precision param and steps on the masters.
            if sharded or policy.low_precision_params and not policy.master_weights:
                # Explicitly asked for no masters: updates below the param's ULP are lost.
                self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
            else:
                self.optimizer = AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        self.scheduler = self._user_scheduler or warmup_cosine_scheduler(
            self.optimizer, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
            min_ratio=cfg.min_lr_ratio)
        # Scaling is on only when the policy needs it (FP16); the non-finite check is always on.
        self.scaler = GradScaler.from_policy(policy, init_scale=cfg.init_scale,
                                             growth_interval=cfg.growth_interval,
                                             hysteresis=cfg.hysteresis, min_scale=cfg.min_scale,
                                             on_min_scale=cfg.on_stuck_scale)
        # Watching the numbers: per-layer statistics on sampled steps, a stuck-scale watch.
        unwrapped = self.strategy.unwrap(self.model)
        self.monitor = (NumericsMonitor(unwrapped, every=cfg.monitor_every, compute_dtype=policy)
                        if cfg.monitor_every else None)
        self.scale_watch = (ScaleWatch(cfg.min_scale, on_stuck=cfg.on_stuck_scale)
                            if policy.loss_scaling else None)

    # ------------------------------------------------------------------ the step

    def _loss(self, model: nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            out = model(inputs, targets) if self._forward_takes_targets else model(inputs)
            return _extract_loss(out)
        out = model(inputs)
        if isinstance(out, torch.Tensor):
            out = self.policy.cast_output(out)
        return self.loss_fn(out, targets)

    def train_step(self, micro_batches: list[Batch]) -> StepOutput:
        """One optimizer step over ``len(micro_batches)`` micro-batches (gradient accumulation)."""
        model, opt, scaler, policy = self.model, self.optimizer, self.scaler, self.policy
        n = len(micro_batches)
        scale_before = scaler.get_scale()
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        opt.zero_grad(set_to_none=True)                   # fresh gradients for this step
        with self._sample_numerics():                     # hooks only on sampled steps
            for i, batch in enumerate(micro_batches):
                inputs, targets = self.strategy.to_device(batch)
                # Gradients are all-reduced only in the last micro-batch's backward.
                sync = contextlib.nullcontext() if i == n - 1 else self.strategy.no_sync(model)
                with sync:
                    with autocast(policy, device_type=self.device.type):  # matmuls in compute dtype
                        loss = self._loss(model, inputs, targets)
                    loss = loss.float() / n               # FP32 loss, averaged over micro-batches
                    scaler.scale(loss).backward()         # x loss scale (FP16) or x 1 (BF16/FP32)
                loss_sum += loss.detach()
                tokens += targets.numel()
            # Unscale exactly once, fused with the inf/NaN check; found_inf is MAX-reduced across ranks.
            scaler.unscale_(opt)
            grad_norm = None
            if self.config.clip_grad_norm:                # clip sees unscaled gradients
                grad_norm = clip_grad_norm_(scaler, opt, self.config.clip_grad_norm)
            elif self.step % self.config.log_interval == self.config.log_interval - 1:
                grad_norm = clip_grad_norm_(scaler, opt, math.inf)  # measure only, on logged steps
            with self._track_updates():
                scaler.step(opt)   # steps FP32 masters and copies back, or skips (one host sync)
        scaler.update()            # back off at once on overflow, grow after clean intervals
        skipped = scaler.last_step_skipped
        if not skipped:
            self.scheduler.step()  # a skipped step must not advance the LR schedule
        return StepOutput(loss_sum, grad_norm, skipped, scale_before, tokens)

    def _sample_numerics(self) -> contextlib.AbstractContextManager:
        if self.monitor is None:
            return contextlib.nullcontext()
        return self.monitor.sample(self.step + 1)

    def _track_updates(self) -> contextlib.AbstractContextManager:
        if self.monitor is None:
            return contextlib.nullcontext()
        return self.monitor.track_updates(self.optimizer)

    def trace_nonfinite(self, micro_batches: list[Batch], out: StepOutput, rng_state: Any):
        """Replay a skipped step's batches with hooks to find the layer that made the inf/NaN.

        Runs on the unwrapped model (no gradient communication) with the RNG state of the original
        step, and leaves parameters, gradients and the RNG stream as they were.
        """
        from mixprec.monitor import locate_nonfinite
        model = self.strategy.unwrap(self.model)
        n = len(micro_batches)

        def run_step() -> torch.Tensor:
            total = None
            for batch in micro_batches:
                inputs, targets = self.strategy.to_device(batch)
                with autocast(self.policy, device_type=self.device.type):
                    loss = self._loss(model, inputs, targets).float() / n
                (loss * out.scale_before).backward()
                total = loss.detach() if total is None else total + loss.detach()
            return total

        return locate_nonfinite(model, run_step, loss_scale=out.scale_before, step=self.step,
                                rng_state=rng_state)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, val_loader: Iterable[Batch], max_batches: int | None = None) -> float:
        """Mean validation loss over up to ``max_batches`` batches, reduced across ranks."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = 0
        # Creating a loader iterator draws from the global RNG: keep training's stream untouched.
        with torch.random.fork_rng(devices=[]):
            for i, batch in enumerate(val_loader):
                if max_batches is not None and i >= max_batches:
                    break
                inputs, targets = self.strategy.to_device(batch)
                with autocast(self.policy, device_type=self.device.type):
                    total += self._loss(self.model, inputs, targets).float()
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

    def _setup_run_dir(self) -> None:
        cfg = self.config
        if cfg.run_dir is not None:
            self.run_dir = Path(cfg.run_dir)
        else:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            self.run_dir = Path("runs") / f"{stamp}-{self.policy.name}"
        if self.strategy.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def fit(self, train_loader: Iterable[Batch], val_loader: Iterable[Batch] | None = None, *,
            resume: str | Path | bool | None = None) -> FitResult:
        cfg = self.config
        try:
            steps_per_epoch = len(train_loader) // cfg.grad_accum_steps  # type: ignore[arg-type]
        except TypeError:
            steps_per_epoch = None
        if cfg.max_steps is not None:
            total = cfg.max_steps
        elif steps_per_epoch:
            total = cfg.epochs * steps_per_epoch
        else:
            raise ConfigError("the training data has no length and max_steps is not set; set "
                              "max_steps")
        if total <= 0:
            raise ConfigError(f"the training data gives no full step ({len(train_loader)} batches "
                              f"for grad_accum_steps={cfg.grad_accum_steps}); use more data or a "
                              "smaller batch")
        self._prepare(total)
        self._setup_run_dir()
        if resume:
            path = self.run_dir if resume is True else Path(resume)
            self.load_checkpoint(path, train_loader)
        main = self.strategy.is_main
        logger = MetricsLogger(self.run_dir, enabled=main, resume_step=self.step if resume else None)
        if main:
            (self.run_dir / "config.toml").write_text(config_to_toml(cfg))
        self._log_start(total, logger)
        peak = peak_flops(self.policy.compute_dtype, self.device)
        model_for_flops = self.strategy.unwrap(self.model)
        flops_per_token = (model_for_flops.flops_per_token()
                           if hasattr(model_for_flops, "flops_per_token")
                           else 6 * sum(p.numel() for p in model_for_flops.parameters()))

        from tqdm import tqdm
        bar = tqdm(total=total, initial=self.step, disable=not (main and cfg.progress),
                   dynamic_ncols=True, file=sys.stderr, desc="train")
        window: list[torch.Tensor] = []
        tokens_window, t_window, last_val = 0, time.perf_counter(), None
        last_out: StepOutput | None = None
        self.model.train()
        groups = self._micro_batches(train_loader)
        if cfg.audit:
            self._audit(logger)
        first_step = self.step == 0
        with self.strategy.guard():  # a lost peer ends the job with one line, not a hang
            while self.step < total:
                batches = next(groups)
                rng = capture_rng_state() if cfg.trace_nonfinite else None  # to replay a skipped step
                out = self.train_step(batches)
                self.step += 1
                if first_step and cfg.audit:
                    self._report(audit_after_first_step(self.strategy.unwrap(self.model)), logger)
                    first_step = False
                last_out = out
                window.append(out.loss)
                tokens_window += out.tokens
                origin = None
                if out.skipped:
                    origin = self._on_skip(batches, out, rng, logger)
                if self.scale_watch is not None:
                    warning = self.scale_watch.observe(self.step, self.scaler.get_scale(), out.skipped, origin)
                    if warning:
                        logger.event({"kind": "stuck-scale", "step": self.step, "message": warning})
                if self.monitor is not None and self.monitor.should_sample(self.step):
                    logger.log_numerics(self.monitor.last_rows)
                do_eval = val_loader is not None and (
                    (cfg.eval_interval and self.step % cfg.eval_interval == 0) or self.step == total)
                if do_eval:
                    last_val = self.evaluate(val_loader, cfg.eval_batches)
                if self.step % cfg.log_interval == 0 or self.step == total or do_eval:
                    # One host sync per logged interval: the losses of the interval come back together.
                    losses = torch.stack(window).tolist()
                    loss = self.strategy.reduce_mean(sum(losses) / len(losses))
                    elapsed = time.perf_counter() - t_window
                    tps = tokens_window * self.strategy.world_size / elapsed
                    mfu = tps / self.strategy.world_size * flops_per_token / peak
                    if mfu > 1.0 and not self._peak_refreshed:
                        # The cached peak was measured on a busy machine: measure it again.
                        self._peak_refreshed = True
                        peak = peak_flops(self.policy.compute_dtype, self.device, refresh=True)
                        mfu = tps / self.strategy.world_size * flops_per_token / peak
                    logger.log(self.step, epoch=self.epoch, loss=loss, val_loss=last_val if do_eval else None,
                               lr=self.scheduler.get_last_lr()[0], loss_scale=self.scaler.get_scale(),
                               skipped=int(out.skipped), skipped_total=self.scaler.num_skipped_steps,
                               grad_norm=float(out.grad_norm) if out.grad_norm is not None else None,
                               tokens_per_s=tps, mfu=mfu,
                               peak_mem_mb=_peak_memory_mb(self.device), time_s=elapsed)
                    bar.set_postfix(loss=f"{loss:.4f}", val=f"{last_val:.4f}" if last_val else "-",
                                    scale=f"{self.scaler.get_scale():g}", refresh=False)
                    window, tokens_window, t_window = [], 0, time.perf_counter()
                if (cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0) or self.step == total:
                    self.save_checkpoint(train_loader)
                bar.update(1)
        bar.close()
        logger.close()
        final_loss = float(last_out.loss) if last_out is not None else None
        return FitResult(self.run_dir, self.step, self.scaler.num_skipped_steps, final_loss,
                         last_val, self.policy.name)

def fit(model: nn.Module, train_loader: Iterable[Batch], *, val_loader: Iterable[Batch] | None = None,
        epochs: int | None = None, strategy: Strategy | str | None = None,
        mixed_precision: str | Policy | bool = True, optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None, loss_fn: Callable | None = None,
        resume: str | Path | bool | None = None, config: FitConfig | None = None,
        **kwargs: Any) -> FitResult:
    """Train ``model`` on ``train_loader``; the seed's ``model.fit(loader, epochs=10,
    strategy=strategy, mixed_precision=True)`` lands here. Other keyword arguments are
    :class:`FitConfig` fields (``max_steps``, ``lr``, ``grad_accum_steps``, ``clip_grad_norm``,
    ``run_dir``, ...)."""
    if epochs is not None:
        kwargs["epochs"] = epochs
    trainer = Trainer(model, config=config, mixed_precision=mixed_precision, optimizer=optimizer,
                      lr_scheduler=lr_scheduler, loss_fn=loss_fn, strategy=strategy, **kwargs)
    return trainer.fit(train_loader, val_loader, resume=resume)
