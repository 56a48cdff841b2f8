"""Data: memory-mapped token datasets, a sharded resumable loader, and the built-in corpus.

* :class:`TokenDataset` - windows of ``max_length + 1`` tokens over token files, ``.npy`` arrays or
  text, memory-mapped;
* :class:`DistributedDataLoader` - batches ``(inputs, targets)`` of shape ``(B, T)``, disjoint
  shards per rank, deterministic reshuffling per epoch, exact mid-epoch resume;
* :func:`builtin_corpus` - the running Python's standard library, byte-tokenized and cached: the
  default training data, no download;
* :mod:`~mixprec.data.token_file` - the token-file format written by ``mixprec prepare``.
"""
from mixprec.data.corpus import Corpus, builtin_corpus
from mixprec.data.loader import DistributedDataLoader
from mixprec.data.prepare import prepare_files
from mixprec.data.token_dataset import TokenDataset
from mixprec.data.token_file import TokenFileWriter, open_token_file, read_header, write_token_file

__all__ = [
    # datasets and loading
    "TokenDataset", "DistributedDataLoader",
    # corpora and preparation
    "Corpus", "builtin_corpus", "prepare_files",
    # the token-file format
    "TokenFileWriter", "write_token_file", "read_header", "open_token_file",
]
