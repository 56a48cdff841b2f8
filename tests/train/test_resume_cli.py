"""`mixprec train --resume` as a shell user lives it: the printed hint pastes into a real shell
(a folder with spaces), the settings it is given are the ones it trains at, one run folder has
one writer, and validation/sequence settings are used or refused."""
import argparse
import csv
import os
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mixprec import hints
from mixprec.errors import ConfigError, DataError
from mixprec.optim.schedule import WarmupCosine

sys.path.insert(0, str(Path(__file__).parent))
from gated import EVENT_BOUND_S, GatedRun  # noqa: E402
from test_train_cli import TINY, mixprec  # noqa: E402


def _hint(stderr: str, label: str) -> str:
    line = next(l for l in stderr.splitlines() if l.startswith(f"[mixprec] {label}:"))
    return line.split(":", 1)[1].split("  (")[0].strip()


def test_the_printed_resume_hint_works_in_a_shell_and_trains_at_the_lr_it_is_given(tmp_path, text_corpus):
    run = tmp_path / "my run's folder"            # a space and a quote
    first = mixprec("train", *TINY, f"data={text_corpus}", "max_steps=4", "ckpt_interval=2",
                    f"run_dir={run}")
    hint = _hint(first.stderr, "resume")
    assert shlex.split(hint) == ["mixprec", "train", "--resume", str(run), "max_steps=8"]
    assert shlex.split(_hint(first.stderr, "report")) == ["mixprec", "report", str(run)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "-c", f"{hint} lr=0.01 warmup_steps=5"], capture_output=True,
                          text=True, env=env, timeout=EVENT_BOUND_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lr = 0.01  (command line)" in proc.stderr
    assert "resumed schedule: lr 0.0003 -> 0.01 at step 4" in proc.stderr
    with open(run / "metrics.csv", newline="") as f:
        lr = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    curve = WarmupCosine(5, 8, 0.1)          # lr at step s = the LR step s ran at: curve(s - 1)
    assert [lr[s] for s in range(5, 9)] == pytest.approx([0.01 * curve(s - 1) for s in range(5, 9)],
                                                         rel=1e-12)
    assert tomllib.loads((run / "config.toml").read_text())["lr"] == 0.01


def test_a_second_writer_of_a_run_folder_is_refused_naming_the_holder(tmp_path, text_corpus):
    run = tmp_path / "run"
    first = GatedRun("step:3", *TINY, f"data={text_corpus}", "max_steps=4", f"run_dir={run}")
    try:
        gate = first.wait_for("GATE step:3")           # training: it holds the folder's lock
        pid = gate.split("pid=")[1].strip()
        second = mixprec("train", "--resume", run, "max_steps=6", check=False)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1].startswith(
            f"mixprec: error: run folder {run} is in use by pid {pid} on host ")
        first.release()
        code, out = first.finish()
        assert code == 0, out[-2000:]
    finally:
        first.kill()


HOLDER = """
import sys
from mixprec.runs.lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("LOCKED", flush=True)
sys.stdin.readline()
"""


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    from mixprec.runs.lock import RunLock
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"       # the announced gate
        with pytest.raises(ConfigError, match=f"in use by pid {holder.pid} on host"):
            RunLock.acquire(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=EVENT_BOUND_S)
        lock = RunLock.acquire(tmp_path)                            # the kernel dropped it
        assert lock.held
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


# --- validation and sequence settings: used, or refused in one line ----------------------------

def _resolve(*settings: str, resume: Path | None = None):
    from mixprec.cli.train import _resolve as resolve
    return resolve(argparse.Namespace(settings=list(settings), config=None, precision=None,
                                      resume=str(resume) if resume else None, list=False))


def test_val_data_without_data_is_used_so_a_missing_file_is_refused():
    from mixprec.cli.train import build_run
    cfg, _, _ = _resolve("model=tiny", "val_data=/nope.txt")
    with pytest.raises(DataError, match="/nope.txt does not exist") as err:
        build_run(cfg)
    # The way out it names is true: omitting val_data= validates on held-out training data (it
    # said "omit it to use the built-in corpus", found by a new-user trial).
    assert "omit val_data= to validate on a held-out part of the training data" in str(err.value)
    assert "built-in corpus" not in str(err.value)


