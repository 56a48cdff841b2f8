"""Guarded training: a layer that makes inf/NaN, or whose FP8 output goes bad, moves one format
safer and the run goes on; a loss spike restores the last good snapshot; a layer that fails in
every format ends the run (exit 3)."""
import json

import pytest
import torch

import mixprec as mp
from mixprec.errors import ConfigError, TrainingDiverged
from mixprec.formats import Fp8Linear
from mixprec.monitor.guard import GuardConfig, StepOutcome, TrainingGuard

from guard_nets import Net as _Net, loader as _loader

FAULTY = "blocks.1.fc"


def _faulty_net(fails_in: str) -> _Net:
    """``FAULTY`` outputs NaN when it runs in FP8 (``fails_in="fp8"``) or always (``"all"``). The
    hook moves with the layer when a format switch swaps its module."""
    net = _Net()

    def fault(module, args, output):
        if fails_in == "all" or isinstance(module, Fp8Linear):
            return torch.full_like(output, float("nan"))
    net.get_submodule(FAULTY).register_forward_hook(fault)
    return net


def _events(run):
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _fit(net, run, steps):
    trainer = mp.Trainer(net, mixed_precision="fp8-tensorwise", max_steps=steps, run_dir=str(run),
                         progress=False, audit=False, guard=True, ckpt_interval=0,
                         log_interval=1, lr=1e-3)
    return trainer, trainer.fit(_loader())


def test_a_layer_making_nan_in_fp8_is_promoted_and_the_run_finishes(tmp_path):
    run = tmp_path / "run"
    trainer, result = _fit(_faulty_net("fp8"), run, 8)
    start = next(e for e in _events(run) if e["kind"] == "formats")["layers"]
    final = trainer.precision.layers.formats
    assert final[FAULTY] == "bf16" and start[FAULTY] == "fp8-tensorwise"
    assert {n: f for n, f in final.items() if n != FAULTY} == \
        {n: f for n, f in start.items() if n != FAULTY}                # no other layer changed
    switches = [e for e in _events(run) if e["kind"] == "format"]
    assert [(e["step"], e["module"], e["from"], e["to"], e["guard"]) for e in switches] == \
        [(2, FAULTY, "fp8-tensorwise", "bf16", "promote")]             # 2 consecutive skips
    assert "non-finite" in switches[0]["reason"]
    assert result.skipped_steps == 2 and result.steps == 8
    assert result.final_loss is not None and result.final_loss == result.final_loss  # finite
    # The scheduler stepped only on the 6 steps taken.
    assert trainer.scheduler.last_epoch == 6
    # Resuming keeps the promotion (the checkpoint holds the current formats).
    again = mp.Trainer(_faulty_net("fp8"), mixed_precision="fp8-tensorwise", max_steps=9,
                       run_dir=str(run), progress=False, audit=False, guard=True, ckpt_interval=0,
                       log_interval=1, lr=1e-3)
    again.fit(_loader(), resume=True)
    assert again.precision.layers.formats[FAULTY] == "bf16"
    from mixprec.report.report import summarize
    from mixprec.runs.metrics import read_events, read_metrics
    assert "blocks.1.fc fp8-tensorwise -> bf16" in summarize(read_metrics(run), read_events(run))["guard"]


def test_a_layer_failing_in_every_format_ends_the_run_with_exit_3(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match="nothing safer is left") as e:
        _fit(_faulty_net("all"), run, 12)
    assert e.value.exit_code == 3
    ladder = [(x["from"], x["to"]) for x in _events(run) if x["kind"] == "format"]
    assert ladder == [("fp8-tensorwise", "bf16"), ("bf16", "fp32")]
    assert any(x.get("action") == "give-up" and x["step"] == 6 for x in _events(run))


def test_guard_settings_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="use one of them"):
        mp.Trainer(_Net(), guard=True, replan_every=5)
    with pytest.raises(ConfigError, match="trace_nonfinite=true"):
        mp.Trainer(_Net(), guard=True, trace_nonfinite=False)
    with pytest.raises(ConfigError, match="window >= 2"):
        mp.Trainer(_Net(), guard=True, guard_window=1)


