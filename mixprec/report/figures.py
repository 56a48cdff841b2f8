"""What every report picture shares: one figure helper, the legend outside the axes, the run's
events marked on its curves, the loss scale at every step it changed, and the captions.

:mod:`mixprec.report.report` (one run) and :mod:`mixprec.report.compare` (several) both draw
with these, so a fix to how a picture reads lands in both.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mixprec.runs.metrics import is_finite_number

__all__ = ["figure", "save", "plot_series", "legend_below", "mark_events", "scale_series", "skip_events",
           "integer_count_axis", "caption", "memory_label"]

# Events drawn on the curves: kind -> (label, colour). A resume is a ``start`` event after step 0;
# a ``format`` record is the re-planner's switch unless it carries ``"guard"`` (the training
# guard's promotion of a layer to a safer format: a different mechanism, marked as its own).
_MARKED = {"resume": ("resumed", "tab:green"), "interrupted": ("stopped", "tab:purple"),
           "diverged": ("diverged", "tab:red"), "format": ("re-plan", "tab:orange"),
           "guard_promote": ("guard: promoted", "tab:olive"),
           "loss_scale_stuck": ("stopped: loss scale stuck", "tab:pink"),
           "guard": ("guard", "tab:brown")}
_LINE_STYLE = {"resumed": ":", "stopped": "-.", "diverged": "--", "re-plan": (0, (6, 2)),
               "guard: promoted": (0, (3, 1, 1, 1)), "stopped: loss scale stuck": (0, (1, 1)),
               "guard": (0, (8, 3, 2, 3))}
"""Each kind of event its own line style: an overlay draws a run's events in the run's colour,
where the colour no longer tells a resume from a stop."""

_CAPTIONS = {
    "loss": "Training and validation loss",
    "loss_scale": "Loss scale at every step it changed (skipped steps marked at the scale they overflowed)",
    "grad_norm": "Gradient norm (unscaled, before clipping)",
    "lr": "Learning rate",
    "throughput": "Throughput and model FLOPs utilisation",
    "memory": "Peak memory",
    "formats": "Compute format per Linear layer over time",
    "compare_loss": "Train loss of each run",
    "compare_val_loss": "Validation loss of each run",
    "compare_loss_relative": "Train loss relative to the first run",
    "compare_skipped": "Skipped steps (cumulative)",
    "compare_loss_scale": "Loss scale of each run",
    "compare_lr": "Learning rate of each run",
    "compare_fp8_share": "Share of Linear layers computing in 8 bits or fewer (FP8 and the block-scaled formats)",
}


def caption(path: Path) -> str:
    """The human title of a report picture (its file stem only names the file)."""
    stem = Path(path).stem
    if stem in _CAPTIONS:
        return _CAPTIONS[stem]
    if stem.startswith("numerics_"):                  # numerics_<kind>_<stat>
        kind, _, stat = stem.removeprefix("numerics_").partition("_")
        what = {"act": "activations", "grad": "gradients", "update": "updates"}.get(kind, kind)
        stat = {"absmax": "largest magnitude (log10)", "overflow_frac": "overflow fraction"}.get(stat, stat)
        marks = ("; hatched cells held inf/NaN, an outlined cell is the layer a skipped step's trace named "
                 "(at logged steps only)")
        if kind == "grad":
            what = ("output gradients (w.r.t. each layer's output, as backward held them: a weight- or "
                    "input-gradient GEMM's inf is not among them, only its skipped step's outline shows it)")
            if stat.startswith("largest"):
                stat += ", the loss scale divided out (a run that did not record it says so in the title)"
        return f"Per-layer {what}: {stat} over time{marks}"
    return stem.replace("_", " ")


def figure(title: str, ylabel: str | None = None, *, xlabel: str = "step", log: bool = False,
           figsize: tuple[float, float] = (7.5, 4.0), rows: int = 1):
    """A bare Figure (the Agg canvas; pyplot's global backend is never touched, so a report
    written from a notebook or a headless server behaves the same) with ``rows`` axes sharing x."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=100)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    axes[0].set_title(title)
    axes[-1].set_xlabel(xlabel)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    if ylabel:
        axes[0].set_ylabel(ylabel)
    if log:
        axes[0].set_yscale("log")
    return (fig, axes[0]) if rows == 1 else (fig, list(axes))


