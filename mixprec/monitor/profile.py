"""Where a training step's time goes: ``torch.profiler`` over a few steps, grouped by kind.

``mixprec bench train --profile`` and ``fit(..., profile=STEPS)`` (``mixprec train profile=3``)
profile a few steps after warm-up and write

* ``profile.txt``: the time per step of each category (GEMM, attention, elementwise, casts,
  optimizer, communication, host syncs), the top operators by self time with their category, and
  the ranges mixprec itself labels (``torch.profiler.record_function``), so the cost of mixed
  precision is visible by name:

  ==========================  ==============================================================
  ``mixprec.scale_loss``      loss x loss scale (FP16 modes; a no-op otherwise)
  ``mixprec.unscale``         gradients / scale, fused with the inf/NaN check
  ``mixprec.clip_grad_norm``  the global norm (and clipping) of the unscaled gradients
  ``mixprec.found_inf_sync``  the one host sync of a step: read the agreed non-finite flag
  ``mixprec.optimizer_step``  the optimizer update (per module with overlap_optimizer)
  ``mixprec.master_grad_copy``  16-bit gradients cast into the FP32 masters' gradients
  ``mixprec.master_copy_back``  FP32 masters rounded back into the 16-bit parameters
  ``mixprec.forward`` / ``mixprec.backward``  the Trainer's forward (under autocast) / backward
  ==========================  ==============================================================

* ``trace.json``: the Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev).

Times are self times: CPU time of each operator on CPU, and on CUDA also the device time of the
kernels it launched. Autocast's casts are ``aten::_to_copy`` (and the ``copy_`` under it).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CATEGORIES", "categorize", "ProfileSummary", "summarize_profile", "StepProfiler"]

CATEGORIES = ("gemm", "attention", "elementwise", "casts", "optimizer", "communication",
              "host syncs")
"""The kinds of work the table groups operators into (plus ``other`` for non-aten events)."""

_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::addmv",
         "aten::mv", "aten::dot", "aten::matmul", "aten::linear", "aten::_addmm_activation",
         "mkldnn::", "aten::mkldnn_", "aten::_mm")
_ATTENTION = ("attention", "sdpa", "flash")
_CASTS = ("aten::_to_copy", "aten::to", "aten::type_as")
_SYNCS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
          "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::is_nonzero", "mixprec.found_inf_sync")
_COMM = ("c10d::", "nccl", "gloo", "allreduce", "all_reduce", "all_gather", "allgather",
         "reduce_scatter", "broadcast", "record_param_comms", "fsdp::")
_OPTIMIZER = ("Optimizer.step", "mixprec.optimizer_step")
_CAST_RANGES = ("mixprec.master_copy_back", "mixprec.master_grad_copy")


def _ancestors(event: Any) -> Iterator[str]:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        yield parent.name
        parent = getattr(parent, "cpu_parent", None)


def categorize(name: str, ancestors: list[str] = ()) -> str:
    """The category of an operator named ``name`` called under ``ancestors`` (innermost first)."""
    low = name.lower()
    if name.startswith(_SYNCS) or any(a.startswith("mixprec.found_inf_sync") for a in ancestors[:1]):
        return "host syncs"
    if any(k in low for k in _COMM) or any(any(k in a.lower() for k in ("c10d::", "nccl", "gloo"))
                                           for a in ancestors):
        return "communication"
    if any(a.startswith(_CAST_RANGES) for a in ancestors) or name.startswith(_CAST_RANGES):
        return "casts"
    if any(a.startswith(_OPTIMIZER) for a in ancestors) or name.startswith(_OPTIMIZER):
        return "optimizer"
    if name in _CASTS or any(a.startswith("aten::_to_copy") for a in ancestors[:2]):
        return "casts"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if name.startswith(_GEMM):
        return "gemm"
    if name.startswith("aten::") or name.startswith("autograd::") or "Backward" in name:
        return "elementwise"
    return "other"


@dataclass
class ProfileSummary:
    """Per-step self times (microseconds) by category, top operators, and mixprec's ranges."""

    steps: int
    device: str
    by_category: dict[str, dict[str, float]] = field(default_factory=dict)
    top: list[dict[str, Any]] = field(default_factory=list)
    mixprec_ranges: list[dict[str, Any]] = field(default_factory=list)

    def table(self) -> str:
        cuda = self.device == "cuda"
        total_cpu = sum(v["cpu_us"] for v in self.by_category.values()) or 1.0
        head = f"{'category':<15} {'self CPU ms/step':>16} {'share':>7}"
        head += f" {'device ms/step':>15}" if cuda else ""
        lines = [f"profiled {self.steps} step(s) on {self.device}; self times per step", "", head]
        for cat in (*CATEGORIES, "other"):
            v = self.by_category.get(cat)
            if not v:
                continue
            row = f"{cat:<15} {v['cpu_us'] / 1e3:>16.2f} {v['cpu_us'] / total_cpu * 100:>6.1f}%"
            row += f" {v['device_us'] / 1e3:>15.2f}" if cuda else ""
            lines.append(row)
        lines += ["", f"{'top operators by self time':<52} {'category':<13} {'ms/step':>9} "
                      f"{'calls/step':>10}"]
        for r in self.top:
            lines.append(f"{r['name'][:52]:<52} {r['category']:<13} {r['us'] / 1e3:>9.2f} "
                         f"{r['calls']:>10.1f}")
        lines += ["", f"{'ranges mixprec labels (inclusive time)':<52} "
                      f"{'ms/step':>9} {'calls/step':>10}"]
        for r in self.mixprec_ranges:
            lines.append(f"{r['name']:<52} {r['us'] / 1e3:>9.2f} {r['calls']:>10.1f}")
        if not self.mixprec_ranges:
            lines.append("(none recorded)")
        return "\n".join(lines)


