"""A plan keeps its budget: measure the whole plan, move layers back while it is over.

The per-layer estimates only rank candidates (:mod:`mixprec.plan.planner`): errors of many layers
add up, interact, and a one-forward estimate can miss what a layer does to the loss. So after the
first choice the planner applies the *whole* plan to a copy of the model and measures its loss
change against FP32, on the calibration batches and on held-out batches the per-layer
measurements never saw:

    change(batches) = mean_b |loss_plan(b) - loss_fp32(b)| / mean_b loss_fp32(b)

While the larger of the two exceeds the budget, every layer not yet at its most accurate
candidate is tried one format safer (FP8 -> BF16 -> FP32, :func:`mixprec.plan.plan.safer_format`),
the whole plan measured again with that one move, and the move that brings the plan's change down
the most (the layer that contributes the most, measured) is kept. It stops when the plan fits or
every layer is at its most accurate format (said in the notes: the layers outside the plan, or
the data, change the loss more than the budget allows).

Cost per round: one forward over the calibration and held-out batches per movable layer; the
model is copied once and layers are swapped in place (:meth:`mixprec.Precision.layers.set_format`).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.plan.plan import PrecisionPlan, safer_format, update_times
from mixprec.precision import Precision, forget_setup, identity, setup_identity

__all__ = ["enforce_budget", "relative_change", "forward_losses", "fp32_copy"]


def fp32_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` that a Precision may set up: ``model`` is a plain FP32 model, or
    one set up for ``32-true`` without overrides (trained by ``fit()`` in FP32), which leaves its
    modules as they were; a model set up for another mode is refused."""
    done = setup_identity(model)
    if done is not None and done != identity(Precision("32-true").policy):
        raise ConfigError(f"the planner measures an FP32 model, and this one was set up for "
                          f"precision {done}; plan on a fresh model with its weights "
                          "(model.load_state_dict(...)) or on the model trained in 32-true")
    trial = copy.deepcopy(model)
    forget_setup(trial)
    return trial


def forward_losses(model: nn.Module, batches: Sequence[Any], objective: Callable, seed: int
                    ) -> list[float]:
    """The model's forward loss on each batch (the RNG seeded once, as the planner's FP32 reference pass is)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [float(objective(model, batch).float()) for batch in batches]


def relative_change(losses: Sequence[float], reference: Sequence[float]) -> float:
    """``mean |loss - reference| / mean reference`` over batches (the module docstring's change)."""
    return sum(abs(a - b) for a, b in zip(losses, reference)) / len(losses) / (sum(reference) / len(reference))


def enforce_budget(plan: PrecisionPlan, model: nn.Module, *, calib: Sequence[Any],
                   heldout: Sequence[Any], ref_calib: Sequence[float], ref_heldout: Sequence[float],
                   objective: Callable, seed: int, device: torch.device,
                   progress: Callable[[str], None] | None = None) -> None:
    """Measure ``plan`` as a whole and move layers back until it keeps ``plan.budget`` (module
    doc). Sets the plan's measured fields, ``loss_change``, ``demoted`` and its GEMM times."""
    say = progress or (lambda s: None)
    cands = list(plan.throughput)
    trial = fp32_copy(model)
    precision = Precision("32-true", device=device, overrides=plan.overrides)
    precision.setup(trial)
    trial.train()
    by_name = {m.name: m for m in plan.layers}

    def measure() -> tuple[float, float | None]:
        cal = relative_change(forward_losses(trial, calib, objective, seed), ref_calib)
        held = (relative_change(forward_losses(trial, heldout, objective, seed), ref_heldout)
                if heldout else None)
        return cal, held

    def worst(c: tuple[float, float | None]) -> float:
        return max(c[0], c[1] if c[1] is not None else 0.0)

    current = measure()
    while worst(current) > plan.budget:
        best = None
        for m in plan.layers:
            safer = safer_format(m, cands)
            if safer is None:
                continue
            precision.layers.set_format(trial, m.name, safer)
            trial_change = measure()
            precision.layers.set_format(trial, m.name, m.chosen)
            key = (worst(trial_change), m.name)
            if best is None or key < best[0]:
                best = (key, m, safer, trial_change)
        if best is None:
            plan.notes.append(f"every layer is at its most accurate candidate and the plan still "
                              f"changes the loss by {100 * worst(current):.3g}% (budget "
                              f"{100 * plan.budget:.3g}%): the budget is below what this model and "
                              "data allow")
            break
        _, m, safer, current = best
        say(f"whole plan over budget: {m.name} {m.chosen} -> {safer}")
        plan.demoted.append({"layer": m.name, "from": m.chosen, "to": safer,
                             "calibration": current[0], "heldout": current[1]})
        by_name[m.name].chosen = safer
        precision.layers.set_format(trial, m.name, safer)
    plan.measured_calibration, plan.measured_heldout = current
    plan.loss_change = worst(current)
    update_times(plan)
