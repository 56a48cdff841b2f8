"""The run folder: where a run writes its config, metrics, events and checkpoints.

A new run never writes into a folder that already holds something: that would truncate the old
run's metrics and move its ``latest`` checkpoint pointer. It is refused with the ways out that
work (resume it, or ``overwrite=true``; hints in the caller's own syntax, mixprec/hints.py).
A folder *is* a run only when it holds a run's own files (:data:`RUN_MARKERS`); ``overwrite``
deletes only the files a run writes (:mod:`mixprec.runs.owned`, at any depth), and refuses in one
line a folder that holds anything else (a project folder with ``train.py`` and ``.git``, a run
folder where the user kept notes, a file of yours in ``checkpoints/``): mixprec never deletes a
file it did not write.
Default folder names cannot collide: the folder is created atomically and a ``-2``, ``-3``, ...
suffix is added when the name is taken (two runs started in the same second). The run that
claims a folder holds its lock (mixprec/runs/lock.py) until it ends: one folder, one writer.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from mixprec import hints
from mixprec.errors import ConfigError
from mixprec.runs import owned as _owned
from mixprec.runs.lock import LOCK_FILE, RunLock

__all__ = ["claim_run_dir", "claim_locked_run_dir", "deleted_note", "default_run_dir_name", "holds_a_run",
           "RUN_MARKERS"]

RUN_MARKERS = frozenset({"config.toml", "metrics.csv", "events.jsonl", "checkpoints"})
"""Entries only a run writes at its start or first save: one of them makes a folder a run."""


def default_run_dir_name(precision: str) -> str:
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{precision}"


def _writable(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run folder {path} ({e.strerror or e}); choose a "
                          "writable place with run_dir=PATH") from None
    return path


def holds_a_run(path: Path) -> bool:
    """Whether the folder holds a run: one of the files only a run writes (:data:`RUN_MARKERS`)."""
    return path.is_dir() and any((path / name).exists() for name in RUN_MARKERS)


def _scan(path: Path) -> tuple[list[Path], list[str]]:
    """The run's files in the folder, and what no run wrote (``.git/``, ``train.py``,
    ``checkpoints/best.pt``, ...), sorted: :func:`mixprec.runs.owned.scan`."""
    if not path.is_dir():
        return [], []
    return _owned.scan(path)


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def claim_run_dir(run_dir: str | Path | None, *, precision: str, resume: bool,
                  overwrite: bool, root: Path = Path("runs"), ways_out: str | None = None,
                  deleted: list[str] | None = None) -> Path:
    """:func:`claim_locked_run_dir` for a caller that does not keep the lock."""
    path, lock = claim_locked_run_dir(run_dir, precision=precision, resume=resume,
                                      overwrite=overwrite, root=root, ways_out=ways_out,
                                      deleted=deleted)
    lock.release()
    return path


def claim_locked_run_dir(run_dir: str | Path | None, *, precision: str, resume: bool,
                         overwrite: bool, root: Path = Path("runs"),
                         ways_out: str | None = None,
                         deleted: list[str] | None = None) -> tuple[Path, RunLock]:
    """Create (or check) the run folder for a run and take its lock; called on the main rank only.

    The lock comes before anything is deleted (``overwrite``) or continued (``resume``): a live
    run's folder is refused, naming the process that writes it. ``ways_out``: what a caller that
    is neither ``fit()`` nor the command line (a framework's callback) tells its user instead.
    ``deleted``: a list that gets the names of the old run's entries ``overwrite`` removed, for the
    caller to say (:func:`deleted_note`)."""
    if run_dir is None:
        root = _writable(root)
        base = default_run_dir_name(precision)
        for n in range(1, 10_000):
            path = root / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir()            # atomic: exactly one run gets each name
                return path, RunLock.acquire(path)
            except FileExistsError:
                continue
        raise ConfigError(f"no free run folder name under {root}; pass run_dir=PATH")
    path = Path(run_dir)
    if resume:
        return path, RunLock.acquire(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} is a file; pass a folder")
    run = holds_a_run(path)
    files, foreign = _scan(path)
    if foreign:
        # Not mixprec's to delete or to mix a run into: refused whatever overwrite says.
        what = ("holds a run and also " if run else
                "is not empty and holds no run: it has ")
        raise ConfigError(
            f"run folder {path} {what}{_listing(foreign)}; mixprec writes a run only into a new "
            "or empty folder (or a run's own) and never deletes what it did not write: choose "
            "another run_dir" + (" or move those files out" if run else ""))
    if run and not overwrite:
        lock = RunLock.acquire(path)          # a live run's folder: say whose it is
        lock.release()
        raise ConfigError(f"run folder {path} already holds a run; " + (ways_out or (
            f"continue it with `{hints.resume(path)}`, choose another run_dir, or pass "
            f"{hints.overwrite()} to delete it and start over")))
    lock = RunLock.acquire(_writable(path))
    if overwrite:                      # the user asked for it: remove the old run's files
        old = [f for f in files if f != path / LOCK_FILE]
        _owned.remove(path, old)
        if deleted is not None:
            deleted.extend(sorted({f.relative_to(path).parts[0] for f in old}))
    return path, lock


def deleted_note(path: str | Path, deleted: list[str]) -> str:
    """The line that says what ``overwrite`` removed (empty when nothing was)."""
    if not deleted:
        return ""
    return f"overwrite: deleted the old run in {path} ({_listing(sorted(deleted), limit=6)})"
