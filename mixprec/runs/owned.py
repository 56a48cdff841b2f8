"""What a run writes into its folder, file by file: the one answer to "may mixprec delete this?".

A run folder is mixprec's only where mixprec wrote it. ``overwrite=true`` deletes an old run's
files and nothing else, and refuses a folder that holds anything else *at any depth* (notes kept
in ``checkpoints/``, an evaluation beside a checkpoint's weights, a file in ``tb/``); rotating a
checkpoint out (``keep_last``) deletes that checkpoint's own files and keeps its folder while it
still holds yours. The rules are names, not guesses: a file is the run's when its path is one a
run, ``mixprec report`` or ``mixprec report A B`` writes (below); a symlink never is.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from mixprec.runs.lock import LOCK_FILE

__all__ = ["MODEL_FILE", "STATE_FILE", "META_FILE", "LATEST_FILE", "TB_DIR", "scan", "remove",
           "delete_checkpoint"]

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LATEST_FILE = "latest"
TB_DIR = "tb"

_TOP_FILES = frozenset({"config.toml", "metrics.csv", "events.jsonl", LOCK_FILE, "numerics.csv",
                        "hf_config.json", "trace.json", "profile.txt"})
_TOP_DIRS = frozenset({"checkpoints", TB_DIR, "report", "compare"})
_CHECKPOINT_FILES = frozenset({MODEL_FILE, STATE_FILE, META_FILE})
_STEP_DIR = re.compile(r"step-\d+|incomplete-step-\d+(-\d+)?|\.tmp-(old-)?step-\d+-\d+")
"""A checkpoint's folder, one saved incompletely (kept aside by a resume), or a save under way."""
_HF_DIR = re.compile(r"hf|\.tmp-hf-\d+|\.old-hf-\d+")
"""A Hugging Face export (``save_pretrained``), or one being written or replaced."""


def _hf_file(name: str) -> bool:
    return name.endswith((".safetensors", ".json"))     # weights, their index, configs


def _in_checkpoint(parts: tuple[str, ...]) -> bool:
    """Whether ``parts`` (inside one checkpoint's folder) is a file a save writes."""
    if len(parts) == 1:
        return parts[0] in _CHECKPOINT_FILES
    return len(parts) == 2 and bool(_HF_DIR.fullmatch(parts[0])) and _hf_file(parts[1])


def _is_run_file(parts: tuple[str, ...]) -> bool:
    head = parts[0]
    if len(parts) == 1:
        return head in _TOP_FILES
    if head == "checkpoints":
        if len(parts) == 2:
            return parts[1] == LATEST_FILE or parts[1].startswith(f".{LATEST_FILE}.tmp-")
        return bool(_STEP_DIR.fullmatch(parts[1])) and _in_checkpoint(parts[2:])
    if head == TB_DIR:
        return len(parts) == 2 and parts[1].startswith("events.out.tfevents.")
    if _HF_DIR.fullmatch(head):
        return len(parts) == 2 and _hf_file(parts[1])
    if head in ("report", "compare"):                  # mixprec report's pictures and pages
        return len(parts) == 2 and parts[1].endswith((".png", ".html"))
    return False


def _is_run_dir(parts: tuple[str, ...]) -> bool:
    head = parts[0]
    if len(parts) == 1:
        return head in _TOP_DIRS or bool(_HF_DIR.fullmatch(head))
    if head != "checkpoints" or not _STEP_DIR.fullmatch(parts[1]):
        return False
    return len(parts) == 2 or (len(parts) == 3 and bool(_HF_DIR.fullmatch(parts[2])))


def scan(folder: Path, *, within: tuple[str, ...] = ()) -> tuple[list[Path], list[str]]:
    """``(the run's files, everything else)`` under ``folder``: the second as paths relative to
    ``folder`` (a folder's with a trailing ``/``, not looked into), sorted. ``within``: where
    ``folder`` sits in its run folder (``("checkpoints", "step-00000100")`` for a checkpoint)."""
    owned: list[Path] = []
    foreign: list[str] = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder).parts
        for d in sorted(dirs):
            if (Path(root) / d).is_symlink() or not _is_run_dir(within + rel + (d,)):
                foreign.append("/".join(rel + (d,)) + "/")
                dirs.remove(d)
        for f in files:
            path = Path(root) / f
            if not path.is_symlink() and _is_run_file(within + rel + (f,)):
                owned.append(path)
            else:
                foreign.append("/".join(rel + (f,)))
    return owned, sorted(foreign)


def remove(folder: Path, files: list[Path]) -> None:
    """Delete ``files`` (the run's, from :func:`scan`), then every folder under ``folder`` (itself
    included) that they leave empty; a folder that still holds something stays."""
    for path in files:
        path.unlink(missing_ok=True)
    for root, _dirs, _files in sorted(os.walk(folder), key=lambda w: -len(Path(w[0]).parts)):
        try:
            os.rmdir(root)             # only if empty
        except OSError:
            pass


def delete_checkpoint(step_dir: Path) -> list[str]:
    """Delete one checkpoint's own files (and its folder once empty); returns what is left, which
    is not the run's (relative to ``step_dir``)."""
    owned, foreign = scan(step_dir, within=("checkpoints", "step-0"))
    remove(step_dir, owned)
    return foreign
