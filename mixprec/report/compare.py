"""``mixprec report RUN_A RUN_B ...``: several runs overlaid in one HTML page and a few PNGs.

The first run is the reference (called so only when it ran one mode everywhere: a run with
per-layer formats is "the first run, a per-layer plan", :func:`reference_words`). Plots (drawn with :mod:`mixprec.report.figures`; each line is
labelled with its run's folder name, the table maps names to what ran, ``Precision.recipe.label``): train loss, validation
loss, learning rate, the relative difference of each run's loss from the reference's
(``loss / loss_ref - 1`` at the steps both logged), skipped steps (cumulative), the loss scale
(log axis), and the share of Linear layers in FP8 over time (when any run used FP8). The summary
table has one row per run: precision, the settings unlike the first run's (config.toml: the
training ones, also in each plot's line labels, then "not training: ..." for those that only
watch or save the run), how far it got
(``320 of 2000`` and whether it completed, stopped, diverged, or is still running or was
killed), final train and validation loss, each against the reference's at the last step every
run reached (named in the column header) and, when every run's last logged step is the same,
final against final (otherwise a note, :func:`compare_notes`, names each run's last step),
skipped steps, final loss scale, and the final layer formats.
"""
from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

from mixprec.report.figures import (caption, figure, integer_count_axis, legend_below, mark_events,
                                    plot_series, save, scale_series)
from mixprec.policy.overrides import is_micro
from mixprec.report.format_timeline import format_timeline
from mixprec.runs.metrics import is_finite_number
from mixprec.runs.read import read_run, run_progress, run_scales_loss

__all__ = ["write_comparison", "compare_summary", "compare_notes", "load_run", "settings_that_differ"]


def _series(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if is_finite_number(r.get(key))}


def load_run(run_dir: Path) -> dict[str, Any]:
    """:func:`~mixprec.runs.read.read_run` plus the per-layer format timeline."""
    run = read_run(run_dir)
    run["layers"], run["formats"] = format_timeline(run["events"], run["last"])
    run["precision"] = run["precision"] or "?"
    run["label"] = run["label"] or run["precision"]
    return run


def reference_words(ref: dict[str, Any]) -> str:
    """What the first run is called: "the reference" when it ran one mode everywhere; a run with
    per-layer formats (a plan) is only the first run, named by what ran."""
    if ref["plan"]:
        return f"the first run, a per-layer plan ({ref['label']}), not a uniform reference"
    if str(ref["label"]).endswith("+switched"):     # its layers changed format while training
        return f"the first run, whose layers switched format ({ref['label']}), not a uniform reference"
    return "the reference"


_UNLISTED = frozenset({"precision", "run_dir", "overwrite", "resume", "recipe"})
"""``config.toml`` keys never listed: ``precision`` has its own column, ``run_dir`` differs for
every run, ``overwrite``/``resume`` say how the folder was opened, and ``[recipe]`` records the
precision choices whose own keys are listed."""

_NOT_TRAINING = frozenset({
    "progress", "audit", "ckpt_interval", "keep_last", "export_hf", "profile", "monitor_every",
    "trace_nonfinite", "overlap_optimizer", "num_workers"})
"""Settings that watch or save a run but do not change its numbers (``monitor_every`` samples
statistics, ``trace_nonfinite`` replays a skipped step and restores the RNG, ``overlap_optimizer``
is bit-identical): listed apart ("not training: ...") and kept out of the plots' line labels.
``log_interval`` is not among them: a metrics row's ``loss`` is the mean over its interval, so
runs logged at other intervals compare other means."""


def _setting(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_setting(v)}" for k, v in value.items()) + "}"
    return str(value)


def settings_that_differ(config: dict[str, Any], ref: dict[str, Any], *, training: bool = True) -> str:
    """The settings of ``config`` unlike the first run's (``ref``), as ``key=value`` in
    ``config.toml``'s order (``lr=0.005 moments=int8 loss_chunk=64``); ``""`` when none: two runs
    labelled alike that differ by their learning rate must not read as a precision effect.
    ``training=False``: the ones that do not change a run's numbers (``_NOT_TRAINING``) instead."""
    keep = lambda k: k not in _UNLISTED and (k in _NOT_TRAINING) != training  # noqa: E731
    keys = [k for k in ref if keep(k)] + [k for k in config if k not in ref and keep(k)]
    return " ".join(f"{k}={_setting(config.get(k))}" for k in keys if config.get(k) != ref.get(k))


def _settings_column(config: dict[str, Any], ref: dict[str, Any]) -> str:
    """Every setting unlike the first's: the training ones, then ``not training: ...``."""
    train, other = settings_that_differ(config, ref), settings_that_differ(config, ref, training=False)
    return "; ".join(filter(None, [train, other and f"not training: {other}"])) or "-"


