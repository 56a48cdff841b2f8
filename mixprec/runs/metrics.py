"""What a run writes while it trains: ``metrics.csv``, ``numerics.csv``, ``events.jsonl``, ``tb/``.

The column orders are fixed by docs/CONTRACTS.md so ``mixprec report``, spreadsheets and other
runs can read any run folder. Every row is flushed as it is written: a run killed with SIGKILL
keeps every row it logged (the OS holds flushed data even when the process dies).

Resuming: a run that resumes from the checkpoint at step S may already have logged rows past S
before it was killed. Those rows describe steps that will be trained again, so
``MetricsLogger(..., resume_step=S)`` drops rows with ``step > S`` from all three files and
purges TensorBoard events from step S+1 on; the files then read as one consistent run.

Only the main process writes (``enabled=False`` on other ranks writes and creates nothing).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mixprec.errors import closest
from mixprec.runs.owned import TB_DIR

__all__ = [
    "METRICS_COLUMNS",
    "NUMERICS_COLUMNS",
    "MetricsLogger",
    "read_metrics",
    "read_numerics",
    "read_events",
]

METRICS_COLUMNS: tuple[str, ...] = (
    "step", "epoch", "loss", "val_loss", "lr", "loss_scale", "skipped", "skipped_total",
    "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb", "time_s", "steps", "eval_s",
)
"""``loss`` (their mean), ``tokens_per_s``, ``mfu`` and ``time_s`` (seconds) cover the row's
``steps`` training steps: the ones since the previous row, fewer than the log interval after a
resume from mid-interval; ``skipped`` counts the skipped steps among them (``skipped_total``: the
run's so far). ``lr``, ``loss_scale``, ``grad_norm`` are the row's last step's. An
evaluation's seconds are ``eval_s``, kept out of ``time_s``, ``tokens_per_s`` and ``mfu``."""
# The monitor defines what a per-layer statistics row holds; the logger writes it as is.
from mixprec.monitor.stats import NUMERICS_COLUMNS  # noqa: E402
NUMERICS_KINDS = ("act", "grad", "update")
_INT_COLUMNS = {"step", "skipped", "skipped_total", "steps"}
_TEXT_COLUMNS = {"module", "kind", "dtype"}

METRICS_FILE = "metrics.csv"
NUMERICS_FILE = "numerics.csv"
EVENTS_FILE = "events.jsonl"


def _scalar(value: Any) -> Any:
    """Python scalar from a tensor / numpy scalar (a host sync for device tensors: log sparingly)."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def _cell(value: Any) -> str:
    value = _scalar(value)
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)  # shortest text that reads back as the same float (incl. nan, inf)
    return str(value)


def _parse(column: str, text: str) -> Any:
    if text == "":
        return None
    if column in _TEXT_COLUMNS:
        return text
    number = float(text)
    if column in _INT_COLUMNS or (column == "epoch" and number.is_integer()):
        return int(number)
    return number


def _as_mapping(row: Any) -> Mapping[str, Any]:
    if isinstance(row, Mapping):
        return row
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    raise TypeError(f"numerics rows must be mappings or dataclasses, got {type(row).__name__}")


def _check_keys(keys: Iterable[str], allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} column {unknown[0]!r}{closest(unknown[0], allowed)}; "
                         f"valid: {', '.join(allowed)}")


def _step_at_most(text: str | None, max_step: int) -> bool:
    try:
        return float(text) <= max_step
    except (TypeError, ValueError):
        return False  # blank or cut-off row


def _rewrite_csv_upto(path: Path, columns: tuple[str, ...], max_step: int) -> None:
    """Keep rows with step <= max_step under the current header (atomic replace)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if _step_at_most(r.get("step"), max_step)]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: r.get(c) or "" for c in columns} for r in rows)
    os.replace(tmp, path)