def plot_series(ax, xs, ys, **style: Any):
    """``ax.plot`` for a series of logged rows; a series of one row (a run that logged once) is
    drawn as a dot, since a line through one point draws nothing."""
    if len(xs) == 1 and "marker" not in style:
        style = {**style, "marker": "o", "ms": 5}
    return ax.plot(xs, ys, **style)


def legend_below(ax, *, ncol: int | None = None, panels=()) -> None:
    """The legend under the axes (it never covers a curve nor leaves the picture: :func:`save`
    writes the figure's tight bounding box). ``panels``: the other axes of a stacked figure whose
    lines this one legend (under the bottom panel, ``ax``) also names, each label once."""
    named: dict[str, Any] = {}
    for a in (*panels, ax):
        for handle, label in zip(*a.get_legend_handles_labels()):
            named.setdefault(label, handle)
    if not named:
        return
    handles, labels = list(named.values()), list(named)
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, frameon=False,
              ncol=ncol or min(len(handles), 4))


def save(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG whose bounds hold every artist (a legend under the axes included)."""
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight")
    return path


def skip_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``skip`` records (one per skipped step, with the scale before and after)."""
    return [e for e in events if e.get("kind") == "skip" and isinstance(e.get("step"), int)]


def scale_series(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The loss scale in force after each step, at every step it is known to have changed.

    ``metrics.csv`` logs the scale once per log interval, so it misses every back-off between two
    rows; each skipped step's ``skip`` record holds the scale before and after it. Both together
    give the scale at every change (a row's value wins on a tie: it is the later reading)."""
    known: dict[int, float] = {}
    for e in skip_events(events):
        if is_finite_number(e.get("loss_scale_before")):
            known.setdefault(e["step"] - 1, float(e["loss_scale_before"]))
        if is_finite_number(e.get("loss_scale_after")):
            known[e["step"]] = float(e["loss_scale_after"])
    for r in rows:
        if is_finite_number(r.get("loss_scale")):
            known[int(r["step"])] = float(r["loss_scale"])
    steps = sorted(known)
    return steps, [known[s] for s in steps]


def _marks(events: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """(step, label, colour) of the events worth a line on the curves."""
    out = []
    for e in events:
        step, kind = e.get("step"), e.get("kind")
        if not isinstance(step, int):
            continue
        if kind == "start" and step > 0:
            kind = "resume"
        elif kind == "format" and e.get("guard"):
            kind = "guard_promote"
        if kind in _MARKED:
            out.append((step, *_MARKED[kind]))
    return out


def mark_events(ax, events: list[dict[str, Any]], *, skips: bool = True, colour: str | None = None,
                run: str | None = None) -> None:
    """Resumes, stops, divergence, re-planning and guard actions as labelled vertical lines;
    skipped steps (``skips``) as red ticks along the bottom of the axes. Overlays pass each run's
    ``colour`` and name (``run``), so a line says whose event it is."""
    seen: set[str] = set()
    for step, label, own in _marks(events):
        text = f"{run}: {label}" if run else label
        ax.axvline(step, color=colour or own, lw=0.9, ls=_LINE_STYLE[label], alpha=0.8,
                   label=text if text not in seen else None)
        seen.add(text)
    if skips:
        steps = [e["step"] for e in skip_events(events)]
        if steps:
            ax.plot(steps, [0.0] * len(steps), "|", color="tab:red", ms=9,
                    transform=ax.get_xaxis_transform(), label="skipped step", clip_on=False)


def integer_count_axis(ax, counts: list[float]) -> None:
    """A count axis from 0 with integer ticks; no counts at all: say so instead of an axis
    around zero."""
    from matplotlib.ticker import MaxNLocator
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(1.0, max(counts, default=0.0) * 1.05))
    if not any(counts):
        ax.text(0.5, 0.5, "no skipped steps", transform=ax.transAxes, ha="center", va="center",
                color="#555", fontsize=11)


def memory_label(device: str | None) -> str:
    """What the ``peak_mem_mb`` column measured on ``device`` (see mixprec/train/meter.py)."""
    if device and device.startswith("cuda"):
        return "CUDA allocator peak (max_memory_allocated)"
    return "process RSS high-water mark (ru_maxrss, all of Python + torch)"
