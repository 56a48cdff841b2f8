"""Overlap the optimizer update with the next forward (seed 000's "multi-stream"), exactly.

A plain step ends with the whole optimizer update, and the next forward starts after it. Yet the
first layer of the next forward needs only the first layer's new weights. :class:`OverlappedUpdate`
issues the update module by module, in forward order, on a side CUDA stream, and makes the next
forward wait, module by module (a forward pre-hook and one CUDA event per module), for that
module's own parameters only. The update of the last layers then runs while the first layers
already compute::

    compute stream:  backward ─ unscale ─ found_inf (host sync) ─ clip ─┐   forward L0  L1  L2 ...
    side stream:                                     wait ──────────────└─ upd L0 │ L1 │ L2 │ ...
                                                                   events ──────────┘   ┘   ┘

What stays as it was:

* The skip decision is the one host sync of the step (``Precision.step``, agreed across ranks);
  only a taken step issues anything, a skipped step issues nothing.
* The update is the optimizer's own, split into per-module *views* of its param groups
  (mixprec.optim.parts): no state is copied, ``state_dict()`` is unchanged (a checkpoint saved
  with overlap resumes without it and vice versa), and for an elementwise optimizer (AdamW, Adam,
  SGD, ...) the weights are bit-identical to the one-shot step. With FP32 masters
  (mixprec.optim.MasterWeights / AdamW) each module's copy-back into its 16-bit parameters is part
  of its update. Clipping (global) happens before, on all gradients; the LR scheduler steps once.
* On CPU there is no stream: the same per-module schedule runs in order, on the host.

Where it waits (what overlaps with what):

* One device, DDP: per module, as drawn above. DDP's gradient all-reduce is done by the time the
  skip decision is read, so the update overlaps the next forward only.
* FSDP2: each rank updates its own *shards*, module by module, on the side stream. The next
  forward's all-gathers read those shards, and FSDP2 orders its all-gather streams after the
  compute stream only at the root module's pre-forward; so the whole update is waited for there,
  before the first all-gather. What overlaps is the host: the CPU issues the update and goes on to
  the next batch and the next forward's launches without waiting.
* ``torch.compile``\\d models: the hooks would run inside the compiled graph, so the whole update
  is waited for before the forward (:meth:`begin_step`), as under FSDP2.

Anything else that reads parameters or optimizer state between steps (saving a checkpoint,
per-layer statistics, your own code) calls :meth:`wait` first; the Trainer does. The gradients
the update reads were allocated on the compute stream: they are marked as used by the side stream
(``record_stream``), so ``zero_grad(set_to_none=True)`` (torch's default) may drop them at once;
``zero_grad(set_to_none=False)`` would zero them under the running update: call :meth:`wait` first.
A parameter must be read in the forward only by a module that holds it (tied weights are held by
both modules, as in ``head.weight = wte.weight``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.optim.parts import check_separable, step_in_parts

__all__ = ["OverlappedUpdate", "module_units"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def module_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The modules whose updates are issued (and waited for) one by one, in declaration order.

    An element of a ``ModuleList`` / ``Sequential`` / ``ModuleDict`` (a transformer block) is one
    unit with all the parameters below it; any other module with parameters of its own is a unit
    with those own parameters (embeddings, the final norm, the head, the root's own parameters).
    """
    units: list[tuple[str, nn.Module, list[nn.Parameter]]] = []

    def visit(name: str, m: nn.Module, block: bool) -> None:
        if block:
            ps = list(m.parameters())
            if ps:
                units.append((name, m, ps))
            return
        own = list(m.parameters(recurse=False))
        if own:
            units.append((name, m, own))
        for cname, child in m.named_children():
            q = f"{name}.{cname}" if name else cname
            if isinstance(child, _CONTAINERS):
                for ename, element in child.named_children():
                    visit(f"{q}.{ename}", element, True)
            else:
                visit(q, child, False)

    visit("", model, False)
    return units


def _updated_by(optimizer: torch.optim.Optimizer):
    """A predicate: does ``optimizer`` update this model parameter?"""
    updates = getattr(optimizer, "updates", None)
    if callable(updates):
        return updates
    master_of = getattr(optimizer, "master_of", None)
    if master_of is not None:
        def mastered(p: torch.Tensor) -> bool:
            try:
                master_of(p)
                return True
            except ConfigError:
                return False
        return mastered
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return lambda p: id(p) in ids


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


