"""Runs that never lie and never lose work: an existing run folder is refused, a diverged run
fails, Ctrl-C/SIGTERM save before stopping, --resume takes any checkpoint folder, "auto" is
recorded as what it resolved to, stray token ids and oversized models are refused up front, and
OS errors are one line."""
import errno
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError, RunInterrupted, TrainingDiverged
from mixprec.runs.owned import scan
from mixprec.runs.run_dir import claim_run_dir

sys.path.insert(0, str(Path(__file__).parent))
from gated import GatedRun  # noqa: E402
from test_train_cli import TINY, losses, mixprec  # noqa: E402


# --- 1. an existing run folder ------------------------------------------------------------------

def test_a_new_run_into_a_folder_holding_a_run_is_refused_and_loses_nothing(tmp_path, text_corpus):
    run = tmp_path / "run"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=3", f"run_dir={run}")
    before = (run / "metrics.csv").read_bytes()
    proc = mixprec("train", *TINY, f"data={text_corpus}", "max_steps=5", f"run_dir={run}", check=False)
    assert proc.returncode == 2
    assert f"already holds a run; continue it with `mixprec train --resume {run}`" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (run / "metrics.csv").read_bytes() == before


def test_overwrite_true_starts_over_in_the_same_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("old")
    (run / "checkpoints").mkdir()
    claim_run_dir(run, precision="32-true", resume=False, overwrite=True)
    assert [p.name for p in run.iterdir()] == [".lock"]      # the folder's lock file (runs/lock.py)


