"""``mixprec report RUN_DIR [RUN_DIR ...]``: the report of one run folder, or several overlaid
(:mod:`mixprec.report`)."""
from __future__ import annotations

import argparse
import errno
from pathlib import Path

from mixprec.errors import DataError
from mixprec.report.compare import compare_notes, compare_summary, load_run, write_comparison
from mixprec.report.report import formats_over_run, guard_summary, write_report
from mixprec.runs.read import format_counts, layer_formats_over_run
from mixprec.runs.metrics import read_events

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec report``."""
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                        help="the run folder `mixprec train` printed; several: one page overlaying "
                             "them (the first is the reference)")
    parser.add_argument("-o", "--out", metavar="OUT", default=None,
                        help="folder for the PNGs and report.html (default: RUN_DIR/report, or "
                             "FIRST_RUN/compare for several runs)")


def run(args: argparse.Namespace) -> int:
    """Write the report (or, for several runs, the comparison) and print where it is."""
    try:
        if len(args.run_dir) > 1:
            return _compare(args)
        html_path = write_report(args.run_dir[0], args.out)
        events = read_events(Path(args.run_dir[0]))
        guard = guard_summary(events)
        if guard != "-":
            print(f"guard: {guard}")                # what guarded training did (guard=true)
        start, end = layer_formats_over_run(events)
        if start != end:                            # what ran is not what the run started with
            last = max((int(e.get("step") or 0) for e in events), default=0)
            print(f"layer formats: {format_counts(start)} at the start, {format_counts(end)} at the "
                  f"end; over the run {formats_over_run(events, last)}")
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC):
            raise
        where = args.out or Path(args.run_dir[0]) / "report"
        raise DataError(f"cannot write the report into {where} ({e.strerror}); write it elsewhere "
                        "with --out DIR") from None
    print(f"report: {html_path}")
    print(f"plots:  {html_path.parent}/*.png")
    return 0


def _compare(args: argparse.Namespace) -> int:
    """``mixprec report RUN_A RUN_B ...``: the overlay page and a summary table."""
    html_path = write_comparison(args.run_dir, args.out)
    runs = [load_run(Path(d)) for d in args.run_dir]
    rows = compare_summary(runs)
    keys = list(rows[0])
    # The table shows what ran by its label (Precision.recipe.label; its whole description is listed
    # under it), with columns aligned, so three runs read at a glance.
    cells = [["-" if r[k] is None else f"{r[k]:+.2f}" if k.endswith("(%)") else
              f"{r[k]:.4g}" if isinstance(r[k], float) else
              str(r[k]).split(" (", 1)[0] if k == "precision" else str(r[k]) for k in keys]
             for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print(" | ".join(k.ljust(w) for k, w in zip(keys, widths)).rstrip())
    for c in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    for note in compare_notes(runs):
        print(f"note: {note}")
    print("precision of each run:")
    for r in runs:
        print(f"  {r['name']}: {r['precision']}")
    print(f"comparison: {html_path}")
    print(f"plots:      {html_path.parent}/compare_*.png")
    return 0
