"""The report of one run folder: plots and one self-contained HTML page.

Reads what :mod:`mixprec.runs.metrics` wrote (``metrics.csv``, and ``numerics.csv`` /
``events.jsonl`` when present) and draws one PNG per question a user asks of a run: is the loss
falling (train and validation), is the loss scale stable or collapsing (log axis, skipped steps
marked at the scale they overflowed), what the learning rate was, are gradients exploding, how
fast is it (tokens/s and MFU, one panel each), how much memory (saying what was measured), and which
layers run close to their format's limits (a module x step heat map). ``report.html`` inlines
every image as base64 so it can be mailed or attached to an issue as one file.

Plots are skipped, not drawn empty, when a run never measured that quantity (e.g. no MFU on CPU),
and the loss-scale plot when the run did not scale (every logged scale is 1, or the precision in
``config.toml`` has no loss scaling). MFU is shown in percent everywhere. The wall time is the
whole run's (the sum of the logged intervals), and the precision and model come from the run
folder's ``config.toml`` (and the start event, which names the resolved policy).
"""
from __future__ import annotations

import base64
import html
import math
import os
from pathlib import Path
from typing import Any

from mixprec.errors import DataError
from mixprec.report.figures import (caption, figure, legend_below, mark_events, memory_label, plot_series,
                                    save, scale_series, skip_events)
from mixprec.runs.read import (format_counts, layer_formats_over_run, read_run_config, run_label,
                               run_precision, run_progress, run_scales_loss, start_field)
from mixprec.runs.metrics import (METRICS_FILE, is_finite_number, read_events, read_metrics,
                                   read_numerics)

__all__ = ["write_report", "summarize"]

_MAX_EVENTS_SHOWN = 200


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

