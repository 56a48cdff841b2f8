"""A training run outlives its terminal.

When the reader of stdout or stderr goes away (``mixprec train ... 2>&1 | tee log``: Ctrl-C ends
``tee`` as well as the run), a plain ``print`` raises ``BrokenPipeError`` from wherever the run
happens to be, and the run ends before it saves the checkpoint the signal asked for. Under
:func:`outlive_readers` what the run prints after its reader left is dropped instead: the run
goes on, saves, and exits as the signal asks (130 for SIGINT). The run folder (``metrics.csv``,
``events.jsonl``, the checkpoint) keeps the record the terminal lost. A command that ends on its
own after its reader left exits as a shell tool killed by SIGPIPE would (:func:`reader_left`).
"""
from __future__ import annotations

import os
import sys
from typing import TextIO


class _ReaderMayLeave:
    """A text stream whose writes stop raising once its reader has gone."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.gone = True
        # Raw writes to the descriptor (the signal herald's announcement) and the interpreter's
        # last flush of what is still buffered go nowhere too, instead of raising again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def outlive_readers() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` drop, not raise, what is written after their
    reader left (idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ReaderMayLeave):
            setattr(sys, name, _ReaderMayLeave(stream))


def reader_left() -> bool:
    """Whether a stream :func:`outlive_readers` wrapped lost its reader."""
    return any(isinstance(s, _ReaderMayLeave) and s.gone for s in (sys.stdout, sys.stderr))
