"""Measuring one Linear at a time against the FP32 model: what the planner (``plan_precision``)
and the what-if report (``what_if``) both do.

* :func:`planned_layers`: the Linears to measure, from the per-layer table (a layer it keeps in
  FP32 is never a candidate; an unknown name is refused in one line);
* :func:`format_variants`: per format, the model set up in it as training would;
* :func:`reference_pass`: the FP32 pass, its losses and per Linear and batch the recorded
  (input, output, output gradient);
* :func:`layer_alone`: one layer (in any format) on those recorded inputs, with the recorded
  output gradients flowing into it: output, weight gradient, input gradient;
* :func:`losses_with`: the forward losses with one Linear temporarily replaced.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.plan.verify import forward_losses, fp32_copy
from mixprec.precision import Precision

__all__ = ["PlannedLayers", "planned_layers", "format_variants", "reference_pass", "layer_alone",
           "losses_with"]


def reference_pass(model: nn.Module, batches: Sequence[Any], objective: Callable, names: list[str],
               seed: int) -> tuple[list[float], dict[str, list[tuple[torch.Tensor, ...]]]]:
    """The FP32 pass: losses; per Linear and batch its (input, output, output gradient)."""
    seen: dict[str, list[list[torch.Tensor]]] = {n: [] for n in names}
    mods = dict(model.named_modules())

    def hook(name):
        def fn(module, args, output):
            rec = [args[0].detach(), output.detach()]
            seen[name].append(rec)
            if output.requires_grad:
                output.register_hook(lambda g: rec.append(g.detach()))
        return fn

    handles = [mods[n].register_forward_hook(hook(n)) for n in names]
    losses = []
    model.zero_grad(set_to_none=True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for batch in batches:
                loss = objective(model, batch).float()
                (loss / len(batches)).backward()
                losses.append(float(loss.detach()))
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return losses, {n: [tuple(r) for r in v] for n, v in seen.items()}


def layer_alone(layer: nn.Module, records: list[tuple[torch.Tensor, ...]],
                outputs: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, weight gradient, input gradient) of ``layer`` on its recorded FP32 inputs, with the
    recorded FP32 output gradients flowing into it: the layer alone, everything around it exact.
    (Measured for the FP32 layer too, so a weight shared with another module, a tied head,
    compares like with like.) The layer's own ``forward`` runs, not its hooks: the recorded inputs
    are what reached ``forward``, after any pre-hook, so running a pre-hook again would apply it
    twice. ``outputs``, when given, receives each record's output as the layer returned it (its
    dtype and shape), for the what-if report's loss pass to replay."""
    layer.zero_grad(set_to_none=True)
    outs, dxs = [], []
    with torch.enable_grad():
        for rec in records:
            x = rec[0].detach().requires_grad_(len(rec) > 2)
            y = layer.forward(x)
            outs.append(y.detach().float().flatten())
            if outputs is not None:
                outputs.append(y.detach())
            if len(rec) > 2:
                y.backward(rec[2].to(y.dtype))
                dxs.append(x.grad.detach().float().flatten())
    g = layer.weight.grad
    g = None if g is None else g.detach().float().clone()
    layer.zero_grad(set_to_none=True)
    return torch.cat(outs), g, (torch.cat(dxs) if dxs else None)


@dataclass(frozen=True, kw_only=True)
class PlannedLayers:
    """The Linears a planner measures, read from a :class:`mixprec.Precision`'s per-layer table."""

    names: list[str]
    """The Linears to measure, in module order."""
    current: dict[str, str]
    """Each one's format under that precision (the table's ``compute``)."""
    kept: dict[str, str]
    """Linears the table keeps in FP32 (a gate, a ``keep_in_fp32`` tag, ``keep_fp32_names``) -> why."""
    notes: list[str]
    """What was left out and why, for the report."""


def planned_layers(precision: Precision, model: nn.Module, layers: Sequence[str] | None = None
                   ) -> PlannedLayers:
    """The layers ``precision``'s per-layer table (:meth:`mixprec.Precision.resolve`) gives a
    per-layer format and does not keep in FP32, that are ``nn.Linear`` (what :func:`layer_alone`
    measures; a Conv1D is left out, said in the notes); limited to ``layers`` when given. A name
    that is no such layer is refused in one line: an unknown one with the closest match, one the
    table keeps in FP32 with the table's reason."""
    table = precision.resolve(model)
    mods = dict(model.named_modules())
    formats, kept = table.plannable, table.kept_fp32
    measured = {n: f for n, f in formats.items() if isinstance(mods[n], nn.Linear)}
    other = [n for n in formats if n not in measured]
    notes = []
    if layers is not None:
        for name in layers:
            if name in kept:
                raise ConfigError(f"'{name}' is kept in FP32 ({kept[name]}): there is no format "
                                  "to plan for it")
            if name not in measured:
                from mixprec.errors import closest
                raise ConfigError(f"no Linear named '{name}'{closest(name, list(measured))}")
        measured = {n: f for n, f in measured.items() if n in layers}
    else:
        if kept:
            notes.append("kept in FP32, not planned: " + "; ".join(f"{n} ({why})" for n, why in kept.items()))
        if other:
            notes.append(f"not measured (the planner measures nn.Linear layers): {', '.join(other)}")
    return PlannedLayers(names=list(measured), current=measured, kept=kept, notes=notes)


def format_variants(model: nn.Module, formats: Sequence[str], device: torch.device
                    ) -> tuple[dict[str, nn.Module], dict[str, dict[str, str]]]:
    """Per format ``f``: a copy of ``model`` set up as training would (``32-true`` with the
    override ``* = f``), so each trial swaps one of its layers into the FP32 model; and the layers
    the rules refuse ``f`` (name -> why)."""
    variants: dict[str, nn.Module] = {}
    refused: dict[str, dict[str, str]] = {}
    for f in formats:
        trial = fp32_copy(model)
        prec = Precision("32-true", device=device, overrides=(("*", f),))
        prec.setup(trial)
        trial.train()
        variants[f] = trial
        why = {n: r for rep in (prec.fp8_report, prec.micro_report) if rep is not None
               for n, r in rep.skipped}
        refused[f] = {n: why.get(n, f"runs {got}") for n, got in prec.layer_formats.items() if got != f}
    return variants, refused


def losses_with(model: nn.Module, name: str, variant: nn.Module, batches: Sequence[Any],
                 objective: Callable, seed: int) -> list[float]:
    """Forward losses of ``model`` with the Linear ``name`` temporarily replaced by ``variant``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    original = getattr(parent, child)
    setattr(parent, child, variant)
    try:
        return forward_losses(model, batches, objective, seed)
    finally:
        setattr(parent, child, original)