def _values(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of one column (rows where it was not measured are left out)."""
    pairs = [(r["step"], r[key]) for r in rows if is_finite_number(r.get(key))]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


_SKIP_EVENT_KINDS = {"skip", "skipped", "overflow", "nonfinite", "non-finite"}


def _skipped_steps(rows: list[dict[str, Any]], events: list[dict[str, Any]] = ()) -> list[int]:
    """Steps known to be skipped: skip/overflow events (one per skipped step, between logged rows
    too) and rows whose own step was skipped. A rising ``skipped_total`` says only that some step
    of the interval was skipped, not which: it marks nothing."""
    marked = {r["step"] for r in rows if (r.get("skipped") or 0) > 0}
    for e in events:
        kind = str(e.get("kind", e.get("type", ""))).lower()
        if isinstance(e.get("step"), int) and (kind in _SKIP_EVENT_KINDS or e.get("skipped") is True):
            marked.add(e["step"])
    return sorted(marked)


def _scale_at(steps: list[int], scale: list[float], step: int) -> float | None:
    """The loss scale in force at ``step``: the last logged value at or before it."""
    value = None
    for s, v in zip(steps, scale):
        if s > step:
            break
        value = v
    return value








def _model(config: dict[str, Any], events: list[dict[str, Any]]) -> str | None:
    parts = []
    if config.get("model"):
        shape = ", ".join(f"{k}={config[k]}" for k in ("num_layers", "d_model", "num_heads",
                                                         "num_experts") if k in config)
        parts.append(f"{config['model']}" + (f" ({shape})" if shape else ""))
    size = start_field(events, "model")
    if size:
        parts.append(size.split(";")[0])
    return "; ".join(parts) or None


def _scaling_off(rows: list[dict[str, Any]], config: dict[str, Any]) -> bool:
    """True when the run did not scale the loss: every logged scale is 1, or its precision has
    no loss scaling."""
    _, scale = _values(rows, "loss_scale")
    if scale and all(v == 1.0 for v in scale):
        return True
    return run_scales_loss(config) is False


def summarize(rows: list[dict[str, Any]], events: list[dict[str, Any]],
              config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Headline figures of a run (None where the run did not measure them)."""
    config = config or {}
    _, losses = _values(rows, "loss")
    val_steps, vals = _values(rows, "val_loss")
    _, mem = _values(rows, "peak_mem_mb")
    _, times = _values(rows, "time_s")
    _, evals = _values(rows, "eval_s")      # evaluation time, kept out of time_s
    totals = [r["skipped_total"] for r in rows if r.get("skipped_total") is not None]
    skipped = totals[-1] if totals else sum(int(r.get("skipped") or 0) for r in rows)
    best = min(range(len(vals)), key=vals.__getitem__) if vals else None
    label, _ = run_label(config, events)
    start, end = layer_formats_over_run(events)
    return {
        "precision": run_precision(config, events),
        "ran": f"{label} ({format_counts(end)})" if label and start != end else label,
        "layer formats at the start": format_counts(start) or None,
        "layer formats at the end": format_counts(end) or None,
        "layer formats over the run": formats_over_run(events, rows[-1]["step"]),
        "model": _model(config, events),
        "last step": rows[-1]["step"],
        "steps": run_progress(config, events, rows[-1]["step"]),   # says an incomplete run is one
        "logged rows": len(rows),
        "final train loss": losses[-1] if losses else None,
        "final val loss": vals[-1] if vals else None,
        "best val loss": vals[best] if best is not None else None,
        "best val loss at step": val_steps[best] if best is not None else None,
        "skipped steps": skipped,
        TOKENS_PER_S: over_training_time(rows, "tokens_per_s"),
        MFU_PERCENT: None if (m := over_training_time(rows, "mfu")) is None else 100 * m,
        "peak memory (MiB)": max(mem) if mem else None,   # metrics.csv's peak_mem_mb is MiB
        "wall time (s)": math.fsum(times + evals) if times else None,   # each interval's
        "events": len(events),
        "guard": guard_summary(events),
    }


TOKENS_PER_S = "tokens/s (all tokens / training time)"
MFU_PERCENT = "MFU (%) (over training time)"


def over_training_time(rows: list[dict[str, Any]], key: str) -> float | None:
    """A rate of the whole run from its rows' rates: each weighted by its row's training seconds.

    For ``tokens_per_s`` that is all tokens over all training time (a row's tokens are its rate
    times its ``time_s``), not the plain mean of the rows' rates (which counts a slow first row of
    20 s and a fast one of 0.2 s alike); ``mfu`` is tokens/s times a constant, so the same.
    Rows without the rate or the time are left out; None when no row has both.
    """
    pairs = [(float(r[key]), float(r["time_s"])) for r in rows
             if is_finite_number(r.get(key)) and is_finite_number(r.get("time_s")) and r["time_s"] > 0]
    seconds = math.fsum(t for _, t in pairs)
    return math.fsum(v * t for v, t in pairs) / seconds if seconds else None


def formats_over_run(events: list[dict[str, Any]], last: int) -> str | None:
    """Each format's share of the Linear-layer training steps (steps 1..``last``, a layer counted
    at each step in the format it had after that step's switches): ``bf16 100 %`` for a guarded
    FP8 run whose layers all went to BF16 at step 1. None when the run logged no formats."""
    from mixprec.report.format_timeline import format_timeline
    layers, rows = format_timeline(events, last)
    steps = range(1, last + 1) if last >= 1 else range(0, 1)
    counts: dict[str, int] = {}
    for name in layers:
        for s in steps:
            counts[rows[name][s]] = counts.get(rows[name][s], 0) + 1
    total = sum(counts.values())
    if not total:
        return None
    return ", ".join(f"{f} {100 * n / total:.3g} %" for f, n in sorted(counts.items(), key=lambda c: -c[1])) \
        + " of layer-steps"


def guard_summary(events: list[dict[str, Any]]) -> str:
    """What guarded training did (``guard=true``): promotions, restores, a give-up; ``on, 0
    repairs`` when it watched and had nothing to do (its start line, ``events.jsonl``'s ``start``
    record); ``-`` when it was off."""
    said = []
    on = False
    for e in events:
        if e.get("kind") == "start":
            on = on or any(str(w).startswith("guard:") for w in e.get("watching", ()))
        elif e.get("kind") == "format" and e.get("guard"):
            said.append(f"step {e.get('step')}: {e.get('module')} {e.get('from')} -> {e.get('to')}")
        elif e.get("kind") == "guard":
            said.append(f"step {e.get('step')}: {e.get('action')}")
    return "; ".join(said) or ("on, 0 repairs" if on else "-")


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------

def _plot_loss(rows, events, out: Path) -> Path | None:
    steps, loss = _values(rows, "loss")
    vsteps, vloss = _values(rows, "val_loss")
    if not loss and not vloss:
        return None
    fig, ax = figure("loss", "loss")
    if loss:
        plot_series(ax, steps, loss, label="train", lw=1.2)
    if vloss:
        ax.plot(vsteps, vloss, "o-", label="validation", lw=1.5, ms=4)
    mark_events(ax, events)
    legend_below(ax)
    return save(fig, out / "loss.png")


def _plot_loss_scale(rows, events, out: Path, config: dict[str, Any] | None = None) -> Path | None:
    steps, scale = scale_series(rows, events)
    if not scale or _scaling_off(rows, config or {}):
        return None
    fig, ax = figure("loss scale (skipped steps marked at the scale they overflowed)", "scale")
    ax.step(steps, scale, where="post", lw=1.2, label="loss scale after the step")
    # A skipped step overflowed at the scale it ran with: its record's scale before, else the
    # scale in force after the step before it.
    before = {e["step"]: float(e["loss_scale_before"]) for e in skip_events(events)
              if is_finite_number(e.get("loss_scale_before"))}
    marks = [(s, before.get(s, _scale_at(steps, scale, s - 1))) for s in _skipped_steps(rows, events)]
    marks = [(s, v) for s, v in marks if v is not None]
    if marks:
        ax.plot([s for s, _ in marks], [v for _, v in marks], "x", color="tab:red", ms=7,
                label=f"skipped step ({len(marks)})")
    mark_events(ax, events, skips=False)
    if all(v > 0 for v in scale):
        ax.set_yscale("log", base=2)
    legend_below(ax)
    return save(fig, out / "loss_scale.png")


def _plot_grad_norm(rows, events, out: Path) -> Path | None:
    steps, norm = _values(rows, "grad_norm")
    if not norm:
        return None
    fig, ax = figure("gradient norm (unscaled, before clipping)", "global L2 norm")
    plot_series(ax, steps, norm, lw=1.0, label="gradient norm")
    if all(v > 0 for v in norm) and max(norm) / min(norm) > 100:
        ax.set_yscale("log")
    mark_events(ax, events)
    legend_below(ax)
    return save(fig, out / "grad_norm.png")


def _plot_lr(rows, events, out: Path) -> Path | None:
    steps, lr = _values(rows, "lr")
    if not lr:
        return None
    fig, ax = figure("learning rate", "lr")
    plot_series(ax, steps, lr, lw=1.2, label="learning rate")
    ax.set_ylim(bottom=0)
    mark_events(ax, events, skips=False)
    legend_below(ax)
    return save(fig, out / "lr.png")


def _plot_throughput(rows, events, out: Path) -> Path | None:
    steps, tps = _values(rows, "tokens_per_s")
    msteps, mfu = _values(rows, "mfu")
    if not tps and not mfu:
        return None
    panels = [p for p in (("tokens/s", steps, tps, "tab:blue"),
                          ("MFU (%)", msteps, [100 * m for m in mfu], "tab:orange")) if p[2]]
    # One panel per quantity: MFU is tokens/s times a constant, so on one axis the lines coincide.
    fig, axes = figure("throughput", rows=len(panels), figsize=(7.5, 2.6 + 1.9 * len(panels)))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (label, xs, ys, colour) in zip(axes, panels):
        plot_series(ax, xs, ys, color=colour, lw=1.2, label=label)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)   # from zero, so timer noise does not look like a trend
        mark_events(ax, events, skips=False)
    legend_below(axes[-1], panels=axes[:-1])    # one legend naming every line of both panels
    return save(fig, out / "throughput.png")