class OverlappedUpdate:
    """Issue each taken optimizer step per module on a side stream; the next forward waits per module.

    Args:
        model: the model as the forward sees it (unwrapped from DDP; FSDP2 modules are detected).
        optimizer: an elementwise optimizer over the model's parameters (checked:
            :func:`mixprec.optim.parts.check_separable`), possibly with FP32 masters.
        per_module: wait per module in forward pre-hooks (default: yes, except under FSDP2, see the
            module docstring). ``False``: :meth:`begin_step` waits for the whole update.

    Use it through ``Precision.step(optimizer, overlap=engine)``; call :meth:`begin_step` before
    each step's first forward, :meth:`wait` before reading parameters or optimizer state, and
    :meth:`close` to remove the hooks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 per_module: bool | None = None) -> None:
        check_separable(optimizer)
        self.model = model
        self.units = module_units(model)
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.streams = self.device.type == "cuda"
        self.per_module = (not _is_fsdp(model)) if per_module is None else per_module
        updated = _updated_by(optimizer)
        # Each updated parameter belongs to the group of the first unit that holds it.
        seen: set[int] = set()
        self.groups: list[list[torch.Tensor]] = []
        for _, _, params in self.units:
            group = [p for p in params if id(p) not in seen and updated(p)]
            seen.update(id(p) for p in group)
            self.groups.append(group)
        self._group_of = {id(p): g for g, ps in enumerate(self.groups) for p in ps}
        # A unit waits for every group holding one of its parameters (tied weights: another's).
        self.waits_for: list[tuple[int, ...]] = [
            tuple(sorted({self._group_of[id(p)] for p in params if id(p) in self._group_of}))
            for _, _, params in self.units]
        self.order: list[int] = list(range(len(self.units)))
        """Units in forward order (declaration order until the first forward is seen on CUDA)."""
        self._seen_order: list[int] | None = [] if self.streams and self.per_module else None
        self._pending: dict[int, list[Any]] = {}
        self._side = torch.cuda.Stream(self.device) if self.streams else None
        self._in_flight = False
        self._handles: list[Any] = []
        if self.streams and self.per_module:
            for u, (_, module, _) in enumerate(self.units):
                self._handles.append(module.register_forward_pre_hook(self._hook(u), prepend=True))
            # Whatever a forward did not reach is waited for at its end (before backward writes grads).
            self._handles.append(model.register_forward_hook(lambda *_: self.wait()))

    # ------------------------------------------------------------------ the forward side

    def _hook(self, unit: int):
        def pre_forward(module: nn.Module, args: Any) -> None:
            if self._seen_order is not None and unit not in self._seen_order:
                self._seen_order.append(unit)
            events = self._pending.pop(unit, None)
            if events:
                stream = torch.cuda.current_stream(self.device)
                for ev in events:
                    stream.wait_event(ev)   # this module's parameters only; no host wait
        return pre_forward

    def begin_step(self) -> None:
        """Before a step's first forward: without per-module waits, wait for the whole update."""
        if not self.per_module:
            self.wait()

    def wait(self) -> None:
        """Make the current stream wait for every issued update (no host wait). Call before reading
        parameters or optimizer state outside the forward (checkpoints, statistics)."""
        if self._in_flight:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._in_flight = False
        self._pending = {}

    # ------------------------------------------------------------------ the update side

    def _forward_order(self) -> list[int]:
        if self._seen_order:
            rest = [u for u in range(len(self.units)) if u not in self._seen_order]
            self.order = self._seen_order + rest
            self._seen_order = None                   # fixed after the first forward
        return self.order

    def issue(self, optimizer: torch.optim.Optimizer, inputs: Any = None) -> None:
        """The optimizer step, issued per module in forward order (side stream on CUDA);
        ``inputs``: a master-weight optimizer's :class:`~mixprec.optim.inputs.StepInputs`."""
        order = [u for u in self._forward_order() if self.groups[u]]
        parts = [self.groups[u] for u in order]
        if self._side is None:
            step_in_parts(optimizer, parts, inputs=inputs)   # CPU: the same schedule, in order
            return
        self.wait()                                   # a previous update not yet waited for
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))   # grads unscaled and clipped
        done: dict[int, Any] = {}

        @contextlib.contextmanager
        def on_side(i: int) -> Iterator[None]:
            with torch.cuda.stream(side):
                yield
                ev = torch.cuda.Event()
                ev.record(side)
            done[order[i]] = ev

        self._in_flight = True
        step_in_parts(optimizer, parts, on_side, inputs=inputs)
        # The grads were allocated on the compute stream; keep their memory until the side stream
        # has read them, even when zero_grad() drops them before that.
        step_grads = getattr(optimizer, "step_grads", None)
        for p in (q for part in parts for q in part):
            grads = step_grads(p) if step_grads is not None else [p.grad]
            for g in grads:
                if g is not None:
                    g.record_stream(side)
        self._pending = {u: [done[g] for g in self.waits_for[u] if g in done]
                         for u in range(len(self.units))}
        self._pending = {u: evs for u, evs in self._pending.items() if evs}

    def close(self) -> None:
        """Wait for the update in flight and remove the hooks."""
        self.wait()
        for h in self._handles:
            h.remove()
        self._handles = []

    def __repr__(self) -> str:
        where = "side CUDA stream" if self.streams else "in order (no streams)"
        wait = "per module" if self.per_module else "before the forward"
        return (f"OverlappedUpdate({sum(1 for g in self.groups if g)} module groups, {where}, "
                f"waits {wait})")
