"""The run folder: where a run writes its config, metrics, events and checkpoints.

A new run never writes into a folder that already holds something: that would truncate the old
run's metrics and move its ``latest`` checkpoint pointer. It is refused with the ways out that
work (resume it, or ``overwrite=true``; hints in the caller's own syntax, mixprec/hints.py).
Default folder names cannot collide: the folder is created atomically and a ``-2``, ``-3``, ...
suffix is added when the name is taken (two runs started in the same second). The run that
claims a folder holds its lock (mixprec/runs/lock.py) until it ends: one folder, one writer.
"""
from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from mixprec import hints
from mixprec.errors import ConfigError
from mixprec.runs.lock import LOCK_FILE, RunLock

__all__ = ["claim_run_dir", "claim_locked_run_dir", "default_run_dir_name", "holds_a_run"]


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
    """Whether the folder holds anything but its lock file."""
    return path.is_dir() and any(child.name != LOCK_FILE for child in path.iterdir())


def claim_run_dir(run_dir: str | Path | None, *, precision: str, resume: bool,
                  overwrite: bool, root: Path = Path("runs"), ways_out: str | None = None) -> Path:
    """:func:`claim_locked_run_dir` for a caller that does not keep the lock."""
    path, lock = claim_locked_run_dir(run_dir, precision=precision, resume=resume,
                                      overwrite=overwrite, root=root, ways_out=ways_out)
    lock.release()
    return path


def claim_locked_run_dir(run_dir: str | Path | None, *, precision: str, resume: bool,
                         overwrite: bool, root: Path = Path("runs"),
                         ways_out: str | None = None) -> tuple[Path, RunLock]:
    """Create (or check) the run folder for a run and take its lock; called on the main rank only.

    The lock comes before anything is deleted (``overwrite``) or continued (``resume``): a live
    run's folder is refused, naming the process that writes it. ``ways_out``: what a caller that
    is neither ``fit()`` nor the command line (a framework's callback) tells its user instead."""
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
    if holds_a_run(path) and not overwrite:
        lock = RunLock.acquire(path)          # a live run's folder: say whose it is
        lock.release()
        raise ConfigError(f"run folder {path} already holds a run; " + (ways_out or (
            f"continue it with `{hints.resume(path)}`, choose another run_dir, or pass "
            f"{hints.overwrite()} to delete it and start over")))
    lock = RunLock.acquire(_writable(path))
    if overwrite:
        for child in path.iterdir():   # the user asked for it: remove the old run's files
            if child.name == LOCK_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    return path, lock
