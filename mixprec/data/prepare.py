"""``mixprec prepare INPUT... -o OUT``: tokenize text files or folders into one token file.

Inputs are files (taken whatever their suffix) and folders (every non-hidden text file under
them, see :data:`~mixprec.data.token_dataset.TEXT_SUFFIXES`, recursively). Files are processed in
the order given, folders' files sorted by path, and their tokens concatenated.

Tokenization is byte-level by default (token = byte, vocabulary 256: no download, no unknown
characters). ``--tokenizer tokenizer.json`` uses a Hugging Face ``tokenizers`` tokenizer from a
local file instead (``pip install 'mixprec[tokenizers]'``); its vocabulary size goes into the
header unless ``--vocab-size`` says more (e.g. a model padded to a multiple of 64). Text is encoded
in ~1 MiB pieces cut at newlines, without the tokenizer's special tokens (a BERT-style ``[CLS]``
would otherwise appear at every piece boundary).

The output is written to a temporary file and renamed into place when complete; inputs are only
ever read, and an output path that is one of the inputs is refused.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mixprec.data.token_dataset import TEXT_SUFFIXES, non_text_share
from mixprec.data.token_file import TokenFileWriter
from mixprec.errors import ConfigError, DataError

__all__ = ["PrepareResult", "prepare_files"]

_CHUNK_BYTES = 16 * 2**20    # bytes read at a time for byte-level tokenization
_TEXT_PIECE = 1 * 2**20      # characters per piece handed to a HF tokenizer (split at a newline)


@dataclass(frozen=True, kw_only=True)
class PrepareResult:
    """What :func:`prepare_files` wrote."""

    path: Path
    """The token file."""
    num_files: int
    """Input files read."""
    num_tokens: int
    """Tokens written."""
    vocab_size: int
    """Vocabulary size recorded in the header."""
    tokenizer: str
    """``"bytes"`` or the tokenizer file used."""
    binary: tuple[tuple[Path, float], ...] = ()
    """Inputs that look binary, with their share of non-text bytes (:func:`non_text_share`)."""


def _gather_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise DataError(f"input folder {path} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
            files.extend(found)
        else:
            raise DataError(f"input {path} does not exist; check the path")
    if not files:
        raise DataError("no input files given; pass text files or folders")
    return files


def _load_tokenizer(path: str | os.PathLike):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the optional package 'tokenizers': pip install 'mixprec[tokenizers]' "
                          "(or leave out --tokenizer for byte-level tokens)") from None
    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist; pass a local tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception on malformed files
        raise DataError(f"cannot read tokenizer {path}: {e}") from None


def _text_pieces(text: str) -> list[str]:
    """Split text into ~1 MiB pieces at newlines, so huge files encode in bounded memory."""
    pieces, start = [], 0
    while start < len(text):
        end = min(start + _TEXT_PIECE, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


def prepare_files(inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                  tokenizer: str | os.PathLike | None = None, vocab_size: int | None = None,
                  progress: bool = True, overwrite: bool = False) -> PrepareResult:
    """Tokenize ``inputs`` into the token file ``output`` (see the module docs). An existing
    ``output`` is replaced only with ``overwrite=True``."""
    files = _gather_inputs(inputs)
    output = Path(output)
    if output.is_dir():
        raise DataError(f"output {output} is a folder; name a file, e.g. {output / 'train.tokens'}")
    if output.exists() and any(os.path.samefile(output, f) for f in files):
        raise DataError(f"output {output} is also an input; refusing to overwrite it, choose another -o path")
    if output.exists() and not overwrite:
        raise DataError(f"output {output} exists; pass --overwrite to replace it (overwrite=True in "
                        "Python), or choose another -o path")
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    base_vocab = tok.get_vocab_size(with_added_tokens=True) if tok is not None else 256
    vocab = base_vocab if vocab_size is None else int(vocab_size)
    if vocab < base_vocab:
        raise ConfigError(f"--vocab-size {vocab} is smaller than the tokenizer's {base_vocab} ids; "
                          f"use at least {base_vocab}")

    from tqdm.auto import tqdm

    total = sum(f.stat().st_size for f in files)
    # disable=None: tqdm's own "a bar only on a terminal"; piped logs get the summary line alone.
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"prepare {output.name}", file=sys.stderr,
               disable=None if progress else True)
    with bar, TokenFileWriter(output, vocab) as writer:
        for path in files:
            if tok is None:
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK_BYTES):
                        writer.write(np.frombuffer(chunk, dtype=np.uint8))
                        bar.update(len(chunk))
            else:
                text = path.read_text(encoding="utf-8", errors="replace")
                for enc in tok.encode_batch(_text_pieces(text), add_special_tokens=False):
                    writer.write(np.asarray(enc.ids, dtype=np.int64))
                bar.update(path.stat().st_size)
    binary = tuple((f, s) for f in files if (s := non_text_share(f)) > 0.1)
    return PrepareResult(path=writer.path, num_files=len(files), num_tokens=writer.num_tokens, vocab_size=vocab,
                         binary=binary,
                         tokenizer=str(tokenizer) if tokenizer is not None else "bytes")