def _outlier_guard(every: int):
    """A set-up FP8 model whose ``blocks.0.proj`` input has two channels 10^5x the rest (its FP8
    output SQNR collapses), a guard over it, and a probe running one forward."""
    net = _outlier_net()
    precision = mp.Precision("fp8-tensorwise")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = precision.setup(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    guard = TrainingGuard(precision, net, opt, sched,
                          config=GuardConfig(every=every, window=5, spike_sigma=6.0))
    x, y = _loader()[0]

    def probe():
        net(x, y)
    return net, opt, sched, precision, guard, probe


def test_a_sampled_low_sqnr_layer_is_promoted_alone():
    net, opt, sched, precision, guard, probe = _outlier_guard(every=1)
    before = dict(precision.layers.formats)
    actions = guard.after_step(StepOutcome(1, 2.0, False), probe)
    assert [(a.kind, a.switch.module, a.switch.new) for a in actions] == [("promote", "blocks.0.proj", "bf16")]
    assert "SQNR" in actions[0].message
    assert guard.last_sqnr["blocks.0.proj"] < 20 < min(v for n, v in guard.last_sqnr.items()
                                                       if n != "blocks.0.proj")
    assert {n: f for n, f in precision.layers.formats.items() if n != "blocks.0.proj"} == \
        {n: f for n, f in before.items() if n != "blocks.0.proj"}


def test_a_loss_spike_restores_the_snapshot_and_promotes_the_layer_that_stands_out():
    net, opt, sched, precision, guard, probe = _outlier_guard(every=0)
    for s in range(1, 6):                       # a calm window; the first step is the snapshot
        guard.after_step(StepOutcome(s, 2.0 + 0.01 * (s % 2), False), probe)
        opt.step()
        sched.step()
    snap = {k: v.clone() for k, v in net.state_dict().items()}
    lr = sched.get_last_lr()
    guard._snaps.take(5)
    with torch.no_grad():                       # the weights get hurt ...
        net.head.weight.add_(1.0)
    opt.step()
    sched.step()
    actions = guard.after_step(StepOutcome(6, 9.0, False), probe)   # ... and the loss spikes
    assert [a.kind for a in actions] == ["restore", "promote"]
    assert actions[1].switch.module == "blocks.0.proj" and "sigma" in actions[1].message
    assert all(torch.equal(v, snap[k]) for k, v in net.state_dict().items())
    assert sched.get_last_lr() == lr                                # the LR schedule rewinds too


MARK = 255


class _Spiky(_Net):
    """``_faulty_net("fp8")``'s fault, and a loss 50x larger on a batch of only ``MARK`` tokens."""

    def __init__(self) -> None:
        super().__init__()

        def fault(module, args, output):
            if isinstance(module, Fp8Linear):
                return torch.full_like(output, float("nan"))
        self.get_submodule(FAULTY).register_forward_hook(fault)

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        return loss * 50 if bool((idx == MARK).all()) else loss


def _spiky_fit(run, resume=False, lr=1e-3):
    data = _loader()
    data[6] = (torch.full((4, 16), MARK), data[6][1])          # step 7's batch spikes the loss
    trainer = mp.Trainer(_Spiky(), mixed_precision="fp8-tensorwise", max_steps=10, run_dir=str(run),
                         progress=False, audit=False, guard=True, guard_every=0, guard_window=3,
                         ckpt_interval=1, keep_last=20, log_interval=1, lr=lr)
    trainer.fit(data, resume=resume)
    return trainer


def _guard_records(run, after):
    return [(e["step"], e.get("module"), e.get("guard") or e.get("action"))
            for e in _events(run) if e["step"] > after and (e["kind"] == "guard" or "guard" in e)]


def test_a_resumed_guarded_run_decides_and_trains_exactly_as_the_uninterrupted_one(tmp_path):
    """Steps 1-2 skip (promoted at 2: two consecutive origins), step 7 spikes (restored to the
    snapshot of step 6, its window holds steps 4-6). Resuming after step 1 needs the origin count,
    after step 6 the loss window and the snapshot: without them the resumed run promotes at 3 /
    does not see the spike."""
    import shutil
    straight = _spiky_fit(tmp_path / "straight")
    done = [(a.kind, a.step) for a in straight.guard.actions]
    assert done[0] == ("promote", 2) and ("restore", 7) in done
    for k in (1, 6):
        run = tmp_path / f"from-{k}"
        name = f"step-{k:08d}"
        shutil.copytree(tmp_path / "straight" / "checkpoints" / name, run / "checkpoints" / name)
        (run / "checkpoints" / "latest").write_text(name + "\n")
        resumed = _spiky_fit(run, resume=True)
        assert [(a.kind, a.step, a.message) for a in resumed.guard.actions] == \
            [(a.kind, a.step, a.message) for a in straight.guard.actions if a.step > k], k
        assert _guard_records(run, k) == _guard_records(tmp_path / "straight", k)
        a, b = straight.model.state_dict(), resumed.model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), k
        assert resumed.precision.layers.formats == straight.precision.layers.formats
        assert resumed.scheduler.last_epoch == straight.scheduler.last_epoch


