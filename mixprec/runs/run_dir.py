"""The run folder: where a run writes its config, metrics, events and checkpoints.

A new run never writes into a folder that already holds something: that would truncate the old
run's metrics and move its ``latest`` checkpoint pointer. It is refused with the two ways out
(``--resume`` it, or ``overwrite=true``). Default folder names cannot collide: the folder is
created atomically and a ``-2``, ``-3``, ... suffix is added when the name is taken (two runs
started in the same second).
"""
from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from mixprec.errors import ConfigError

__all__ = ["claim_run_dir", "default_run_dir_name"]


def default_run_dir_name(precision: str) -> str:
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{precision}"


def _writable(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run folder {path} ({e.strerror or e}); choose a "
                          "writable place with run_dir=PATH") from None
    return path


def claim_run_dir(run_dir: str | Path | None, *, precision: str, resume: bool,
                  overwrite: bool, root: Path = Path("runs")) -> Path:
    """Create (or check) the run folder for a run; called on the main rank only."""
    if run_dir is None:
        root = _writable(root)
        base = default_run_dir_name(precision)
        for n in range(1, 10_000):
            path = root / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir()            # atomic: exactly one run gets each name
                return path
            except FileExistsError:
                continue
        raise ConfigError(f"no free run folder name under {root}; pass run_dir=PATH")
    path = Path(run_dir)
    if resume:
        return path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} is a file; pass a folder")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"run folder {path} already holds a run; continue it with `mixprec train --resume "
                f"{path}`, choose another run_dir, or pass overwrite=true to delete it and start over")
        for child in path.iterdir():   # the user asked for it: remove the old run's files
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    return _writable(path)
