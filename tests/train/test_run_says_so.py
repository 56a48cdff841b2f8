"""A run says in one line what a user would otherwise find out the hard way (#37): settings that
do nothing here, a schedule that never left warm-up, the final validation loss of a finished run."""
from __future__ import annotations

import pytest

from mixprec.cli.main import main

TINY = ["model=tiny", "seq_len=32", "batch_size=4", "log_interval=1", "eval_interval=0",
        "eval_batches=2", "lr=3e-3", "progress=false", "audit=false"]


def train(capsys, *args) -> str:
    assert main(["train", *TINY, *map(str, args)]) == 0
    return capsys.readouterr().err


def test_settings_that_do_nothing_in_one_cpu_process_are_said_at_start(text_corpus, tmp_path, capsys):
    err = train(capsys, f"data={text_corpus}", "max_steps=1", "warmup_steps=1", "overlap_optimizer=true",
                "grad_compression=fp16", f"run_dir={tmp_path / 'r'}")
    start = err.split("step 1/1")[0]
    assert "overlap_optimizer=true does nothing on cpu" in start
    assert "grad_compression=fp16 does nothing in one process" in start


def test_settings_that_act_are_not_flagged(text_corpus, tmp_path, capsys):
    err = train(capsys, f"data={text_corpus}", "max_steps=2", "warmup_steps=2", f"run_dir={tmp_path / 'r'}")
    assert "does nothing" not in err and "never left warm-up" not in err


def test_a_run_whose_steps_were_all_skipped_says_its_lr_never_left_warm_up(text_corpus, tmp_path, capsys):
    err = train(capsys, f"data={text_corpus}", "max_steps=3", "warmup_steps=2", "precision=16-mixed",
                "init_scale=1e30", "max_skipped_fraction=1", f"run_dir={tmp_path / 'r'}")
    line = next(l for l in err.splitlines() if "never left warm-up" in l)
    assert "advanced 0 of its 2 warm-up steps" in line and "3 of its 3 steps were skipped" in line
    assert err.index("never left warm-up") < err.index("done:")
    assert "no step was taken; it stays at its first warm-up LR 0.0015, 50 % of the peak 0.003" in line


def test_a_run_whose_steps_were_all_skipped_with_a_one_step_warm_up_claims_no_warm_up(text_corpus, tmp_path,
                                                                                   capsys):
    """It said "the LR never left warm-up ... the LR reached 0.003, 100 % of the peak": warmup_steps=1
    starts at the peak, so there is no warm-up to stay in."""
    err = train(capsys, f"data={text_corpus}", "max_steps=2", "warmup_steps=1", "precision=16-mixed",
                "init_scale=1e30", "max_skipped_fraction=1", f"run_dir={tmp_path / 'r'}")
    assert "done: 2 steps (2 skipped)" in err
    assert "never left warm-up" not in err and "100 % of the peak" not in err


def test_resuming_a_finished_run_prints_its_recorded_final_validation_loss(text_corpus, tmp_path, capsys):
    run = tmp_path / "r"
    first = train(capsys, f"data={text_corpus}", "max_steps=2", "warmup_steps=1", f"run_dir={run}")
    recorded = first.split("final validation loss ")[1].split(",")[0]
    assert recorded != "n/a"
    assert main(["train", "--resume", str(run)]) == 0
    again = capsys.readouterr().err
    assert f"(final validation loss {recorded});" in again and len(again.splitlines()) == 1


def test_resuming_a_finished_run_says_there_is_nothing_to_train_and_how_to_train_on(text_corpus, tmp_path,
                                                                                   capsys):
    """It printed the start and end of a run, and no word that nothing was trained."""
    run = tmp_path / "r"
    train(capsys, f"data={text_corpus}", "max_steps=2", "warmup_steps=1", f"run_dir={run}")
    assert main(["train", "--resume", str(run)]) == 0
    said = capsys.readouterr().err.splitlines()          # that line only (tests/train/test_resume_cli.py)
    assert len(said) == 1 and said[0].startswith(f"[mixprec] nothing to train: run {run} already finished "
                                                 "at step 2 of 2 (final validation loss ")
    assert said[0].endswith(f"; give a larger max_steps= to continue: mixprec train --resume {run} max_steps=4")
