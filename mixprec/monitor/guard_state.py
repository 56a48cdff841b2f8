"""What the training guard (:mod:`mixprec.monitor.guard`) measures and what it keeps.

* :func:`sample_layers`: one replay of the step's forward with a hook on every Linear not in FP32:
  its output SQNR against the same GEMM in FP32 on the same inputs, and the share of its inputs
  its format flushes or saturates (:func:`mixprec.monitor.replan.flushed_share`); under several
  ranks the worst of any rank (one all-reduce), one host sync in all.
* :func:`take_snapshot` / :func:`restore_snapshot`: the in-memory copy of the weights, the buffers
  outside the state dict (FP8 amax histories), the optimizer state and the LR schedule's step, and
  putting it back with this run's optimizer settings and schedule curve; :class:`Snapshots` keeps
  the guard's last good one with what it vouches for (the taken steps since, each layer's last
  passing sample) and its part of the guard's checkpoint.

The decisions (which layer to promote, when to restore) stay in :class:`~mixprec.monitor.guard.TrainingGuard`.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.monitor.replan import flushed_share
from mixprec.optim.schedule import rewind
from mixprec.precision import Precision

__all__ = ["sample_layers", "take_snapshot", "restore_snapshot", "Snapshots"]


@torch.no_grad()
def sample_layers(precision: Precision, model: nn.Module, probe: Callable[[], Any],
                  agree: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[dict[str, float], dict[str, float]] | None:
    """(output SQNR dB, flushed share of the inputs) per Linear of ``precision.layers.formats`` not
    in FP32 that ``probe()`` (the step's forward) ran; ``agree``: an element-wise MAX over ranks
    (the lowest SQNR and largest share any rank measured). None when no layer is watched, or (one
    process) none ran. The random state is left as it was."""
    watched = {n: f for n, f in precision.layers.formats.items() if f != "fp32"}
    energy: dict[str, list[torch.Tensor]] = {}
    handles = []

    def hook(name: str):
        def fn(module: nn.Module, args, output) -> None:
            x = args[0]
            bias = None if module.bias is None else module.bias.float()
            ref = torch.nn.functional.linear(x.float(), module.weight.float(), bias)
            noise = (output.float() - ref).square().sum()
            zero = torch.zeros((), device=ref.device)
            sig, err, flush = energy.get(name, [zero, zero, zero])
            energy[name] = [sig + ref.square().sum(), err + noise,
                            torch.maximum(flush, flushed_share(x, watched[name], "act"))]
        return fn

    for name in watched:
        handles.append(model.get_submodule(name).register_forward_hook(hook(name)))
    try:
        with torch.random.fork_rng(devices=[]):
            probe()
    finally:
        for h in handles:
            h.remove()
    if not watched or (agree is None and not energy):
        return None                          # (the watched set is the same on every rank)
    # One row per watched layer in the same order on every rank: (-SQNR, flushed, seen).
    names = list(watched)
    device = next(iter(energy.values()))[0].device if energy else torch.device("cpu")
    rows = []
    for n in names:
        if n not in energy:
            rows.append(torch.tensor([-math.inf, 0.0, 0.0], dtype=torch.float64, device=device))
            continue
        sig, err, flush = (v.double() for v in energy[n])
        db = torch.where(err == 0, math.inf, torch.where(
            (sig > 0) & err.isfinite(), 10 * torch.log10(sig / err), -math.inf))
        rows.append(torch.stack([-db, flush, torch.ones((), dtype=torch.float64)]))
    votes = torch.stack(rows)
    if agree is not None:
        votes = agree(votes)                 # the lowest SQNR, the largest flush of any rank
    out, flushed = {}, {}
    for n, (neg_db, share, seen) in zip(names, votes.tolist()):
        if seen:
            out[n], flushed[n] = -neg_db, share
    return out, flushed


def take_snapshot(model: nn.Module, optimizer: Any, scheduler: Any, step: int) -> dict:
    """A copy of everything a restore puts back (tensors and plain values: a checkpoint keeps it)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "step": step,
        "model": state,
        # Buffers outside the state dict: the FP8 amax histories of delayed scaling.
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers() if k not in state},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
    }


def restore_snapshot(snap: dict, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    """Put ``snap`` back: its weights, buffers, optimizer state (moments, step counts) and the
    schedule's step, with this run's optimizer settings and schedule curve (a snapshot saved in a
    checkpoint may predate a resume that changed lr, the schedule or weight decay)."""
    model.load_state_dict(snap["model"])
    live = dict(model.named_buffers())
    with torch.no_grad():                    # (a layer promoted since has none left)
        for k, v in snap.get("buffers", {}).items():
            if k in live and live[k].shape == v.shape:
                live[k].copy_(v)
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    # load_state_dict may keep the given tensors: hand it copies, keep the snapshot intact.
    optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
    rewind(scheduler, copy.deepcopy(snap["scheduler"]))   # this run's curve, its step


class Snapshots:
    """The guard's last good snapshot of ``model``, ``optimizer`` and ``scheduler`` (None before
    the first), the taken steps since it (``healthy``), and per watched layer the step of its last
    passing SQNR sample (``passed``). When to take or restore one is the guard's decision."""

    def __init__(self, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.snapshot: dict | None = None
        self.healthy = 0
        self.passed: dict[str, int] = {}

    def take(self, step: int) -> None:
        """Snapshot the state after ``step`` steps."""
        self.snapshot = take_snapshot(self.model, self.optimizer, self.scheduler, step)
        self.healthy = 0

    def taken_between(self, since: int, step: int) -> bool:
        """Whether the snapshot is no older than step ``since`` and older than ``step``."""
        return self.snapshot is not None and since <= self.snapshot["step"] < step

    def restore(self) -> int | None:
        """Put the snapshot back; the step it was taken at (None: no snapshot yet)."""
        snap = self.snapshot
        if snap is None:
            return None
        restore_snapshot(snap, self.model, self.optimizer, self.scheduler)
        self.healthy = 0
        # Steps after the snapshot are undone: no layer is verified later than it.
        self.passed = {n: min(v, snap["step"]) for n, v in self.passed.items()}
        return snap["step"]

    def state_dict(self) -> dict:
        return {"healthy": self.healthy, "snapshot": self.snapshot, "passed": dict(self.passed)}

    def load_state_dict(self, state: dict) -> None:
        self.healthy = int(state["healthy"])
        self.snapshot = state["snapshot"]
        self.passed = {str(n): int(v) for n, v in state.get("passed", {}).items()}
