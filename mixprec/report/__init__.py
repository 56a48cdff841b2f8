"""Offline reports of run folders: one run's plots and HTML page, several runs compared. Reads run
folders through :func:`mixprec.runs.read_run` only; ``mixprec report`` is :mod:`mixprec.cli.report`."""
from mixprec.report.compare import compare_summary, write_comparison
from mixprec.report.report import summarize, write_report

__all__ = ["write_report", "summarize", "write_comparison", "compare_summary"]