def _rewrite_events_upto(path: Path, max_step: int) -> None:
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line).get("step")
        except ValueError:
            continue  # a line cut short by a kill: drop it
        if not isinstance(step, (int, float)) or step <= max_step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Append-only writer for a run folder's metrics, numerics and events (and TensorBoard).

    ``resume_step=None`` starts the files afresh; ``resume_step=S`` keeps what was logged up to
    step S and appends after it. ``tensorboard=False`` (or tensorboard missing) writes CSV only.
    """

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.resume_step = resume_step
        self._files: dict[str, Any] = {}
        self._writers: dict[str, csv.writer] = {}
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._open_csv(METRICS_FILE, METRICS_COLUMNS)
        self._open_csv(NUMERICS_FILE, NUMERICS_COLUMNS)
        events = self.run_dir / EVENTS_FILE
        if resume_step is not None and events.exists():
            _rewrite_events_upto(events, resume_step)
        self._files[EVENTS_FILE] = open(events, "a" if resume_step is not None else "w", encoding="utf-8")
        if tensorboard:
            self._tb = self._open_tensorboard()

    # -- files -------------------------------------------------------------------------------

    def _open_csv(self, name: str, columns: tuple[str, ...]) -> None:
        path = self.run_dir / name
        resuming = self.resume_step is not None and path.exists() and path.stat().st_size > 0
        if resuming:
            _rewrite_csv_upto(path, columns, self.resume_step)
        f = open(path, "a" if resuming else "w", newline="", encoding="utf-8")
        writer = csv.writer(f)
        if not resuming:
            writer.writerow(columns)
            f.flush()
        self._files[name] = f
        self._writers[name] = writer

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is a dependency, but keep CSV logging alive
            warnings.warn(f"TensorBoard logging disabled ({exc}); metrics.csv is still written",
                          stacklevel=3)
            return None
        purge = None if self.resume_step is None else self.resume_step + 1
        folder = self.run_dir / TB_DIR
        before = _event_files(folder)
        writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        # TensorBoard reads a folder's event files in name order, and the purge at the resumed
        # step works only if this file comes after the earlier ones. A name is
        # "<second>.<host>.<pid>.<writer count in this process>": two writers of one process in
        # the same second sort by that count as text, so a 10th writer sorts before a 9th (the
        # earlier rows were then purged instead). Such a file is dropped and made again in the
        # next second, whose name sorts after.
        new = _event_files(folder) - before
        if before and new and min(new) < max(before):
            writer.close()
            for name in new:
                (folder / name).unlink(missing_ok=True)
            now = time.time()
            time.sleep(math.floor(now) + 1.0 - now)
            writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        return writer

    # -- logging -----------------------------------------------------------------------------

    def log(self, step: int, **values: Any) -> None:
        """Append one ``metrics.csv`` row; columns not given stay empty (not measured this row).

        Values may be Python numbers, bools or 0-d tensors (each tensor costs a host sync).
        """
        _check_keys(values, METRICS_COLUMNS[1:], "metrics")
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _scalar(v) for k, v in values.items()}}
        self._writers[METRICS_FILE].writerow([_cell(row.get(c)) for c in METRICS_COLUMNS])
        self._files[METRICS_FILE].flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(_tb_tag(key), float(value), global_step=int(step))

    def log_numerics(self, rows: Iterable[Mapping[str, Any] | Any]) -> None:
        """Append per-layer statistics rows (mappings or dataclasses with NUMERICS_COLUMNS keys)."""
        prepared = []
        for row in rows:
            row = _as_mapping(row)
            _check_keys(row, NUMERICS_COLUMNS, "numerics")
            if row.get("kind") not in NUMERICS_KINDS:
                raise ValueError(f"numerics kind must be one of {', '.join(NUMERICS_KINDS)}, got {row.get('kind')!r}")
            if row.get("step") is None or not row.get("module"):
                raise ValueError("every numerics row needs a step and a module name")
            prepared.append([_cell(_dtype_name(row.get(c)) if c == "dtype" else row.get(c))
                             for c in NUMERICS_COLUMNS])
        if not self.enabled or not prepared:
            return
        self._writers[NUMERICS_FILE].writerows(prepared)
        self._files[NUMERICS_FILE].flush()

    def event(self, event: Mapping[str, Any]) -> None:
        """Append one JSON object to ``events.jsonl``; it needs a human ``message``.

        A ``time`` (unix seconds) is added when missing; tensors become numbers, other
        non-JSON values their ``str``.
        """
        if not isinstance(event.get("message"), str) or not event["message"]:
            raise ValueError("an event needs a non-empty 'message' string saying what happened")
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **event}
        line = json.dumps(record, default=_json_default, allow_nan=True)
        f = self._files[EVENTS_FILE]
        f.write(line + "\n")
        f.flush()

    def close(self) -> None:
        """Flush and close every file; safe to call twice."""
        for f in self._files.values():
            if not f.closed:
                f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_files(folder: Path) -> set[str]:
    """Names of the TensorBoard event files in ``folder``."""
    return {p.name for p in folder.glob("*tfevents*")} if folder.is_dir() else set()


def _tb_tag(key: str) -> str:
    """Group TensorBoard charts: both losses on one panel group, the rest under train/."""
    if key in ("loss", "val_loss"):
        return f"loss/{'val' if key == 'val_loss' else 'train'}"
    return f"train/{key}"


def _dtype_name(value: Any) -> Any:
    return str(value).removeprefix("torch.") if value is not None and not isinstance(value, str) else value


def _json_default(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    return str(value)


# ---------------------------------------------------------------------------------------------
# Reading a run folder back
# ---------------------------------------------------------------------------------------------

def _read_csv(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = []
        for raw in csv.DictReader(f):
            if raw.get("step") in (None, ""):
                continue  # a row cut short by a kill
            try:
                rows.append({k: _parse(k, v or "") for k, v in raw.items() if k is not None})
            except ValueError:
                continue
        return rows


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of ``metrics.csv`` as dicts: step/skipped counts as ints, the rest floats, blanks None."""
    return _read_csv(Path(run_dir) / METRICS_FILE)


def read_numerics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of ``numerics.csv`` (module, kind and dtype as strings); [] when absent."""
    return _read_csv(Path(run_dir) / NUMERICS_FILE)


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Objects of ``events.jsonl`` in order; unreadable (cut-off) lines are skipped."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            events.append(obj)
    return events


def is_finite_number(value: Any) -> bool:
    """True for a real, finite number (what a plot can draw)."""
    return isinstance(value, (int, float)) and math.isfinite(value)
