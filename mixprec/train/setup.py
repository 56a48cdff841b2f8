"""What a :class:`~mixprec.train.Trainer` is built with and what ``prepare()`` builds, in order:
the run's ``Precision`` (from ``fit()``'s arguments), the precision applied to the model (wrapped
by the strategy), the optimizer and its LR schedule, and the optional watchers that become the
step hooks (train/hooks.py); and the record of those choices in the run's ``config.toml``.

Each function returns what it built; the trainer keeps it. A setting that changes nothing, or
that changes what the user would assume, is said at start: appended to ``notes`` as ``(message,
kind)``, which the run's events say and record once they are open.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from mixprec.errors import ConfigError, closest, excerpt
from mixprec.models.hf import is_hf_model, is_hf_spec, keep_run_config
from mixprec.models.objective import apply_loss_chunk, make_objective
from mixprec.monitor import NumericsMonitor, ScaleWatch
from mixprec.monitor.guard import TrainingGuard
from mixprec.monitor.replan import LayerReplanner
from mixprec.nn.fp8_activations import store_activations_in_fp8
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.optim.registry import find_optimizer_for
from mixprec.optim.schedule import warmup_cosine_scheduler
from mixprec.precision import Policy, Precision
from mixprec.strategies import Strategy
from mixprec.train.config import (FitConfig, config_to_toml, refuse_changes_to_ready_precision,
                                  refuse_two_modes)
from mixprec.train.hooks import GuardHook, NumericsHook, ReplanHook, ScaleWatchHook, StepHook
from mixprec.train.schedules import move_scheduler

__all__ = ["with_overrides", "choose_precision", "refuse_swaps_when_sharded", "apply_precision",
           "build_optimizer", "build_scheduler", "watch_numbers", "overlapped_update",
           "activations_in_fp8", "watch_formats", "step_hooks", "compiled_first_step",
           "write_run_config", "fit_model_name"]

Notes = list[tuple[str, str]]


def with_overrides(config: FitConfig | None, overrides: dict[str, Any]) -> FitConfig:
    """``config`` (or the defaults) with ``fit()``'s keyword overrides, validated: an unknown
    argument or a bad value is refused in one line."""
    config = config or FitConfig()
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = set(overrides) - fields
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(f"fit() got an unknown argument '{name}'{closest(name, fields)}")
    cfg = dataclasses.replace(config, **overrides) if overrides else config
    cfg.validate()
    return cfg


def choose_precision(model: nn.Module, cfg: FitConfig, given: set[str],
                     mixed_precision: str | Policy | Precision | bool | None,
                     optimizer: torch.optim.Optimizer | None,
                     device: torch.device) -> tuple[Precision, torch.optim.Optimizer | None]:
    """``(precision, found optimizer)``: the run's ``Precision`` (every precision choice of the
    run, fixed here; a ready one keeps its own settings: a ``given`` setting that would change it
    is refused), and the optimizer built for this model that was not passed."""
    choice = mixed_precision if mixed_precision is not None else cfg.precision
    if isinstance(choice, Precision):           # a ready Precision keeps its own settings
        refuse_changes_to_ready_precision(choice, cfg, given)
        if cfg.micro_options:
            raise ConfigError("micro_options with a ready Precision: pass them to it, "
                              "mixprec.Precision(mode, micro_options=...)")
    elif mixed_precision is not None and "precision" in given:
        refuse_two_modes(mixed_precision, cfg.precision, device)
    # An optimizer the user built for this model (docs/sources.md: build one, call fit()); one
    # that stores the parameters in 16 bits decides `auto` now, when the recipe is built.
    found = find_optimizer_for(model.parameters()) if optimizer is None else None
    # Every precision choice of the run, fixed here (scaling only where the mode needs it).
    precision = choice if isinstance(choice, Precision) else Precision(
        cfg.recipe(choice, device=device, optimizer=optimizer or found), device=device)
    return precision, found


def refuse_swaps_when_sharded(cfg: FitConfig, strategy: Strategy) -> None:
    """The guard and the re-planner swap Linear modules, which FSDP2 shards: refused before
    anything touches the model."""
    if not strategy.shards_parameters:
        return
    swaps = [(given, off) for given, off, on in (
        ("guard=true", "guard=false", cfg.guard),
        (f"replan_every={cfg.replan_every}", "replan_every=0", cfg.replan_every)) if on]
    if swaps:
        given, off = swaps[0]
        raise ConfigError(f"{given} swaps Linear modules while training and FSDP2 shards "
                          f"them: use strategy=ddp or single, or {off}")


def apply_precision(raw_model: nn.Module, precision: Precision, strategy: Strategy, cfg: FitConfig, *,
                    loss_fn: Callable | None, optimizer: torch.optim.Optimizer | None,
                    found: torch.optim.Optimizer | None, notes: Notes) -> tuple[nn.Module, Callable]:
    """``(model, objective)``: the model on the device with the precision applied (storage dtypes,
    FP32 exemptions, FP8 swap), wrapped by the strategy (DDP / FSDP, or none), and its loss."""
    model = raw_model.to(strategy.device)
    precision.recipe.check_optimizer(optimizer)   # a ready Precision's mode is its own
    asked = precision.recipe.resolved_from or precision.name
    if found is not None and strategy.is_main:   # one line: what was found, and what it changed
        change = (f"; it stores parameters in 16 bits, so precision {asked} -> {precision.name}"
                  if precision.name != asked else "")
        print(f"[mixprec] using the {type(found).__name__} built for this model (not passed to "
              f"fit()){change}", file=sys.stderr)
    sharded = strategy.shards_parameters              # FSDP2: FP32 shards are the masters
    # Storage dtypes, FP32 exemptions (norms, gates), FP8 swap.
    precision.setup_module(model, sharded=sharded, optimizer=optimizer)
    apply_loss_chunk(model, cfg.loss_chunk, loss_fn=loss_fn)   # refused where it cannot act
    if cfg.loss_chunk:
        notes.append((f"loss: computed {cfg.loss_chunk} tokens at a time, each slice's head "
                      "and cross-entropy recomputed in backward (loss_chunk; docs/lean.md)", "loss"))
    objective = make_objective(model, precision, loss_fn)
    model, _ = strategy.setup(model, precision=precision)  # DDP / FSDP wrapping (or none)
    if cfg.compile:
        strategy.unwrap(model).compile()     # the model's forward, not the loop
    return model, objective


def build_optimizer(model: nn.Module, precision: Precision, strategy: Strategy, cfg: FitConfig, *,
                    optimizer: torch.optim.Optimizer | None, scheduler: Any,
                    notes: Notes) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """``(optimizer, group settings)``: the user's optimizer set up on the precision's masters
    (their scheduler moved onto it), or mixprec's AdamW with the recipe's master layout and
    moments; the group settings are what a restore puts back (this run's, not the checkpoint's)."""
    sharded = strategy.shards_parameters
    group_settings: list[dict[str, Any]] = []
    if optimizer is not None:
        built = precision.setup_optimizer(optimizer, model, sharded=sharded)
        if scheduler is not None and getattr(scheduler, "optimizer", None) is optimizer \
                and built is not optimizer:
            # The optimizer now steps FP32 masters: the schedule must set their learning rate
            # (moved as torch would have built it: no warning about mixprec's own move).
            move_scheduler(scheduler, built)
        notes.append((
            f"optimizer: your {type(optimizer).__name__}, with its own settings (the lr/weight_decay/"
            f"beta1/beta2 settings are not used; config.toml records the optimizer's)"
            + ("" if scheduler is not None else
               f"; LR schedule: {cfg.warmup_steps} warm-up steps then cosine to "
               f"{cfg.min_lr_ratio:g}x over its LRs (pass lr_scheduler= for your own)"),
            "optimizer"))
        return built, group_settings
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # Master layout and moments: the recipe's (split_masters, moments).
    built = precision.make_optimizer(groups, sharded=sharded, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     model=strategy.unwrap(model))
    # What a restore must not take from the checkpoint: this run's settings win (also
    # the kernel: a CPU run's checkpoint resumed on CUDA steps fused, and back).
    group_settings = [{k: g[k] for k in ("weight_decay", "betas", "fused", "foreach") if k in g}
                      for g in built.param_groups]
    return built, group_settings


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: FitConfig, *, scheduler: Any,
                    total_steps: int, notes: Notes) -> Any:
    """The user's scheduler, or mixprec's warm-up then cosine over ``total_steps``."""
    # Warm-up step s (from 0) runs at (s + 1) / warmup_steps of the peak: a warm-up exactly as
    # long as the run reaches the peak at its last step; only a longer one never does.
    if scheduler is None and cfg.warmup_steps > total_steps:
        notes.append((f"warm-up ({cfg.warmup_steps} steps) is longer than the run ({total_steps} "
                      f"steps): the LR never reaches its peak; set warmup_steps= at most "
                      f"{total_steps}", "schedule"))
    return scheduler or warmup_cosine_scheduler(
        optimizer, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_ratio=cfg.min_lr_ratio)


def overlapped_update(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
                      cfg: FitConfig, *, replacing: OverlappedUpdate | None,
                      notes: Notes) -> OverlappedUpdate | None:
    """The update of a taken step issued per module, overlapping the next forward (CUDA), in
    place of the one ``replacing`` (closed); and the settings accepted here that change nothing,
    said in one line at start, not left to be found in a benchmark that shows no difference."""
    if replacing is not None:
        replacing.close()
    overlap = (OverlappedUpdate(model, optimizer, per_module=False if cfg.compile else None)
               if cfg.overlap_optimizer else None)
    if cfg.overlap_optimizer and strategy.device.type != "cuda":
        notes.append((f"overlap_optimizer=true does nothing on {strategy.device.type}: there is "
                      "no CUDA stream for the update to overlap on (it runs in order, the same "
                      "update)", "overlap"))
    compression = getattr(cfg, "grad_compression", None)
    compression = compression if compression not in (None, "none") else getattr(strategy, "grad_compression", None)
    if compression not in (None, "none") and not strategy.is_distributed:
        notes.append((f"grad_compression={compression} does nothing in one process: it compresses "
                      "what DDP sends between processes (launch with torchrun "
                      "--nproc_per_node=N)", "strategy"))
    return overlap


def activations_in_fp8(model: nn.Module, precision: Precision, cfg: FitConfig, *, replacing: Any,
                       notes: Notes) -> Any:
    """What Linear layers save for backward, kept in FP8 (opt-in; mixprec/nn/fp8_activations.py):
    the store (``remove()`` undoes it), or None; in place of the store ``replacing`` (removed)."""
    if replacing is not None:
        replacing.remove()
    store = store_activations_in_fp8(model) if precision.recipe.fp8_activations else None
    if store is not None:
        notes.append((f"activations: what {len(store.modules)} Linear layers save "
                      "for backward kept in FP8 E4M3 with per-block scales, widened in "
                      "backward (fp8_activations; docs/lean.md)", "memory"))
    if cfg.replan_every and precision.recipe.fp8_activations:
        raise ConfigError("replan_every swaps Linear modules, which drops the FP8-activation "
                          "hooks on them; use fp8_activations=false or replan_every=0")
    return store


def watch_numbers(model: nn.Module, precision: Precision,
                  cfg: FitConfig) -> tuple[NumericsMonitor | None, ScaleWatch | None]:
    """Watching the numbers: per-layer statistics on sampled steps (``monitor_every``), and a
    stuck-scale watch where the loss is scaled."""
    monitor = (NumericsMonitor(model, every=cfg.monitor_every, compute_dtype=precision)
               if cfg.monitor_every else None)
    floor = precision.scaler.config        # the Precision's own floor (fit()'s, or a ready one's)
    scale_watch = (ScaleWatch(floor.min_scale, on_stuck=floor.on_min_scale)
                   if precision.recipe.scales_loss else None)
    return monitor, scale_watch


def watch_formats(model: nn.Module, precision: Precision, strategy: Strategy, cfg: FitConfig, *,
                  optimizer: torch.optim.Optimizer,
                  scheduler: Any) -> tuple[LayerReplanner | None, TrainingGuard | None]:
    """Acting on the numbers: the re-planner (``replan_every``) and the guard (``guard``)."""
    replanner = (LayerReplanner(precision, model, every=cfg.replan_every, window=cfg.replan_window)
                 if cfg.replan_every else None)
    guard = (TrainingGuard(precision, model, optimizer, scheduler,
                           config=cfg.guard_config(),   # ranks vote (MAX) alike
                           agree=strategy.all_reduce_max if strategy.world_size > 1 else None)
             if cfg.guard else None)
    return replanner, guard


def step_hooks(scale_watch: ScaleWatch | None, monitor: NumericsMonitor | None,
               replanner: LayerReplanner | None, guard: TrainingGuard | None) -> list[StepHook]:
    """The watchers as step hooks, in call order."""
    hooks: list[StepHook] = [ScaleWatchHook(scale_watch)] if scale_watch is not None else []
    if monitor is not None:
        hooks.append(NumericsHook(monitor))
    if replanner is not None:
        hooks.append(ReplanHook(replanner))
    if guard is not None:
        hooks.append(GuardHook(guard))   # last: it may restore what others measured
    return hooks


def compiled_first_step(trainer: Any, batches: list[Any]) -> Any:
    """``trainer.train_step(batches)``, the first step of a ``compile=true`` run, which compiles
    the model; if torch.compile cannot (say why), the step runs eager."""
    try:
        return trainer.train_step(batches)
    except Exception as e:
        if not any(type(x).__module__.startswith(("torch._dynamo", "torch._inductor"))
                   for x in (e, e.__cause__) if x is not None):
            raise
        # The compile failed in the first forward, before any gradient or update: undo it.
        trainer.strategy.unwrap(trainer.model)._compiled_call_impl = None
        first = excerpt(e, 300)
        trainer.events.note(f"compile=true failed ({type(e).__name__}: {first}); training eager",
                            trainer.step, kind="compile")
        return trainer.train_step(batches)


def write_run_config(run_dir: Path, cfg: FitConfig, precision: Precision, *, model: nn.Module,
                     optimizer: torch.optim.Optimizer | None, train_loader: Any) -> None:
    """``config.toml`` (rank 0): the resolved precision ("auto" means something else on another
    machine), the optimizer's settings that ran, and the ``[recipe]`` table."""
    # A plan's layers (plan:PATH, precision_overrides) are kept as the [overrides]
    # table beside its base mode: what a resume rebuilds the same Precision from.
    recipe = precision.recipe     # the [recipe] table below records all of it
    resolved = dataclasses.replace(cfg, precision=precision.name,
                                   precision_overrides=recipe.policy.overrides,
                                   micro_options=",".join(
                                       f"{k}={'none' if v is None else v}"
                                       for k, v in recipe.policy.micro_options),
                                   split_masters=recipe.split_masters, moments=recipe.moments,
                                   fp8_activations=recipe.fp8_activations,
                                   **_optimizer_settings(optimizer))
    mine = optimizer
    used = ("" if mine is None else
            f"# optimizer: the caller's {type(mine).__name__}; lr, weight_decay and betas above are "
            f"its own where all its groups agree ({', '.join(_optimizer_settings(mine)) or 'none'}), "
            "the others were not used\n")
    ran = (f"# ran: {precision.layers.ran()}\n"
           if precision.recipe.has_plan or precision.layers.switched else "")
    (run_dir / "config.toml").write_text(
        config_to_toml(resolved, _what_fit_trained(cfg, model, train_loader)) + used
        + ran + "\n" + recipe.to_toml())
    if is_hf_spec(getattr(cfg, "model", "")):   # a resume needs it, not its old path
        keep_run_config(cfg.model, run_dir)


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


def fit_model_name(model: nn.Module) -> str:
    """The model class a ``fit()`` run records in ``config.toml`` (``model = "fit: <this>"``)."""
    kind = type(model)
    return (f"transformers {kind.__name__} (its config.json: RUN_DIR/hf)" if is_hf_model(model)
            else f"{kind.__module__}.{kind.__qualname__}")


def _what_fit_trained(cfg: FitConfig, model: nn.Module, loader: Any) -> str:
    """For a ``fit()`` run (a config without ``model``): the model and, where the loader says, the
    batch shape, as ``config.toml`` lines, so a reader (and ``mixprec train --resume``) learns them."""
    if hasattr(cfg, "model"):
        return ""
    lines = [f"model = {json.dumps('fit: ' + fit_model_name(model))}"]
    inner = getattr(loader, "loader", loader)
    seq_len = getattr(getattr(inner, "dataset", None), "max_length", None)
    for key, value in (("seq_len", seq_len), ("batch_size", getattr(inner, "batch_size", None))):
        if isinstance(value, int) and not isinstance(value, bool):
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