@pytest.mark.parametrize("extra", [[], ["val_data=v.txt", "data=d.txt"]])
def test_val_fraction_that_would_not_be_used_is_refused(extra):
    with pytest.raises(ConfigError, match="val_fraction=0.2 splits data= .*drop val_fraction"):
        _resolve("val_fraction=0.2", *extra)


def test_a_resumed_run_keeps_its_models_length_and_takes_a_shorter_seq_len_not_a_longer(tmp_path, text_corpus):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f'model = "tiny"\nseq_len = 64\ndata = "{text_corpus}"\n')
    cfg, _, _ = _resolve("seq_len=32", resume=run)
    assert (cfg.seq_len, cfg.max_seq_len) == (32, 64)
    from mixprec.cli.train import build_run
    model = build_run(cfg)[0]
    assert model.config.max_seq_len == 64                    # the position table the checkpoint holds
    with pytest.raises(ConfigError, match="seq_len=128 is longer than the model's max_seq_len=64"):
        _resolve("seq_len=128", resume=run)


def test_a_fit_run_resumed_by_the_command_line_is_refused_with_the_python_way(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('model = "fit: mymodels.Net"\nbatch_size = 8\n')
    with pytest.raises(ConfigError, match=r"fit\(\) trained it on mymodels.Net.*fit\(\.\.\., run_dir="):
        _resolve(resume=run)


# --- every hint is built in one place, for the way the run was launched ------------------------

def test_a_multi_node_hint_carries_the_rendezvous_options_the_job_was_launched_with(monkeypatch):
    two_nodes = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2",
                 "GROUP_WORLD_SIZE": "2"}
    agent = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes=2", "--node-rank=0", "--nproc-per-node=1",
             "--rdzv_backend", "c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=job7",
             "--local-addr=10.0.0.1", "-m", "mixprec", "train", "data=a.tokens"]
    monkeypatch.setattr(hints, "_launcher_argv", lambda: agent)
    text = hints.command("train", "--resume", "runs/r", env=two_nodes)
    assert text == ("on every node, each with its own --node-rank:\n"
                    "torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 "
                    "--rdzv-id=job7 -m mixprec train --resume runs/r")
    static = ["torchrun", "--nnodes", "2", "--master_addr", "10.0.0.1", "--master-port=29500", "-m", "mixprec"]
    monkeypatch.setattr(hints, "_launcher_argv", lambda: static)
    assert "--nproc_per_node=1 --master-addr=10.0.0.1 --master-port=29500 -m" in hints.command("x", env=two_nodes)
    monkeypatch.setattr(hints, "_launcher_argv", lambda: None)     # not readable: say what to add
    assert hints.command("x", env=two_nodes).startswith(
        "on every node, adding this job's rendezvous options (--rdzv-backend and --rdzv-endpoint, or "
        "--master-addr and --master-port):\n")


@pytest.mark.parametrize("agent", [
    ["torchrun", "--nnodes=2", "--node-rank=0", "--rdzv-endpoint=10.0.0.1:29400", "-m", "mixprec"],
    ["torchrun", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "-m", "mixprec"],
    None])
def test_a_multi_node_hint_pastes_whole_into_a_shell_with_its_note_on_the_line_before(monkeypatch, agent):
    """Before: "torchrun ... --resume 'runs/my run'  (on every node)" on one line, and bash read the
    parenthesis as a subshell: pasted whole, a syntax error."""
    two_nodes = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2",
                 "GROUP_WORLD_SIZE": "2"}
    monkeypatch.setattr(hints, "_launcher_argv", lambda: agent)
    lines = hints.command("train", "--resume", "runs/my run", env=two_nodes).splitlines()
    line = next(x for x in lines if x.startswith("torchrun "))
    proc = subprocess.run(["bash", "-c", 'torchrun() { printf "%s\\n" "$@"; }\n' + line],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-4:] == ["mixprec", "train", "--resume", "runs/my run"]
    assert lines.index(line) == 1 and lines[0].startswith("on every node")     # the note before


