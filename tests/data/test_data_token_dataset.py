"""TokenDataset: formats, windows, stride, honest len, split without leakage, and every bad input."""
from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
import torch

from mixprec.data import TokenDataset, write_token_file
from mixprec.data import token_file as tf
from mixprec.errors import DataError


def _tree_hash(root) -> dict[str, str]:
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_windows_are_next_token_pairs_with_default_non_overlapping_stride(tmp_path):
    tokens = np.arange(1000) % 97
    ds = TokenDataset(write_token_file(tmp_path / "a.tokens", tokens, vocab_size=97), max_length=10)
    assert ds.stride == 10 and ds.vocab_size == 97
    assert len(ds) == (1000 - 11) // 10 + 1 == 99
    for i in (0, 1, 50, len(ds) - 1, -1):
        x, y = ds[i]
        start = (i % len(ds)) * 10
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (10,)
        assert x.tolist() == tokens[start:start + 10].tolist()
        assert y.tolist() == tokens[start + 1:start + 11].tolist()
    # every token from 1 to the last full window is a target exactly once
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    assert targets.numel() == len(ds) * 10
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_overlapping_stride_and_exact_length_boundary(tmp_path):
    path = write_token_file(tmp_path / "a.tokens", np.arange(21), vocab_size=21)
    assert len(TokenDataset(path, max_length=20)) == 1          # exactly max_length + 1 tokens
    ds = TokenDataset(path, max_length=4, stride=1)
    assert len(ds) == 17 and ds[16][1].tolist() == [17, 18, 19, 20]


def test_inputs_do_not_alias_targets(tmp_path):
    ds = TokenDataset(write_token_file(tmp_path / "a.tokens", np.arange(50), vocab_size=50), max_length=8)
    x, y = ds[0]
    x[1] = 42
    assert y[0].item() == 1


def test_text_npy_and_folder_concatenation_across_file_boundaries(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(b"hello ")
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "b.py").write_bytes(b"world, again")
    (tmp_path / "d" / ".hidden.txt").write_bytes(b"SKIPPED")
    ds = TokenDataset(tmp_path / "d", max_length=5)
    assert ds.vocab_size == 256 and ds.num_tokens == 18
    stream = b"".join(bytes(ds[i][0].tolist()) for i in range(len(ds)))
    assert stream == b"hello world, ag"  # window 1 crosses from a.txt into sub/b.py

    ids = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    ds = TokenDataset(tmp_path / "ids.npy", max_length=3)
    assert ds.vocab_size == 10  # inferred: max id + 1
    assert ds[1][0].tolist() == [1, 5, 9] and ds[1][1].tolist() == [5, 9, 2]  # stride 3
    assert TokenDataset(tmp_path / "ids.npy", max_length=3, vocab_size=512).vocab_size == 512


def test_split_is_contiguous_and_leak_free(tmp_path):
    tokens = np.arange(10_000)
    ds = TokenDataset(write_token_file(tmp_path / "a.tokens", tokens, vocab_size=10_000), max_length=16)
    train, val = ds.split(0.1)
    train_ids = set(torch.cat([torch.cat(train[i]) for i in range(len(train))]).tolist())
    val_ids = set(torch.cat([torch.cat(val[i]) for i in range(len(val))]).tolist())
    assert not train_ids & val_ids
    assert max(train_ids) < 9000 <= min(val_ids)
    assert train.num_tokens == 9000 and val.num_tokens == 1000
    assert len(train) == (9000 - 17) // 16 + 1 and len(val) == (1000 - 17) // 16 + 1
    assert val[0][0].tolist() == tokens[9000:9016].tolist()
    with pytest.raises(DataError, match="leaves 9 validation tokens"):
        ds.split(0.0009)
    with pytest.raises(DataError, match="val_fraction must be between 0 and 1"):
        ds.split(1.0)


