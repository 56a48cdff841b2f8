"""TokenDataset: fixed-length training windows over memory-mapped token files.

A dataset is one long stream of token ids made of one file or of every data file under a folder
(sorted by path, read as if concatenated). Three formats are understood, recognised per file:

* **token files** written by ``mixprec prepare`` (:mod:`mixprec.data.token_file`), found by their
  magic bytes whatever their name (a ``.tokens`` file without the magic is an error);
* **``.npy`` arrays** of integer ids, 1-D, opened with ``mmap_mode="r"``;
* **plain text** (``.txt .md .rst .py .json .jsonl .csv .tsv .html .xml .c .h .cpp .js .ts .yaml
  .yml .toml .ini .cfg .sh .tex``), whose bytes are the tokens (vocabulary 256), memory-mapped too.

Nothing is read at construction except headers and file sizes, so a multi-GB dataset opens at
once and stays mostly on disk; the pages a window touches are all that becomes resident.

**Samples.** Sample ``i`` is the ``max_length + 1`` tokens starting at ``i * stride``, returned as
``(inputs, targets) = (w[:-1], w[1:])``, both ``int64`` of shape ``(max_length,)``. The default
``stride = max_length`` makes consecutive windows share exactly one token (the last target of one
window is the first input of the next), so every token is predicted exactly once per epoch and no
sample repeats another. ``len()`` is the exact number of full windows; a tail too short for a
window is left out.

**Vocabulary checks.** Token ids outside ``[0, vocab_size)`` would index past the embedding table,
a silent wrong result on CPU and a device-side assert on GPU. Checks are chosen so that opening
stays instant:

* text is uint8 with vocabulary 256: nothing can be out of range;
* a token file's ids are checked when it is written; on read each window is checked again (a
  vectorised max over ``max_length + 1`` values, negligible next to the copy), unless the dtype
  cannot hold an id ``>= vocab_size`` at all;
* an ``.npy`` without ``vocab_size=`` is scanned once at open, in 16 M-token chunks, to infer the
  vocabulary (``max + 1``) and reject negative ids; pass ``vocab_size=`` to skip that scan and get
  the per-window check instead.

:meth:`TokenDataset.validate` scans everything up front when you want the error before training.
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mixprec.data import token_file
from mixprec.errors import DataError

__all__ = ["TokenDataset", "TEXT_SUFFIXES", "non_text_share"]

TEXT_SUFFIXES: frozenset[str] = frozenset(
    ".txt .md .rst .py .json .jsonl .csv .tsv .html .xml .c .h .cpp .js .ts .yaml .yml .toml .ini "
    ".cfg .sh .tex".split())
"""File suffixes read as byte-level text."""

_SCAN_CHUNK = 1 << 24  # tokens per chunk when a whole file is scanned


@dataclass(kw_only=True)
class _Segment:
    """One file's tokens: where they are and what they may contain."""

    path: Path
    kind: str                    # "tokens" | "npy" | "text"
    dtype: np.dtype
    length: int                  # number of tokens
    declared_vocab: int | None   # vocabulary the file itself states (token file header, text: 256)
    needs_check: bool = True     # ids may fall outside [0, vocab); set once the vocabulary is known


def _open_memmap(seg: _Segment) -> np.ndarray:
    if seg.length == 0:
        return np.empty(0, dtype=seg.dtype)
    if seg.kind == "tokens":
        return token_file.open_token_file(seg.path)[1]
    if seg.kind == "npy":
        return np.load(seg.path, mmap_mode="r", allow_pickle=False)
    return np.memmap(seg.path, dtype=np.uint8, mode="r")