def test_hints_follow_the_launch_and_are_shell_quoted(tmp_path, monkeypatch):
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2",
                "GROUP_WORLD_SIZE": "1"}
    assert hints.launcher({}) == ["mixprec"]
    assert hints.launcher(torchrun) == ["torchrun", "--nproc_per_node=2", "-m", "mixprec"]
    two_nodes = {**torchrun, "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}
    assert hints.launcher(two_nodes)[:3] == ["torchrun", "--nnodes=2", "--nproc_per_node=2"]
    monkeypatch.setattr(hints, "_state", {"cli": True, "run_dir": tmp_path / "a b"})
    for k, v in torchrun.items():
        monkeypatch.setenv(k, v)
    assert shlex.split(hints.resume()) == ["torchrun", "--nproc_per_node=2", "-m", "mixprec", "train",
                                           "--resume", str(tmp_path / "a b")]
    # A lost peer names the real folder and the launch, not a placeholder.
    from mixprec.strategies import RankFailureError, rank_failure_guard
    with pytest.raises(RankFailureError) as err:
        with rank_failure_guard(0, 5.0, world_size=2):
            raise RuntimeError("Connection closed by peer")
    assert str(err.value).endswith(f"resume from the last checkpoint: {hints.resume()}")
    assert "RUN_DIR" not in str(err.value)
    monkeypatch.setattr(hints, "_state", {"cli": False, "run_dir": None})
    assert hints.resume(tmp_path, lr=1e-3) == f"fit(..., run_dir={str(tmp_path)!r}, resume=True, lr=0.001)"


def test_the_printed_resume_line_pastes_whole_into_a_shell_for_a_folder_with_spaces_and_parentheses(tmp_path, capsys):
    """Before: the line went on after the command ("  (train on to step 4: ...)"), and bash read
    that as a subshell: pasted whole, it ended in a syntax error."""
    from mixprec.cli import main
    run = tmp_path / "my run (1)"
    tiny = [s for s in TINY if not s.startswith("eval_batches=")]          # each setting given once
    assert main(["train", *tiny, "max_steps=2", "eval_batches=1", f"run_dir={run}"]) == 0
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[mixprec] resume:"))
    pasted = line.split(":", 1)[1]                                   # everything after the label
    proc = subprocess.run(["bash", "-c", 'mixprec() { printf "%s\\n" "$@"; }\n' + pasted],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["train", "--resume", str(run), "max_steps=4"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["--resume", "resume=auto"])
def test_resuming_a_finished_run_says_so_in_one_line_and_writes_nothing(tmp_path, capsys, how):
    from mixprec.cli import main
    run = tmp_path / "run"
    tiny = [s for s in TINY if not s.startswith("eval_batches=")]
    assert main(["train", *tiny, "max_steps=2", "eval_batches=1", f"run_dir={run}"]) == 0
    capsys.readouterr()
    before = _snapshot(run)
    argv = ["train", "--resume", str(run)] if how == "--resume" else ["train", *tiny, "max_steps=2",
                                                                      "eval_batches=1", f"run_dir={run}", "resume=auto"]
    assert main(argv) == 0                 # nothing to do is not an error (docs/CONTRACTS.md)
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"[mixprec] nothing to train: run {run} already finished at step 2 of 2 "
                               "(final validation loss ")
    assert "; give a larger max_steps= to continue: " in lines[0]
    assert shlex.split(lines[0].split("to continue: ")[1])[-4:] == ["train", "--resume", str(run), "max_steps=4"]
    assert _snapshot(run) == before        # no event, no metrics row, no checkpoint, no lock left


def test_resuming_a_finished_run_with_a_larger_max_steps_trains_on(tmp_path, capsys):
    from mixprec.cli import main
    run = tmp_path / "run"
    tiny = [s for s in TINY if not s.startswith("eval_batches=")]
    assert main(["train", *tiny, "max_steps=2", "eval_batches=1", f"run_dir={run}"]) == 0
    assert main(["train", "--resume", str(run), "max_steps=3"]) == 0
    assert "done: 3 steps" in capsys.readouterr().err