def summarize_profile(prof: Any, steps: int, device: str, top: int = 15) -> ProfileSummary:
    """Group a finished ``torch.profiler.profile``'s events by :func:`categorize`."""
    steps = max(steps, 1)
    by_cat: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_us": 0.0, "device_us": 0.0})
    ops: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: {"us": 0.0, "calls": 0})
    ranges: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "calls": 0})
    for e in prof.events():
        name = e.name
        if name.startswith("ProfilerStep"):
            continue
        if name.startswith("mixprec."):
            ranges[name]["us"] += e.cpu_time_total
            ranges[name]["calls"] += 1
        cat = categorize(name, list(_ancestors(e)))
        cpu = float(e.self_cpu_time_total)
        dev = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        by_cat[cat]["cpu_us"] += cpu
        by_cat[cat]["device_us"] += dev
        key = (name, cat)
        ops[key]["us"] += dev if device == "cuda" and dev else cpu
        ops[key]["calls"] += 1
    rows = sorted(({"name": n, "category": c, "us": v["us"] / steps, "calls": v["calls"] / steps}
                   for (n, c), v in ops.items()), key=lambda r: r["us"], reverse=True)[:top]
    mp = sorted(({"name": n, "us": v["us"] / steps, "calls": v["calls"] / steps}
                 for n, v in ranges.items()), key=lambda r: r["us"], reverse=True)
    cats = {c: {k: x / steps for k, x in v.items()} for c, v in by_cat.items()}
    return ProfileSummary(steps=steps, device=device, by_category=cats, top=rows, mixprec_ranges=mp)


class StepProfiler:
    """Profile ``steps`` calls of :meth:`step` after ``warmup`` unprofiled ones, then write
    ``profile.txt`` and ``trace.json`` into ``out_dir`` (when ``write``; other ranks profile too,
    so every rank runs the same code, but only one writes)."""

    def __init__(self, steps: int, out_dir: Path | str | None, *, device: torch.device,
                 warmup: int = 2, write: bool = True, top: int = 15) -> None:
        self.steps, self.warmup, self.top = steps, warmup, top
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.device, self.write = torch.device(device), write
        self._calls = 0
        self._prof: Any = None
        self.summary: ProfileSummary | None = None
        self.files: list[Path] = []

    @property
    def done(self) -> bool:
        return self.summary is not None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one training step."""
        if self.done or self.steps <= 0:
            yield
            return
        if self._calls == self.warmup and self._prof is None:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts)
            self._prof.__enter__()
        self._calls += 1
        yield
        if self._prof is not None and self._calls - self.warmup >= self.steps:
            self.finish()

    def finish(self) -> ProfileSummary | None:
        """Stop (if running) and write the files; None when no step was profiled."""
        if self._prof is None or self.done:
            return self.summary
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        profiled = self._calls - self.warmup
        self.summary = summarize_profile(self._prof, profiled, self.device.type, top=self.top)
        if self.write and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            trace = self.out_dir / "trace.json"
            self._prof.export_chrome_trace(str(trace))
            text = self.out_dir / "profile.txt"
            text.write_text(self.summary.table() + "\n")
            self.files = [text, trace]
        self._prof = None
        return self.summary
