"""Drive ``gated_worker.py`` (``mixprec train`` with gates) from a test, by events.

Every wait is for a line the worker prints (a gate it reached, the announcement of a signal), read
by a thread into a queue: events, not sleeps. ``EVENT_BOUND_S`` only bounds a wait that would
otherwise hang forever; a loaded machine makes the events later, never different.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "gated_worker.py"
EVENT_BOUND_S = 240


class GatedRun:
    """``GatedRun(gates, *settings, launcher=())``: start the worker (under ``launcher``, e.g.
    torchrun's arguments); its stdout and stderr are one stream of lines (unless ``stderr`` says
    otherwise)."""

    def __init__(self, gates: str, *settings: str, launcher: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, stderr: int = subprocess.STDOUT) -> None:
        env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, *launcher, str(WORKER), gates, *settings],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=stderr, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.pending: list[str] = []        # further events found in a line already returned
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str) -> str:
        """Block until a line containing ``text`` arrives; return it from ``text`` on. Two
        processes writing one pipe can run their lines together: each occurrence of ``text`` is
        one event, and a later call returns the next one from the same line."""
        for i, event in enumerate(self.pending):
            if event.startswith(text):
                return self.pending.pop(i)
        while True:
            try:
                line = self.lines.get(timeout=EVENT_BOUND_S)
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {EVENT_BOUND_S} s:\n" + "".join(self.seen[-30:]))
            if line is None:
                raise AssertionError(f"the worker ended before {text!r}:\n" + "".join(self.seen[-30:]))
            self.seen.append(line)
            if text in line:
                first, *more = [text + part for part in line.split(text)[1:]]
                self.pending.extend(more)
                return first

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def release(self) -> None:
        """Let a worker waiting at a gate go on."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[int | None, str]:
        """Wait for the end; ``(exit code, everything it printed)``; a hang is killed (code None)."""
        try:
            code = self.proc.wait(timeout=EVENT_BOUND_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        while (line := self.lines.get(timeout=EVENT_BOUND_S)) is not None:
            self.seen.append(line)
        return code, "".join(self.seen)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
