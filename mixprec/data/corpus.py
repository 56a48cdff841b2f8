"""The built-in corpus: the running Python's own standard library sources, byte-tokenized.

Every machine that runs mixprec has a Python installation, and its standard library is a few
hundred files of real, varied text (code, docstrings, comments), so the default training run and
the tests need no download. :func:`builtin_corpus` builds it once and caches it; ``mixprec train``
trains on it when no data path is given. On CPython 3.11 it is 734 files, 12.1 MB: 11.6 M
training and 0.53 M validation tokens; building it takes well under a second.

How it is made, deterministically:

1. every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, excluding the folders ``test``,
   ``tests``, ``idle_test``, ``site-packages``, ``dist-packages`` and ``__pycache__`` and any hidden
   folder, sorted by relative path (POSIX form);
2. files are taken in that order while the total stays within :data:`MAX_BYTES` (16 MiB; CPython
   3.11's non-test library is about 12 MB, so on 3.11 it is all of it);
3. file number ``i`` (0-based, in that order) goes to validation when ``i % 20 == 19`` (about 5%),
   the rest to training; splitting by file means no file contributes to both sides;
4. the bytes of each side's files are concatenated, and written as token files (vocabulary 256)
   ``train.tokens`` and ``val.tokens``.

Different Python versions ship different libraries, so the cache folder is named after the Python
version and a SHA-256 of the chosen files' paths and contents:
``$MIXPREC_CACHE/corpus/stdlib-py3.11-<hash12>/`` (``~/.cache/mixprec`` when ``MIXPREC_CACHE`` is
unset). Files are written atomically (temporary file + rename), so concurrent ranks building the
same corpus at the same time are safe.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from mixprec.data import token_file
from mixprec.errors import DataError

__all__ = ["Corpus", "builtin_corpus", "default_cache_dir", "MAX_BYTES", "VAL_EVERY"]

MAX_BYTES = 16 * 2**20
"""Upper bound on the corpus size in bytes (= tokens)."""
VAL_EVERY = 20
"""Every ``VAL_EVERY``-th file (the last of each group of 20) is a validation file."""
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A prepared text corpus on disk: token files for training and validation."""

    name: str
    """Short name, e.g. ``stdlib-py3.11-1a2b3c4d5e6f`` (also the cache folder's name)."""
    train_path: Path
    """Token file with the training tokens."""
    val_path: Path
    """Token file with the validation tokens."""
    num_train_tokens: int
    """Tokens in ``train_path``."""
    num_val_tokens: int
    """Tokens in ``val_path``."""
    vocab_size: int
    """Vocabulary size (256: one token per byte)."""
    num_files: int
    """Source files the corpus was built from."""
    python_version: str
    """``major.minor.micro`` of the Python whose library this is."""
    content_hash: str
    """SHA-256 (hex) over the chosen files' relative paths and bytes."""
    description: str
    """One line for logs and reports."""


def default_cache_dir() -> Path:
    """``$MIXPREC_CACHE``, else ``~/.cache/mixprec``."""
    env = os.environ.get("MIXPREC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mixprec"


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("."))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _gather(root: Path, max_bytes: int) -> tuple[list[tuple[str, bytes]], str]:
    """The chosen ``(relative path, bytes)`` pairs, in order, and their content hash."""
    chosen, total, digest = [], 0, hashlib.sha256()
    for path in _stdlib_files(root):
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        data = path.read_bytes()
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
        chosen.append((rel, data))
        total += len(data)
    return chosen, digest.hexdigest()


def _write_side(path: Path, parts: list[bytes]) -> int:
    import numpy as np

    with token_file.TokenFileWriter(path, 256) as writer:
        for data in parts:
            writer.write(np.frombuffer(data, dtype=np.uint8))
    return writer.num_tokens


def _cached_count(path: Path) -> int | None:
    try:
        header = token_file.read_header(path)
    except DataError:
        return None
    return header.num_tokens if header.vocab_size == 256 else None


def builtin_corpus(cache_dir: str | os.PathLike | None = None, *, max_bytes: int = MAX_BYTES) -> Corpus:
    """The Python standard library corpus, built on first use and cached (see the module docs).

    Args:
        cache_dir: where to keep it; default :func:`default_cache_dir`.
        max_bytes: size cap; the default keeps the build to about a second.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, content_hash = _gather(root, max_bytes)
    if len(chosen) < VAL_EVERY:
        raise DataError(f"only {len(chosen)} .py files of the Python standard library at {root} fit in "
                        f"max_bytes={max_bytes} (need {VAL_EVERY}); raise max_bytes, or pass a dataset path if "
                        "this Python install is stripped of its sources")
    version = ".".join(map(str, sys.version_info[:3]))
    name = f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-{content_hash[:12]}"
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = folder / "corpus" / name
    train = [data for i, (_, data) in enumerate(chosen) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [data for i, (_, data) in enumerate(chosen) if i % VAL_EVERY == VAL_EVERY - 1]
    n_train, n_val = sum(map(len, train)), sum(map(len, val))
    train_path, val_path = folder / "train.tokens", folder / "val.tokens"
    if _cached_count(train_path) != n_train:
        _write_side(train_path, train)
    if _cached_count(val_path) != n_val:
        _write_side(val_path, val)
    return Corpus(
        name=name, train_path=train_path, val_path=val_path, num_train_tokens=n_train, num_val_tokens=n_val,
        vocab_size=256, num_files=len(chosen), python_version=version, content_hash=content_hash,
        description=(f"Python {version} standard library, {len(chosen)} .py files, {n_train + n_val:,} bytes "
                     f"(byte-level, vocab 256; {n_val:,} validation bytes from every {VAL_EVERY}th file)"),
    )