def _describe(seg_path: Path) -> _Segment:
    """Classify a file by content/suffix and read only what is needed to know its length."""
    if token_file.is_token_file(seg_path) or seg_path.suffix == token_file.TOKEN_FILE_SUFFIX:
        header = token_file.read_header(seg_path)
        return _Segment(path=seg_path, kind="tokens", dtype=header.dtype, length=header.num_tokens,
                        declared_vocab=header.vocab_size)
    suffix = seg_path.suffix.lower()
    if suffix == ".npy":
        try:
            arr = np.load(seg_path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            reason = "truncated" if "larger than" in str(e) or "size" in str(e) else "not a valid .npy file"
            raise DataError(f"{seg_path} is {reason} ({e}); re-save it with numpy.save") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise DataError(f"{seg_path} holds a {arr.ndim}-D {arr.dtype} array; a token .npy must be a 1-D "
                            "integer array (save ids.ravel().astype(np.uint16 or np.int32))")
        return _Segment(path=seg_path, kind="npy", dtype=arr.dtype, length=int(arr.shape[0]), declared_vocab=None)
    if suffix in TEXT_SUFFIXES:
        return _Segment(path=seg_path, kind="text", dtype=np.dtype(np.uint8), length=seg_path.stat().st_size,
                        declared_vocab=256)
    raise DataError(f"{seg_path}: unknown data format '{suffix or '(no suffix)'}'; use a token file from "
                    "`mixprec prepare`, a 1-D .npy of ids, or text (.txt, .py, .md, ...)")


_TEXT_CONTROLS = frozenset(b"\t\n\r\f\b\x1b")
_SNIFF_BYTES = 1 << 16


def non_text_share(path: str | os.PathLike, sniff: int = _SNIFF_BYTES) -> float:
    """The share of a file's first ``sniff`` bytes that are not text: bytes of invalid UTF-8 and
    control characters other than tabs, line breaks and escapes. 0 for prose and code; random
    bytes and executables score well above 10 %."""
    with open(path, "rb") as f:
        head = f.read(sniff)
    if not head:
        return 0.0
    chars = head.decode("utf-8", errors="replace")
    if len(head) == sniff:                 # a multi-byte character cut at the end is not binary
        chars = chars.rstrip("\ufffd")
    bad = sum(1 for c in chars if c == "\ufffd" or (ord(c) < 32 and ord(c) not in _TEXT_CONTROLS)
              or ord(c) == 127)
    return bad / max(1, len(chars))


def _collect_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"data path {path} does not exist; check the path (or omit it to use the built-in corpus)")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"data folder {path} holds no files; put token files, .npy or text files in it")
    return files


def _scan_range(seg: _Segment, arr: np.ndarray) -> tuple[int, int]:
    """(min, max) of a whole file, chunk by chunk so resident memory stays bounded."""
    lo, hi = 0, -1
    for i in range(0, seg.length, _SCAN_CHUNK):
        chunk = arr[i:i + _SCAN_CHUNK]
        lo, hi = (min(lo, int(chunk.min())), max(hi, int(chunk.max()))) if hi >= 0 else \
            (int(chunk.min()), int(chunk.max()))
    return lo, hi


