"""Errors a user can act on.

Every exception here carries one readable line that says what is wrong and how to fix it. The
command line prints that line (no traceback unless ``--debug``) and exits non-zero. Library users
catch them like the built-in type they derive from (``ValueError``, ``RuntimeError``, ...).
"""
from __future__ import annotations

import difflib
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
