"""Measuring one Linear at a time against the FP32 model: what the planner (``plan_precision``)
and the what-if report (``what_if``) both do.

* :func:`linear_names`: the Linears to measure (an unknown name refused in one line);
* :func:`reference_pass`: the FP32 pass, its losses and per Linear and batch the recorded
  (input, output, output gradient);
* :func:`layer_alone`: one layer (in any format) on those recorded inputs, with the recorded
  output gradients flowing into it: output, weight gradient, input gradient;
* :func:`losses_with`: the forward losses with one Linear temporarily replaced.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.plan.verify import forward_losses

__all__ = ["linear_names", "reference_pass", "layer_alone", "losses_with"]


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


@torch.no_grad()
def linear_names(model: nn.Module, layers: Sequence[str] | None = None) -> list[str]:
    """The model's ``nn.Linear`` names, limited to ``layers`` when given (an unknown name is
    refused in one line, with the closest match)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if layers is not None:
        unknown = [n for n in layers if n not in names]
        if unknown:
            from mixprec.errors import closest
            raise ConfigError(f"no Linear named '{unknown[0]}'{closest(unknown[0], names)}")
        names = [n for n in names if n in layers]
    return names


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