class TokenDataset(torch.utils.data.Dataset):
    """Windows of ``max_length + 1`` tokens over a token file, ``.npy``, text file or folder of them.

    Args:
        path: a file, or a folder whose non-hidden files (recursively, sorted) form the stream.
        max_length: tokens per sample (``T``); each sample reads ``T + 1`` tokens.
        stride: tokens between the starts of consecutive samples; default ``max_length``
            (non-overlapping: every token is a target once per epoch). Smaller values overlap.
        vocab_size: the model's vocabulary. Default: what the files declare (token-file header,
            256 for text), or ``max id + 1`` of ``.npy`` files (one scan at open).

    ``dataset[i]`` is ``(inputs, targets)``, ``int64`` tensors of shape ``(max_length,)``.
    """

    def __init__(self, path: str | os.PathLike, max_length: int, *, stride: int | None = None,
                 vocab_size: int | None = None) -> None:
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise DataError(f"max_length must be a positive integer, got {max_length!r}")
        stride = max_length if stride is None else stride
        if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
            raise DataError(f"stride must be a positive integer, got {stride!r}")
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise DataError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.root = Path(path)
        self.max_length = max_length
        self.stride = stride
        segments = [_describe(p) for p in _collect_files(self.root)]
        self.vocab_size = self._resolve_vocab(segments, vocab_size)
        self.vocab_inferred = vocab_size is None and all(s.declared_vocab is None for s in segments)
        """True when ``vocab_size`` is the data's largest id + 1 (nothing declared it)."""
        self._segments = segments
        self._starts = np.cumsum([0] + [s.length for s in segments]).tolist()  # token offset of each file
        self._maps: list[np.ndarray] | None = None
        self._begin, self._end = 0, self._starts[-1]
        self._check_length()

    # -- construction helpers -------------------------------------------------------------------
    def _resolve_vocab(self, segments: list[_Segment], vocab_size: int | None) -> int:
        declared = {s.declared_vocab: s.path for s in segments if s.declared_vocab is not None}
        if len(declared) > 1:
            (v1, p1), (v2, p2) = sorted(declared.items())[:2]
            raise DataError(f"files disagree on the vocabulary: {p1} has {v1} ids, {p2} has {v2}; "
                            "keep files from one tokenizer per dataset folder")
        if vocab_size is not None and declared and max(declared) > vocab_size:
            v, p = max(declared.items())
            raise DataError(f"{p} declares a vocabulary of {v} ids but vocab_size={vocab_size}; "
                            f"pass vocab_size >= {v} (the model's embedding table must cover it)")
        vocab = vocab_size if vocab_size is not None else (next(iter(declared)) if declared else None)
        if vocab is None:  # only .npy files and no vocab_size: infer it with one chunked scan
            hi = -1
            for seg in segments:
                if seg.length:
                    lo, seg_hi = _scan_range(seg, _open_memmap(seg))
                    if lo < 0:
                        raise DataError(f"{seg.path} holds negative token id {lo}; token ids must be >= 0")
                    hi = max(hi, seg_hi)
                    seg.needs_check = False
            vocab = hi + 1 if hi >= 0 else 1
        for seg in segments:
            if seg.dtype.kind == "u" and 2 ** (8 * seg.dtype.itemsize) <= vocab:
                seg.needs_check = False  # the storage type cannot hold an out-of-range id
        return vocab

    def count_distinct_ids(self, max_tokens: int = 1 << 24) -> int:
        """Distinct token ids among the first ``max_tokens`` tokens (a sample of big data)."""
        seen: set[int] = set()
        left = max_tokens
        for arr in self._maps_open():
            if left <= 0:
                break
            chunk = np.asarray(arr[:left])
            seen.update(np.unique(chunk).tolist())
            left -= len(chunk)
        return len(seen)

    def binary_text_files(self, threshold: float = 0.1) -> list[tuple[Path, float]]:
        """The text files (read as bytes) whose first 64 KiB look binary: ``(path, share)`` with
        the share of non-text bytes above ``threshold`` (:func:`non_text_share`)."""
        found = []
        for seg in self._segments:
            if seg.kind == "text":
                share = non_text_share(seg.path)
                if share > threshold:
                    found.append((seg.path, share))
        return found

    def _check_length(self) -> None:
        need, have = self.max_length + 1, self._end - self._begin
        if have < need:
            raise DataError(f"a sequence length of {self.max_length} (seq_len, the dataset's max_length) needs "
                            f"{need} tokens per sample but {self.root} holds only {have}; lower seq_len "
                            "or add data")

    def _maps_open(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [_open_memmap(s) for s in self._segments]
        return self._maps

    # Memory maps are re-opened in each DataLoader worker instead of being pickled (pickling a
    # numpy.memmap copies all of its data).
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    # -- the dataset protocol -------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Tokens in this dataset's range (all files, or one side of :meth:`split`)."""
        return self._end - self._begin

    def __len__(self) -> int:
        return (self.num_tokens - (self.max_length + 1)) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample {index} out of range for a dataset of {n} samples")
        window = self.read(self._begin + index * self.stride, self.max_length + 1)  # (T+1,)
        t = torch.from_numpy(window)
        return t[:-1].clone(), t[1:]  # (T,), (T,): inputs, next-token targets

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A whole batch in one vectorised gather per file (torch's DataLoader calls this when present).

        The per-sample path costs tens of microseconds of Python per window; gathering
        ``(B, max_length + 1)`` tokens with one fancy index per file keeps the loader far ahead of
        the training step even without worker processes.
        """
        n, width = len(self), self.max_length + 1
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + n, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"sample index out of range for a dataset of {n} samples")
        starts = self._begin + idx * self.stride                                   # (B,)
        seg_first = np.searchsorted(self._starts, starts, side="right") - 1        # file of each window's start
        seg_last = np.searchsorted(self._starts, starts + width - 1, side="right") - 1
        block = np.empty((idx.size, width), dtype=np.int64)                        # (B, T+1)
        maps, offsets = self._maps_open(), np.arange(width)
        for seg_i in np.unique(seg_first):
            rows = np.flatnonzero((seg_first == seg_i) & (seg_last == seg_i))
            if rows.size:
                seg = self._segments[seg_i]
                local = starts[rows] - self._starts[seg_i]
                tokens = maps[seg_i][local[:, None] + offsets]                      # (rows, T+1)
                if seg.needs_check and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
                    for row in rows:  # find the offending window again to report its exact position
                        self.read(int(starts[row]), width)
                block[rows] = tokens
        for row in np.flatnonzero(seg_first != seg_last):                          # windows spanning files
            block[row] = self.read(int(starts[row]), width)
        t = torch.from_numpy(block)
        inputs, targets = t[:, :-1].clone(), t[:, 1:]                                # (B, T), (B, T)
        return list(zip(inputs, targets))

    def read(self, start: int, count: int) -> np.ndarray:
        """Copy tokens ``[start, start + count)`` of the whole stream into a new int64 array."""
        maps = self._maps_open()
        out = np.empty(count, dtype=np.int64)
        seg_i = bisect.bisect_right(self._starts, start) - 1
        filled = 0
        while filled < count:
            seg = self._segments[seg_i]
            lo = start + filled - self._starts[seg_i]
            piece = maps[seg_i][lo:lo + count - filled]
            if seg.needs_check and piece.size:
                self._check_ids(seg, piece, lo)
            out[filled:filled + piece.size] = piece
            filled += piece.size
            seg_i += 1
        return out

    def _check_ids(self, seg: _Segment, piece: np.ndarray, offset: int) -> None:
        lo, hi = int(piece.min()), int(piece.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            where = offset + int(np.argmax(piece == bad))
            raise DataError(f"{seg.path} holds token id {bad} at position {where}, outside the vocabulary "
                            f"[0, {self.vocab_size}); re-tokenize the data or pass the right vocab_size")

    def validate(self) -> None:
        """Scan every token once (chunked) and raise DataError on the first out-of-range id."""
        maps = self._maps_open()
        for seg, arr in zip(self._segments, maps):
            if seg.needs_check:
                for i in range(0, seg.length, _SCAN_CHUNK):
                    self._check_ids(seg, arr[i:i + _SCAN_CHUNK], i)

    # -- splitting ------------------------------------------------------------------------------
    def split(self, val_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """Split into (train, validation) by contiguous token ranges: validation is the last
        ``val_fraction`` of the tokens. No window of one side touches a token of the other, so
        nothing leaks. The same files are shared (no copy)."""
        if not 0.0 < float(val_fraction) < 1.0:
            raise DataError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
        cut = self._begin + round(self.num_tokens * (1.0 - float(val_fraction)))
        parts = []
        for begin, end, name in ((self._begin, cut, "training"), (cut, self._end, "validation")):
            if end - begin < self.max_length + 1:
                raise DataError(f"val_fraction={val_fraction} leaves {end - begin} {name} tokens, fewer than one "
                                f"sample of seq_len+1={self.max_length + 1} tokens; change val_fraction or add data")
            part = object.__new__(TokenDataset)
            part.__dict__.update(self.__getstate__())
            part._begin, part._end = begin, end
            parts.append(part)
        return parts[0], parts[1]

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.root)!r}, max_length={self.max_length}, stride={self.stride}, "
                f"vocab_size={self.vocab_size}, files={len(self._segments)}, tokens={self.num_tokens}, "
                f"samples={len(self)})")
