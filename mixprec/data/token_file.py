"""The mixprec token file: a small self-describing header followed by the raw token ids.

Layout (little-endian, 32-byte header, then ``count`` tokens of ``dtype``)::

    offset  size  field
    0       8     magic       b"MXPTOKv\\0"
    8       4     version     uint32, currently 1
    12      4     itemsize    uint32, 2 (uint16 tokens) or 4 (uint32 tokens)
    16      8     count       uint64, number of tokens that follow
    24      8     vocab_size  uint64, every token id is < vocab_size
    32      ...   tokens

The header is just big enough to make a file usable without any side-car: a reader knows the
token width, how many tokens there must be (so a truncated copy is caught by comparing with the
file size), and the vocabulary size the model needs. Tokens are stored in the narrowest width that
holds the vocabulary (uint16 up to 65,536 ids), which halves disk and page-cache use for the usual
GPT-2/Llama vocabularies.

Reading never loads the tokens: :func:`open_token_file` checks the header against the file size
and returns a read-only ``numpy.memmap``, so a multi-GB file opens in microseconds and only the
pages a window touches become resident. Writing goes through :class:`TokenFileWriter`, which
streams chunks to a temporary file next to the target and renames it into place only when the
file is complete, so a crash never leaves a half-written file under the final name.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from mixprec.errors import DataError

__all__ = [
    "MAGIC", "VERSION", "HEADER_SIZE", "TOKEN_FILE_SUFFIX", "TokenFileHeader", "TokenFileWriter",
    "dtype_for_vocab", "read_header", "open_token_file", "write_token_file", "is_token_file",
]

MAGIC = b"MXPTOKv\0"
"""First eight bytes of every token file."""
VERSION = 1
"""Format version this code writes and reads."""
HEADER_SIZE = 32
"""Bytes before the first token (a multiple of 4, so uint32 tokens stay aligned)."""
TOKEN_FILE_SUFFIX = ".tokens"
"""Suffix ``mixprec prepare`` suggests; readers recognise the format by its magic, not its name."""

_HEADER = struct.Struct("<8sIIQQ")
assert _HEADER.size == HEADER_SIZE
_DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


@dataclass(frozen=True, kw_only=True)
class TokenFileHeader:
    """What the first 32 bytes of a token file say."""

    version: int
    """Format version (1)."""
    dtype: np.dtype
    """Token storage type: little-endian uint16 or uint32."""
    num_tokens: int
    """Number of tokens after the header."""
    vocab_size: int
    """Every token id in the file is below this."""

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, self.dtype.itemsize, self.num_tokens, self.vocab_size)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest supported token type for ``vocab_size`` ids (uint16 up to 65,536)."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if vocab_size > 2**32:
        raise DataError(f"vocab_size {vocab_size} does not fit the token file's uint32 ids (max 2**32)")
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def is_token_file(path: str | os.PathLike) -> bool:
    """True when the file starts with the token-file magic (whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike) -> TokenFileHeader:
    """Read and check a token file's header against the file's size; never reads the tokens."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist; check the path or create it with `mixprec prepare`")
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE or raw[:6] != MAGIC[:6]:
        raise DataError(f"{path} is not a mixprec token file (wrong magic {raw[:8]!r}, expected {MAGIC!r}); "
                        "create one with `mixprec prepare`")
    magic, version, itemsize, count, vocab = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(f"{path} has a damaged header (magic {magic!r}, expected {MAGIC!r}); "
                        "re-create it with `mixprec prepare`")
    if version != VERSION:
        raise DataError(f"{path} is token-file version {version}, but this mixprec reads version {VERSION}; "
                        "re-create it with this version's `mixprec prepare`")
    if itemsize not in _DTYPES:
        raise DataError(f"{path} declares {itemsize}-byte tokens; only 2 (uint16) and 4 (uint32) exist; "
                        "re-create it with `mixprec prepare`")
    if vocab < 1 or vocab > 2 ** (8 * itemsize):
        raise DataError(f"{path} declares vocab_size {vocab}, impossible for {itemsize}-byte tokens; "
                        "re-create it with `mixprec prepare`")
    expected = HEADER_SIZE + count * itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{path} is {what}: header says {count} tokens ({expected} bytes) but the file has "
                        f"{size} bytes; re-copy or re-create it with `mixprec prepare`")
    return TokenFileHeader(version=version, dtype=_DTYPES[itemsize], num_tokens=count, vocab_size=vocab)


def open_token_file(path: str | os.PathLike) -> tuple[TokenFileHeader, np.ndarray]:
    """Return the header and a read-only memory map of the tokens, shape ``(num_tokens,)``.

    An empty file maps to an empty array (``mmap`` cannot map zero bytes).
    """
    header = read_header(path)
    if header.num_tokens == 0:
        return header, np.empty(0, dtype=header.dtype)
    tokens = np.memmap(path, dtype=header.dtype, mode="r", offset=HEADER_SIZE, shape=(header.num_tokens,))
    return header, tokens


class TokenFileWriter:
    """Stream token chunks into a token file, atomically.

    Tokens go to ``<path>.tmp-<pid>`` in the target's folder; :meth:`close` writes the final
    header, flushes to disk and renames the file into place. Leaving the ``with`` block on an
    exception deletes the temporary file, so the target is either the complete new file or
    whatever was there before.

    Every chunk is checked (``0 <= id < vocab_size``) before it is written, so a file this class
    produced never holds an out-of-range id.
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int) -> None:
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.num_tokens = 0
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._tmp, "wb")
        self._file.write(b"\0" * HEADER_SIZE)  # placeholder until the count is known

    def write(self, tokens: np.ndarray | list[int]) -> None:
        """Append a 1-D chunk of token ids."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"token chunks must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return
        if arr.dtype.kind not in "iu":
            raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}); "
                            "pass the tokenizer's real --vocab-size")
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += arr.size

    def close(self) -> Path:
        """Finish the header, fsync, and move the file into place. Returns the final path."""
        header = TokenFileHeader(version=VERSION, dtype=self.dtype, num_tokens=self.num_tokens,
                                 vocab_size=self.vocab_size)
        self._file.seek(0)
        self._file.write(header.pack())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file; the target path is untouched."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_file(path: str | os.PathLike, tokens: np.ndarray | list[int], vocab_size: int) -> Path:
    """Write ``tokens`` (1-D ids, all ``< vocab_size``) as a token file, atomically."""
    with TokenFileWriter(path, vocab_size) as writer:
        writer.write(tokens)
    return writer.path