def _plot_memory(rows, events, out: Path) -> Path | None:
    steps, mem = _values(rows, "peak_mem_mb")
    if not mem:
        return None
    fig, ax = figure(f"peak memory: {memory_label(start_field(events, 'device'))}", "MiB")
    plot_series(ax, steps, mem, lw=1.2, label="peak memory")
    ax.set_ylim(0, 1.1 * max(mem))
    # A resumed run is a new process: its high-water mark starts over, so the line can drop there.
    mark_events(ax, events, skips=False)
    legend_below(ax)
    return save(fig, out / "memory.png")


def _grad_scaling(rows: list[dict[str, Any]], numerics: list[dict[str, Any]]) -> str:
    """How the ``grad`` rows' magnitudes relate to the gradients: ``"divided"`` (each row carries
    its step's loss scale, divided out here), ``"scaled"`` (the run scaled its loss but the rows
    do not say by how much: they are drawn as backward held them, and the title says so), or
    ``"none"`` (no loss scaling)."""
    grads = [r for r in numerics if r.get("kind") == "grad"]
    if grads and all(is_finite_number(r.get("loss_scale")) and r["loss_scale"] > 0 for r in grads):
        return "divided"
    scaled = any(is_finite_number(r.get("loss_scale")) and r["loss_scale"] != 1.0 for r in [*rows, *grads])
    return "scaled" if scaled else "none"


