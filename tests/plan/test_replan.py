"""Re-planning while training: a layer whose inputs grow outliers mid-run leaves FP8 at the next
sampled step, the run stays finite, and a resume restores the current plan."""
import json
import math

import torch
from torch import nn

import mixprec as mp
from mixprec.monitor import LayerReplanner

from guard_nets import Net, loader as _loader

GROW_AT = 5          # the 5th forward (step 5) grows outliers in blocks.1.proj's inputs


class _Net(Net):
    """Its training forwards from the ``GROW_AT``-th on grow outliers in ``blocks.1.proj``'s inputs."""

    def __init__(self) -> None:
        super().__init__(boost=True)
        self.calls = 0

    def forward(self, idx, targets):
        if self.training:
            self.calls += 1
            if self.calls >= GROW_AT:
                self.blocks[1].grow_outliers()
        return super().forward(idx, targets)


def _fit(run, steps, resume=False):
    trainer = mp.Trainer(_Net(), mixed_precision="fp8-tensorwise", max_steps=steps, run_dir=str(run),
                         progress=False, audit=False, replan_every=2, replan_window=2,
                         ckpt_interval=0, log_interval=1, lr=1e-3)
    trainer.fit(_loader(), resume=resume)
    return trainer


def test_growing_outliers_promote_the_layer_at_the_next_sample_and_resume_keeps_the_plan(tmp_path):
    run = tmp_path / "run"
    t = _fit(run, 7)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    switches = [e for e in events if e["kind"] == "format"]
    assert [(e["step"], e["module"], e["from"], e["to"]) for e in switches] == \
        [(6, "blocks.1.proj", "fp8-tensorwise", "bf16")]               # first sample after step 5
    assert "flush to zero" in switches[0]["message"]
    assert t.precision.layers.formats["blocks.1.proj"] == "bf16"
    assert t.precision.layers.formats["blocks.0.proj"] == "fp8-tensorwise"
    losses = [float(r["loss"]) for r in mp.runs.metrics.read_metrics(run)]
    assert len(losses) == 7 and all(math.isfinite(v) for v in losses)
    assert t.precision.scaler.num_skipped_steps == 0
    from mixprec.report.format_timeline import format_timeline
    from mixprec.report.report import write_report
    layers, rows = format_timeline(events, 7)
    assert rows["blocks.1.proj"][5:] == ["fp8-tensorwise", "bf16", "bf16"]
    html = write_report(run)
    assert (html.parent / "formats.png").is_file() and "blocks.1.proj fp8-tensorwise -&gt; bf16" in html.read_text()

    resumed = _fit(run, 8, resume=True)                                   # step 8: a sample, healthy 1
    model = resumed.strategy.unwrap(resumed.model)
    assert resumed.precision.layers.formats["blocks.1.proj"] == "bf16"    # the saved plan, not the initial
    assert type(model.blocks[1].proj) is nn.Linear                       # bf16: the mode's own format
    assert resumed.replanner.healthy["blocks.1.proj"] == 0               # outliers still there


def test_a_switch_keeps_parameters_and_optimizer_state():
    precision = mp.Precision("fp8-tensorwise")
    model, _ = precision.setup(_Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _loader()[0]
    with precision.autocast():
        model(x, y).backward()
    opt.step()
    before = model.blocks[0].fc.weight
    state = opt.state[before]["exp_avg"].clone()
    assert precision.layers.set_format(model, "blocks.0.fc", "fp32") == "fp32"
    assert model.blocks[0].fc.weight is before and torch.equal(opt.state[before]["exp_avg"], state)
    assert precision.layers.set_format(model, "blocks.0.fc", "fp8-tensorwise") == "fp8-tensorwise"
    assert precision.layers.set_format(model, "head", "fp8-tensorwise") == "bf16"   # FP8 rules hold
    replanner = LayerReplanner(precision, model, every=1)
    assert "head" not in replanner.planned


class _LoudGrad(torch.autograd.Function):
    """Identity forward; backward multiplies two channels of the gradient by 10^6."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[..., [1, 17]] *= 1e6
        return g


def test_gradient_outliers_promote_a_layer_too():
    precision = mp.Precision("fp8-blockwise")        # E4M3 gradients: 10^6 is past their range
    model, _ = precision.setup(_Net())
    replanner = LayerReplanner(precision, model, every=1)
    x, y = _loader()[0]
    original = model.blocks[0].forward
    model.blocks[0].forward = lambda h: _LoudGrad.apply(original(h))   # reaches blocks.0.proj's output
    with replanner.sample(model, 1):
        with precision.autocast():
            model(x, y).backward()
    switches = replanner.decide(model, 1)
    assert [(s.module, s.new) for s in switches] == [("blocks.0.proj", "bf16")], switches
    assert "output gradient flushes" in switches[0].reason
    assert replanner.last_measured["blocks.0.fc"][2] <= 0.01            # its gradient: no outliers