def _last_common(runs: list[dict[str, Any]], key: str) -> int | None:
    """The last step at which every run logged ``key`` (None when they share none)."""
    common = set.intersection(*(set(_series(r["rows"], key)) for r in runs))
    return max(common) if common else None


def _final_steps(runs: list[dict[str, Any]], key: str) -> list[int | None]:
    """Each run's last step that logged ``key`` (None: never)."""
    return [max(s) if (s := _series(r["rows"], key)) else None for r in runs]


def _same_final_step(runs: list[dict[str, Any]], key: str) -> bool:
    return len(set(_final_steps(runs, key))) == 1


def compare_notes(runs: list[dict[str, Any]]) -> list[str]:
    """What the summary's columns do not say themselves: runs whose last logged steps differ are
    compared at the last step every run logged only (a final loss at step 30 against one at step
    16 is no precision effect), naming each run's last step."""
    notes = []
    for key, name in (("loss", "loss"), ("val_loss", "validation loss")):
        finals = _final_steps(runs, key)
        if any(f is not None for f in finals) and not _same_final_step(runs, key):
            at = _last_common(runs, key)
            where = (f"compared at step {at} only, the last step every run logged" if at is not None
                     else "no step logged by every run, so no comparison")
            notes.append(f"the runs' last {name} steps differ ("
                         + ", ".join(f"{r['name']}: {'none' if f is None else f'step {f}'}"
                                     for r, f in zip(runs, finals)) + f"): {where}")
    return notes


def compare_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run; differences are against the first run, each column saying what it
    compares: at the last step every run reached (named in the header), and final against final
    only when every run's final is at the same step (:func:`compare_notes` says when not)."""
    ref = runs[0]
    at = {key: _last_common(runs, key) for key in ("loss", "val_loss")}
    same_end = {key: _same_final_step(runs, key) for key in ("loss", "val_loss")}

    def pct(a: float | None, b: float | None) -> float | None:
        return 100 * (a / b - 1) if a is not None and b else None

    def final(s: dict[int, float]) -> float | None:
        return s[max(s)] if s else None

    out = []
    for r in runs:
        row: dict[str, Any] = {"run": r["name"], "precision": r["label"],
                               "settings unlike the first's": _settings_column(r["config"], ref["config"]),
                               "steps": run_progress(r["config"], r["events"], r["last"])}
        for key, name in (("loss", "loss"), ("val_loss", "val loss")):
            s, rs = _series(r["rows"], key), _series(ref["rows"], key)
            row[f"final {name}"] = final(s)
            if same_end[key]:
                row[f"final {name} vs first's final (%)"] = pct(final(s), final(rs))
            if at[key] is not None:
                row[f"{name} vs first at step {at[key]} (%)"] = pct(s[at[key]], rs[at[key]])
        scales = _series(r["rows"], "loss_scale")
        totals = [int(x["skipped_total"]) for x in r["rows"] if is_finite_number(x.get("skipped_total"))]
        counts: dict[str, int] = {}
        for f in (f[-1] for f in r["formats"].values()):
            counts[f] = counts.get(f, 0) + 1
        row.update({
            "skipped steps": totals[-1] if totals else 0,
            "final loss scale": None if run_scales_loss(r["config"]) is False else final(scales),
            "layer formats": ", ".join(f"{n} {f}" for f, n in counts.items()) or "-",
            "format switches": sum(e.get("kind") == "format" for e in r["events"]),
        })
        out.append(row)
    return out


def _overlay(runs, key: str, title: str, ylabel: str, out: Path, name: str, *, log: bool = False,
             style: str | None = None, keep=lambda s: bool(s)) -> Path | None:
    """One line per run (labelled with its short name; the table maps names to precisions),
    each run's events marked, the legend under the axes."""
    fig, ax = figure(title, ylabel, log=log)
    for r in runs:
        s = _series(r["rows"], key)
        if keep(s):
            line, = plot_series(ax, list(s), list(s.values()), label=r["legend"], color=r["colour"],
                                **({"marker": style, "ms": 4} if style else {}))
            mark_events(ax, r["events"], skips=False, colour=line.get_color(), run=r["name"])
    if not ax.lines:
        return None
    legend_below(ax)
    return save(fig, out / name)


