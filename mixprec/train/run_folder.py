"""A run's folder as ``fit()`` opens it: which folder (claimed and locked by rank 0), what
``config.toml`` records there (the resolved precision, the ``[recipe]`` table, the model a
``fit()`` trained), and how many steps the run takes."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec import hints
from mixprec.errors import ConfigError
from mixprec.models.hf import is_hf_model, is_hf_spec, keep_run_config
from mixprec.precision import Precision
from mixprec.runs.run_dir import claim_locked_run_dir, deleted_note
from mixprec.strategies import Strategy
from mixprec.train.config import FitConfig, config_to_toml

__all__ = ["total_steps", "claim_run_dir", "write_run_config", "fit_model_name"]


def total_steps(train_loader: Any, cfg: FitConfig) -> int:
    """The steps the run takes: ``max_steps``, or ``epochs`` of the loader's full steps."""
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


def claim_run_dir(strategy: Strategy, cfg: FitConfig, precision: Precision, *, resume: bool,
                  start_over: bool = False, notes: list[tuple[str, str]]) -> tuple[Path, Any]:
    """``(run folder, rank 0's lock on it)``: rank 0 claims (and locks: one folder, one writer) the
    run folder; every rank learns which, or the one-line refusal. ``start_over``: the folder holds
    a run with no complete checkpoint, which a resume begins again from step 0 (its old files are
    replaced)."""
    claim: tuple[str | None, str | None] = (None, None)
    lock = None
    if strategy.is_main:
        deleted: list[str] = []
        try:
            path, lock = claim_locked_run_dir(
                cfg.run_dir, precision=precision.label, resume=resume and not start_over,
                overwrite=cfg.overwrite or start_over, deleted=deleted)
            claim = (str(path), None)
            if not start_over and (said := deleted_note(path, deleted)):  # (a restart says its own)
                notes.append((said, "overwrite"))
        except ConfigError as e:
            claim = (None, str(e))
    # Rank 0 picked (and made) the folder, or refused it: every rank learns which.
    path, error = strategy.broadcast_object(claim)
    if error is not None:
        raise ConfigError(error)
    run_dir = Path(path)
    hints.set_run_dir(run_dir)
    return run_dir, lock


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
    ran = (f"# ran: {precision.ran()}\n"
           if precision.has_plan or precision.switched else "")
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
