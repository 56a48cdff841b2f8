"""Checkpoint save/load: bitwise round trips, tied weights, crash safety, corruption, pruning, RNG."""
from __future__ import annotations

import io
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mixprec.errors import CheckpointError
from mixprec.runs import checkpoint as ckpt
from mixprec.runs.checkpoint import (capture_rng_state, list_checkpoints, load_checkpoint,
                                      restore_rng_state, save_checkpoint)


class TiedLM(torch.nn.Module):
    """Embedding and head share one weight, like most language models."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(idx)))


def _trained_state(seed: int = 0) -> tuple[TiedLM, dict]:
    torch.manual_seed(seed)
    model = TiedLM().to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(2):
        for m in masters:
            m.grad = torch.randn_like(m)
        opt.step()
        sched.step()
    train_state = {
        "step": 2,
        "optimizer": opt.state_dict(),
        "masters": [m.detach() for m in masters],
        "scheduler": sched.state_dict(),
        "scaler": {"scale": 65536.0, "growth_tracker": 3, "num_skipped_steps": 1},
        "rng": capture_rng_state(),
        "loader": {"epoch": 1, "position": 37, "order": torch.randperm(10)},
        "config": {"lr": 1e-2, "precision": "bf16-mixed", "tags": ["a", "b"], "max_steps": None,
                   "compile": False, "param_dtype": torch.bfloat16, "betas": (0.9, 0.95)},
    }
    return model, train_state


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        # Compare bit patterns, so -0.0 vs 0.0 or different NaN payloads would be caught.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip_is_bitwise_for_weights_and_whole_train_state(tmp_path):
    model, state = _trained_state()
    folder = save_checkpoint(tmp_path, 2, model_state=model.state_dict(), train_state=state)
    assert folder == tmp_path / "checkpoints" / "step-00000002"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    weights, loaded, meta = load_checkpoint(tmp_path)
    _assert_same(dict(model.state_dict()), weights)
    _assert_same(state, loaded)
    assert meta["step"] == 2 and set(meta["files"]) == {"model.safetensors", "state.pt"}
    # The state file really is loadable by a plain weights_only torch.load (what the docs promise).
    torch.load(folder / "state.pt", weights_only=True)


def test_tied_weights_are_stored_once_and_come_back_shared(tmp_path):
    model, state = _trained_state()
    folder = save_checkpoint(tmp_path, 1, model_state=model.state_dict(), train_state=state)
    raw = load_file(str(folder / "model.safetensors"))
    assert "emb.weight" in raw and "head.weight" not in raw
    weights, _, _ = load_checkpoint(folder)
    assert weights["head.weight"] is weights["emb.weight"]
    fresh = TiedLM().to(torch.bfloat16)
    fresh.load_state_dict(weights)
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight)


def test_different_views_of_one_storage_are_saved_separately(tmp_path):
    fused = torch.arange(12, dtype=torch.float32)
    state = {"q": fused[:4], "k": fused[4:8], "v": fused[8:].view(2, 2), "kT": fused[:4].view(2, 2).t()}
    save_checkpoint(tmp_path, 0, model_state=state, train_state={})
    weights, _, meta = load_checkpoint(tmp_path)
    assert meta["aliases"] == {}
    for k, v in state.items():
        assert torch.equal(weights[k], v)


def test_crash_after_first_file_keeps_previous_checkpoint_and_latest(tmp_path, monkeypatch):
    model, state = _trained_state()
    save_checkpoint(tmp_path, 1, model_state=model.state_dict(), train_state=state)

    def dying_save(obj, f, *a, **k):
        raise RuntimeError("simulated crash while writing state.pt")

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(CheckpointError, match=r"step-00000002.*previous checkpoint step-00000001 is intact"):
        save_checkpoint(tmp_path, 2, model_state=model.state_dict(), train_state=state)
    monkeypatch.undo()
    ckdir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckdir.iterdir()) == ["latest", "step-00000001"]
    _, loaded, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 1 and loaded["step"] == 2


def test_full_disk_gives_one_line_error_and_leaves_no_tmp(tmp_path, monkeypatch):
    model, state = _trained_state()
    save_checkpoint(tmp_path, 5, model_state=model.state_dict(), train_state=state)

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 6, model_state=model.state_dict(), train_state=state)
    msg = str(info.value)
    assert "\n" not in msg
    assert "could not save checkpoint step-00000006" in msg
    assert "no space left on device writing" in msg and "needed ~" in msg and "MiB" in msg
    assert "keep_last=" in msg and "run_dir=" in msg
    assert "step-00000005 is intact" in msg
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert load_checkpoint(tmp_path)[2]["step"] == 5


class _FillingDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC after the first few, as on a disk that fills up."""

    def __init__(self) -> None:
        self.writes = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.writes += 1
        if self.writes > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(b)


