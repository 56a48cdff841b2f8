"""``fit()`` reads step t's outcome (taken or skipped) just before step t + 1's update
(``Trainer.conclude``), not right after step t: a run with forced FP16 overflows is the same, bit
for bit, as one that reads every outcome right after its step (``settle_each_step``): every
update's LR, the weights and optimizer state, the loss scale and skip counters, the checkpoints,
the metrics rows and the skip events (each traced to its layer while the next step's gradients
are waiting, with dropout: the trace must leave them and the RNG stream as they were)."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from mixprec.precision import Precision, StepTaken
from mixprec.runs import checkpoint as ckpt
from mixprec.runs.metrics import read_events, read_metrics
from mixprec.train.step import StepOutput
from mixprec.train.trainer import Trainer

from tests.amp.amp_helpers import assert_bitwise_equal
from tests.train.test_trainer_step import batches

_OVERFLOWS = (3, 7, 8)
"""Steps whose targets (x 1e4) overflow the FP16 backward at any loss scale the run reaches."""
_TIMING = ("time", "time_s", "tokens_per_s", "samples_per_s", "mfu", "peak_mem_mb", "eval_s")


class _DropoutRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)


def _run(tmp_path, name: str, *, settle_each_step: bool, monkeypatch):
    torch.manual_seed(0)
    data = [(x, y * 1e4 if i + 1 in _OVERFLOWS else y) for i, (x, y) in enumerate(batches(12))]
    trainer = Trainer(_DropoutRegressor(), run_dir=str(tmp_path / name), mixed_precision="16-mixed",
                      max_steps=12, log_interval=5, ckpt_interval=4, keep_last=0, warmup_steps=3,
                      clip_grad_norm=1.0, progress=False, audit=False)
    trainer.settle_each_step = settle_each_step
    lrs: list[float] = []
    traced: dict[int, bool] = {}      # skipped step -> traced inside the next step's train_step
    step, trace = Precision.step, Trainer.trace_nonfinite

    def recorded_step(precision, optimizer, **k):
        lrs.append(optimizer.param_groups[0]["lr"])          # the LR this update runs at
        return step(precision, optimizer, **k)

    def recorded_trace(tr, micro, out, rng):
        traced[tr.step] = any(f.function == "train_step" for f in inspect.stack())
        return trace(tr, micro, out, rng)
    monkeypatch.setattr(Precision, "step", recorded_step)
    monkeypatch.setattr(Trainer, "trace_nonfinite", recorded_trace)
    result = trainer.fit(data)
    monkeypatch.undo()
    assert type(trainer.optimizer).__module__.startswith("mixprec.optim")   # skips on the device
    return trainer, result, lrs, traced


def _without(rows: list[dict], keys=_TIMING) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in rows]


def test_a_lagged_run_with_forced_overflows_is_bit_identical_to_one_settled_each_step(tmp_path, monkeypatch):
    lag, lag_result, lag_lrs, lag_traced = _run(tmp_path, "lag", settle_each_step=False,
                                                monkeypatch=monkeypatch)
    now, now_result, now_lrs, now_traced = _run(tmp_path, "now", settle_each_step=True,
                                                monkeypatch=monkeypatch)
    assert lag.outcome_lags and not now.outcome_lags
    # The lag was exercised: skips concluded by the next step's train_step, traced there.
    assert set(_OVERFLOWS) <= set(lag_traced) and lag_traced.keys() == now_traced.keys()
    assert lag_traced[3] and lag_traced[7] and not any(now_traced.values()), (lag_traced, now_traced)
    assert lag_lrs == now_lrs and len(lag_lrs) == 12
    assert lag_result.skipped_steps == now_result.skipped_steps >= len(_OVERFLOWS)
    assert lag.scheduler.state_dict() == now.scheduler.state_dict()
    assert lag.scheduler.last_epoch == 12 - lag_result.skipped_steps
    assert_bitwise_equal(lag.model.state_dict(), now.model.state_dict())
    assert_bitwise_equal(lag.optimizer.state_dict(), now.optimizer.state_dict())
    assert lag.precision.scaler.state_dict() == now.precision.scaler.state_dict()
    assert lag.precision.scaler.counters == now.precision.scaler.counters
    rows = _without(read_metrics(lag.run_dir))
    assert rows == _without(read_metrics(now.run_dir)) and len(rows) == 3
    skips = [e for e in read_events(lag.run_dir) if e.get("kind") == "skip"]
    assert _without(skips) == _without([e for e in read_events(now.run_dir) if e.get("kind") == "skip"])
    assert [e["step"] for e in skips] == sorted(lag_traced) and all(e.get("module") for e in skips)
    for step in (4, 8, 12):
        lag_model, lag_state, _ = ckpt.load_checkpoint(lag.run_dir / "checkpoints" / ckpt.step_dir_name(step))
        now_model, now_state, _ = ckpt.load_checkpoint(now.run_dir / "checkpoints" / ckpt.step_dir_name(step))
        assert_bitwise_equal(lag_model, now_model, f"step {step}")
        lag_state.pop("config"), now_state.pop("config")             # its run_dir differs
        assert_bitwise_equal(lag_state, now_state, f"step {step}")


def test_a_step_called_on_its_own_concludes_before_it_returns(tmp_path):
    # Outside fit() there is no next step to wait for: the schedule moves as train_step returns.
    from tests.train.test_trainer_step import Regressor, make_trainer
    torch.manual_seed(0)
    trainer = make_trainer(Regressor(), tmp_path, mixed_precision="bf16-true", max_steps=2)
    trainer.prepare(total_steps=2)
    out = trainer.train_step(batches(1))
    assert out.known and not out.skipped and trainer.scheduler.last_epoch == 1


@pytest.mark.parametrize("setting, lags", [
    ({}, True),
    ({"monitor_every": 2}, False),          # its rows are the sampled step's
    ({"replan_every": 2}, False),           # it may switch a format before the next forward
])
def test_the_outcome_lags_unless_a_hook_needs_it_before_the_next_forward(tmp_path, setting, lags):
    from tests.train.test_trainer_step import Regressor
    trainer = Trainer(Regressor(), run_dir=str(tmp_path / "r"), mixed_precision="bf16-true",
                      progress=False, audit=False, **setting)
    trainer.prepare(total_steps=4)
    assert trainer.outcome_lags is lags


def test_delayed_scaling_fp8_reads_each_outcome_right_after_its_step(tmp_path):
    # The next forward moves the amax history the trace of a skip must replay as it was.
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    trainer = Trainer(model, run_dir=str(tmp_path / "r"), mixed_precision="fp8-delayed",
                      progress=False, audit=False, loss_fn=lambda out, y: (out.float() - y).pow(2).mean())
    trainer.prepare(total_steps=4)
    assert "fp8-delayed" in trainer.precision.layers.formats.values() and not trainer.outcome_lags


def test_a_step_output_reads_whether_it_was_skipped_only_when_asked():
    reads = []
    taken = StepTaken(torch.tensor(1.0), resolve=lambda: reads.append("read"))
    out = StepOutput(torch.tensor(0.5), None, None, 1.0, 8, taken=taken)
    assert not out.known and "on the device" in repr(out) and reads == []
    assert out.skipped is True and out.known and reads == ["read"]
    assert out.skipped is True and reads == ["read"]                 # once
    assert StepOutput(torch.tensor(0.5), None, False, 1.0, 8).known
    with pytest.raises(TypeError, match="one of them"):
        StepOutput(torch.tensor(0.5), None, None, 1.0, 8)
