"""What a Trainer checkpoint holds, and how a run continues from one.

A mixin of :class:`mixprec.train.Trainer`: it reads the trainer's model, optimizer, scaler,
scheduler, strategy, step and epoch. Files are written by :mod:`mixprec.train.checkpoint`
(atomic folders, safetensors weights, ``weights_only`` state).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mixprec.errors import CheckpointError
from mixprec.train import checkpoint as ckpt

__all__ = ["CheckpointMixin"]


class CheckpointMixin:
    """Save and restore everything an exact resume needs (see docs/checkpoints.md)."""


    def _train_state(self, loader: Any) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        return {
            "step": self.step,
            "epoch": self.epoch,
            "policy": self.policy.spec(),
            "optimizer": self.strategy.optimizer_state_dict(self.model, self.optimizer),
            "scaler": {**self.scaler.state_dict(), **self.scaler.counters},  # counters: also with scaling off
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
            "strategy": self.strategy.state_dict() if hasattr(self.strategy, "state_dict") else None,
            "config": {k: v for k, v in cfg.items() if v is not None},
        }

    def save_checkpoint(self, loader: Any) -> Path | None:
        state = self._train_state(loader)            # collectives (FSDP) run on every rank
        model_state = self.strategy.model_state_dict(self.model)
        path = None
        if self.strategy.is_main and self.run_dir is not None:
            path = ckpt.save_checkpoint(self.run_dir, self.step, model_state=model_state,
                                        train_state=state, keep_last=self.config.keep_last)
        self.strategy.barrier()
        return path

    def load_checkpoint(self, path: str | Path, loader: Any) -> None:
        model_state, state, _meta = ckpt.load_checkpoint(path)
        if state.get("policy") != self.policy.spec():
            raise CheckpointError(
                f"checkpoint {path} was trained with precision {state.get('policy')}, this run uses "
                f"{self.policy.spec()}; resume with the same --precision")
        try:
            self.strategy.load_model_state_dict(self.model, model_state)
        except (RuntimeError, KeyError) as e:
            lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
            first = " ".join(lines[:2])[:240]
            raise CheckpointError(f"checkpoint {path} does not fit this model ({first}); resume with "
                                  "the model settings it was saved with") from None
        self.strategy.load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state["loader"])
            self._loader_resumed = True
            # The loader moves to the next epoch as soon as it hands out an epoch's last batch.
            self.epoch = int(state["loader"].get("epoch", self.epoch))
        if state.get("strategy") is not None and hasattr(self.strategy, "load_state_dict"):
            self.strategy.load_state_dict(state["strategy"])
        ckpt.restore_rng_state(state["rng"])
