"""The built-in corpus: deterministic, cached, split by file, readable by TokenDataset."""
from __future__ import annotations

import hashlib
import sys

import pytest

from mixprec.data import TokenDataset, builtin_corpus, read_header
from mixprec.data import corpus as corpus_mod
from mixprec.errors import DataError


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corpus_is_deterministic_and_cached(tmp_path):
    a = builtin_corpus(tmp_path / "one")
    b = builtin_corpus(tmp_path / "two")
    assert a.content_hash == b.content_hash and a.name == b.name
    assert (_sha(a.train_path), _sha(a.val_path)) == (_sha(b.train_path), _sha(b.val_path))
    assert a.name.startswith(f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-")
    assert a.train_path.parent == tmp_path / "one" / "corpus" / a.name

    stat = a.train_path.stat()
    again = builtin_corpus(tmp_path / "one")
    assert again == a
    assert (again.train_path.stat().st_ino, again.train_path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)

    a.val_path.write_bytes(a.val_path.read_bytes()[:-10])  # a damaged cache entry is rebuilt
    assert _sha(builtin_corpus(tmp_path / "one").val_path) == _sha(b.val_path)


def test_corpus_contents_sizes_and_split(tmp_path):
    c = builtin_corpus(tmp_path)
    assert c.vocab_size == 256 and c.num_files >= 20
    assert read_header(c.train_path).num_tokens == c.num_train_tokens
    assert read_header(c.val_path).num_tokens == c.num_val_tokens
    assert c.num_train_tokens + c.num_val_tokens <= corpus_mod.MAX_BYTES
    assert 0.02 < c.num_val_tokens / (c.num_train_tokens + c.num_val_tokens) < 0.10

    import sysconfig
    from pathlib import Path
    root = Path(sysconfig.get_paths()["stdlib"])
    files = corpus_mod._stdlib_files(root)[: c.num_files]
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.relative_to(root).parts)
    train = TokenDataset(c.train_path, max_length=64)
    # the training stream starts with the first sorted file, the validation stream with file #19
    assert bytes(train.read(0, 64).tolist()) == files[0].read_bytes()[:64]
    assert bytes(TokenDataset(c.val_path, max_length=64).read(0, 64).tolist()) == files[19].read_bytes()[:64]


def test_cache_folder_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_CACHE", str(tmp_path / "env-cache"))
    c = builtin_corpus(max_bytes=1_500_000)
    assert c.train_path.is_relative_to(tmp_path / "env-cache")
    assert c.num_train_tokens + c.num_val_tokens <= 1_500_000


def test_too_small_a_cap_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="fit in max_bytes=1000"):
        builtin_corpus(tmp_path, max_bytes=1000)