def test_overwrite_true_says_at_start_in_one_line_what_it_deleted(tmp_path, capsys):
    """overwrite=true deleted the old run without a word."""
    from mixprec.cli import main
    run = tmp_path / "run"
    assert main(["train", *TINY, "max_steps=1", f"run_dir={run}"]) == 0
    capsys.readouterr()
    assert main(["train", *TINY, "max_steps=1", f"run_dir={run}", "overwrite=true"]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [x for x in err if f"overwrite: deleted the old run in {run} (" in x]
    assert len(said) == 1 and "checkpoints" in said[0] and "metrics.csv" in said[0]
    assert err.index(said[0]) < next(i for i, x in enumerate(err) if "step" in x and "loss" in x)
    assert main(["train", *TINY, "max_steps=1", f"run_dir={tmp_path / 'new'}", "overwrite=true"]) == 0
    assert "deleted" not in capsys.readouterr().err                # nothing there: nothing said


def _project_folder(root: Path) -> Path:
    """A user's project folder: a git repository with code, and no run."""
    project = root / "project"
    (project / "src").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    (project / "src" / "model.py").write_text("x = 1\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    return project


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_overwrite_refuses_a_folder_that_holds_no_run_and_deletes_nothing(tmp_path, text_corpus):
    project = _project_folder(tmp_path)
    before = _tree(project)
    proc = mixprec("train", *TINY, f"data={text_corpus}", "max_steps=2", "run_dir=.",
                   "overwrite=true", check=False, cwd=project)
    assert proc.returncode == 2, proc.stderr
    assert "is not empty and holds no run: it has .git/, src/, train.py" in proc.stderr
    assert "overwrite" not in proc.stderr.split("[mixprec]")[-1]   # never suggests deleting it
    assert "Traceback" not in proc.stderr
    assert _tree(project) == before and (project / ".git" / "HEAD").is_file()
    with pytest.raises(ConfigError, match="holds no run"):        # fit()'s path, the same rule
        claim_run_dir(project, precision="32-true", resume=False, overwrite=True)
    assert _tree(project) == before


def test_a_new_run_without_overwrite_into_a_non_run_folder_is_refused_without_suggesting_deletion(tmp_path):
    project = _project_folder(tmp_path)
    with pytest.raises(ConfigError) as e:
        claim_run_dir(project, precision="32-true", resume=False, overwrite=False)
    assert "holds no run" in str(e.value) and "overwrite" not in str(e.value)


def test_overwrite_of_a_run_folder_that_also_holds_user_files_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("old")
    (run / "notes.md").write_text("mine")
    with pytest.raises(ConfigError, match="holds a run and also notes.md; .* move those files out"):
        claim_run_dir(run, precision="32-true", resume=False, overwrite=True)
    assert (run / "notes.md").read_text() == "mine" and (run / "metrics.csv").is_file()


def test_overwrite_removes_every_file_a_run_writes_and_nothing_else(tmp_path, text_corpus):
    run = tmp_path / "run"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=2", f"run_dir={run}")
    other = tmp_path / "other"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=2", f"run_dir={other}")
    mixprec("report", str(run))
    mixprec("report", str(run), str(other))                 # writes run/compare/
    assert scan(run)[1] == []           # every file a run and its reports write is the run's own
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=2", f"run_dir={run}", "overwrite=true")
    assert (run / "metrics.csv").is_file()
    assert not (run / "report").exists() and not (run / "compare").exists()


def test_overwrite_refuses_a_run_whose_subfolders_hold_user_files_and_deletes_nothing(
        tmp_path, text_corpus):
    # Found by a new-user trial: overwrite=true used to delete checkpoints/, tb/, ... whole.
    run = tmp_path / "run"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=2", "ckpt_interval=1",
            f"run_dir={run}")
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    mine = {run / "checkpoints" / "best.pt": "a", step / "my_eval.json": "b",
            run / "tb" / "notes.txt": "c"}
    for path, text in mine.items():
        path.write_text(text)
    before = _tree(run)
    with pytest.raises(ConfigError, match=r"holds a run and also "
                                          r"checkpoints/best\.pt, checkpoints/step-\d+/my_eval\.json, "
                                          r"tb/notes\.txt; .* move those files out"):
        claim_run_dir(run, precision="32-true", resume=False, overwrite=True)
    assert _tree(run) == before and all(p.read_text() == t for p, t in mine.items())


def test_default_run_folders_started_in_the_same_second_do_not_collide(tmp_path):
    names = {claim_run_dir(None, precision="bf16-mixed", resume=False, overwrite=False, root=tmp_path)
             for _ in range(3)}
    assert len(names) == 3 and all(p.is_dir() for p in names)


# --- 2. divergence ------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_a_diverged_run_fails_with_a_clear_message_and_reports_its_skips(tmp_path, text_corpus, precision):
    tiny = [s for s in TINY if not s.startswith(("lr=", "log_interval="))]   # each given once
    proc = mixprec("train", *tiny, f"data={text_corpus}", "max_steps=40", "lr=1e6", "clip_grad_norm=0",
                   "log_interval=10", f"precision={precision}", f"run_dir={tmp_path / 'r'}", check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "mixprec: error: training diverged at step" in proc.stderr
    assert proc.stderr.count("skipped: ") >= 1         # the skips reached the terminal (progress=false)
    assert "Traceback" not in proc.stderr


def _regressor_batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, generator=g)) for _ in range(n)]


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class InfAfter(nn.Module):
    """Makes non-finite gradients on every step after ``good`` steps (loss stays finite)."""

    def __init__(self, good: int):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.good, self.calls = good, 0

    def forward(self, x, y):
        self.calls += 1
        out = self.lin(x).squeeze(-1)
        if self.calls > self.good:
            out = _NanGrad.apply(out)   # a NaN gradient, a finite loss
        return nn.functional.mse_loss(out, y)


def test_too_many_skipped_steps_after_warmup_end_the_run(tmp_path):
    model = InfAfter(good=15)
    with pytest.raises(TrainingDiverged, match=r"of the \d+ steps after warm-up were skipped"):
        mp.fit(model, _regressor_batches(60), mixed_precision="32-true", max_steps=60, warmup_steps=5,
               log_interval=10, run_dir=str(tmp_path / "r"), progress=False, audit=False,
               trace_nonfinite=False, ckpt_interval=10)


def test_max_skipped_fraction_one_lets_the_run_go_on(tmp_path):
    model = InfAfter(good=15)
    result = mp.fit(model, _regressor_batches(40), mixed_precision="32-true", max_steps=40,
                    warmup_steps=5, log_interval=10, max_skipped_fraction=1.0, run_dir=str(tmp_path / "r"),
                    progress=False, audit=False, trace_nonfinite=False, ckpt_interval=0)
    assert result.skipped_steps == 25


# --- 3. Ctrl-C and SIGTERM ----------------------------------------------------------------------

def Gated(run: Path, corpus: Path, gates: str, *extra: str) -> GatedRun:
    return GatedRun(gates, *TINY, f"data={corpus}", "max_steps=100000", "ckpt_interval=0",
                    f"run_dir={run}", *extra)


