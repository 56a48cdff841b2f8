"""The ``mixprec`` command.

Each sub-command is one thin module of :mod:`mixprec.cli` that exposes two functions:
``configure(parser: argparse.ArgumentParser) -> None`` and ``run(args: argparse.Namespace) -> int``.
Each is imported when the parser is built; their top-level imports are kept light.

Errors derived from :class:`mixprec.errors.MixprecError` and operating-system errors (a full disk,
a read-only or missing folder) are printed as one line, ``mixprec: error: ...``, with the fix and
exit status 2 (3 for a diverged run). A run stopped by a signal exits with the shell's ``128 + N``:
130 for Ctrl-C (SIGINT), 143 for SIGTERM (:mod:`mixprec.train.signals` says when it saves first).
``--debug`` shows the traceback.
"""
from __future__ import annotations

import argparse
import errno
import os
import importlib
import signal
import sys

from mixprec import hints
from mixprec.cli.streams import outlive_readers, reader_left
from mixprec.errors import MixprecError, RunInterrupted
from mixprec.train.signals import Aborted, StopRequest

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mixprec.cli.train", "train a Transformer (default: small model, built-in corpus)"),
    "audit": ("mixprec.cli.audit", "pre-flight precision audit of a training set-up"),
    "report": ("mixprec.cli.report", "write PNG plots and an HTML page for a run folder"),
    "prepare": ("mixprec.cli.prepare", "tokenize text files into a mixprec token file"),
    "bench": ("mixprec.cli.bench", "benchmarks: matmul throughput, training step per precision"),
    "memory": ("mixprec.cli.memory", "estimate memory per precision mode: params, grads, masters, moments, activations"),
    "plan": ("mixprec.cli.plan", "choose FP8/BF16/FP32 per Linear layer from measured sensitivity and cost"),
    "estimate": ("mixprec.cli.estimate", "estimate memory, time, energy and cost of a training run on a cluster"),
    "whatif": ("mixprec.cli.whatif", "which format (FP8, MXFP8, MXFP4, NVFP4, BF16) can each Linear take: table, CSV, heat-map"),
}