def test_a_restore_after_a_resume_keeps_the_resumed_runs_lr_schedule(tmp_path):
    """The snapshot in step 6's checkpoint was taken under lr=1e-3; resumed with lr=3e-3, the
    spike at step 7 restores the weights and moments but rewinds the new schedule (it restored the
    old one: peak 1e-3 for the rest of the run)."""
    import shutil
    _spiky_fit(tmp_path / "first")
    run, name = tmp_path / "resumed", "step-00000006"
    shutil.copytree(tmp_path / "first" / "checkpoints" / name, run / "checkpoints" / name)
    (run / "checkpoints" / "latest").write_text(name + "\n")
    resumed = _spiky_fit(run, resume=True, lr=3e-3)
    assert ("restore", 7) in [(a.kind, a.step) for a in resumed.guard.actions]
    sched = resumed.scheduler
    assert sched.base_lrs == [3e-3, 3e-3]
    curve = sched.lr_lambdas[0]
    assert [g["lr"] for g in resumed.optimizer.param_groups] == \
        pytest.approx([3e-3 * curve(sched.last_epoch)] * 2, rel=1e-12)
    assert [g["initial_lr"] for g in resumed.optimizer.param_groups] == [3e-3, 3e-3]


def _outlier_net() -> _Net:
    """``_outlier_guard``'s model for ``fit()``: ``blocks.0.proj`` loses its FP8 output from step 1."""
    net = _Net()
    boost = torch.ones(64)
    boost[[3, 40]] = 1e5
    net.blocks[0].proj.register_forward_pre_hook(lambda mod, args: (args[0] * boost,))
    with torch.no_grad():
        net.blocks[0].proj.weight[:, [3, 40]] /= 1e5
    return net


def test_a_layer_bad_from_the_start_is_promoted_at_step_1_and_that_step_undone(tmp_path):
    """The first SQNR sample is at step 1, not at step ``guard_every``; the step that ran the
    layer in FP8 is undone (the snapshot before step 1: weights, moments, LR schedule). Without
    the first-step sample the layer trains 50 steps in FP8 with its output lost."""
    net = _outlier_net()
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    run = tmp_path / "run"
    trainer = mp.Trainer(net, mixed_precision="fp8-tensorwise", max_steps=1, run_dir=str(run),
                         progress=False, audit=False, guard=True, ckpt_interval=0,
                         log_interval=1, lr=1e-3)
    result = trainer.fit(_loader())
    assert [(a.kind, a.step) for a in trainer.guard.actions] == [("restore", 1), ("promote", 1)]
    assert "restored to step 0" in trainer.guard.actions[0].message
    formats = trainer.precision.layers.formats
    assert formats["blocks.0.proj"] == "bf16"
    assert {f for n, f in formats.items() if n not in ("blocks.0.proj", "head")} == {"fp8-tensorwise"}
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k].float(), v.float()) for k, v in initial.items()), "step 1 undone"
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0
    assert result.steps == 1
    kinds = [(e["kind"], e.get("action") or e.get("guard")) for e in _events(run) if e["step"] == 1]
    assert ("guard", "restore") in kinds and ("format", "promote") in kinds


