"""Measuring one Linear at a time against the FP32 model: what the planner (``plan_precision``)
and the what-if report (``what_if``) both do.

* :func:`planned_layers`: the Linears to measure, from the per-layer table (a layer it keeps in
  FP32 is never a candidate; an unknown name is refused in one line); :func:`linear_names`: every
  ``nn.Linear`` (what :func:`block_list` groups);
* :func:`format_variants`: per format, the model set up in it as training would;
* :func:`reference_pass`: the FP32 pass, its losses and per Linear and batch the recorded
  (input, output, output gradient);
* :func:`layer_alone`: one layer (in any format) on those recorded inputs, with the recorded
  output gradients flowing into it: output, weight gradient, input gradient;
* :func:`losses_with`: the forward losses with one Linear temporarily replaced;
* :class:`Replay` and :func:`block_list`: the what-if's shortcuts for that loss pass. A module
  whose inputs are exactly those it had in the reference pass (and the RNG state too) gives the
  output it gave there, so it need not run again: the blocks before the replaced Linear, and the
  replaced Linear itself on the inputs :func:`layer_alone` already ran it on, are replayed. Any
  input that differs runs the module, so a replay never changes a result.
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

__all__ = ["PlannedLayers", "planned_layers", "format_variants", "linear_names", "reference_pass",
           "layer_alone", "losses_with", "block_list", "Call", "Replay"]


@dataclass(frozen=True, kw_only=True)
class Call:
    """One call of a module as the reference pass saw it: what it got, what it gave, and the
    RNG state before and after (None: not checked, for a module that draws no random numbers)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    rng_before: tuple[torch.Tensor, ...] | None = None
    rng_after: tuple[torch.Tensor, ...] | None = None


def _rng_state() -> tuple[torch.Tensor, ...]:
    """The CPU generator's state, and the current CUDA device's where CUDA is in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.get_rng_state(), torch.cuda.get_rng_state()
    return (torch.get_rng_state(),)


def _set_rng_state(state: tuple[torch.Tensor, ...]) -> None:
    torch.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state(state[1])


def _detach(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (tuple, list)):
        return type(v)(_detach(x) for x in v)
    if isinstance(v, dict):
        return {k: _detach(x) for k, x in v.items()}
    return v


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


def _same(a: Any, b: Any) -> bool:
    """Exactly the same inputs: tensors equal bit for bit (dtype and shape too); containers
    element by element; anything else by ``==``, and unequal when that cannot say."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and \
            all(_same(a[k], b[k]) for k in a)
    if a is b or a is None or b is None:
        return a is b
    try:
        return bool(a == b)
    except Exception:   # noqa: BLE001 - an object that cannot say: run the module
        return False


class Replay(nn.Module):
    """Stands in for ``module`` in a loss pass: its ``i``-th call returns (a copy of) ``calls[i]``'s
    output when the call's inputs, and the RNG state where recorded, are exactly ``calls[i]``'s
    (then the RNG is left as the module left it); any other call runs ``module``. ``replayed``
    counts the calls answered from the record."""

    def __init__(self, module: nn.Module, calls: Sequence[Call]):
        super().__init__()
        self.module = module
        self._calls = list(calls)
        self._next = 0
        self.replayed = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        i, self._next = self._next, self._next + 1
        call = self._calls[i] if i < len(self._calls) else None
        if call is not None and _same(args, call.args) and _same(kwargs, call.kwargs) and \
                (call.rng_before is None or _same(_rng_state(), call.rng_before)):
            if call.rng_after is not None:
                _set_rng_state(call.rng_after)
            self.replayed += 1
            return _clone(call.output)
        return self.module(*args, **kwargs)


def block_list(model: nn.Module, names: Sequence[str]) -> list[str]:
    """The model's chain of blocks, in order: the children of the ``nn.ModuleList`` (or
    ``nn.Sequential``) with the most children holding a Linear of ``names`` (mixprec's
    ``blocks``, a Hugging Face ``model.layers``); [] when no list holds two."""
    best: list[str] = []
    for list_name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        prefix = f"{list_name}." if list_name else ""
        kids = [f"{prefix}{k}" for k in mod._modules]
        holding = [k for k in kids if any(n == k or n.startswith(k + ".") for n in names)]
        if len(holding) >= 2 and len(holding) > len(best):
            best = kids
    return best


