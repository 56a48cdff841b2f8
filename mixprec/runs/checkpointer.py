"""What a Trainer checkpoint holds, and how a run continues from one.

:class:`Checkpointer` saves and restores everything an exact resume needs; its inputs are
explicit arguments (model, optimizer, precision, scheduler, loader, step, epoch, config), not a
trainer it reaches into. Files are written by :mod:`mixprec.runs.checkpoint` (atomic folders,
safetensors weights, ``weights_only`` state). See docs/checkpoints.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.precision import Precision
from mixprec.errors import CheckpointError, ConfigError, excerpt
from mixprec.strategies import Strategy
from mixprec.runs import checkpoint as ckpt
from mixprec.models.hf import export_pretrained, is_hf_model

__all__ = ["Checkpointer", "Restored"]


@dataclass(frozen=True)
class Restored:
    """Where a restored run stands."""

    step: int
    epoch: int
    loader_resumed: bool   # the loader knows its epoch and position (do not call set_epoch)
    saved_lr: list[float] = dataclasses.field(default_factory=list)
    """The LR of each optimizer group as the checkpoint left it."""
    notes: tuple[str, ...] = ()
    """What the run should say and record (a checkpoint skipped, and why)."""


class Checkpointer:
    """Writes a run's checkpoints under ``run_dir`` (rank 0) and restores them (every rank)."""

    def __init__(self, strategy: Strategy, run_dir: Path | None, *, keep_last: int,
                 export_hf: bool = False, model: nn.Module | None = None) -> None:
        self.strategy = strategy
        self.run_dir = run_dir
        self.keep_last = keep_last
        # A Hugging Face model also goes out as a save_pretrained folder: RUN_DIR/hf at the end,
        # and checkpoints/step-N/hf with each checkpoint when export_hf is set.
        self.hf = model is not None and is_hf_model(strategy.unwrap(model))
        if export_hf and not self.hf:
            name = type(strategy.unwrap(model)).__name__ if model is not None else "the model"
            raise ConfigError(f"export_hf=true writes Hugging Face save_pretrained folders, but "
                              f"{name} is not a transformers model; set export_hf=false")
        self.export_hf = export_hf

    def save(self, *, step: int, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             precision: Precision, scheduler: Any, loader: Any, config: Any,
             replanner: Any = None, guard: Any = None) -> Path | None:
        """Write checkpoint ``step`` atomically; collectives (FSDP) run on every rank."""
        strategy = self.strategy
        cfg = dataclasses.asdict(config)
        state = {
            "step": step,
            "epoch": epoch,
            "policy": precision.policy.spec(),
            "precision": precision.name,
            "overrides": [list(o) for o in precision.policy.overrides],
            # The current per-layer formats (re-planning changes them) and the re-planner's state.
            "layer_formats": dict(precision.layers.formats),
            "replan": replanner.state_dict() if replanner is not None else None,
            # The training guard's windows, counters and snapshot (mixprec/monitor/guard.py).
            "guard": guard.state_dict() if guard is not None else None,
            "optimizer": strategy.optimizer_state_dict(model, optimizer),
            # Skip counts live outside a disabled scaler's (torch-compatible, empty) state dict.
            "scaler": {**precision.scaler.state_dict(), **precision.scaler.counters},
            "scheduler": scheduler.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
            "strategy": strategy.state_dict() if hasattr(strategy, "state_dict") else None,
            "config": {k: v for k, v in cfg.items() if v is not None},
        }
        model_state = strategy.model_state_dict(model)
        path = None
        if strategy.is_main and self.run_dir is not None:
            path = ckpt.save_checkpoint(self.run_dir, step, model_state=model_state,
                                        train_state=state, keep_last=self.keep_last or None)
            if self.export_hf:
                self._export(model, path / "hf", model_state)
        strategy.barrier()
        return path

    def export_final(self, model: nn.Module) -> Path | None:
        """A Hugging Face model's final weights as ``RUN_DIR/hf`` (``save_pretrained``); None for
        other models. Call on every rank (sharded strategies gather collectively)."""
        if not self.hf or self.run_dir is None:
            return None
        state = self.strategy.model_state_dict(model) if self.strategy.shards_parameters else None
        path = None
        if self.strategy.is_main:
            path = self._export(model, self.run_dir / "hf", state)
        self.strategy.barrier()
        return path

    def _export(self, model: nn.Module, folder: Path, full_state: dict | None) -> Path:
        # Unsharded models save themselves (tied weights stay tied); FSDP2 passes the gathered state.
        state = full_state if self.strategy.shards_parameters else None
        return export_pretrained(self.strategy.unwrap(model), folder, state_dict=state)

    def load(self, path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer,
             precision: Precision, scheduler: Any, loader: Any, replanner: Any = None,
             guard: Any = None) -> Restored:
        """Restore weights, optimizer, loss scale, schedule, data position and RNG from ``path``."""
        strategy = self.strategy
        step_dir, note = ckpt.resolve_checkpoint(Path(path))
        model_state, state, _meta = ckpt.load_checkpoint(step_dir)
        if state.get("policy") != precision.policy.spec():
            saved = state.get("precision") or state.get("policy")
            raise CheckpointError(
                f"checkpoint {path} was trained with precision {saved}, this run uses "
                f"{precision.name}; resume with --precision {saved}")
        saved_overrides = tuple(tuple(o) for o in state.get("overrides", ()))
        if saved_overrides != precision.policy.overrides:
            raise CheckpointError(
                f"checkpoint {path} was trained with per-layer overrides {list(saved_overrides)}, "
                f"this run uses {list(precision.policy.overrides)}; resume with the same overrides")
        try:
            strategy.load_model_state_dict(model, model_state)
        except (RuntimeError, KeyError) as e:
            misfit = _misfit(strategy.unwrap(model), model_state) or excerpt(e, 240)
            raise CheckpointError(f"checkpoint {path} does not fit this model ({misfit}); resume with "
                                  "the model settings it was saved with") from None
        # Same Parameters whatever the formats: restore the plan, then the optimizer.
        precision.layers.restore(strategy.unwrap(model), dict(state.get("layer_formats") or {}))
        if replanner is not None and state.get("replan"):
            replanner.load_state_dict(state["replan"])
        if guard is not None and state.get("guard"):
            guard.load_state_dict(state["guard"])
        strategy.load_optimizer_state_dict(model, optimizer, state["optimizer"])
        precision.scaler.load_state_dict(state["scaler"])
        scheduler.load_state_dict(state["scheduler"])
        saved_lr = [float(g["lr"]) for g in optimizer.param_groups]
        step, epoch = int(state["step"]), int(state["epoch"])
        loader_resumed = False
        if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state["loader"])
            loader_resumed = True
            if getattr(loader, "resume_note", None):
                note = f"{note}; {loader.resume_note}" if note else loader.resume_note
            # The loader moves to the next epoch as soon as it hands out an epoch's last batch.
            epoch = int(state["loader"].get("epoch", epoch))
            if getattr(loader, "resume_note", None) and hasattr(loader, "epoch"):
                epoch = int(loader.epoch)        # the position moved (to the next epoch's start)
        if state.get("strategy") is not None and hasattr(strategy, "load_state_dict"):
            strategy.load_state_dict(state["strategy"])
        ckpt.restore_rng_state(state["rng"])
        return Restored(step, epoch, loader_resumed, saved_lr, (note,) if note else ())


def _names(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 9 more``: whole names, and how many were left out."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _misfit(model: nn.Module, state: Any) -> str:
    """How a checkpoint's weights differ from ``model``'s, counted, in whole names: ``12 weights
    missing from the checkpoint (blocks.2.ln1.weight, ... and 9 more); 1 of another shape, the
    checkpoint's -> this model's (wpe.weight [64, 64] -> [1024, 64])``. torch's own message lists
    every key and had to be cut to fit one line; ``""`` when names and shapes agree (the caller
    quotes torch then)."""
    if state is None:
        return ""
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}
    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    shapes = [f"{k} {list(theirs[k])} -> {list(mine[k])}"
              for k in mine if k in theirs and theirs[k] != mine[k]]
    parts = [f"{len(names)} {what} ({_names(names)})" for names, what in (
        (missing, "weights missing from the checkpoint"),
        (unexpected, "weights this model does not have"),
        (shapes, "of another shape, the checkpoint's -> this model's")) if names]
    return "; ".join(parts)
