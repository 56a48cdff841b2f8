"""Stopping a run without losing work: the first Ctrl-C (SIGINT) or SIGTERM (what schedulers
send) asks the loop to finish the current step, write a checkpoint and exit; a second one aborts
at once."""
from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType

__all__ = ["StopRequest"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """``with StopRequest(announce=...) as stop:`` ... ``if stop.requested: ...``.

    Handlers are installed only in the main thread (Python delivers signals there) and the
    previous handlers come back on exit.
    """

    def __init__(self, *, announce: bool = True) -> None:
        self.signum: int | None = None
        self.announce = announce
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:       # the second one: stop now
            self._restore()
            raise KeyboardInterrupt
        self.signum = signum
        if self.announce:
            print(f"\n[mixprec] {signal.Signals(signum).name}: finishing this step and saving a "
                  "checkpoint; press Ctrl-C again to abort at once", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous = {}

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._restore()