def test_a_layer_failing_a_later_sample_undoes_the_steps_since_its_last_pass():
    """Samples at steps 1 and 2 pass (a snapshot follows each); outliers appear after step 2; the
    sample of step 4 fails: weights and LR schedule go back to step 2, then the layer is promoted."""
    net, on = _Net(), [False]
    boost = torch.ones(64)
    boost[[3, 40]] = 1e5
    net.blocks[0].proj.register_forward_pre_hook(lambda mod, args: (args[0] * boost,) if on[0] else None)
    with torch.no_grad():                  # (the outliers, once on, leave the function as it was)
        net.blocks[0].proj.weight[:, [3, 40]] /= 1e5
    precision = mp.Precision("fp8-tensorwise")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = precision.setup(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    guard = TrainingGuard(precision, net, opt, sched,
                          config=GuardConfig(every=2, window=100, spike_sigma=0.0))
    x, y = _loader()[0]

    def step(s):
        guard.before_step(s)
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
        sched.step()
        return guard.after_step(StepOutcome(s, 2.0, False), lambda: net(x, y))

    assert step(1) == [] and step(2) == []
    at_2 = {k: v.clone() for k, v in net.state_dict().items()}
    on[0] = True
    assert step(3) == []                                   # no sample at step 3
    actions = step(4)
    assert [(a.kind, a.step) for a in actions] == [("restore", 4), ("promote", 4)]
    assert "last passed: step 2" in actions[0].message and "restored to step 2" in actions[0].message
    assert actions[1].switch.module == "blocks.0.proj"
    after = net.state_dict()
    assert all(torch.equal(after[k].float(), v.float()) for k, v in at_2.items())
    assert sched.last_epoch == 2 and sched.get_last_lr() == [0.1 / 3] * len(opt.param_groups)


def test_a_restore_rewinds_the_fp8_amax_history_with_the_weights():
    """Delayed scaling keeps its amax history outside the state dict: a restore brings back the
    snapshot's, not the spike's."""
    net = _Net()
    precision = mp.Precision("fp8-delayed")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = precision.setup(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard = TrainingGuard(precision, net, opt, sched, config=GuardConfig(every=0, window=5))
    x, y = _loader()[0]
    net(x, y)
    layer = net.get_submodule(FAULTY)
    kept = layer.amax_history.clone()
    assert kept.abs().sum() > 0
    guard.before_step(1)
    with torch.no_grad():
        layer.amax_history.fill_(1e9)                       # a spike's amaxes
    guard._restore(1, "test")
    assert torch.equal(layer.amax_history, kept)


def test_a_guarded_run_says_what_the_guard_watches_and_the_report_says_on_with_0_repairs(tmp_path, capsys):
    """Before: with nothing to repair the guard was silent and the report's guard cell said '-'."""
    run = tmp_path / "run"
    trainer, _ = _fit(_Net(), run, 1)
    assert trainer.guard.actions == []
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[mixprec] guard:"))
    assert "watching 5 Linear layers" in line and "every 50 steps" in line
    assert "bf16 < 20 dB" in line                               # the head
    assert "fp8-tensorwise < 20 dB or > 1 % flushed" in line and "6 sigma" in line
    from mixprec.report.report import summarize
    from mixprec.runs.metrics import read_events, read_metrics
    assert summarize(read_metrics(run), read_events(run))["guard"] == "on, 0 repairs"
    from mixprec.report.report import guard_summary
    unguarded = [e for e in read_events(run) if e["kind"] != "start"] + [{"kind": "start", "watching": []}]
    assert guard_summary(unguarded) == "-"


def test_a_guarded_run_whose_fp8_layers_all_went_to_bf16_is_labelled_by_what_ran(tmp_path):
    """Before: ``FitResult.policy``, the last line and the report said ``fp8-tensorwise`` for a
    run whose four FP8 layers all trained in BF16 from step 1 (a BF16 run compared as FP8)."""
    from mixprec.report.compare import compare_summary, load_run
    from mixprec.report.report import summarize
    from mixprec.runs.metrics import read_events, read_metrics
    from mixprec.runs.read import read_run_config
    run = tmp_path / "run"
    trainer = mp.Trainer(_Net(), mixed_precision="fp8-tensorwise", max_steps=2, run_dir=str(run),
                         progress=False, audit=False, guard=True, guard_min_sqnr=200.0,
                         ckpt_interval=0, log_interval=1, lr=1e-3)
    result = trainer.fit(_loader())
    assert set(trainer.precision.layers.formats.values()) == {"bf16"}
    assert result.policy == "fp8-tensorwise+switched (5 bf16)"
    summary = summarize(read_metrics(run), read_events(run), read_run_config(run))
    assert summary["ran"] == "fp8-tensorwise+switched (5 bf16)"
    assert summary["layer formats at the start"] == "4 fp8-tensorwise, 1 bf16"
    assert summary["layer formats at the end"] == "5 bf16"
    assert summary["layer formats over the run"] == "bf16 100 % of layer-steps"
    assert compare_summary([load_run(run)])[0]["precision"] == "fp8-tensorwise+switched"
    from mixprec.report.compare import reference_words
    assert "not a uniform reference" in reference_words(load_run(run))
    # A guarded run whose guard did nothing keeps its mode's label.
    quiet = tmp_path / "quiet"
    trainer, result = _fit(_Net(), quiet, 1)
    assert result.policy == "fp8-tensorwise"
    assert summarize(read_metrics(quiet), read_events(quiet))["ran"] == "fp8-tensorwise"


def _fp16_guard(min_scale: float = 1.0):
    precision = mp.Precision("16-mixed", min_scale=min_scale)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = precision.setup(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return TrainingGuard(precision, net, opt, sched, config=GuardConfig(every=0, patience=2))


def _skip(step, origin="blocks.1.proj", direction="backward", scale=2.0 ** 20):
    return StepOutcome(step, 2.0, True, origin, direction, scale)


def test_skips_of_the_scalers_search_before_the_first_taken_step_promote_nothing():
    """``16-mixed guard=true init_scale=1e6``: the scale halving to its level overflowed the backward
    first in one Linear on steps 1-2, and the guard moved it to FP32 (two layers by step 4)."""
    guard = _fp16_guard()
    assert [guard.after_step(_skip(s, scale=1e6 / 2 ** s)) for s in range(4)] == [[], [], [], []]
    assert set(guard.precision.layers.formats.values()) == {"fp16"}
    # After a taken step the scale has found a level: the same two skips are the layer's.
    assert guard.after_step(StepOutcome(5, 2.0, False)) == []
    guard.after_step(_skip(6))
    (action,) = guard.after_step(_skip(7))
    assert (action.kind, action.switch.module, action.switch.new) == ("promote", "blocks.1.proj", "fp32")


@pytest.mark.parametrize("outcome", [
    lambda s: _skip(s, direction="forward"),     # the scale multiplies only the backward
    lambda s: _skip(s, scale=4.0),               # at min_scale: nothing left to search
    lambda s: StepOutcome(s, 2.0, True, "blocks.1.proj", "backward", None),   # no loss scaling
])
def test_skips_the_scale_cannot_explain_count_from_the_first_step(outcome):
    guard = _fp16_guard(min_scale=4.0)
    assert guard.after_step(outcome(1)) == []
    (action,) = guard.after_step(outcome(2))
    assert action.kind == "promote" and action.switch.module == "blocks.1.proj"


def test_whether_a_step_was_taken_is_kept_in_the_guards_state():
    guard = _fp16_guard()
    guard.after_step(StepOutcome(1, 2.0, False))
    again = _fp16_guard()
    again.load_state_dict(guard.state_dict())
    again.after_step(_skip(2))
    assert len(again.after_step(_skip(3))) == 1          # the resumed guard counts them too
    older = {k: v for k, v in _fp16_guard().state_dict().items() if k != "taken_any"}
    old = _fp16_guard()
    old.load_state_dict(older)                   # a checkpoint from before: past the search
    old.after_step(_skip(1))
    assert len(old.after_step(_skip(2))) == 1