def reference_pass(model: nn.Module, batches: Sequence[Any], objective: Callable, names: list[str],
                   seed: int, blocks: Sequence[str] = (),
                   block_calls: dict[str, list[Call]] | None = None
                   ) -> tuple[list[float], dict[str, list[tuple[torch.Tensor, ...]]]]:
    """The FP32 pass: losses; per Linear and batch its (input, output, output gradient). With
    ``blocks`` (:func:`block_list`), ``block_calls`` receives each block's calls (for
    :class:`Replay`)."""
    seen: dict[str, list[list[torch.Tensor]]] = {n: [] for n in names}
    mods = dict(model.named_modules())
    before: dict[str, tuple[torch.Tensor, ...]] = {}

    def pre_hook(name):
        def fn(module, args, kwargs):
            before[name] = _rng_state()
        return fn

    def block_hook(name):
        def fn(module, args, kwargs, output):
            block_calls.setdefault(name, []).append(Call(
                args=_detach(args), kwargs=_detach(kwargs), output=_detach(output),
                rng_before=before.pop(name), rng_after=_rng_state()))
        return fn

    def hook(name):
        def fn(module, args, output):
            rec = [args[0].detach(), output.detach()]
            seen[name].append(rec)
            if output.requires_grad:
                output.register_hook(lambda g: rec.append(g.detach()))
        return fn

    handles = [mods[n].register_forward_hook(hook(n)) for n in names]
    if block_calls is not None:
        for b in blocks:
            handles += [mods[b].register_forward_pre_hook(pre_hook(b), with_kwargs=True),
                        mods[b].register_forward_hook(block_hook(b), with_kwargs=True)]
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
                outputs: list[torch.Tensor] | None = None, *, input_grad: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, weight gradient, input gradient) of ``layer`` on its recorded FP32 inputs, with the
    recorded FP32 output gradients flowing into it: the layer alone, everything around it exact.
    (Measured for the FP32 layer too, so a weight shared with another module, a tied head,
    compares like with like.) The layer's own ``forward`` runs, not its hooks: the recorded inputs
    are what reached ``forward``, after any pre-hook, so running a pre-hook again would apply it
    twice. ``outputs``, when given, receives each record's output as the layer returned it (its
    dtype and shape), for the what-if report's loss pass to replay. ``input_grad=False``: no input
    gradient (its GEMM is skipped; the third item is None)."""
    layer.zero_grad(set_to_none=True)
    outs, dxs = [], []
    with torch.enable_grad():
        for rec in records:
            x = rec[0].detach().requires_grad_(len(rec) > 2 and input_grad)
            y = layer.forward(x)
            outs.append(y.detach().float().flatten())
            if outputs is not None:
                outputs.append(y.detach())
            if len(rec) > 2:
                y.backward(rec[2].to(y.dtype))
                if input_grad:
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
        # The table set-up resolved: the one eligibility function's reason in its refused column.
        refused[f] = {r.name: r.refused or f"runs {r.compute}" for r in prec.layers.table
                      if r.per_layer and r.compute != f}
    return variants, refused


def losses_with(model: nn.Module, name: str, variant: nn.Module, batches: Sequence[Any],
                objective: Callable, seed: int, replays: dict[str, nn.Module] | None = None
                ) -> list[float]:
    """Forward losses of ``model`` with the Linear ``name`` temporarily replaced by ``variant``
    (and each module named in ``replays`` by its :class:`Replay`)."""
    swaps = {**(replays or {}), name: variant}
    originals: dict[str, nn.Module] = {}
    try:
        for n, new in swaps.items():
            parent_name, _, child = n.rpartition(".")
            parent = model.get_submodule(parent_name)
            originals[n] = getattr(parent, child)
            setattr(parent, child, new)
        return forward_losses(model, batches, objective, seed)
    finally:
        for n, old in originals.items():
            parent_name, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent_name), child, old)
