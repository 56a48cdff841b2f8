"""What a ``numerics.csv`` heat map draws over its colours, so it never hides an inf.

* **Non-finite cells.** A cell whose tensor held an inf or a NaN (its ``absmax`` is inf/NaN) is
  drawn in its own hatched colour on *both* maps of its kind, with a legend entry: the largest
  magnitude has no finite value to colour (it was left blank), and the overflow fraction of such a
  tensor (0.0039 for the head whose gradient made the inf) looked like any small fraction.
* **Skipped steps.** A ``skip`` record in ``events.jsonl`` names the module the trace found
  (:mod:`mixprec.monitor.trace`), the tensor and, for a parameter's gradient, the GEMM that made it.
  When that step is a logged column and the module a row, the cell is outlined, its legend entry
  saying which tensor it was: a weight-gradient GEMM's inf is no output gradient, so the map's own
  colours show nothing there (the ``grad`` rows are gradients w.r.t. each layer's *output*).
  Backward origins go on the ``grad`` maps, forward ones on the ``act`` maps.
"""
from __future__ import annotations

import math
from typing import Any

from mixprec.report.figures import skip_events

__all__ = ["nonfinite_cells", "skip_cells", "draw_nonfinite", "draw_skips", "legend_under", "NONFINITE_LABELS"]

NONFINITE_LABELS = {"inf": "tensor held inf", "nan": "tensor held NaN"}
_NONFINITE_STYLE = {"inf": {"facecolor": "#d62728", "hatch": "xxx", "edgecolor": "white"},
                    "nan": {"facecolor": "#9a9a9a", "hatch": "///", "edgecolor": "black"}}
"""Neither red nor grey is in viridis or magma, and the hatch tells them from any colour."""

_TENSOR = {"grad_output": "output gradient", "grad_input": "input gradient", "output": "output"}
_SKIP_MARKERS = ("s", "D", "o", "^")


def _nonfinite(value: Any) -> str | None:
    if isinstance(value, (int, float)) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    return None


def nonfinite_cells(rows: list[dict[str, Any]], stat: str, row: dict[str, int],
                    col: dict[int, int]) -> dict[str, list[tuple[int, int]]]:
    """``{"inf" | "nan": [(row, column), ...]}``: the cells whose tensor held an inf or a NaN
    (``absmax`` inf or NaN, or ``stat`` itself NaN; NaN wins when both)."""
    cells: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        held = {_nonfinite(r.get(stat)), _nonfinite(r.get("absmax"))} - {None}
        what = "nan" if "nan" in held else "inf" if held else None
        if what is not None:
            cells.setdefault(what, []).append((row[r["module"]], col[r["step"]]))
    return cells


def skip_cells(events: list[dict[str, Any]], kind: str, row: dict[str, int],
               col: dict[int, int]) -> dict[str, list[tuple[int, int]]]:
    """``{legend label: [(row, column), ...]}``: the cells of the layers the traces of skipped steps
    named, on this kind's map (backward origins on ``grad``, forward ones on ``act``). A skip at a
    step that is no column, or at ``<loss>``/``<input>``, has no cell: the loss-scale plot marks it."""
    direction = {"grad": "backward", "act": "forward"}.get(kind)
    cells: dict[str, list[tuple[int, int]]] = {}
    for e in skip_events(events):
        module = e.get("module")
        if direction is None or e.get("direction") != direction or module not in row or e["step"] not in col:
            continue
        tensor = str(e.get("made_by") or _TENSOR.get(str(e.get("tensor")), e.get("tensor") or "its tensor"))
        shown = tensor == ("output gradient" if kind == "grad" else "output")
        label = f"skipped step: first {e.get('nonfinite') or 'inf/NaN'} in this layer's {tensor}"
        cells.setdefault(label if shown else f"{label} (not on this map)", []).append(
            (row[module], col[e["step"]]))
    return cells


def draw_nonfinite(ax, cells: dict[str, list[tuple[int, int]]]) -> None:
    """One hatched, labelled :class:`~matplotlib.collections.PolyCollection` per kind of cell."""
    from matplotlib.collections import PolyCollection

    for what in ("inf", "nan"):
        if cells.get(what):
            squares = [[(c - 0.5, r - 0.5), (c + 0.5, r - 0.5), (c + 0.5, r + 0.5), (c - 0.5, r + 0.5)]
                       for r, c in cells[what]]
            ax.add_collection(PolyCollection(squares, linewidth=0.0, label=NONFINITE_LABELS[what],
                                             zorder=2, **_NONFINITE_STYLE[what]), autolim=False)


def draw_skips(ax, cells: dict[str, list[tuple[int, int]]]) -> None:
    """Each skipped step's origin cell outlined, one labelled marker line per kind of origin."""
    for marker, (label, where) in zip(_SKIP_MARKERS * len(cells), cells.items()):
        ax.plot([c for _, c in where], [r for r, _ in where], linestyle="none", marker=marker, ms=11,
                markerfacecolor="none", markeredgecolor="#00e5ff", markeredgewidth=2.2, label=label,
                zorder=3)


def legend_under(fig, ax) -> None:
    """The marks' legend under the whole figure, one entry a line: under the axes (as
    :func:`~mixprec.report.figures.legend_below` puts it) a short map's legend covered its
    ``step`` label. Nothing when nothing is marked."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
                   frameon=False, ncol=1)
