"""fit()'s AdamW is torch's fused one on CUDA where no parameter has a separate master
(32-true, bf16-mixed, 16-mixed), said in the run's start lines; on a CPU it stays foreach (what
the hand-loop-equals-fit tests compare). A checkpoint resumes across the two: the run's own
kernel choice wins over the checkpoint's. CUDA is stood in for by forcing the choice on a CPU."""
from __future__ import annotations

import math

import pytest
import torch

import mixprec.precision.plugins.params as precision_mod
from mixprec.optim.inputs import takes_found_inf
from mixprec.train.trainer import Trainer

from tests.train.test_trainer_step import Regressor, batches

QUIET = dict(progress=False, audit=False, log_interval=1, eval_interval=0, warmup_steps=2,
             clip_grad_norm=None)


def _fit(run, mode, max_steps, *, fused, resume=None):
    with pytest.MonkeyPatch.context() as m:
        if fused:        # what make_optimizer decides for parameters on CUDA
            m.setattr(precision_mod, "_fuses", lambda *a: True)
        torch.manual_seed(0)
        trainer = Trainer(Regressor(), run_dir=str(run), mixed_precision=mode, max_steps=max_steps,
                          ckpt_interval=3, **QUIET)
        trainer.fit(batches(8), resume=resume)
    return trainer


def _inner(trainer):
    return trainer.optimizer.inner


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "16-mixed"])
def test_on_a_cpu_fits_adamw_stays_foreach_and_says_nothing_about_fused(tmp_path, mode):
    trainer = _fit(tmp_path / "run", mode, 2, fused=False)
    assert _inner(trainer).defaults["fused"] is None and not takes_found_inf(_inner(trainer))
    assert not any("fused" in n for n in trainer.precision.notes)


def test_a_fused_run_says_so_in_its_start_lines(tmp_path):
    trainer = _fit(tmp_path / "run", "bf16-mixed", 2, fused=True)
    assert takes_found_inf(_inner(trainer))
    said = (tmp_path / "run" / "events.jsonl").read_text()
    assert "AdamW: torch's fused kernel" in said


@pytest.mark.parametrize("saved_fused", [True, False], ids=["fused-to-foreach", "foreach-to-fused"])
def test_a_checkpoint_resumes_across_fused_and_foreach_with_the_runs_own_kernel(tmp_path, saved_fused):
    run = tmp_path / "run"
    _fit(run, "16-mixed", 3, fused=saved_fused)
    resumed = _fit(run, "16-mixed", 6, fused=not saved_fused, resume=True)
    assert resumed.step == 6
    assert all(bool(g["fused"]) is (not saved_fused) for g in resumed.optimizer.param_groups)
    assert takes_found_inf(_inner(resumed)) is (not saved_fused)
    # the checkpoint's state was continued: each taken step counted once, across the two kernels
    steps = {float(st["step"]) for st in resumed.optimizer.state_dict()["state"].values()}
    assert steps == {6.0 - resumed.precision.scaler.num_skipped_steps}
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_a_fused_run_skips_traces_and_schedules_as_the_host_decided_run(tmp_path, mode):
    # The same run with the skip on the device (torch's fused kernel) and decided on the host (the
    # flag read first): the same weights and moments bit for bit, the same skipped steps, trace
    # events, LRs and loss scale.
    import mixprec.optim.inputs as inputs_mod
    from mixprec.runs.metrics import read_events

    def run(name, on_device):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(precision_mod, "_fuses", lambda *a: True)
            if not on_device:
                m.setattr(inputs_mod, "skips_on_device", lambda opt: False)
            torch.manual_seed(0)
            model = Regressor()

            def poison(module, args, output):   # NaN whenever the batch carries the marker value
                return torch.where(args[0][:, :1] == 1234.0, torch.full_like(output, math.nan), output)

            model.net[0].register_forward_hook(poison)
            data = batches(8)
            for i in (3, 5):
                data[i][0][0, 0] = 1234.0
            trainer = Trainer(model, run_dir=str(tmp_path / name), mixed_precision=mode, max_steps=8,
                              ckpt_interval=0, **QUIET)
            lrs = []
            step_of = trainer.train_step

            def train_step(micro):
                out = step_of(micro)
                lrs.append(trainer.scheduler.get_last_lr()[0])
                return out
            trainer.train_step = train_step
            trainer.fit(data)
        skips = [(e["step"], e["module"], e["nonfinite"]) for e in read_events(tmp_path / name)
                 if e["kind"] == "skip"]
        return trainer, skips, lrs

    (dev, dev_skips, dev_lrs), (host, host_skips, host_lrs) = run("dev", True), run("host", False)
    assert takes_found_inf(_inner(dev))
    assert dev_skips == host_skips and len(dev_skips) == 2
    assert dev_lrs == host_lrs
    assert dev.precision.scaler.num_skipped_steps == host.precision.scaler.num_skipped_steps == 2
    assert dev.precision.scaler.state_dict() == host.precision.scaler.state_dict()
    for pa, pb in zip(dev.model.parameters(), host.model.parameters()):
        assert torch.equal(pa.view(torch.int32), pb.view(torch.int32))
    sa, sb = dev.optimizer.state_dict()["state"], host.optimizer.state_dict()["state"]
    for k in sa:
        for key in sa[k]:
            assert torch.equal(sa[k][key].view(torch.int32), sb[k][key].view(torch.int32)), (k, key)
