"""The token-file format: header round trip, width choice, atomic writes, and every header error."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from mixprec.data import token_file as tf
from mixprec.errors import DataError


def test_round_trip_keeps_tokens_vocab_and_picks_narrowest_width(tmp_path):
    small = np.array([0, 5, 255, 65535], dtype=np.int64)
    path = tf.write_token_file(tmp_path / "a.tokens", small, vocab_size=65536)
    header, tokens = tf.open_token_file(path)
    assert header.dtype == np.dtype("<u2") and header.num_tokens == 4 and header.vocab_size == 65536
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
    np.testing.assert_array_equal(tokens, small)

    big = np.array([0, 65536, 100_000], dtype=np.int64)
    path = tf.write_token_file(tmp_path / "b.tokens", big, vocab_size=100_001)
    header, tokens = tf.open_token_file(path)
    assert header.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(tokens, big)
    assert path.stat().st_size == tf.HEADER_SIZE + 3 * 4


def test_empty_file_opens_as_empty_array(tmp_path):
    header, tokens = tf.open_token_file(tf.write_token_file(tmp_path / "e.tokens", [], vocab_size=10))
    assert header.num_tokens == 0 and tokens.shape == (0,)


def test_writer_rejects_out_of_range_ids_and_leaves_target_untouched(tmp_path):
    target = tmp_path / "t.tokens"
    target.write_bytes(b"previous content")
    with pytest.raises(DataError, match=r"token id 300 is outside the vocabulary \[0, 256\)"):
        with tf.TokenFileWriter(target, 256) as w:
            w.write(np.arange(10))
            w.write(np.array([1, 300]))
    assert target.read_bytes() == b"previous content"
    assert [p.name for p in tmp_path.iterdir()] == ["t.tokens"]  # no temporary left behind
    with pytest.raises(DataError, match="token id -1"):
        tf.write_token_file(tmp_path / "n.tokens", np.array([-1, 2]), vocab_size=256)
    with pytest.raises(DataError, match="must be integers"):
        tf.write_token_file(tmp_path / "f.tokens", np.array([1.5]), vocab_size=256)


def _raw(path, magic=tf.MAGIC, version=tf.VERSION, itemsize=2, count=3, vocab=256, payload=b"\1\0\2\0\3\0"):
    path.write_bytes(struct.pack("<8sIIQQ", magic, version, itemsize, count, vocab) + payload)
    return path


@pytest.mark.parametrize("kwargs, message", [
    (dict(magic=b"NOTATOKN"), "is not a mixprec token file"),
    (dict(magic=b"MXPTOKx\0"), "damaged header"),
    (dict(version=2), "token-file version 2, but this mixprec reads version 1"),
    (dict(itemsize=3), "declares 3-byte tokens"),
    (dict(count=4), "is truncated: header says 4 tokens"),
    (dict(count=2), "longer than its header says"),
    (dict(vocab=70_000), "declares vocab_size 70000, impossible for 2-byte tokens"),
])
def test_bad_headers_give_one_line_errors(tmp_path, kwargs, message):
    path = _raw(tmp_path / "bad.tokens", **kwargs)
    with pytest.raises(DataError, match=message) as info:
        tf.read_header(path)
    assert "\n" not in str(info.value)


def test_short_file_and_missing_file(tmp_path):
    (tmp_path / "s.tokens").write_bytes(tf.MAGIC[:4])
    with pytest.raises(DataError, match="not a mixprec token file"):
        tf.read_header(tmp_path / "s.tokens")
    with pytest.raises(DataError, match="does not exist"):
        tf.read_header(tmp_path / "missing.tokens")


def test_vocab_size_limits():
    assert tf.dtype_for_vocab(2**16) == np.dtype("<u2")
    assert tf.dtype_for_vocab(2**16 + 1) == np.dtype("<u4")
    with pytest.raises(DataError, match="positive integer"):
        tf.dtype_for_vocab(0)
    with pytest.raises(DataError, match="does not fit"):
        tf.dtype_for_vocab(2**32 + 1)
