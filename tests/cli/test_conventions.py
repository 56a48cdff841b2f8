"""CLI conventions: --version, one flag name per concept, help with defaults for every flag,
"did you mean" for settings and flags, readable --list, keep_last=all, the model's own sequence
length in estimate/memory."""
import argparse
import json
import re
from pathlib import Path

import pytest

import mixprec
from mixprec.cli.main import _build_parser, main
from mixprec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LLAMA_TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "max_position_embeddings": 256, "hidden_act": "silu"}


@pytest.fixture
def llama_json(tmp_path) -> str:
    path = tmp_path / "hf-llama-tiny.json"
    path.write_text(json.dumps(LLAMA_TINY))
    return str(path)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_single_sourced_version(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main([flag])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mixprec {mixprec.__version__}"
    assert mixprec.__version__ == "0.4.0.dev0"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "mixprec._version.__version__" in pyproject


def test_license_and_changelog_exist():
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert all(f"## {v}" in changelog for v in ("0.1.0", "0.2.0", "0.3.0"))


def _actions(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("mixprec",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                assert action._choices_actions, path
                yield from _actions(sub, (*path, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, parser, action


def test_every_flag_and_subcommand_has_help_with_its_default():
    parser = _build_parser()
    for path, sub, action in _actions(parser):
        if action.help is argparse.SUPPRESS:      # a deprecated alias: hidden on purpose
            continue
        assert action.help, f"{' '.join(path)} {action.option_strings or action.dest} has no help"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            text = sub.formatter_class(prog="x")._get_help_string(action) % vars(action)
            assert "default" in text, f"{' '.join(path)} {action.option_strings[0]}: {text}"
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(c.help for c in commands._choices_actions)


@pytest.mark.parametrize("argv", [["memory", "--model", "tiny"], ["estimate", "--model", "tiny", "--tokens", "1M"]])
def test_batch_size_and_seq_len_are_one_name_across_commands(argv, capsys):
    assert main([*argv, "--batch-size", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr()
    assert "deprecated" not in out.err
    assert "64" in out.out


@pytest.mark.parametrize("argv, old, new", [
    (["memory", "--model", "tiny", "--batch", "2"], "--batch", "--batch-size"),
    (["memory", "--model", "tiny", "--seq", "64"], "--seq", "--seq-len"),
    (["estimate", "--model", "tiny", "--tokens", "1M", "--micro-batch", "2"], "--micro-batch", "--batch-size"),
    (["estimate", "--model", "tiny", "--tokens", "1M", "--seq", "64"], "--seq", "--seq-len"),
])
def test_old_flag_names_still_work_and_say_so_in_one_line(argv, old, new, capsys):
    assert main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert err == [f"mixprec: {old} is deprecated; use {new}"]


def test_memory_reads_a_hugging_face_config_like_estimate(llama_json, capsys):
    assert main(["memory", "--model", llama_json, "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 1 x 256 per device" in out and "max_position_embeddings" in out


def test_estimate_takes_the_sequence_length_from_the_config_and_says_where_from(llama_json, capsys):
    assert main(["estimate", "--model", llama_json, "--tokens", "1M", "--gpu", "H100", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"sequence length: 256 tokens \(max_position_embeddings of .*hf-llama-tiny.json\)", out), out
    assert main(["estimate", "--model", llama_json, "--tokens", "1M", "--gpu", "H100", "--gpus", "1",
                 "--seq-len", "128"]) == 0
    assert "sequence length: 128 tokens (--seq-len)" in capsys.readouterr().out


def test_gpt2_style_config_gives_n_positions(tmp_path):
    from mixprec.estimate.cluster import model_from_hf_config
    cfg = {k: v for k, v in LLAMA_TINY.items() if k != "max_position_embeddings"}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_positions": 512}))
    spec = model_from_hf_config(tmp_path)
    assert spec.default_seq == 512 and spec.seq_source.startswith("n_positions")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = model_from_hf_config(tmp_path)
    assert spec.default_seq == 4096 and spec.seq_source.startswith("assumed")


def test_list_prints_a_table_not_python_reprs(capsys):
    assert main(["train", "--list"]) == 0
    out = capsys.readouterr().out
    assert "precision_overrides = ()" not in out and "'auto'" not in out and "None" not in out.split("description")[0]
    row = next(line for line in out.splitlines() if line.split()[:1] == ["lr"])
    assert row.split()[1] == "0.002" and "learning rate" in row.lower()


@pytest.mark.parametrize("setting, suggestion", [("learning_rate=3e-4", "lr"), ("max_length=64", "seq_len"),
                                                 ("max_stpes=5", "max_steps")])
def test_unknown_setting_says_did_you_mean(setting, suggestion, capsys):
    assert main(["train", setting]) == 2
    assert f"(did you mean '{suggestion}'?)" in capsys.readouterr().err


def test_a_setting_written_as_a_flag_is_shown_as_key_value(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--max_steps", "5"])
    assert info.value.code == 2
    assert "write max_steps=5" in capsys.readouterr().err


def test_a_setting_written_as_a_flag_gets_the_one_line_hint_without_the_usage_block(capsys):
    """Before: argparse's usage block (three lines) came before the one-line hint."""
    with pytest.raises(SystemExit) as info:
        main(["train", "--max_steps", "2"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "mixprec train: error: --max_steps is not a flag: settings are key=value, write max_steps=2"]


def test_a_flag_with_underscores_suggests_the_dashed_one(capsys):
    with pytest.raises(SystemExit):
        main(["memory", "--batch_size", "3"])
    assert "did you mean '--batch-size'?" in capsys.readouterr().err


@pytest.mark.parametrize("text, kept", [("all", 0), ("0", 0), ("5", 5)])
def test_keep_last_all_or_zero_keeps_every_checkpoint(text, kept):
    from mixprec.train.config import load_config
    cfg, _ = load_config(None, {"keep_last": text})
    assert cfg.keep_last == kept
    with pytest.raises(ConfigError, match="keep_last must be >= 0"):
        load_config(None, {"keep_last": "-1"})


def test_too_short_data_names_seq_len(tmp_path):
    from mixprec.data import TokenDataset
    from mixprec.errors import DataError
    (tmp_path / "t.txt").write_text("abc")
    with pytest.raises(DataError) as info:
        TokenDataset(tmp_path / "t.txt", 64)
    assert "lower seq_len" in str(info.value) and "lower max_length" not in str(info.value)


def test_a_reader_that_goes_away_ends_the_command_quietly_with_sigpipes_code():
    """`mixprec memory ... | head` used to end with "mixprec: error: Broken pipe; check the path
    and the disk" (a BrokenPipeError is an OSError). The pipe's read end is closed before the
    command starts writing, so its first write fails."""
    import os
    import signal
    import subprocess
    import sys
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "mixprec", "train", "--list"], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr
    assert "error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_misspelt_overrides_table_is_named_not_taken_for_a_setting(tmp_path):
    """Before: ``[overides] head = "bf16"`` said "unknown setting 'head' (did you mean
    'num_heads'?)", sending the user to a setting they never meant."""
    from mixprec.errors import ConfigError
    from mixprec.train.config import load_config
    path = tmp_path / "cfg.toml"
    path.write_text('[overides]\nhead = "bf16"\n"blocks.0.*" = "fp32"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith("unknown table [overides] (file cfg.toml) (did you mean [overrides]?)")
    path.write_text('[optim]\nlrr = 0.1\n')              # a grouping table: the setting is named
    with pytest.raises(ConfigError, match=r"unknown setting 'lrr' \(file cfg.toml\) \(did you mean 'lr'\?\)"):
        load_config(path)


def test_two_different_precisions_on_one_command_line_are_refused_in_one_line(capsys):
    """Before: ``--precision bf16-mixed precision=16-mixed`` trained in one of the two, silently."""
    assert main(["train", "--precision", "bf16-mixed", "precision=16-mixed"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mixprec: error: --precision bf16-mixed and precision=16-mixed disagree; pass one of them"]
    from mixprec.cli.train import _same_mode
    assert _same_mode("bf16", "bf16-mixed") and not _same_mode("auto", "bf16-mixed")


def test_list_shows_fits_defaults_where_they_differ_from_the_clis(capsys):
    from mixprec.train.config import FitConfig, TrainConfig
    assert main(["train", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(l for l in lines if l.startswith("training loop"))
    assert "fit()" in header and "differ" in header
    for name in ("max_steps", "lr", "warmup_steps", "eval_interval"):
        assert getattr(FitConfig(), name) != getattr(TrainConfig(), name)
        row = next(l for l in lines if l.split()[:1] == [name]).split()
        fit_default = "none" if getattr(FitConfig(), name) is None else f"{getattr(FitConfig(), name):g}"
        assert row[1:3] == [f"{getattr(TrainConfig(), name):g}", fit_default], row
    epochs = next(l for l in lines if l.split()[:1] == ["epochs"]).split()
    assert epochs[1] == "1" and not epochs[2][0].isdigit()     # the same default: no fit() value