def test_memory_maps_are_reopened_not_pickled(tmp_path):
    ds = TokenDataset(write_token_file(tmp_path / "a.tokens", np.arange(100_000) % 50, vocab_size=50), max_length=64)
    ds[0]  # opens the maps
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000  # the 200 KB of tokens did not travel
    clone = pickle.loads(blob)
    assert torch.equal(clone[7][0], ds[7][0])


def _bad_inputs(tmp_path):
    """(description, path-builder, kwargs, expected message) for each bad input of issue 4."""
    def missing():
        return tmp_path / "nope"

    def empty_dir():
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / ".gitkeep").write_bytes(b"")
        return tmp_path / "empty"

    def unknown():
        (tmp_path / "x.parquet").write_bytes(b"PAR1....")
        return tmp_path / "x.parquet"

    def wrong_magic():
        (tmp_path / "w.tokens").write_bytes(b"GARBAGE!" + bytes(40))
        return tmp_path / "w.tokens"

    def wrong_version():
        p = write_token_file(tmp_path / "v.tokens", np.arange(40), vocab_size=40)
        raw = bytearray(p.read_bytes())
        raw[8:12] = (7).to_bytes(4, "little")
        p.write_bytes(bytes(raw))
        return p

    def truncated():
        p = write_token_file(tmp_path / "t.tokens", np.arange(40), vocab_size=40)
        p.write_bytes(p.read_bytes()[:-6])
        return p

    def id_too_big():
        p = write_token_file(tmp_path / "i.tokens", np.arange(40), vocab_size=40)
        raw = bytearray(p.read_bytes())
        raw[tf.HEADER_SIZE + 2 * 5: tf.HEADER_SIZE + 2 * 6] = (41).to_bytes(2, "little")  # token 5 := 41
        p.write_bytes(bytes(raw))
        return p

    def npy_negative():
        np.save(tmp_path / "neg.npy", np.array([1, 2, -3, 4] * 10))
        return tmp_path / "neg.npy"

    def npy_2d():
        np.save(tmp_path / "two.npy", np.zeros((4, 10), dtype=np.int32))
        return tmp_path / "two.npy"

    def npy_truncated():
        np.save(tmp_path / "cut.npy", np.arange(100, dtype=np.int32))
        p = tmp_path / "cut.npy"
        p.write_bytes(p.read_bytes()[:-40])
        return p

    def too_short():
        (tmp_path / "short.txt").write_bytes(b"tiny")
        return tmp_path / "short.txt"

    def mixed_vocab():
        (tmp_path / "mix").mkdir()
        write_token_file(tmp_path / "mix" / "a.tokens", np.arange(40), vocab_size=50_000)
        (tmp_path / "mix" / "b.txt").write_bytes(b"x" * 40)
        return tmp_path / "mix"

    def big_vocab():
        return write_token_file(tmp_path / "big.tokens", np.arange(40), vocab_size=50_000)

    return [
        ("missing path", missing, {}, "does not exist"),
        ("empty directory", empty_dir, {}, "holds no files"),
        ("unknown format", unknown, {}, "unknown data format '.parquet'"),
        ("wrong magic", wrong_magic, {}, "is not a mixprec token file"),
        ("wrong version", wrong_version, {}, "token-file version 7"),
        ("truncated", truncated, {}, "is truncated: header says 40 tokens"),
        ("npy truncated", npy_truncated, {}, "cut.npy is truncated"),
        ("id >= vocab (per window)", id_too_big, {"index": 0}, r"token id 41 at position 5, outside the vocabulary \[0, 40\)"),
        ("npy negative id", npy_negative, {}, "negative token id -3"),
        ("npy 2-D", npy_2d, {}, "a token .npy must be a 1-D"),
        ("max_length too long", too_short, {}, r"sequence length of 8 \(seq_len, the dataset.s max_length\) needs 9 tokens per sample but .*short.txt holds only 4; lower seq_len"),
        ("files disagree on vocab", mixed_vocab, {}, "files disagree on the vocabulary"),
        ("vocab_size below declared", big_vocab, {"vocab_size": 300}, "declares a vocabulary of 50000 ids"),
    ]


