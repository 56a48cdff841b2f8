"""`mixprec train` with gates, so a test can send signals at chosen points without sleeping.

    python gated_worker.py GATES KEY=VALUE...

``GATES`` is a comma-separated list of ``setup`` (before the run is built), ``step:N`` (before
step N computes anything), ``save`` (in the middle of writing a checkpoint, after its weights
file is written) and ``exit`` (after the command returned, before the process exits). At a gate
the worker prints ``GATE <name>`` on stdout and waits for one line on stdin: the test sends its
signal while the worker waits there (a signal interrupts the wait and its handler runs at once),
then releases it (or never does, when the signal should end the run). The gates wrap mixprec's
functions from the outside; nothing in the library knows about them. The command runs as
``python -m mixprec train`` does (``main()`` reads ``sys.argv``: the process's own signal policy).

A gate name ending in ``@R`` (``step:5@1``) stops only rank ``R``. Under torchrun gates stop only
the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): a restarted worker runs straight through.
tests/train/gated.py drives it.
"""
from __future__ import annotations

import os
import sys


def gate(name: str) -> None:
    # One write(2) of the whole line: under torchrun every rank shares one pipe, and print()'s
    # separate writes of text and newline let two ranks' lines run together into one.
    sys.stdout.flush()
    os.write(1, f"GATE {name} pid={os.getpid()}\n".encode())
    # One line, byte by byte from the file descriptor: under torchrun every rank shares the
    # launcher's stdin, and a buffered readline() could take both ranks' "go" lines at once.
    while os.read(0, 1) not in (b"\n", b""):
        pass


def _mine(gates: set[str]) -> set[str]:
    """The gates for this process: ``name`` or ``name@<RANK>``; none in a restarted attempt."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return set()
    rank = os.environ.get("RANK", "0")
    return {g.split("@")[0] for g in gates if "@" not in g or g.split("@")[1] == rank}


def main(gates: set[str], settings: list[str]) -> int:
    gates = _mine(gates)
    from mixprec.cli import train as command
    from mixprec.runs import checkpoint
    from mixprec.train.trainer import Trainer

    if "setup" in gates:
        build_run = command.build_run

        def gated_build_run(cfg):
            gate("setup")
            return build_run(cfg)
        command.build_run = gated_build_run
    steps = {int(g.split(":")[1]) for g in gates if g.startswith("step:")}
    if steps:
        train_step = Trainer.train_step

        def gated_train_step(self, micro_batches):
            if self.step + 1 in steps:
                gate(f"step:{self.step + 1}")
            return train_step(self, micro_batches)
        Trainer.train_step = gated_train_step
    if "save" in gates:
        fsync_file = checkpoint._fsync_file

        def gated_fsync(path):
            if path.name == checkpoint.MODEL_FILE:
                gate("save")
            return fsync_file(path)
        checkpoint._fsync_file = gated_fsync
    from mixprec.cli import main as mixprec_main
    sys.argv = ["mixprec", "train", *settings]
    code = mixprec_main()
    if "exit" in gates:
        gate("exit")
    return code


if __name__ == "__main__":
    sys.exit(main(set(sys.argv[1].split(",")) - {""}, sys.argv[2:]))
