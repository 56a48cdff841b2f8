"""`mixprec prepare`: exact round trip, folders, safety of the inputs, optional HF tokenizers."""
from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np
import pytest

from mixprec.data import TokenDataset, prepare_files, read_header
from mixprec.cli import prepare as prepare_cmd
from mixprec.errors import ConfigError, DataError


def _corpus(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.txt").write_bytes("héllo wörld\n".encode() * 30)
    (src / "pkg" / "b.py").write_bytes(bytes(range(256)) * 3)  # every byte value, not valid UTF-8
    (src / "notes.bin").write_bytes(b"\0\1 skipped: not a text suffix")
    return src


def _hashes(root):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_byte_level_round_trip_is_exact_and_sources_untouched(tmp_path):
    src = _corpus(tmp_path)
    before = _hashes(src)
    result = prepare_files([src], tmp_path / "out" / "train.tokens", progress=False)
    expected = (src / "a.txt").read_bytes() + (src / "pkg" / "b.py").read_bytes()
    assert (result.num_files, result.num_tokens, result.vocab_size) == (2, len(expected), 256)
    assert read_header(result.path).vocab_size == 256
    ds = TokenDataset(result.path, max_length=len(expected) - 1)
    x, y = ds[0]
    assert bytes(x.tolist()) + bytes([y[-1].item()]) == expected
    assert _hashes(src) == before


def test_cli_configure_and_run(tmp_path, capsys):
    src = _corpus(tmp_path)
    parser = argparse.ArgumentParser()
    prepare_cmd.configure(parser)
    out = tmp_path / "cli.tokens"
    args = parser.parse_args([str(src / "a.txt"), str(src / "notes.bin"), "-o", str(out), "--quiet",
                              "--vocab-size", "512"])
    assert prepare_cmd.run(args) == 0
    assert "2 file(s), vocab_size 512 (bytes)" in capsys.readouterr().out
    header = read_header(out)
    assert header.vocab_size == 512 and header.num_tokens == (src / "a.txt").stat().st_size + (src / "notes.bin").stat().st_size


def test_refuses_to_overwrite_an_input_and_reports_bad_inputs(tmp_path):
    src = _corpus(tmp_path)
    before = _hashes(src)
    with pytest.raises(DataError, match="is also an input; refusing to overwrite it"):
        prepare_files([src], src / "a.txt", progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare_files([tmp_path / "missing"], tmp_path / "o.tokens", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no text files"):
        prepare_files([tmp_path / "empty"], tmp_path / "o.tokens", progress=False)
    with pytest.raises(DataError, match="is a folder"):
        prepare_files([src], tmp_path, progress=False)
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 256 ids"):
        prepare_files([src], tmp_path / "o.tokens", vocab_size=100, progress=False)
    assert _hashes(src) == before and not (tmp_path / "o.tokens").exists()


def test_missing_tokenizers_package_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'mixprec\[tokenizers\]'"):
        prepare_files([_corpus(tmp_path)], tmp_path / "o.tokens", tokenizer=tmp_path / "tok.json", progress=False)


def test_hugging_face_tokenizer_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, ".": 4}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("the cat sat .\nthe dog sat .\n" * 50)
    result = prepare_files([tmp_path / "t.txt"], tmp_path / "o.tokens", tokenizer=tmp_path / "tokenizer.json",
                           progress=False)
    assert result.vocab_size == 5 and result.num_tokens == 400
    ds = TokenDataset(result.path, max_length=399)
    np.testing.assert_array_equal(ds.read(0, 8), [1, 2, 3, 4, 1, 0, 3, 4])
    with pytest.raises(DataError, match="tokenizer file .* does not exist"):
        prepare_files([tmp_path / "t.txt"], tmp_path / "p.tokens", tokenizer=tmp_path / "nope.json", progress=False)