_CASES = ["missing path", "empty directory", "unknown format", "wrong magic", "wrong version", "truncated",
          "npy truncated", "id >= vocab (per window)", "npy negative id", "npy 2-D", "max_length too long",
          "files disagree on vocab", "vocab_size below declared"]


@pytest.mark.parametrize("case", range(len(_CASES)), ids=_CASES)
def test_every_bad_input_gives_one_line_error_and_leaves_sources_untouched(tmp_path, case):
    name, build, kwargs, message = _bad_inputs(tmp_path)[case]
    assert name == _CASES[case]
    path = build()
    before = _tree_hash(path) if path.exists() else {}
    kwargs = dict(kwargs)
    index = kwargs.pop("index", None)
    with pytest.raises(DataError, match=message) as info:
        ds = TokenDataset(path, max_length=8, **kwargs)
        if index is not None:
            ds[index]
    assert "\n" not in str(info.value), name
    assert (_tree_hash(path) if path.exists() else {}) == before, f"{name}: source files changed"


def test_validate_finds_out_of_range_id_anywhere(tmp_path):
    p = write_token_file(tmp_path / "i.tokens", np.arange(1000) % 40, vocab_size=40)
    raw = bytearray(p.read_bytes())
    raw[-2:] = (45).to_bytes(2, "little")  # the very last token, past every full window
    p.write_bytes(bytes(raw))
    ds = TokenDataset(p, max_length=8)  # opening stays cheap: no full scan
    with pytest.raises(DataError, match="token id 45 at position 999"):
        ds.validate()


def test_bad_arguments(tmp_path):
    p = write_token_file(tmp_path / "a.tokens", np.arange(40), vocab_size=40)
    for kwargs, message in [(dict(max_length=0), "max_length must be a positive integer"),
                            (dict(max_length=4, stride=0), "stride must be a positive integer"),
                            (dict(max_length=4, vocab_size=-1), "vocab_size must be a positive integer")]:
        with pytest.raises(DataError, match=message):
            TokenDataset(p, **kwargs)


def test_batched_fetch_matches_per_sample_fetch_across_files(tmp_path):
    (tmp_path / "d").mkdir()
    write_token_file(tmp_path / "d" / "a.tokens", np.arange(0, 95), vocab_size=300)
    write_token_file(tmp_path / "d" / "b.tokens", np.arange(95, 130), vocab_size=300)
    write_token_file(tmp_path / "d" / "c.tokens", np.arange(130, 300), vocab_size=300)
    ds = TokenDataset(tmp_path / "d", max_length=9, stride=7)
    indices = list(range(len(ds))) + [-1, 3, 3]
    batched = ds.__getitems__(indices)
    for i, (x, y) in zip(indices, batched):
        assert torch.equal(x, ds[i][0]) and torch.equal(y, ds[i][1])
    _, val = ds.split(0.3)
    assert all(torch.equal(a[0], val[i][0]) for i, a in enumerate(val.__getitems__(list(range(len(val))))))
    with pytest.raises(IndexError):
        ds.__getitems__([len(ds)])


def test_batched_fetch_reports_the_exact_bad_position(tmp_path):
    p = write_token_file(tmp_path / "i.tokens", np.arange(100) % 40, vocab_size=40)
    raw = bytearray(p.read_bytes())
    raw[tf.HEADER_SIZE + 2 * 33: tf.HEADER_SIZE + 2 * 34] = (99).to_bytes(2, "little")
    p.write_bytes(bytes(raw))
    ds = TokenDataset(p, max_length=8)
    ds.__getitems__([0, 1, 2])  # windows before position 33 are fine
    with pytest.raises(DataError, match="token id 99 at position 33"):
        ds.__getitems__([0, 4, 9])
