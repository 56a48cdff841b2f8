"""The layers x formats text table that ``mixprec plan`` and ``mixprec whatif`` print.

One row per Linear: its name, an optional lead column (the planner's FLOP share), one cell per
format (``None``: the rules keep the layer out of that format, shown ``n/a``) and the choice.
:func:`layer_grid` lays the rows out; :func:`format_counts` is the summary line's "3 fp8-tensorwise,
1 bf16".
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["GridRow", "layer_grid", "format_counts"]


@dataclass(frozen=True, kw_only=True)
class GridRow:
    name: str
    cells: Sequence[str | None]
    """One formatted cell per format, ``None`` for ``n/a``."""
    choice: str
    lead: str = ""


def layer_grid(rows: Sequence[GridRow], heads: Sequence[str], *, what: str | Sequence[str], width: int,
               align: str = ">", lead: tuple[str, str] | None = None, name_width: int = 12,
               choice: str = "chosen") -> list[str]:
    """The table's lines: a header (``heads``, one per format, then ``choice``), a sub-header
    saying ``what`` a cell holds (one text for all, or one per head), one line per row. Cells are ``width`` wide, aligned by ``align``
    (a format-spec alignment: ``>``, ``^``); ``lead`` is the optional lead column's two header
    lines; the name column is as wide as the longest name (at least ``name_width``)."""
    w = max([name_width] + [len(r.name) for r in rows])

    def line(name: str, first: str, cells: Iterable[str], end: str) -> str:
        pre = "" if lead is None else f"{first:>6} "
        return f"{name:<{w}} {pre}" + " ".join(f"{c:{align}{width}}" for c in cells) + end

    out = [line("layer", lead[0] if lead else "", heads, f"  {choice}"),
           line("", lead[1] if lead else "", [what] * len(heads) if isinstance(what, str) else what, "")]
    out += [line(r.name, r.lead, ("n/a" if c is None else c for c in r.cells), f"  {r.choice}")
            for r in rows]
    return out


def format_counts(choices: Iterable[str]) -> str:
    """``"3 fp8-tensorwise, 1 bf16"``: how many layers chose each format, in first-seen order."""
    return ", ".join(f"{n} {f}" for f, n in Counter(choices).items())
