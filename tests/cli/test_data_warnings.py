"""`mixprec prepare` does not overwrite without --overwrite; binary data named .txt is warned about
in one line; tf32 on a CPU says it is plain FP32 here; piped, it draws no progress bar."""
import os
import random
import sys

import pytest
import torch

from mixprec.cli.main import main
from mixprec.data.token_dataset import non_text_share


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("the loss scale backs off and grows again.\n" * 400)
    return path


@pytest.fixture
def random_txt(tmp_path):
    path = tmp_path / "random.txt"
    path.write_bytes(random.Random(0).randbytes(20_000))
    return path


def test_prepare_refuses_to_overwrite_its_output_without_the_flag(tmp_path, text, capsys):
    out = tmp_path / "train.tokens"
    assert main(["prepare", str(text), "-o", str(out), "--quiet"]) == 0
    before = out.read_bytes()
    text.write_text("different text now\n" * 100)
    assert main(["prepare", str(text), "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"output {out} exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before
    assert main(["prepare", str(text), "-o", str(out), "--quiet", "--overwrite"]) == 0
    assert out.read_bytes() != before


def test_non_text_share_tells_text_from_random_bytes_and_executables(text, random_txt):
    assert non_text_share(text) == 0.0
    assert non_text_share(random_txt) > 0.3
    assert non_text_share(sys.executable) > 0.1   # an ELF (or other) binary


def test_prepare_warns_about_binary_input(tmp_path, random_txt, capsys):
    assert main(["prepare", str(random_txt), "-o", str(tmp_path / "o.tokens"), "--quiet"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "looks binary" in line]
    assert len(warnings) == 1 and "% non-text bytes" in warnings[0] and str(random_txt) in warnings[0]


def test_training_on_binary_data_warns_before_training(tmp_path, random_txt, capsys):
    rc = main(["train", f"data={random_txt}", "model=tiny", "seq_len=16", "batch_size=2", "max_steps=1",
               "eval_batches=1", "progress=false", "audit=false", f"run_dir={tmp_path / 'r'}"])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    warning = next(i for i, line in enumerate(err) if "data looks binary:" in line)
    assert warning < next(i for i, line in enumerate(err) if "done:" in line)


def test_tf32_on_a_cpu_says_it_is_plain_fp32():
    from mixprec.monitor import audit
    from mixprec.precision import Precision
    findings = audit(torch.nn.Linear(4, 4), precision=Precision("tf32"), device=torch.device("cpu"))
    assert [f.code for f in findings if "plain FP32" in f.message] == ["tf32-not-here"]
    assert not [f for f in audit(torch.nn.Linear(4, 4), precision=Precision("32-true"),
                                 device=torch.device("cpu")) if f.code == "tf32-not-here"]


def test_prepare_into_a_pipe_writes_no_progress_bar_only_its_summary(tmp_path, text, capsys):
    out = tmp_path / "train.tokens"
    assert main(["prepare", str(text), "-o", str(out)]) == 0      # no --quiet; stderr is no TTY
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "prepare train.tokens" not in captured.err
    assert captured.out.startswith(f"wrote {out}")