def _plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    for i, r in enumerate(runs):            # one colour per run in every picture
        r["colour"] = f"C{i % 10}"
        # Each line says how its run's settings differ from the first's, not its folder alone.
        differ = settings_that_differ(r["config"], runs[0]["config"])
        r["legend"] = f"{r['name']} ({differ})" if differ else r["name"]
    paths = [_overlay(runs, "loss", "train loss", "loss", out, "compare_loss.png"),
             _overlay(runs, "val_loss", "validation loss", "loss", out, "compare_val_loss.png",
                      style="o"),
             _overlay(runs, "lr", "learning rate", "lr", out, "compare_lr.png")]
    ref = runs[0]
    fig, ax = figure(f"train loss relative to {ref['name']} ({reference_words(ref)})",
                     "loss / first run - 1 (%)")
    rs = _series(ref["rows"], "loss")
    shared: set[int] = set()
    for r in runs[1:]:
        s = _series(r["rows"], "loss")
        common = sorted(set(s) & set(rs))
        shared.update(common)
        if common:
            ys = [100 * (s[c] / rs[c] - 1) for c in common]
            plot_series(ax, common, ys, label=r["legend"], color=r["colour"])
            if len(common) == 1:      # a lone dot: its value beside it, not a bare mark
                ax.annotate(f"{ys[0]:+.2f} %", (common[0], ys[0]), xytext=(6, 4),
                            textcoords="offset points", fontsize=8, color=r["colour"])
    if ax.lines:
        ax.axhline(0, color="#888", lw=0.8)
        # The steps the runs reached, not an axis around one shared step (9.6 to 10.4).
        ax.set_xlim(0, max(r["last"] for r in runs) or 1)
        if len(shared) == 1:
            ax.set_title(f"{ax.get_title()}\nat step {min(shared)} only, the one step the runs "
                         "logged in common", fontsize=10)
        legend_below(ax)
        paths.append(save(fig, out / "compare_loss_relative.png"))
    fig, ax = figure("skipped steps (cumulative)", "skipped steps")
    counts: list[float] = []
    for r in runs:
        s = _series(r["rows"], "skipped_total")
        if s and any(s.values()):
            ax.step(list(s), list(s.values()), where="post", label=r["legend"], color=r["colour"])
        counts += list(s.values())
    if counts:
        integer_count_axis(ax, counts)
        ax.set_xlim(0, max(r["last"] for r in runs) or 1)
        legend_below(ax)
        paths.append(save(fig, out / "compare_skipped.png"))
    fig, ax = figure("loss scale (runs that scale the loss)", "scale")
    for r in runs:
        steps, scale = scale_series(r["rows"], r["events"])
        if scale and any(v != 1 for v in scale):
            ax.step(steps, scale, where="post", label=r["legend"], color=r["colour"])
    if ax.lines:
        ax.set_yscale("log", base=2)
        legend_below(ax)
        paths.append(save(fig, out / "compare_loss_scale.png"))
    fig, ax = figure("Linear layers in 8 bits or fewer (FP8, MXFP8, MXFP4, NVFP4)", "share of Linear layers (%)")
    for r in runs:
        if r["layers"]:
            n = len(r["layers"])
            share = [100 * sum(_narrow(r["formats"][name][t]) for name in r["layers"]) / n
                     for t in range(r["last"] + 1)]
            ax.step(range(r["last"] + 1), share, where="post", label=r["legend"], color=r["colour"])
    if any(max(line.get_ydata(), default=0) > 0 for line in ax.lines):   # no FP8 anywhere: no picture
        ax.set_ylim(-2, 102)
        legend_below(ax)
        paths.append(save(fig, out / "compare_fp8_share.png"))
    return [p for p in paths if p is not None]


def write_comparison(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike | None = None) -> Path:
    """Overlay ``run_dirs`` (the first is the reference) into ``out_dir`` (default
    ``<first run>/compare``); returns the HTML path."""
    runs = [load_run(Path(d)) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else runs[0]["dir"] / "compare"
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(runs, out)
    summary = compare_summary(runs)
    esc = html.escape
    notes = "\n".join(f"<p><strong>Note:</strong> {esc(n)}</p>" for n in compare_notes(runs))

    head = "".join(f"<th>{esc(k)}</th>" for k in summary[0])
    body = "\n".join("<tr>" + "".join(f"<td>{_fmt(k, v)}</td>" for k, v in row.items()) + "</tr>"
                     for row in summary)
    figures = "\n".join(
        f'<figure><img alt="{esc(caption(p))}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode("ascii")}"><figcaption>{esc(caption(p))}</figcaption></figure>'
        for p in images)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mixprec comparison</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }}
th {{ background: #f4f4f4; }} img {{ max-width: 100%; }} figcaption {{ color: #666; font-size: 0.9em; }}
</style></head><body>
<h1>mixprec comparison</h1>
<p>Differences are against {esc(reference_words(runs[0]))}: <code>{esc(str(runs[0]['dir'].resolve()))}</code></p>
<table><tr>{head}</tr>
{body}
</table>
{notes}
<h2>Plots</h2>
{figures}
</body></html>
"""
    path = out / "compare.html"
    path.write_text(page, encoding="utf-8")
    return path


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.2f}" if key.endswith("(%)") else f"{v:.4g}"
    return html.escape(str(v))


def _narrow(fmt: str) -> bool:
    """A Linear layer's format is 8 bits or fewer: FP8 (any recipe) or a block-scaled micro format."""
    return fmt.startswith("fp8") or is_micro(fmt)
