"""A resume with nothing to train is one rule (train/finished.py) for ``fit()`` and ``mixprec
train --resume``: one line, nothing built or written to the run folder, and a result that says
what the run has (its steps and final losses, from its files); a checkpoint past the end is
refused before anything is written."""
import csv
import sys
from pathlib import Path

import pytest

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.train.finished import finished_run
from mixprec.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_resume_lifecycle import QUIET, Regressor, batches  # noqa: E402


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _last_row(run: Path) -> dict[str, str]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))[-1]


@pytest.fixture
def finished(tmp_path):
    run = tmp_path / "run"
    first = mp.fit(Regressor(), batches(), val_loader=batches(4), max_steps=4, ckpt_interval=2,
                   run_dir=str(run), **QUIET)
    return run, first


@pytest.mark.parametrize("how", ["resume=True", "resume=RUN", "run_dir=RUN/checkpoints"])
def test_fit_resuming_a_finished_run_writes_nothing_and_says_so_in_one_line(finished, capsys, how):
    run, _ = finished
    capsys.readouterr()
    before = _snapshot(run)
    kwargs = {"resume=True": dict(run_dir=str(run), resume=True),
              "resume=RUN": dict(run_dir=str(run), resume=str(run)),
              "run_dir=RUN/checkpoints": dict(run_dir=str(run / "checkpoints"), resume=True)}[how]
    result = mp.fit(Regressor(), batches(), val_loader=batches(4), max_steps=4, **kwargs, **QUIET)
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[mixprec] nothing to train: run {run} already finished at step 4 of 4 "
                               "(final validation loss ")
    assert lines[0].endswith(f"; give a larger max_steps= to continue: fit(..., run_dir={str(run)!r}, "
                             "resume=True, max_steps=8)")
    assert _snapshot(run) == before        # no event, no row, no checkpoint, no config.toml rewrite
    assert result.nothing_to_train and result.steps == 4


def test_fit_resuming_a_finished_run_returns_what_its_files_record(finished):
    run, first = finished
    result = mp.fit(Regressor(), batches(), val_loader=batches(4), max_steps=4, run_dir=str(run),
                    resume=True, **QUIET)
    row = _last_row(run)
    assert result.nothing_to_train and not first.nothing_to_train
    assert result.run_dir == run and result.steps == 4 == first.steps
    assert result.skipped_steps == int(row["skipped_total"]) == first.skipped_steps
    assert result.final_loss == float(row["loss"])          # the file's value, not a new step's
    assert result.final_val_loss == float(row["val_loss"]) == first.final_val_loss
    assert result.policy == "32-true"


def test_fit_resuming_a_finished_run_builds_nothing(finished):
    run, _ = finished
    trainer = Trainer(Regressor(), max_steps=4, run_dir=str(run), **QUIET)
    trainer.fit(batches(), resume=True)
    assert trainer.model is None and trainer.optimizer is None      # prepare() never ran
    assert trainer.step == 4 and trainer.run_dir == run


def test_a_checkpoint_past_max_steps_is_refused_before_anything_is_written(finished):
    run, _ = finished
    before = _snapshot(run)
    with pytest.raises(ConfigError, match="the checkpoint is at step 4, past max_steps=3; resume with "
                                          "max_steps=4 or more"):
        mp.fit(Regressor(), batches(), max_steps=3, run_dir=str(run), resume=True, **QUIET)
    assert _snapshot(run) == before


def test_the_rule_reads_a_run_folder_its_checkpoints_or_true_for_run_dir(finished):
    run, _ = finished
    assert finished_run(run, run, 4).step == 4
    assert finished_run(run, True, 4).run_dir == run
    assert finished_run(run / "checkpoints", True, 4).run_dir == run      # the checkpoint's run
    assert finished_run(run, run / "checkpoints" / "step-00000002", 4) is None   # 2 steps to go
    assert finished_run(run, run, 5) is None and finished_run(run, None, 4) is None
    assert finished_run(run, run, None) is None         # an epochs= run: fit() asks with its total


def test_the_cli_refuses_a_checkpoint_past_max_steps_as_fit_does(tmp_path, capsys):
    """It said "nothing to train: ... already finished at step 2 of 1", exit 0, where fit() refused."""
    from mixprec.cli import main
    from test_train_cli import TINY
    run = tmp_path / "run"
    assert main(["train", *TINY, "max_steps=2", f"run_dir={run}"]) == 0
    capsys.readouterr()
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "max_steps=1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mixprec: error: the checkpoint is at step 2, past max_steps=1; resume with max_steps=2 or more"]
    assert _snapshot(run) == before
