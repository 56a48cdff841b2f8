"""The training step's order of operations, on small models and the library API."""
import math

import pytest
import torch
from torch import nn

from mixprec.train.trainer import Trainer


class Regressor(nn.Module):
    """forward(x, y) -> MSE loss, so the trainer needs no loss_fn."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)


def batches(n: int, bs: int = 8, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bs, d, generator=g), torch.randn(bs, generator=g)) for _ in range(n)]


def make_trainer(model, tmp_path, **kw):
    kw.setdefault("mixed_precision", "32-true")
    kw.setdefault("progress", False)
    kw.setdefault("audit", False)
    kw.setdefault("ckpt_interval", 0)
    kw.setdefault("warmup_steps", 0)
    return Trainer(model, run_dir=str(tmp_path / "run"), **kw)


def test_skipped_step_leaves_params_and_lr_schedule_unchanged(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    trainer = make_trainer(model, tmp_path, max_steps=4, clip_grad_norm=None)
    trainer.prepare(total_steps=4)
    data = batches(4)
    trainer.train_step([data[0]])
    lr_after_first = trainer.scheduler.get_last_lr()[0]
    epoch_after_first = trainer.scheduler.last_epoch
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # Poison one gradient: the finite check (on even in FP32) must skip the whole step.
    handle = model.net[0].weight.register_hook(lambda g: torch.full_like(g, math.inf))
    out = trainer.train_step([data[1]])
    handle.remove()
    assert out.skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert trainer.scheduler.last_epoch == epoch_after_first
    assert trainer.scheduler.get_last_lr()[0] == lr_after_first
    out = trainer.train_step([data[2]])
    assert not out.skipped and trainer.scheduler.last_epoch == epoch_after_first + 1


def test_clipping_sees_unscaled_gradients_under_fp16_loss_scaling(tmp_path):
    torch.manual_seed(0)
    ref_model = Regressor()
    model = Regressor()
    model.load_state_dict(ref_model.state_dict())
    (x, y), = batches(1)
    ref_model(x, y).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()])
    trainer = make_trainer(model, tmp_path, mixed_precision="16-mixed", max_steps=1,
                           clip_grad_norm=1e9, init_scale=2.0**10)
    trainer.prepare(total_steps=1)
    out = trainer.train_step([(x, y)])
    assert not out.skipped
    # FP16 matmuls: 1% relative agreement with the FP32 reference norm (a scaled norm would be 1024x).
    assert float(out.grad_norm) == pytest.approx(float(ref_norm), rel=1e-2)


def test_gradient_accumulation_equals_one_large_batch(tmp_path):
    torch.manual_seed(0)
    a, b = Regressor(), Regressor()
    b.load_state_dict(a.state_dict())
    (x, y), = batches(1, bs=16)
    big = make_trainer(a, tmp_path / "a", max_steps=1, grad_accum_steps=1, clip_grad_norm=None,
                       optimizer=torch.optim.SGD(a.parameters(), lr=0.1))
    small = make_trainer(b, tmp_path / "b", max_steps=1, grad_accum_steps=4, clip_grad_norm=None,
                         optimizer=torch.optim.SGD(b.parameters(), lr=0.1))
    big.prepare(1)
    small.prepare(1)
    out_big = big.train_step([(x, y)])
    out_small = small.train_step([(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)])
    assert float(out_small.loss) == pytest.approx(float(out_big.loss), rel=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_fit_runs_the_seed_call_and_reports_steps(tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    from mixprec.train import fit
    result = fit(model, batches(6), epochs=2, mixed_precision=True, run_dir=str(tmp_path / "r"),
                 progress=False, audit=False, log_interval=2, ckpt_interval=0)
    assert result.steps == 12 and result.skipped_steps == 0
    assert (tmp_path / "r" / "metrics.csv").is_file()
    assert (tmp_path / "r" / "checkpoints" / "latest").is_file()


def test_fit_rejects_unknown_arguments_with_a_suggestion(tmp_path):
    from mixprec.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown argument 'max_step'.*did you mean 'max_steps'"):
        Trainer(Regressor(), max_step=3)


def test_model_without_loss_needs_loss_fn(tmp_path):
    from mixprec.errors import ConfigError
    model = nn.Linear(8, 1)
    trainer = make_trainer(model, tmp_path, max_steps=1)
    trainer.prepare(1)
    before = [p.detach().clone() for p in model.parameters()]
    # Decided at the first batch (what the batch is matters), told before any update.
    with pytest.raises(ConfigError, match="takes no targets.*loss_fn=lambda out, targets: F.mse_loss"):
        trainer.train_step(batches(1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    trainer = make_trainer(model, tmp_path, max_steps=1,
                           loss_fn=lambda out, y: nn.functional.mse_loss(out.squeeze(-1), y))
    trainer.prepare(1)
    assert not trainer.train_step(batches(1)).skipped


def test_skipped_step_is_traced_to_the_module_that_made_the_nan(tmp_path):
    torch.manual_seed(0)
    model = Regressor()

    def poison(module, args, output):   # NaN whenever the batch carries the marker value
        return torch.where(args[0][:, :1] == 1234.0, torch.full_like(output, math.nan), output)

    model.net[0].register_forward_hook(poison)
    data = batches(3)
    data[1][0][0, 0] = 1234.0
    from mixprec.train import fit
    result = fit(model, data, epochs=1, mixed_precision="32-true", run_dir=str(tmp_path / "r"),
                 progress=False, audit=False, log_interval=1, ckpt_interval=0, clip_grad_norm=None)
    assert result.skipped_steps == 1
    from mixprec.runs.metrics import read_events
    skips = [e for e in read_events(tmp_path / "r") if e["kind"] == "skip"]
    assert len(skips) == 1
    assert skips[0]["module"] == "net.0" and skips[0]["direction"] == "forward"
    assert skips[0]["message"].startswith("step 2 skipped: nan first at net.0 (forward, fp32)")


def test_skip_event_names_the_module_and_keeps_its_nonfinite_kind_for_a_second_micro_batch_fault(tmp_path):
    torch.manual_seed(0)
    model = Regressor()

    def poison(module, args, output):   # inf * output wherever the batch carries the marker value
        return output * torch.where(args[0][:, :1] == 1234.0, math.inf, 1.0)

    model.net[0].register_forward_hook(poison)
    data = batches(4)
    data[3][0][0, 0] = 1234.0           # step 2, second micro-batch
    from mixprec.train import fit
    result = fit(model, data, epochs=1, mixed_precision="32-true", run_dir=str(tmp_path / "r"),
                 grad_accum_steps=2, progress=False, audit=False, log_interval=1, ckpt_interval=0,
                 clip_grad_norm=None)
    assert result.skipped_steps == 1
    from mixprec.runs.metrics import read_events
    (skip,) = [e for e in read_events(tmp_path / "r") if e["kind"] == "skip"]
    # tanh saturates the forward inf, so the loss stays finite: the gradient is where it shows
    assert (skip["module"], skip["direction"], skip["nonfinite"]) == ("net.0", "backward", "nan")
    assert skip["micro_batch"] == 1


def test_numerics_monitor_writes_rows_only_on_sampled_steps(tmp_path):
    torch.manual_seed(0)
    from mixprec.train import fit
    from mixprec.runs.metrics import read_numerics
    fit(Regressor(), batches(4), epochs=1, mixed_precision="32-true", run_dir=str(tmp_path / "r"),
        progress=False, audit=False, ckpt_interval=0, monitor_every=2)
    rows = read_numerics(tmp_path / "r")
    assert {r["step"] for r in rows} == {2, 4}
    assert {r["kind"] for r in rows} == {"act", "grad", "update"}