ANNOUNCED = "finishing this step and saving a checkpoint"


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_saves_a_checkpoint_prints_the_resume_command_and_exits_128_plus_n(
        tmp_path, text_corpus, sig, code):
    run = tmp_path / "run"
    worker = Gated(run, text_corpus, "step:6")
    worker.wait_for("GATE step:6")               # 5 steps done, the 6th about to start
    worker.signal(sig)
    worker.wait_for(ANNOUNCED)
    worker.release()
    rc, out = worker.finish()
    assert rc == code, out[-2000:]
    assert f"stopped by {signal.Signals(sig).name} at step 6" in out
    assert f"continue with: mixprec train --resume {run}" in out
    from mixprec.runs.checkpoint import list_checkpoints
    assert [s for s, _ in list_checkpoints(run)] == [6]
    assert "Traceback" not in out
    if sig == signal.SIGTERM:                    # a preempted job continues where it stopped
        resumed = mixprec("train", "--resume", run, "max_steps=8")
        assert "steps: 6 -> 8" in resumed.stderr and "done:" in resumed.stderr


def test_ctrl_c_after_the_terminal_reader_left_still_saves_and_exits_130(tmp_path, text_corpus):
    """`mixprec train ... 2>&1 | tee log` then Ctrl-C: tee dies with the run's stderr reader.
    Before, the next line the run printed raised BrokenPipeError and it ended without a
    checkpoint (exit 141)."""
    run = tmp_path / "run"
    worker = GatedRun("step:6", *TINY, f"data={text_corpus}", "max_steps=100000", "ckpt_interval=0",
                      f"run_dir={run}", stderr=subprocess.PIPE)
    worker.proc.stderr.close()                   # the reader is gone before the run says a word
    worker.wait_for("GATE step:6")
    worker.signal(signal.SIGINT)
    worker.release()
    rc, _ = worker.finish()
    assert rc == 130
    from mixprec.runs.checkpoint import list_checkpoints
    assert [s for s, _ in list_checkpoints(run)] == [6]


def test_a_second_signal_during_a_step_aborts_at_once_with_128_plus_n(tmp_path, text_corpus):
    sig, code = signal.SIGTERM, 143
    run = tmp_path / "run"
    worker = Gated(run, text_corpus, "step:2")
    worker.wait_for("GATE step:2")
    worker.signal(signal.SIGINT)
    worker.wait_for(ANNOUNCED)                   # the first one is noted; the worker still waits
    worker.signal(sig)                           # inside step 2: it never finishes
    rc, out = worker.finish()
    assert rc == code, out[-2000:]
    assert f"mixprec: interrupted ({signal.Signals(sig).name})" in out
    assert not (run / "checkpoints").exists()     # aborted without finishing the step
    assert "Traceback" not in out


def test_a_second_signal_during_the_save_aborts_and_leaves_no_partial_checkpoint(tmp_path, text_corpus):
    run = tmp_path / "run"
    worker = Gated(run, text_corpus, "step:3,save")
    worker.wait_for("GATE step:3")
    worker.signal(signal.SIGTERM)
    worker.wait_for(ANNOUNCED)
    worker.release()                             # step 3 runs, then the checkpoint is written...
    worker.wait_for("GATE save")                 # ...and stops with its weights file on disk
    worker.signal(signal.SIGINT)
    rc, out = worker.finish()
    assert rc == 130, out[-2000:]
    assert "mixprec: interrupted (SIGINT)" in out
    assert list((run / "checkpoints").iterdir()) == []   # the half-written folder was removed
    from mixprec.runs.checkpoint import list_checkpoints
    assert list_checkpoints(run) == []


def test_a_signal_after_the_save_changes_nothing_and_the_run_exits_with_the_first_ones_code(
        tmp_path, text_corpus):
    run = tmp_path / "run"
    worker = Gated(run, text_corpus, "step:3,exit")
    worker.wait_for("GATE step:3")
    worker.signal(signal.SIGTERM)
    worker.wait_for(ANNOUNCED)
    worker.release()
    worker.wait_for("GATE exit")                 # saved, said so, about to exit
    worker.signal(signal.SIGINT)                 # ignored: neither a kill nor a new exit code
    worker.signal(signal.SIGTERM)
    worker.release()
    rc, out = worker.finish()
    assert rc == 143, out[-2000:]
    assert "stopped by SIGTERM at step 3; checkpoint saved" in out
    from mixprec.runs.checkpoint import list_checkpoints
    assert [s for s, _ in list_checkpoints(run)] == [3]


