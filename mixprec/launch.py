"""``python -m mixprec.launch``: torchrun, with torchrun's own arguments, that ends honestly.

Stopped by a signal (Ctrl-C, ``timeout -s INT``, a scheduler's SIGTERM), plain ``torchrun``
forwards it to its workers, which save a checkpoint and exit ``128 + N``, and then prints a
``SignalException`` traceback of its own and exits 1. When a worker fails (exit 3 for a diverged
run, 2 for bad input), it prints a ``ChildFailedError`` traceback and exits 1 as well. This
launcher runs the same launcher code (``torch.distributed.run``, nothing re-implemented) and
turns those two endings into one line and the status that happened::

    python -m mixprec.launch --nproc_per_node=2 -m mixprec train max_steps=1000

* stopped by signal N: one line, exit ``128 + N`` (130 for SIGINT, 143 for SIGTERM);
* a worker failed: torch's one-line-per-rank summary (no traceback) and the first failed rank's
  exit status (1 if it has none, e.g. it was killed);
* success: 0.

The workers see ``MIXPREC_LAUNCHER=mixprec.launch``, so the commands they print (resume hints)
name this launcher. Everything else (rendezvous, restarts, multi-node) is torchrun's, unchanged.
"""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["main", "LAUNCHER_ENV"]

LAUNCHER_ENV = "MIXPREC_LAUNCHER"


def _failure_code(error) -> int:
    """The exit status of the first failed rank (by global rank); 1 when it has none."""
    for _, failure in sorted(getattr(error, "failures", {}).items()):
        code = getattr(failure, "exitcode", None)
        if isinstance(code, int) and 0 < code < 256:
            return code
        if isinstance(code, int) and code < 0:       # killed by a signal: the shell's 128 + N
            return 128 - code
    return 1


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ[LAUNCHER_ENV] = "mixprec.launch"         # the workers' hints name this launcher
    try:
        torchrun.run(args)
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        print(f"mixprec.launch: stopped by {sig.name}; the workers were sent {sig.name} and have "
              f"ended (their lines above say what they saved); exit {128 + sig.value}",
              file=sys.stderr)
        return 128 + sig.value
    except ChildFailedError as e:
        code = _failure_code(e)
        ranks = ", ".join(f"rank {r}: exit {getattr(f, 'exitcode', '?')}"
                          for r, f in sorted(e.failures.items()))
        print(f"mixprec.launch: {e.name} failed ({ranks}); their messages are above; exit {code}",
              file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