def _plot_numerics(numerics, out: Path, metrics: list[dict[str, Any]] | None = None,
                   events: list[dict[str, Any]] = ()) -> list[Path]:
    """One heat map per (kind, statistic): rows are modules, columns logged steps. The gradients'
    largest magnitudes are the gradients' own: each row's loss scale divided out (an FP16 run's
    scale moves 2^24 -> 2^16 -> 2^18, and colours that followed it would show the scale, not the
    gradients); the overflow fraction stays that of the loss-scaled values, which are what
    overflows. Cells whose tensor held inf/NaN, and the layer each skipped step's trace named, are
    drawn over the colours (:mod:`mixprec.report.heat_marks`)."""
    import numpy as np

    from mixprec.report.heat_marks import (draw_nonfinite, draw_skips, legend_under, nonfinite_cells,
                                           skip_cells)

    grad_scaling = _grad_scaling(metrics or [], numerics)

    paths = []
    # One layer order for every heat map: forward order (as the activations were logged), then
    # any module seen only in gradients or updates (those are logged in backward order).
    kinds = ("act", "grad", "update")
    order = list(dict.fromkeys(r["module"] for k in kinds for r in numerics if r.get("kind") == k))
    for kind in kinds:
        rows = [r for r in numerics if r.get("kind") == kind]
        if not rows:
            continue
        present = {r["module"] for r in rows}
        modules = [m for m in order if m in present]
        steps = sorted({r["step"] for r in rows})
        col = {s: i for i, s in enumerate(steps)}
        row = {m: i for i, m in enumerate(modules)}
        skips = skip_cells(list(events), kind, row, col)
        what = "output gradients" if kind == "grad" else kind
        for stat, label, transform in (("absmax", "log10 |x| max", _log10),
                                       ("overflow_frac", "overflow fraction", float)):
            note = ""
            if kind == "grad" and grad_scaling != "none":
                note = {("absmax", "divided"): " (unscaled: divided by the loss scale)",
                        ("absmax", "scaled"): " (times the loss scale, not divided out)"}.get(
                    (stat, grad_scaling), " (of the loss-scaled gradients)")
            grid = np.full((len(modules), len(steps)), np.nan)
            for r in rows:
                if is_finite_number(r.get(stat)):
                    value = r[stat]
                    if kind == "grad" and stat == "absmax" and grad_scaling == "divided":
                        value = value / r["loss_scale"]
                    grid[row[r["module"]], col[r["step"]]] = transform(value)
            held = nonfinite_cells(rows, stat, row, col)
            if not held and not skips and (np.isnan(grid).all() or (
                    stat == "overflow_frac" and not np.nanmax(grid) > 0)):
                continue
            height = min(12.0, 2.5 + 0.25 * len(modules))   # room for the title over a few rows
            fig, ax = figure(f"{what}: {label} per module over time{note}", figsize=(8.0, height))
            ax.grid(False)
            image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest",
                              cmap="magma" if stat == "overflow_frac" else "viridis")
            ax.set_yticks(range(len(modules)), labels=modules, fontsize=max(5, 9 - len(modules) // 20))
            ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
            ax.set_xticks(ticks, labels=[str(steps[i]) for i in ticks])
            ax.set_xlabel("step")
            fig.colorbar(image, ax=ax, label=label)
            draw_nonfinite(ax, held)
            draw_skips(ax, skips)
            fig.tight_layout()                  # the figure's bottom edge, then the legend under it
            legend_under(fig, ax)
            paths.append(save(fig, out / f"numerics_{kind}_{stat}.png"))
    return paths


def _log10(value: float) -> float:
    return math.log10(value) if value > 0 else math.nan


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _profile_html(run_dir: Path, out: Path) -> str:
    """A link to the run's Chrome trace and its profile table, when ``profile=STEPS`` wrote them."""
    trace, table = run_dir / "trace.json", run_dir / "profile.txt"
    if not trace.is_file():
        return ""
    esc = html.escape
    href = Path(os.path.relpath(trace.resolve(), out.resolve())).as_posix()
    text = table.read_text(encoding="utf-8") if table.is_file() else ""
    return (f'<h2>Profile</h2>\n<p><a href="{esc(href)}">trace.json</a> (Chrome trace: open it in '
            f'chrome://tracing or https://ui.perfetto.dev)</p>\n'
            + (f"<pre>{esc(text)}</pre>\n" if text else ""))


def _html(run_dir: Path, summary: dict[str, Any], images: list[Path], events: list[dict],
          profile: str = "") -> str:
    esc = html.escape
    rows = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(_fmt(v))}</td></tr>" for k, v in summary.items())
    figures = "\n".join(
        f'<figure><img alt="{esc(caption(p))}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode("ascii")}"><figcaption>{esc(caption(p))}</figcaption></figure>'
        for p in images)
    shown = events[:_MAX_EVENTS_SHOWN]
    items = "\n".join(
        f"<li><code>step {esc(str(e.get('step', '—')))}</code> "
        f"{esc(str(e.get('kind', e.get('type', 'event'))))}: {esc(str(e.get('message', '')))}</li>"
        for e in shown)
    more = (f"<p>… and {len(events) - len(shown)} more in events.jsonl</p>" if len(events) > len(shown) else "")
    events_html = f"<ol>{items}</ol>{more}" if events else "<p>No events (no overflow, skip or scale change was logged).</p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mixprec report: {esc(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.8em; text-align: left; }}
th {{ background: #f4f4f4; font-weight: 600; }}
figure {{ margin: 1em 0; }} img {{ max-width: 100%; }} figcaption {{ color: #666; font-size: 0.9em; }}
</style></head><body>
<h1>mixprec report</h1>
<p>Run folder: <code>{esc(str(run_dir.resolve()))}</code></p>
<h2>Summary</h2>
<table>
{rows}
</table>
<h2>Plots</h2>
{figures}
<h2>Events</h2>
{events_html}
{profile}</body></html>
"""


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write the PNGs and ``report.html`` for ``run_dir`` into ``out_dir``; returns the HTML path."""
    run_path = Path(run_dir)
    if not run_path.is_dir():
        raise DataError(f"no run folder at {run_path}; pass the folder `mixprec train` printed "
                        "(it holds metrics.csv)")
    if not (run_path / METRICS_FILE).is_file():
        raise DataError(f"{run_path} has no {METRICS_FILE}; pass a run folder written by `mixprec train`")
    rows = read_metrics(run_path)
    if not rows:
        raise DataError(f"{run_path / METRICS_FILE} has no rows yet; train for at least one logging "
                        "interval, then run the report again")
    numerics = read_numerics(run_path)
    events = read_events(run_path)
    config = read_run_config(run_path)
    out = Path(out_dir) if out_dir is not None else run_path / "report"
    out.mkdir(parents=True, exist_ok=True)

    images = [p for p in (_plot_loss(rows, events, out), _plot_loss_scale(rows, events, out, config),
                          _plot_lr(rows, events, out), _plot_grad_norm(rows, events, out),
                          _plot_throughput(rows, events, out), _plot_memory(rows, events, out))
              if p is not None]
    images += _plot_numerics(numerics, out, rows, events)
    from mixprec.report.format_timeline import plot_formats
    last = max((int(r["step"]) for r in rows if r.get("step") is not None), default=0)
    images += [p for p in (plot_formats(events, last, out),) if p is not None]
    html_path = out / "report.html"
    html_path.write_text(_html(run_path, summarize(rows, events, config), images, events,
                               _profile_html(run_path, out)), encoding="utf-8")
    return html_path
