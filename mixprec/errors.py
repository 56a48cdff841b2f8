"""Errors a user can act on.

Every exception here carries one readable line that says what is wrong and how to fix it. The
command line prints that line (no traceback unless ``--debug``) and exits non-zero. Library users
catch them like the built-in type they derive from (``ValueError``, ``RuntimeError``, ...).
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

__all__ = [
    "MixprecError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "NumericsError",
    "TrainingDiverged",
    "RunInterrupted",
    "closest",
    "excerpt",
]


class MixprecError(Exception):
    """Base class for errors whose message is meant for the user, one line, with the fix."""


class ConfigError(MixprecError, ValueError):
    """A setting, name or combination of settings is invalid."""


class DataError(MixprecError, ValueError):
    """A data file or folder is missing, malformed or inconsistent."""


class CheckpointError(MixprecError, RuntimeError):
    """A checkpoint cannot be written or read back."""


class NumericsError(MixprecError, RuntimeError):
    """Training cannot continue safely (e.g. the loss scale is stuck at its minimum)."""


def closest(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` when none is close."""
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def excerpt(error: BaseException | str, limit: int = 200) -> str:
    """Another library's error message, shortened for one of our one-line errors.

    Whole sentences only: as many of the message's sentences as fit in ``limit`` characters (line
    breaks and terminal colour codes removed). A first sentence longer than that (a list of missing
    keys) is cut after its last complete item or word before ``limit`` and ends in ``...``; the
    cut never falls inside a word, a dotted name or a quoted string, and nothing is appended to
    the excerpt but that ellipsis. An exception with no message gives its type name.
    """
    text = str(error) if isinstance(error, BaseException) else str(error)
    text = " ".join(_ANSI.sub("", text).split())
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    if len(text) <= limit:
        return text
    kept = ""
    for sentence in _SENTENCE_END.split(text):
        candidate = f"{kept} {sentence}".strip()
        if len(candidate) > limit:
            break
        kept = candidate
    if kept:
        return kept
    head = text[:limit + 1]
    for sep in (", ", "; ", " "):     # after the last whole item, else the last whole word
        cut = head.rfind(sep)
        if cut > limit // 3:
            head = head[:cut]
            break
    head = head[:limit].rstrip(" ,;:")
    if head.count('"') % 2:            # never leave a quoted name open
        head = head[:head.rfind('"')].rstrip(" ,;:")
    if head.count("`") % 2:
        head = head[:head.rfind("`")].rstrip(" ,;:")
    return f"{head} ..."


class TrainingDiverged(NumericsError):
    """The loss became non-finite, or too many steps were skipped: the run cannot go on."""

    exit_code = 3


class RunInterrupted(MixprecError):
    """The run was stopped by Ctrl-C (SIGINT) or SIGTERM after saving a checkpoint.

    ``signum`` is the signal; ``exit_code`` the shell's ``128 + signum`` (130 for SIGINT, 143 for
    SIGTERM), which ``mixprec train`` exits with. In your own script: ``sys.exit(e.exit_code)``.
    """

    def __init__(self, message: str, signum: int = 2) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