def test_torch_zip_writer_error_on_a_full_disk_reads_no_space_left(tmp_path, monkeypatch):
    """torch.save says `[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0` when
    the disk fills (its zip writer swallows the OSError): that is a full disk too."""
    model, state = _trained_state()
    save_checkpoint(tmp_path, 5, model_state=model.state_dict(), train_state=state)
    real_save = torch.save

    def save_on_a_full_disk(obj, f, *a, **k):
        real_save(obj, _FillingDisk(), *a, **k)     # raises torch's own RuntimeError

    monkeypatch.setattr(ckpt.torch, "save", save_on_a_full_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 6, model_state=model.state_dict(), train_state=state)
    msg = str(info.value)
    assert "\n" not in msg and "inline_container" not in msg
    assert "no space left on device writing" in msg and "step-00000005 is intact" in msg
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert load_checkpoint(tmp_path)[2]["step"] == 5


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_quota_read_only_and_permission_errors_are_one_line(tmp_path, monkeypatch, code):
    model, state = _trained_state()

    def refuse(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ckpt, "save_file", refuse)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, 1, model_state=model.state_dict(), train_state=state)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "checkpoints") in msg
    assert ("no space left" in msg) == (code == errno.EDQUOT)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    model, state = _trained_state()
    save_checkpoint(tmp_path, 5, model_state=model.state_dict(), train_state=state)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 100))
    with pytest.raises(CheckpointError, match=r"no space left on device writing .*free 0 MiB"):
        save_checkpoint(tmp_path, 6, model_state=model.state_dict(), train_state=state)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000005"]


_KILLED_SAVER = textwrap.dedent("""
    import sys, time, torch
    from mixprec.runs import checkpoint as ckpt
    run = sys.argv[1]
    ckpt.save_checkpoint(run, 1, model_state={"w": torch.ones(4)}, train_state={"step": 1})
    real_save = torch.save
    def slow_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.flush()
        print("WRITING", flush=True)
        time.sleep(60)
    ckpt.torch.save = slow_save
    ckpt.save_checkpoint(run, 2, model_state={"w": torch.zeros(4)}, train_state={"step": 2})
""")


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    ckdir = tmp_path / "checkpoints"
    assert len(list(ckdir.glob(".tmp-step-00000002-*"))) == 1  # the half-written save, aside
    weights, state, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 1 and state == {"step": 1} and torch.equal(weights["w"], torch.ones(4))
    (ckdir / f".latest.tmp-{proc.pid}").write_text("step-00000002\n")  # as if killed while updating latest
    # The next save cleans up the dead process's temporaries.
    save_checkpoint(tmp_path, 3, model_state={"w": torch.full((4,), 3.0)}, train_state={"step": 3})
    assert sorted(p.name for p in ckdir.iterdir()) == ["latest", "step-00000001", "step-00000003"]


@pytest.mark.parametrize("victim", ["model.safetensors", "state.pt"])
def test_truncated_file_is_named_and_previous_checkpoint_suggested(tmp_path, victim):
    model, state = _trained_state()
    for step in (10, 20):
        save_checkpoint(tmp_path, step, model_state=model.state_dict(), train_state=state)
    target = tmp_path / "checkpoints" / "step-00000020" / victim
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path)
    msg = str(info.value)
    assert str(target) in msg and "truncated" in msg and "\n" not in msg
    assert str(tmp_path / "checkpoints" / "step-00000010") in msg


def test_flipped_byte_is_caught_by_checksum(tmp_path):
    model, state = _trained_state()
    folder = save_checkpoint(tmp_path, 1, model_state=model.state_dict(), train_state=state)
    target = folder / "state.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state\.pt is corrupt .*no earlier checkpoint exists"):
        load_checkpoint(folder)


