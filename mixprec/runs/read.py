"""Reading a run folder back: the one :func:`read_run` reports, comparisons and tools use.

A run folder holds ``config.toml`` (what was asked), ``metrics.csv`` / ``numerics.csv`` and
``events.jsonl`` (what ran, written by :mod:`mixprec.runs.metrics`) and ``checkpoints/``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mixprec.errors import DataError
from mixprec.precision import Precision
from mixprec.runs.metrics import read_events, read_metrics, read_numerics

__all__ = ["format_counts", "layer_formats_over_run", "read_run", "read_run_config", "run_label",
           "run_precision", "run_progress", "start_field"]


def read_run_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's ``config.toml`` as a dict ({} when absent or unreadable)."""
    import tomllib
    try:
        return tomllib.loads((Path(run_dir) / "config.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def start_field(events: list[dict[str, Any]], name: str) -> str | None:
    """``name: ...`` from the start event's message (``model: 0.82M parameters; ...``)."""
    for e in events:
        if e.get("kind") == "start":
            for part in str(e.get("message", "")).split("; "):
                if part.startswith(f"{name}: "):
                    return part[len(name) + 2:]
    return None


def run_precision(config: dict[str, Any], events: list[dict[str, Any]]) -> str | None:
    """The resolved precision as the run described it. The description itself contains "; ", so
    it is its own field of the start event (runs written before that: the message up to the
    device line); without a start event, what ``config.toml`` asked for."""
    for e in events:
        if e.get("kind") == "start":
            if e.get("precision"):
                return str(e["precision"])
            message = str(e.get("message", ""))
            if message.startswith("precision: "):
                return message[len("precision: "):].split("; device: ")[0]
    return config.get("precision")


def layer_formats_over_run(events: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """(each Linear's format at the start, at the end) from ``events.jsonl``: the first ``formats``
    record, then every switch (``format`` records) and resumed runs' ``formats`` records in step
    order. Both empty when the run logged no formats."""
    records = sorted(((i, e) for i, e in enumerate(events) if e.get("kind") in ("formats", "format")),
                     key=lambda p: (int(p[1].get("step", 0) or 0), p[0]))
    start: dict[str, str] = {}
    end: dict[str, str] = {}
    for _, e in records:
        if e["kind"] == "formats":
            layers = {str(n): str(f) for n, f in (e.get("layers") or {}).items()}
            start = start or dict(layers)
            end.update(layers)
        elif e.get("module") is not None and e.get("to") is not None:
            end[str(e["module"])] = str(e["to"])
    return start, end


def format_counts(formats: dict[str, str]) -> str:
    """``9 bf16, 1 fp32`` (largest count first), as ``Precision.layers.format_counts`` says it."""
    counts: dict[str, int] = {}
    for f in formats.values():
        counts[f] = counts.get(f, 0) + 1
    return ", ".join(f"{n} {f}" for f, n in sorted(counts.items(), key=lambda c: -c[1]))


def run_label(config: dict[str, Any], events: list[dict[str, Any]]) -> tuple[str | None, bool]:
    """What ran, by its short label (``Precision.recipe.label``: ``32-true``, or ``32-true+plan`` when
    per-layer formats ran on top of the mode; ``+switched`` when layers changed format while
    training, as ``Precision.layers.ran`` says), and whether it was a per-layer plan. From the start
    event; runs written before it recorded them: asked of ``Precision`` from ``config.toml``."""
    start, end = layer_formats_over_run(events)
    switched = "+switched" if start != end else ""
    for e in events:
        if e.get("kind") == "start" and e.get("label"):
            return str(e["label"]) + switched, bool(e.get("plan"))
    name = config.get("precision")
    if not isinstance(name, str) or name == "auto":      # "auto" recorded unresolved: not askable
        return (name + switched if isinstance(name, str) else None), bool(config.get("overrides"))
    try:
        precision = Precision(name, overrides=dict(config.get("overrides") or {}) or None)
    except ValueError:
        return name + switched, bool(config.get("overrides"))
    return precision.recipe.label + switched, precision.recipe.has_plan


def run_scales_loss(config: dict[str, Any]) -> bool | None:
    """Whether the run's precision scales the loss: its ``[recipe]`` table's ``loss_scaling``,
    for runs written before it asked of ``Precision``; None when the config does not name a mode
    that can be asked (``auto`` recorded unresolved, or unknown)."""
    recorded = config.get("recipe")
    if isinstance(recorded, dict) and isinstance(recorded.get("loss_scaling"), bool):
        return recorded["loss_scaling"]
    name = config.get("precision")
    if not isinstance(name, str) or name == "auto":
        return None
    try:
        return Precision(name).recipe.scales_loss
    except ValueError:
        return None


def run_progress(config: dict[str, Any], events: list[dict[str, Any]], last: int) -> str:
    """How far the run got, in words: ``60 of 60 (complete)``, ``320 of 2000 (stopped: ...)``,
    ``(diverged)``, ``(stopped: loss scale stuck)`` (every step skipped while the loss was finite;
    runs before it recorded that as ``diverged``), or ``(incomplete: still running, or killed)`` when nothing recorded an end.
    The planned total is ``config.toml``'s ``max_steps`` (an epochs run: the steps are shown alone)."""
    total = config.get("max_steps")
    ends = [e for e in events if e.get("kind") in ("interrupted", "diverged", "loss_scale_stuck")
            and isinstance(e.get("step"), int) and e["step"] >= last]
    # A stop between two logged rows records the step it reached: that, not the last row's step.
    reached = max([last, *(e["step"] for e in ends)])
    head = f"{reached} of {total}" if isinstance(total, int) else f"{reached}"
    if isinstance(total, int) and reached >= total:
        return f"{head} (complete)"
    if ends:                  # an end recorded at the last step (a resume past it trains on)
        end = ends[-1]
        said = {"diverged": "diverged", "loss_scale_stuck": "stopped: loss scale stuck"}.get(end["kind"], "stopped")
        return f"{head} ({said})"
    return f"{head} (incomplete: still running, or killed)" if isinstance(total, int) else head


def read_run(run_dir: str | os.PathLike, *, require_rows: bool = True) -> dict[str, Any]:
    """Everything a run folder says: ``{dir, name, config, rows, numerics, events, last,
    precision, label, plan}`` (``label``/``plan``: :func:`run_label`). Raises :class:`~mixprec.errors.DataError` (one line, with the fix) for a path
    that is not a run folder, or, with ``require_rows``, one without metrics rows yet."""
    path = Path(run_dir)
    if not path.is_dir():
        raise DataError(f"no run folder at {path}; pass folders `mixprec train` printed")
    rows = read_metrics(path)
    if require_rows and not rows:
        raise DataError(f"{path} has no metrics rows yet; train for at least one logging interval")
    events = read_events(path)
    config = read_run_config(path)
    label, plan = run_label(config, events)
    return {"dir": path, "name": path.name, "config": config, "rows": rows,
            "numerics": read_numerics(path), "events": events,
            "last": max((int(r["step"]) for r in rows), default=0),
            "precision": run_precision(config, events), "label": label, "plan": plan}
