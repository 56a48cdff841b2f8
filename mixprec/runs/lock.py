"""One run folder, one writer: an OS advisory lock on ``RUN_DIR/.lock``.

The process that trains into a folder (rank 0 of a distributed job; the other ranks write
nothing there) holds ``fcntl.flock(LOCK_EX)`` on the folder's ``.lock`` file until its run ends.
A second writer (``mixprec train --resume SAME`` twice, ``fit()`` into a folder a running job
writes, ``overwrite=true`` on a live run) is refused in one line naming the pid and host that
hold it. The lock belongs to the open file, so the kernel drops it when the process ends in any
way (``kill -9`` included): no stale lock is ever left to clean up. The file itself stays (it
names the last holder) and means nothing once no process holds it.

On a network file system ``flock`` is only as good as the server's lock support (NFSv4 and
Lustre honour it; some FUSE mounts do not): two jobs on different machines writing one folder
are then not caught.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from mixprec.errors import ConfigError

__all__ = ["RunLock", "LOCK_FILE"]

LOCK_FILE = ".lock"


class RunLock:
    """``RunLock.acquire(run_dir)`` holds the folder's lock until :meth:`release` (or exit)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike) -> "RunLock":
        path = Path(run_dir) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot create the lock file {path} ({e.strerror or e}); choose a "
                              "writable run_dir=PATH") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"run folder {path.parent} is in use by {holder or 'another process'}"
                                  "; one run folder has one writer: wait for that run to end (or "
                                  "stop it), or choose another run_dir") from None
            raise ConfigError(f"cannot lock the run folder {path.parent} ({e.strerror or e}); its "
                              "file system may not support locks: choose a local run_dir") from None
        # Ours now: say who holds it, for the message a second writer reads.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)          # closing the file drops the flock

    def __del__(self) -> None:   # a lock that is no longer referenced is no longer held
        self.release()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