def _build_parser() -> argparse.ArgumentParser:
    from mixprec._version import __version__
    parser = argparse.ArgumentParser(prog="mixprec", description="Mixed-precision training for PyTorch.")
    parser.add_argument("-V", "--version", action="version", version=f"mixprec {__version__}",
                        help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks on errors")
        p.set_defaults(_module=module)
        importlib.import_module(module).configure(p)
    return parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (``(default: 16)``), unless the help already says it
    or there is nothing to say (a switch that is off, no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) \
                or isinstance(action, argparse._StoreTrueAction):
            return text
        return super()._get_help_string(action)


def _unknown_flag_line(flag: str, argv: list[str], sub: argparse.ArgumentParser | None,
                       takes_settings: bool) -> str:
    """The one line for an unrecognised ``--flag``: a setting written as a flag
    (``--max_steps 5`` -> ``max_steps=5``), underscores for dashes, or the closest flag."""
    from mixprec.errors import closest
    name, eq, value = flag.lstrip("-").partition("=")
    key = name.replace("-", "_")
    if takes_settings:
        from mixprec.train.config import TrainConfig, setting_suggestion
        import dataclasses
        if key in {f.name for f in dataclasses.fields(TrainConfig)}:
            if not eq:
                i = argv.index(flag) if flag in argv else -1
                value = argv[i + 1] if 0 <= i < len(argv) - 1 and not argv[i + 1].startswith("-") else "VALUE"
            return f"{flag} is not a flag: settings are key=value, write {key}={value}"
        hint = setting_suggestion(key)
        if hint:
            return f"unrecognized argument {flag}{hint}; settings are key=value"
    flags = [o for a in (sub._actions if sub else []) for o in a.option_strings
             if a.help is not argparse.SUPPRESS]
    dashed = "--" + name.replace("_", "-")
    if dashed in flags and dashed != flag.partition("=")[0]:
        return f"unrecognized argument {flag} (did you mean '{dashed}'? flags use dashes)"
    return f"unrecognized argument {flag}{closest(dashed, flags)}"


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser | None:
    """The parser of the command that was given (``bench train``: the innermost)."""
    found = None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                found = _subparser(action.choices[name], args) or action.choices[name]
    return found


def main(argv: list[str] | None = None) -> int:
    argv_given = argv
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    # key=value settings may stand anywhere, also after options (`--precision bf16 lr=3e-4`).
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "settings"):
        args.settings += [e for e in extra if "=" in e and not e.startswith("-")]
        extra = [e for e in extra if not ("=" in e and not e.startswith("-"))]
    flags = [e for e in extra if e.startswith("-")]
    if flags:
        sub = _subparser(parser, args)
        # The line says the fix: argparse's usage block before it only buried it.
        (sub or parser).exit(2, f"{(sub or parser).prog}: error: "
                             f"{_unknown_flag_line(flags[0], argv, sub, hasattr(args, 'settings'))}\n")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    # The process's signal policy, from here until it ends (argv None: this is the process's
    # entry point, so after a signal the exit itself must not be killable by the next one).
    if args.command == "train" and argv_given is None:
        outlive_readers()          # a run's checkpoint must not depend on who reads its output
    with StopRequest(loop=False, hold=argv_given is None) as signals:
        try:
            code = int(importlib.import_module(args._module).run(args) or 0)
            # Output dropped after the reader left (`mixprec train ... | head`): the run is
            # complete, and the exit says what a shell tool killed by SIGPIPE would.
            return 128 + signal.SIGPIPE if code == 0 and reader_left() else code
        except Aborted as e:
            signals.ending = True          # an attribute store, not a call: no signal lands first
            print(f"mixprec: interrupted ({signal.Signals(e.signum).name})", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:
            signals.ending = True
            print("mixprec: interrupted", file=sys.stderr)
            return 130
        except RunInterrupted as e:
            signals.ending = True
            print(f"mixprec: {e}", file=sys.stderr)
            return e.exit_code
        except BrokenPipeError:
            # The reader went away (`mixprec memory ... | head`): as a shell tool killed by SIGPIPE
            # does, stop quietly with 128 + SIGPIPE; point stdout at /dev/null so the interpreter's
            # final flush does not raise again.
            signals.ending = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        except (MixprecError, OSError) as e:
            signals.ending = True
            if getattr(args, "debug", False):
                raise
            message = str(e) if isinstance(e, MixprecError) else _os_error_line(e)
            print(f"mixprec: error: {message}", file=sys.stderr)
            return getattr(e, "exit_code", 2)
        finally:
            signals.ending = True
            # A caller that runs the CLI in-process (tests, notebooks) and then calls fit() gets
            # Python hints again, not this command's shell ones or its run folder.
            hints.from_command_line(False)
            hints.set_run_dir(None)


_OS_FIXES = {
    errno.ENOSPC: "free some space or write the run elsewhere (run_dir=PATH)",
    errno.EROFS: "the file system is read-only; write the run elsewhere (run_dir=PATH)",
    errno.EACCES: "you may not write there; choose a folder you own (run_dir=PATH)",
    errno.EPERM: "you may not write there; choose a folder you own (run_dir=PATH)",
    errno.ENOENT: "check the path",
    errno.EISDIR: "pass a file, not a folder",
    errno.EDQUOT: "your disk quota is full; free some space or write elsewhere",
}


def _os_error_line(e: OSError) -> str:
    """``[Errno 28] No space left on device: 'runs/x/metrics.csv'`` as one line with the fix."""
    what = e.strerror or type(e).__name__
    where = f" ({e.filename})" if e.filename else ""
    fix = _OS_FIXES.get(e.errno or -1, "check the path and the disk")
    return f"{what}{where}; {fix}"
