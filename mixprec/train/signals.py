"""Stopping a run without losing work, and exiting with the code a shell expects.

Inside a training loop the first Ctrl-C (SIGINT) or SIGTERM (what schedulers send) asks the loop
to finish the current step, write a checkpoint and stop; a second one aborts at once. Outside a
loop (building the model, reading data) there is nothing to save, so the first one aborts. The
exit status is the shell's ``128 + N``: 130 for SIGINT, 143 for SIGTERM (:func:`exit_code`).

One state machine per process, so that no moment is left where a signal meets Python's or the
operating system's default handler (which would kill the process by the signal, mid-save or
mid-exit)::

    loop, nothing asked  --signal-->  stop requested (announced; the loop saves, then stops)
    stop requested       --signal-->  Aborted raised (once)
    no loop              --signal-->  Aborted raised (once)
    Aborted raised, or ending     -->  later signals change nothing: the process is already ending

The first stop request is announced the moment the signal arrives, even while the main thread
sits in one long kernel (a first step at ``seq_len=100000`` can take minutes, and Python runs its
signal handlers only between bytecodes): the outermost context points the interpreter's wakeup
file descriptor (:func:`signal.set_wakeup_fd`, written by the C-level handler at once) at a pipe
that a small thread reads. The stop itself still waits for the step to finish.

``StopRequest`` contexts nest: the outermost one installs the handlers and, on exit, puts the
previous ones back; inner ones (the trainer's loop inside ``mixprec train``'s own) share its
state. With ``hold=True`` (the command line, which owns its process) the outermost one leaves
both signals ignored after a signal was seen, so interpreter shutdown cannot be killed by the
next one either.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType

__all__ = ["StopRequest", "Aborted", "exit_code", "SIGNALS"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The exit status of a process ended by signal ``signum``: ``128 + signum`` (130 for SIGINT,
    143 for SIGTERM), as shells, Slurm and Kubernetes read it."""
    return 128 + int(signum)


class Aborted(KeyboardInterrupt):
    """Stop now, without saving: a second signal in a training loop, or one outside any loop.

    A ``KeyboardInterrupt`` (code that handles Ctrl-C handles it), carrying the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopRequest:
    """``with StopRequest(announce=...) as stop:`` ... ``if stop.requested: ...``.

    Args:
        announce: print one line when the first signal asks the loop to stop (rank 0 only).
        loop: True for a training loop (the first signal asks to stop); False for a context
            where the first signal aborts at once (the command line around everything).
        hold: on leaving the outermost context after a signal was seen, ignore both signals
            instead of putting the previous handlers back (for a process that is about to end).

    Handlers are installed only in the main thread (Python delivers signals there); elsewhere
    the context does nothing and ``requested`` stays False.
    """

    _root: "StopRequest | None" = None      # the outermost active context of this process

    def __init__(self, *, announce: bool = True, loop: bool = True, hold: bool = False) -> None:
        self.announce = announce
        self.loop = loop
        self.hold = hold
        self.signum: int | None = None        # the signal that asked this loop to stop
        self.aborted_by: int | None = None    # the signal that raised Aborted (outermost only)
        self.ending = False
        """Outermost only: the process is ending (its checkpoint written, or its exit code decided),
        so later signals change nothing. Set it with an attribute store where even a call is a
        moment too long (Python runs signal handlers at calls); elsewhere call :meth:`end`."""
        self.signals_seen = 0                 # outermost only
        self._previous: dict[int, object] = {}
        self._loops: list[StopRequest] = []    # outermost only: the active loop contexts
        self._owner: StopRequest | None = None
        self._announced = threading.Lock()     # outermost only: taken by whoever announces first
        self._wakeup: tuple[int, int] | None = None   # outermost only: the herald's pipe

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def end(self) -> None:
        """The run is ending (its checkpoint is written): later signals change nothing."""
        (self._owner or self).ending = True

    # ------------------------------------------------------------------ the handler

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals_seen += 1
        if self.ending:
            return
        loop = self._loops[-1] if self._loops else None
        if loop is not None and loop.signum is None:
            loop.signum = signum                  # the first one: finish the step, save, stop
            if loop.announce and self._announced.acquire(blocking=False):   # not yet by the herald
                print(_stop_line(signum), file=sys.stderr, flush=True)
            return
        self.ending = True                        # from now on the process is only ending
        self.aborted_by = signum
        raise Aborted(signum)

    # ------------------------------------------------------------------ nesting

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            return self
        root = StopRequest._root
        if root is None:
            StopRequest._root = root = self
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            self._start_herald()
        else:
            self._owner = root
        if self.loop:
            root._loops.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        root = self._owner or self
        if self in root._loops:
            root._loops.remove(self)
        if self._owner is not None or StopRequest._root is not self:
            return
        seen = self.signals_seen > 0
        for s, previous in self._previous.items():
            # Leaving the handler in place until the new one is set: no gap between the two.
            signal.signal(s, signal.SIG_IGN if (self.hold and seen) else previous)  # type: ignore[arg-type]
        self._previous = {}
        self._stop_herald()
        StopRequest._root = None

    # ------------------------------------------------------------------ the herald

    def _start_herald(self) -> None:
        """Point the wakeup fd at a pipe read by a daemon thread (unless someone else, an asyncio
        loop say, already uses it: then the handler alone announces, when Python runs it)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return
        self._wakeup = (r, w)
        threading.Thread(target=self._herald, args=(r,), name="mixprec-stop-herald", daemon=True).start()

    def _stop_herald(self) -> None:
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(-1)
        os.close(self._wakeup[1])        # the thread reads end-of-file, closes its end and ends
        self._wakeup = None

    def _herald(self, r: int) -> None:
        """Announce the first stop request as soon as its signal arrives (the handler's line,
        once: whichever of the two comes first says it)."""
        try:
            while data := os.read(r, 64):
                for signum in data:
                    loop = self._loops[-1] if self._loops else None
                    if (signum not in SIGNALS or self.ending or loop is None or not loop.announce
                            or not self._announced.acquire(blocking=False)):
                        continue
                    os.write(ANNOUNCE_FD, (_stop_line(signum) + "\n").encode())
        except OSError:
            pass
        finally:
            os.close(r)


ANNOUNCE_FD = 2
"""Where the herald thread writes its line: stderr's file descriptor (a raw write, no lock that
the interrupted main thread might hold)."""


def _stop_line(signum: int) -> str:
    return (f"\n[mixprec] {signal.Signals(signum).name}: finishing this step and saving a checkpoint; "
            "press Ctrl-C again to abort at once")
