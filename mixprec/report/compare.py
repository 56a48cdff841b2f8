"""``mixprec report RUN_A RUN_B ...``: several runs overlaid in one HTML page and a few PNGs.

The first run is the reference. Plots: train loss, validation loss, the relative difference of
each run's loss from the reference's (``loss / loss_ref - 1`` at the steps both logged), skipped
steps (cumulative), the loss scale (log axis), and the share of Linear layers in FP8 over time
(from ``events.jsonl``: per-layer formats and re-planning switches). The summary table has one
row per run: precision, steps, final train and validation loss and their difference from the
reference, skipped steps, final loss scale, and the final layer formats.
"""
from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

from mixprec.report.format_timeline import format_timeline
from mixprec.runs.metrics import is_finite_number
from mixprec.runs.read import read_run

__all__ = ["write_comparison", "compare_summary", "load_run"]


def _series(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if is_finite_number(r.get(key))}


def load_run(run_dir: Path) -> dict[str, Any]:
    """:func:`~mixprec.runs.read.read_run` plus the per-layer format timeline."""
    run = read_run(run_dir)
    run["layers"], run["formats"] = format_timeline(run["events"], run["last"])
    run["precision"] = run["precision"] or "?"
    return run


def compare_summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run; differences are against the first run."""
    ref = runs[0]
    out = []
    for r in runs:
        loss, val = _series(r["rows"], "loss"), _series(r["rows"], "val_loss")
        rloss, rval = _series(ref["rows"], "loss"), _series(ref["rows"], "val_loss")
        scales = _series(r["rows"], "loss_scale")
        totals = [int(x["skipped_total"]) for x in r["rows"] if is_finite_number(x.get("skipped_total"))]
        fin = {n: f[-1] for n, f in r["formats"].items()}
        counts: dict[str, int] = {}
        for f in fin.values():
            counts[f] = counts.get(f, 0) + 1

        def last_common(a: dict[int, float], b: dict[int, float]) -> float | None:
            common = sorted(set(a) & set(b))
            return 100 * (a[common[-1]] / b[common[-1]] - 1) if common else None
        out.append({
            "run": r["name"], "precision": r["precision"], "last step": r["last"],
            "final loss": loss[max(loss)] if loss else None,
            "loss vs first (%)": last_common(loss, rloss),
            "final val loss": val[max(val)] if val else None,
            "val loss vs first (%)": last_common(val, rval),
            "skipped steps": totals[-1] if totals else 0,
            "final loss scale": scales[max(scales)] if scales else None,
            "layer formats": ", ".join(f"{n} {f}" for f, n in counts.items()) or "-",
            "format switches": sum(e.get("kind") == "format" for e in r["events"]),
        })
    return out


def _plots(runs: list[dict[str, Any]], out: Path) -> list[Path]:
    from matplotlib.figure import Figure
    paths = []

    def figure(title: str, ylabel: str, log: bool = False):
        fig = Figure(figsize=(7.5, 4.0), dpi=100)
        ax = fig.subplots()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if log:
            ax.set_yscale("log")
        return fig, ax

    def save(fig, ax, name: str) -> None:
        if ax.lines:
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / name, format="png")
            paths.append(out / name)

    ref = runs[0]
    for key, title in (("loss", "train loss"), ("val_loss", "validation loss")):
        fig, ax = figure(title, "loss")
        for r in runs:
            s = _series(r["rows"], key)
            if s:
                ax.plot(list(s), list(s.values()), marker="o" if key == "val_loss" else None,
                        label=f"{r['name']} ({r['precision']})")
        save(fig, ax, f"compare_{key}.png")
    fig, ax = figure(f"loss relative to {ref['name']}", "loss / reference - 1 (%)")
    rs = _series(ref["rows"], "loss")
    for r in runs[1:]:
        s = _series(r["rows"], "loss")
        common = sorted(set(s) & set(rs))
        if common:
            ax.plot(common, [100 * (s[c] / rs[c] - 1) for c in common], label=r["name"])
    ax.axhline(0, color="#888", lw=0.8)
    save(fig, ax, "compare_loss_relative.png")
    fig, ax = figure("skipped steps (cumulative)", "skipped")
    for r in runs:
        s = _series(r["rows"], "skipped_total")
        if s:
            ax.step(list(s), list(s.values()), where="post", label=r["name"])
    save(fig, ax, "compare_skipped.png")
    fig, ax = figure("loss scale", "scale", log=True)
    for r in runs:
        s = _series(r["rows"], "loss_scale")
        if s and any(v != 1 for v in s.values()):
            ax.plot(list(s), list(s.values()), label=r["name"])
    save(fig, ax, "compare_loss_scale.png")
    fig, ax = figure("Linear layers in FP8", "share of Linear layers (%)")
    for r in runs:
        if r["layers"]:
            n = len(r["layers"])
            share = [100 * sum(r["formats"][name][t].startswith("fp8") for name in r["layers"]) / n
                     for t in range(r["last"] + 1)]
            ax.step(range(r["last"] + 1), share, where="post", label=r["name"])
    save(fig, ax, "compare_fp8_share.png")
    return paths


def write_comparison(run_dirs: list[str | os.PathLike], out_dir: str | os.PathLike | None = None) -> Path:
    """Overlay ``run_dirs`` (the first is the reference) into ``out_dir`` (default
    ``<first run>/compare``); returns the HTML path."""
    runs = [load_run(Path(d)) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else runs[0]["dir"] / "compare"
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(runs, out)
    summary = compare_summary(runs)
    esc = html.escape

    head = "".join(f"<th>{esc(k)}</th>" for k in summary[0])
    body = "\n".join("<tr>" + "".join(f"<td>{_fmt(k, v)}</td>" for k, v in row.items()) + "</tr>"
                     for row in summary)
    figures = "\n".join(
        f'<figure><img alt="{esc(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode("ascii")}"><figcaption>{esc(p.stem)}</figcaption></figure>'
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
<p>Reference (differences are against it): <code>{esc(str(runs[0]['dir'].resolve()))}</code></p>
<table><tr>{head}</tr>
{body}
</table>
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
