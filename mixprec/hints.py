"""The commands mixprec's messages tell a user to run: built here, and only here.

A hint is a working command for the way *this* process was launched, shell-quoted
(:func:`shlex.join`) so a run folder with spaces or quotes pastes as one argument:

* ``mixprec train`` in one process: ``mixprec train --resume 'runs/my run'``;
* ``mixprec train`` under torchrun (one node): ``torchrun --nproc_per_node=2 -m mixprec train
  --resume 'runs/my run'`` (a checkpoint saved by N ranks resumes only on N ranks); on several
  nodes the ``--nnodes`` count and the rendezvous options the job was launched with
  (``--rdzv-backend``/``--rdzv-endpoint``/``--rdzv-id``, or ``--master-addr``/``--master-port``,
  read from the launcher's command line; torchrun does not pass them to its workers), or, where
  they cannot be read, a note that they must be added;
* ``fit()`` from Python: ``fit(..., run_dir='runs/my run', resume=True)``, the Python way.

:func:`from_command_line` marks the process as the command line's (``mixprec train`` calls it);
:func:`set_run_dir` tells the hints of a lower layer (a lost peer, say) which folder this run
writes, so they name it instead of a placeholder. Like :mod:`mixprec.errors`, this module may be
imported from every room.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

__all__ = ["from_command_line", "set_run_dir", "run_dir", "launcher", "command", "resume",
           "report", "overwrite", "is_command_line", "rendezvous_options"]

_state: dict[str, Any] = {"cli": False, "run_dir": None}


def from_command_line(on: bool = True) -> None:
    """This process runs ``mixprec train`` (hints are shell commands), or not (Python calls)."""
    _state["cli"] = bool(on)


def is_command_line() -> bool:
    return bool(_state["cli"])


def set_run_dir(path: str | os.PathLike | None) -> None:
    """The folder this process's run writes (None: none yet)."""
    _state["run_dir"] = None if path is None else Path(path)


def run_dir() -> Path | None:
    return _state["run_dir"]


def launcher(env: dict[str, str] | None = None) -> list[str]:
    """The words before ``train``: ``["mixprec"]``, or torchrun's for a job it launched."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_WORLD_SIZE" not in env:
        return ["mixprec"]
    nproc = int(env["LOCAL_WORLD_SIZE"])
    nnodes = int(env.get("GROUP_WORLD_SIZE") or max(int(env.get("WORLD_SIZE", nproc)) // nproc, 1))
    # `python -m mixprec.launch` (torchrun with honest exits, mixprec/launch.py) tells its workers.
    words = ["python", "-m", "mixprec.launch"] if env.get("MIXPREC_LAUNCHER") == "mixprec.launch" \
        else ["torchrun"]
    if nnodes > 1:
        words.append(f"--nnodes={nnodes}")
    return [*words, f"--nproc_per_node={nproc}", "-m", "mixprec"]


_RDZV_OPTIONS = ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "master-addr", "master-port")
"""torchrun's options that say where the nodes meet: the same on every node."""


def rendezvous_options(argv: list[str]) -> tuple[list[str], bool]:
    """The rendezvous options in a launcher's ``argv`` (``--rdzv-endpoint=HOST:PORT`` spelled
    either way, ``--rdzv_endpoint HOST:PORT`` too), as ``--name=value`` words, and whether the
    launch gave each node its own ``--node-rank`` (static rendezvous)."""
    found: list[str] = []
    node_rank = False
    it = iter(argv)
    for word in it:
        if not word.startswith("--"):
            continue
        name, eq, value = word[2:].partition("=")
        name = name.replace("_", "-")
        node_rank = node_rank or name == "node-rank"
        if name in _RDZV_OPTIONS:
            found.append(f"--{name}={value if eq else next(it, '')}")
    return found, node_rank


def _launcher_argv() -> list[str] | None:
    """The command line of this worker's launcher (torchrun's agent is its parent), or None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return None
    text = " ".join(argv)
    return argv if any(k in text for k in ("torchrun", "torch.distributed.run", "mixprec.launch")) else None


def command(*words: str | os.PathLike, env: dict[str, str] | None = None) -> str:
    """``mixprec WORDS...`` as one pasteable shell command for this launch (several nodes: with
    the job's rendezvous options, to run on every node, said on a line of its own before the
    command, so the command's line pastes whole into a shell)."""
    launch = launcher(env)
    if not any(w.startswith("--nnodes") for w in launch):
        return shlex.join([*launch, *map(str, words)])
    argv = _launcher_argv()
    options, node_rank = rendezvous_options(argv) if argv is not None else ([], False)
    at = launch.index("-m")
    text = shlex.join([*launch[:at], *options, *launch[at:], *map(str, words)])
    # The note goes on its own line before the command: after it ("cmd  (on every node)"), a
    # whole-line paste made bash read the parenthesis as a subshell and fail.
    if not options:
        note = ("on every node, adding this job's rendezvous options (--rdzv-backend and "
                "--rdzv-endpoint, or --master-addr and --master-port)")
    else:
        note = "on every node, each with its own --node-rank" if node_rank else "on every node"
    return f"{note}:\n{text}"


def _python_value(value: Any) -> str:
    return repr(value)


def resume(path: str | os.PathLike | None = None, *, checkpoint: bool = False,
           **settings: Any) -> str:
    """The command that continues a run (``path``: its folder, or one of its checkpoint folders
    with ``checkpoint=True``; default the folder :func:`set_run_dir` named, else a placeholder),
    with ``settings`` changed (``lr=1e-3``; a string value is written as given, e.g. ``'<more>'``)."""
    where = path if path is not None else (run_dir() or "RUN_DIR")
    if is_command_line():
        return command("train", "--resume", where, *(f"{k}={_cli_value(v)}" for k, v in settings.items()))
    if checkpoint:      # RUN/checkpoints/step-N: continue in RUN, from that step
        folder = Path(where).parent.parent if Path(where).parent.name == "checkpoints" else None
        args = ([f"run_dir={str(folder)!r}"] if folder is not None else []) + [f"resume={str(where)!r}"]
    else:
        args = [f"run_dir={str(where)!r}", "resume=True"]
    args += [f"{k}={_python_value(v)}" for k, v in settings.items()]
    return f"fit(..., {', '.join(args)})"


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def report(path: str | os.PathLike) -> str:
    """``mixprec report RUN`` (one process reads the folder, whatever launched the run)."""
    return shlex.join(["mixprec", "report", str(path)])


def overwrite() -> str:
    """The setting that starts over in a folder that holds a run, as this caller writes it."""
    return "overwrite=true" if is_command_line() else "overwrite=True"
