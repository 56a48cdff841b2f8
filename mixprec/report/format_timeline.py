"""Per-layer formats over a run, from ``events.jsonl``: the ``formats`` record written at the start
(every Linear's resolved format) and one ``format`` record per switch made while re-planning.

:func:`format_timeline` turns them into a (layer x step) table; :func:`plot_formats` draws it as
the report's formats heat map, each switch a change of colour in its layer's row.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mixprec.policy.overrides import LAYER_FORMATS

__all__ = ["format_timeline", "plot_formats"]


def format_timeline(events: list[dict[str, Any]], last_step: int) -> tuple[list[str], dict[str, list[str]]]:
    """(layers, layer -> format at steps 0..last_step). Resumed runs append a new ``formats``
    record (the restored plan); it wins from its step on."""
    layers: list[str] = []
    rows: dict[str, list[str]] = {}
    for e in sorted((e for e in events if e.get("kind") in ("formats", "format")),
                    key=lambda e: (int(e.get("step", 0)), e.get("kind") == "format")):
        step = min(int(e.get("step", 0)), last_step)
        changes = e.get("layers", {}) if e["kind"] == "formats" else {e.get("module"): e.get("to")}
        for name, fmt in changes.items():
            if name is None or fmt is None:
                continue
            if name not in rows:
                layers.append(name)
                rows[name] = [fmt] * (last_step + 1)
            rows[name][step:] = [fmt] * (last_step + 1 - step)
    return layers, rows


def plot_formats(events: list[dict[str, Any]], last_step: int, out: Path) -> Path | None:
    """``formats.png``: rows are Linear layers, columns steps, colour the format (None when the run
    logged no formats or every layer kept one format throughout)."""
    layers, rows = format_timeline(events, last_step)
    if not layers or (len({f for r in rows.values() for f in r}) < 2
                      and not any(e.get("kind") == "format" for e in events)):
        return None
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    used = sorted({f for r in rows.values() for f in r},
                  key=lambda f: LAYER_FORMATS.index(f) if f in LAYER_FORMATS else 99)
    index = {f: i for i, f in enumerate(used)}
    grid = np.array([[index[f] for f in rows[n]] for n in layers])
    fig = Figure(figsize=(8.0, min(12.0, 1.5 + 0.25 * len(layers))))
    ax = fig.subplots()
    cmap = ListedColormap(["#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#9467bd", "#8c564b",
                           "#e377c2"][: len(used)])
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=-0.5, vmax=len(used) - 0.5)
    ax.set_yticks(range(len(layers)), labels=layers, fontsize=max(5, 9 - len(layers) // 20))
    ax.set_xlabel("step")
    ax.set_title("compute format per Linear layer over time (switches: re-planning)", fontsize=9)
    bar = fig.colorbar(image, ax=ax, ticks=range(len(used)))
    bar.ax.set_yticklabels(used)
    fig.tight_layout()
    path = Path(out) / "formats.png"
    fig.savefig(path, dpi=100)
    return path