def test_sigterm_before_training_starts_exits_143_in_one_line(tmp_path, text_corpus):
    worker = Gated(tmp_path / "run", text_corpus, "setup")
    worker.wait_for("GATE setup")
    worker.signal(signal.SIGTERM)
    rc, out = worker.finish()
    assert rc == 143, out[-2000:]
    assert out.strip().splitlines()[-1] == "mixprec: interrupted (SIGTERM)"


class _Stopper(nn.Module):
    """A regressor that sends its own process SIGINT during its third forward (step 3)."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 1), 0

    def forward(self, x, y):
        self.calls += 1
        if self.calls == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


def test_fit_raises_run_interrupted_after_saving(tmp_path):
    with pytest.raises(RunInterrupted, match="stopped by SIGINT at step 3; checkpoint saved"):
        mp.fit(_Stopper(), _regressor_batches(10), mixed_precision="32-true", max_steps=10,
               run_dir=str(tmp_path / "r"), progress=False, audit=False, ckpt_interval=0)
    assert (tmp_path / "r" / "checkpoints" / "step-00000003").is_dir()


# --- 4. resume from any checkpoint folder; 5. the resolved precision is recorded -----------------

def test_resume_accepts_a_checkpoint_folder_and_auto_is_recorded_resolved(tmp_path, text_corpus):
    run = tmp_path / "run"
    mixprec("train", *TINY, f"data={text_corpus}", "max_steps=6", "ckpt_interval=2", "keep_last=3",
            "precision=auto", f"run_dir={run}")
    saved = tomllib.loads((run / "config.toml").read_text())["precision"]
    assert saved != "auto" and saved == mp.Precision("auto").name
    step2 = run / "checkpoints" / "step-00000004"
    proc = mixprec("train", "--resume", step2, "max_steps=8")
    assert "steps: 4 -> 8" in proc.stderr
    # A corrupt newest checkpoint names a command that works as printed.
    (run / "checkpoints" / "step-00000008" / "model.safetensors").write_bytes(b"garbage")
    bad = mixprec("train", "--resume", run, "max_steps=9", check=False)
    hint = bad.stderr.split("mixprec train --resume ")[-1].split()[0]
    assert bad.returncode == 2 and hint.endswith("step-00000006")
    assert "done:" in mixprec("train", "--resume", hint, "max_steps=9").stderr


# --- 6. an optimizer that stores fp16 params is honoured ----------------------------------------

def test_seed_style_fp16_params_optimizer_is_honoured_by_fit(tmp_path, capsys):
    torch.manual_seed(0)
    model = mp.models.Transformer(num_layers=1, d_model=32, num_heads=4, max_seq_len=16)
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))] * 3
    result = model.fit(batches, mixed_precision=True, max_steps=3, run_dir=str(tmp_path / "r"),
                       progress=False, audit=False)
    assert result.policy == "16-true"
    assert model.blocks[0].mlp.fc.weight.dtype == torch.float16
    assert model.blocks[0].ln1.weight.dtype == torch.float32
    assert opt.master_of(model.blocks[0].mlp.fc.weight).dtype == torch.float32
    err = capsys.readouterr().err
    assert "fp16_params=True" in err and "master weights fp32" in err


# --- 7. stray ids and oversized models ----------------------------------------------------------

def test_one_stray_token_id_is_refused_before_anything_is_built(tmp_path):
    data = np.random.default_rng(0).integers(0, 200, size=50_000)
    data[17] = 10**6
    np.save(tmp_path / "ids.npy", data)
    proc = mixprec("train", *TINY, f"data={tmp_path / 'ids.npy'}", "max_steps=1",
                   f"run_dir={tmp_path / 'r'}", check=False)
    assert proc.returncode == 2
    assert "largest token id is 1000000 but the data holds only 201 distinct ids" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_a_model_too_big_for_free_memory_is_refused_before_allocation(monkeypatch):
    from mixprec.cli import train as command
    monkeypatch.setattr(command, "_available_memory_bytes", lambda: 2**30)
    monkeypatch.setattr(command.torch.cuda, "is_available", lambda: False)
    from mixprec.models import Transformer
    with pytest.raises(ConfigError, match=r"needs ~.* GiB \(.* GiB weights, gradients and optimizer state, .* GiB "
                                          r"activations\) but 1.0 GiB are free; lower seq_len"):
        command._check_fits_in_memory(lambda: Transformer.from_preset("small", d_model=2048), 256)
    command._check_fits_in_memory(lambda: Transformer.from_preset("tiny"), 256)   # fits


# --- 8. OS errors are one line ------------------------------------------------------------------

@pytest.mark.parametrize("code,fix", [(errno.ENOSPC, "free some space"), (errno.EROFS, "free some space"),
                                      (errno.EACCES, "choose another run_dir")])
def test_os_errors_opening_the_run_files_are_one_line_with_the_fix(tmp_path, text_corpus, monkeypatch,
                                                                   capsys, code, fix):
    from mixprec.cli import main
    from mixprec.runs import metrics

    def fail(self, *a, **k):
        raise OSError(code, os.strerror(code), str(tmp_path / "r" / "metrics.csv"))
    monkeypatch.setattr(metrics.MetricsLogger, "__init__", fail)
    rc = main(["train", *TINY, f"data={text_corpus}", "max_steps=1", f"run_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (f"mixprec: error: cannot write to the run folder {tmp_path / 'r'} "
                                   f"({os.strerror(code)}); free some space or choose another run_dir=PATH")
    assert fix in err[-1]


def test_other_os_errors_are_one_line_with_the_fix(monkeypatch, capsys):
    from mixprec.cli import main
    from mixprec.cli import train as command

    def fail(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/tokens.bin")
    monkeypatch.setattr(command, "run", fail)
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip() == ("mixprec: error: No space left on device (/data/tokens.bin); "
                                               "free some space or write the run elsewhere (run_dir=PATH)")


def test_report_on_an_unwritable_run_folder_is_one_line(tmp_path, monkeypatch, capsys):
    from mixprec.cli import main
    from mixprec.cli import report
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text("step,loss\n1,2.0\n")

    def fail(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(run / "report"))
    monkeypatch.setattr(report, "write_report", fail)
    rc = main(["report", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"mixprec: error: cannot write the report into {run / 'report'} "
                               "(Read-only file system); write it elsewhere with --out DIR"]


# --- 11. what the terminal shows ----------------------------------------------------------------

@pytest.mark.parametrize("progress", ["true", "false"])
def test_without_a_terminal_each_log_interval_is_one_plain_line(tmp_path, text_corpus, progress):
    proc = mixprec("train", *[t for t in TINY if not t.startswith(("progress", "log_interval"))],
                   f"progress={progress}",
                   f"data={text_corpus}", "max_steps=4", "log_interval=2", f"run_dir={tmp_path / 'r'}")
    lines = [ln for ln in proc.stderr.splitlines() if "step " in ln and "/4" in ln]
    assert [ln.split()[2] for ln in lines] == ["2/4", "4/4"]
    assert "\r" not in proc.stderr


# --- mixprec audit reads the same set-up as mixprec train ---------------------------------------

def test_audit_command_reports_on_the_train_setup(tmp_path, text_corpus):
    proc = mixprec("audit", *TINY, f"data={text_corpus}", "precision=bf16-true")
    assert "precision: bf16-true" in proc.stdout and "audit:" in proc.stdout


def test_a_stop_between_logged_rows_records_the_steps_since_the_last_row(tmp_path):
    """Ctrl-C at step 3 with log_interval=2: steps 1-2 are one row, step 3 its own (steps=1), so
    every trained step is in metrics.csv before the run stops (it was missing until the resume)."""
    import csv

    with pytest.raises(RunInterrupted, match="stopped by SIGINT at step 3"):
        mp.fit(_Stopper(), _regressor_batches(10), mixed_precision="32-true", max_steps=10, log_interval=2,
               run_dir=str(tmp_path / "r"), progress=False, audit=False, ckpt_interval=0)
    with open(tmp_path / "r" / "metrics.csv", newline="") as f:
        rows = [(int(r["step"]), int(r["steps"])) for r in csv.DictReader(f)]
    assert rows == [(2, 2), (3, 1)]