def test_truncated_file_without_verification_still_fails_cleanly(tmp_path):
    model, state = _trained_state()
    folder = save_checkpoint(tmp_path, 1, model_state=model.state_dict(), train_state=state)
    target = folder / "model.safetensors"
    target.write_bytes(target.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read"):
        load_checkpoint(folder, verify=False)


def test_keep_last_prunes_oldest_complete_checkpoints(tmp_path):
    for step in range(0, 60, 10):
        save_checkpoint(tmp_path, step, model_state={"w": torch.full((2,), float(step))},
                        train_state={"step": step}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50]
    save_checkpoint(tmp_path, 60, model_state={"w": torch.zeros(2)}, train_state={}, keep_last=None)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [40, 50, 60]


def test_rotating_a_checkpoint_out_keeps_a_file_of_yours_in_its_folder(tmp_path):
    first = save_checkpoint(tmp_path, 1, model_state={"w": torch.ones(1)}, train_state={})
    (first / "my_eval.json").write_text("mine")
    save_checkpoint(tmp_path, 2, model_state={"w": torch.ones(1)}, train_state={}, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]        # step 1 is no checkpoint now
    assert sorted(p.name for p in first.iterdir()) == ["my_eval.json"]
    assert (first / "my_eval.json").read_text() == "mine"
    third = save_checkpoint(tmp_path, 3, model_state={"w": torch.ones(1)}, train_state={}, keep_last=1)
    assert not (tmp_path / "checkpoints" / "step-00000002").exists()  # nothing of yours: all gone
    assert third.is_dir()


def test_saving_a_step_again_keeps_a_file_of_yours_from_the_old_folder(tmp_path):
    old = save_checkpoint(tmp_path, 5, model_state={"w": torch.ones(1)}, train_state={})
    (old / "notes.txt").write_text("mine")
    new = save_checkpoint(tmp_path, 5, model_state={"w": torch.zeros(1)}, train_state={})
    assert torch.equal(load_checkpoint(new)[0]["w"], torch.zeros(1))
    kept = tmp_path / "checkpoints" / "replaced-step-00000005"
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    assert not (new / "notes.txt").exists()


def test_keep_last_never_deletes_checkpoints_from_later_steps(tmp_path):
    for step in (100, 200, 300):
        save_checkpoint(tmp_path, step, model_state={"w": torch.ones(1)}, train_state={}, keep_last=None)
    save_checkpoint(tmp_path, 150, model_state={"w": torch.ones(1)}, train_state={}, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [150, 200, 300]
    assert load_checkpoint(tmp_path)[2]["step"] == 150  # latest names the newest save, not the max step


def test_resaving_an_existing_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 7, model_state={"w": torch.ones(2)}, train_state={"v": 1})
    save_checkpoint(tmp_path, 7, model_state={"w": torch.zeros(2)}, train_state={"v": 2})
    weights, state, _ = load_checkpoint(tmp_path)
    assert state == {"v": 2} and torch.equal(weights["w"], torch.zeros(2))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7]


def test_missing_or_dangling_latest_falls_back_to_newest_complete_folder(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model_state={"w": torch.full((1,), float(step))}, train_state={})
    latest = tmp_path / "checkpoints" / "latest"
    latest.write_text("step-00000099\n")
    assert load_checkpoint(tmp_path)[2]["step"] == 2
    latest.unlink()
    assert load_checkpoint(tmp_path / "checkpoints")[2]["step"] == 2
    (tmp_path / "checkpoints" / ".tmp-step-00000003-1").mkdir()  # incomplete saves are ignored
    assert load_checkpoint(tmp_path)[2]["step"] == 2


def test_missing_or_empty_locations_give_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        load_checkpoint(tmp_path)


def test_unsafe_train_state_is_refused_before_writing_naming_the_key(tmp_path):
    with pytest.raises(CheckpointError, match=r"train_state\['config'\]\['data'\] is a pathlib\.\w*Path"):
        save_checkpoint(tmp_path, 1, model_state={}, train_state={"config": {"data": tmp_path}})
    with pytest.raises(CheckpointError, match=r"numpy.*\.item\(\)"):
        save_checkpoint(tmp_path, 1, model_state={}, train_state={"loss": np.float64(1.0)})
    assert list_checkpoints(tmp_path) == []


def test_rng_capture_restore_reproduces_draws_under_weights_only(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.randn(3), torch.randn(3)
    np.random.normal()  # leaves a cached gaussian in numpy's legacy state
    save_checkpoint(tmp_path, 1, model_state={}, train_state={"rng": capture_rng_state()})

    def draws():
        return (random.random(), random.gauss(0, 1), np.random.randn(5).tolist(),
                np.random.normal(), torch.randn(5).tolist(), torch.randint(0, 1000, (3,)).tolist())

    expected = draws()
    draws()  # move every generator somewhere else
    _, state, _ = load_checkpoint(tmp_path)
    restore_rng_state(state["rng"])
    assert draws() == expected


def test_save_leaves_only_complete_folders_and_latest(tmp_path):
    started = time.perf_counter()
    save_checkpoint(tmp_path, 1, model_state={"w": torch.randn(256, 256)}, train_state={})
    assert time.perf_counter() - started < 10
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-00000001"]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step-00000001").iterdir()) == [
        "meta.json", "model.safetensors", "state.pt"]


def test_invalid_arguments_are_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="non-negative int"):
        save_checkpoint(tmp_path, -1, model_state={}, train_state={})
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, 1, model_state={}, train_state={}, keep_last=0)
    with pytest.raises(CheckpointError, match="not a tensor"):
        save_checkpoint(tmp_path, 1, model_state={"x": 3}, train_state={})
