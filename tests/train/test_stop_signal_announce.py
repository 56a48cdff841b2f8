"""The first Ctrl-C is announced at once, even while the main thread is stuck in one long native
call (a minutes-long first step at a huge seq_len), before Python can run its signal handler."""
from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

import pytest

from mixprec.train import signals
from mixprec.train.signals import StopRequest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and libc")


def _in_futex_wait(tid: int) -> bool:
    """The thread sleeps in a futex (syscall 202 on x86-64, 98 on aarch64): the native lock."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            return f.read().split()[0] in ("202", "98")
    except (OSError, IndexError):
        return False


def test_the_first_sigint_is_announced_while_the_main_thread_is_inside_a_native_call(monkeypatch):
    libc = ctypes.CDLL(None, use_errno=True)
    mutex = ctypes.create_string_buffer(64)            # zeroed: PTHREAD_MUTEX_INITIALIZER
    read_end, write_end = os.pipe()
    monkeypatch.setattr(signals, "ANNOUNCE_FD", write_end)
    main_tid = threading.get_native_id()
    locked, seen = threading.Event(), []

    def signal_then_release():
        libc.pthread_mutex_lock(mutex)
        locked.set()
        try:
            for _ in range(2000):                      # wait until main blocks on the mutex
                if _in_futex_wait(main_tid):
                    break
                threading.Event().wait(0.005)
            os.kill(os.getpid(), signal.SIGINT)
            ready, _, _ = select.select([read_end], [], [], 20.0)
            if ready:
                seen.append(os.read(read_end, 4096).decode())
                seen.append(loop.signum)               # the Python handler has not run yet
        finally:
            libc.pthread_mutex_unlock(mutex)

    with StopRequest(announce=True) as loop:
        helper = threading.Thread(target=signal_then_release)
        helper.start()
        locked.wait(10)
        libc.pthread_mutex_lock(mutex)                 # a native call: no Python handler runs
        libc.pthread_mutex_unlock(mutex)
        helper.join(30)
        assert loop.requested and loop.name == "SIGINT"   # the handler ran afterwards
    os.close(read_end)
    os.close(write_end)
    assert seen and "SIGINT: finishing this step and saving a checkpoint" in seen[0]
    assert seen[1] is None


def test_the_announcement_is_made_once_when_the_handler_runs_first(capsys, monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setattr(signals, "ANNOUNCE_FD", write_end)
    before = signal.getsignal(signal.SIGINT)
    # Heralds of earlier tests' StopRequests may still be winding down: count this one's only.
    earlier = {t.ident for t in threading.enumerate() if t.name == "mixprec-stop-herald"}
    with StopRequest(announce=True) as loop:
        os.kill(os.getpid(), signal.SIGINT)           # handled at the next bytecode
        heralds = [t for t in threading.enumerate()
                   if t.name == "mixprec-stop-herald" and t.ident not in earlier]
    for t in heralds:                                  # the pipe closed: the thread ends
        t.join(10)
    os.close(write_end)
    herald_said = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert loop.requested and len(heralds) == 1
    said = capsys.readouterr().err + herald_said
    assert said.count("SIGINT: finishing this step") == 1
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1             # the wakeup fd is handed back
