"""One rule book, one answer: casting, FP8 conversion, the audit, the memory estimator and MFU
agree (issue #23). Each test failed before the rule had one home."""
import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.estimate import cluster, memory
from mixprec.estimate.gpus import peak_kind
from mixprec.monitor import audit
from mixprec.runs.metrics import MetricsLogger, read_metrics
from mixprec.strategies import SingleDeviceStrategy
from mixprec.train import meter as meter_mod
from mixprec.train.step import StepOutput


class GatedNet(nn.Module):
    """A user's MoE-style module whose router is a plain Linear named ``gating``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.gating = nn.Linear(32, 16)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        h = self.fc(x)
        return self.out(h) * torch.softmax(self.gating(h), dim=-1)


def test_a_gating_module_is_a_gate_for_casting_fp8_conversion_and_the_audit():
    # casting: the router keeps FP32 parameters, the rest is stored in bf16
    model = GatedNet()
    precision = mp.Precision("bf16-true")
    precision.setup(model)
    assert model.gating.weight.dtype == torch.float32 and model.fc.weight.dtype == torch.bfloat16
    row = precision.resolve(model)["gating"]
    assert row.kind == "gate" and row.fp32_island and "gate" in row.why
    # the audit agrees: nothing to warn about a gate kept in FP32
    assert "half-precision-gate" not in {f.code for f in audit(model, precision=precision)}
    # FP8 conversion: the router stays out of FP8, the other Linears go in
    fp8_model = GatedNet()
    fp8 = mp.Precision("fp8-tensorwise")
    fp8.setup(fp8_model)
    assert type(fp8_model.gating) is nn.Linear and "fp8" in type(fp8_model.fc).__name__.lower()
    assert "gate" in dict(fp8.layers.fp8_report.skipped)["gating"].lower()
    # a gate the user cast to 16 bits by hand is what the audit warns about
    hand = GatedNet().to(torch.bfloat16)
    assert "half-precision-gate" in {f.code for f in audit(hand, policy="bf16-true")}


def test_the_audit_asks_for_a_loss_scaler_when_a_per_layer_override_is_fp16():
    policy = mp.get_policy("bf16-mixed").replace(overrides={"fc": "fp16"})
    assert mp.Precision(policy).recipe.scales_loss
    findings = audit(GatedNet(), policy=policy)       # no scaler given
    assert "fp16-without-loss-scaler" in {f.code for f in findings}
    # with the run's Precision, its own (enabled) scaler is the one checked
    assert "fp16-without-loss-scaler" not in {f.code for f in audit(GatedNet(), precision=mp.Precision(policy))}


def test_the_memory_estimate_stores_untagged_norms_in_16_bits_when_the_policy_says_so():
    shape = memory.ModelShape(num_layers=2, d_model=64, num_heads=4, vocab_size=256, max_seq_len=64,
                              tagged_norms=False)
    keep = mp.get_policy("bf16-true")
    plain = keep.replace(keep_norms_fp32=False)
    n, norms = shape.num_parameters(), shape.norm_parameters()
    kept = memory.estimate_memory(shape, keep, batch=1, seq=8)
    dropped = memory.estimate_memory(shape, plain, batch=1, seq=8)
    assert kept.parameters == 2 * (n - norms) + 4 * norms
    assert dropped.parameters == 2 * n                 # every parameter in bf16
    assert dropped.master_weights > kept.master_weights  # and the norms now have masters too
    # mixprec's own norms declare keep_in_fp32: FP32 whatever the policy says
    tagged = memory.ModelShape(num_layers=2, d_model=64, num_heads=4, vocab_size=256, max_seq_len=64)
    assert memory.estimate_memory(tagged, plain, batch=1, seq=8).parameters == kept.parameters


def test_an_fp8_run_measures_mfu_against_the_peak_estimate_uses(monkeypatch, tmp_path):
    precision = mp.Precision("fp8-tensorwise")
    assert precision.layers.peak_format == "fp8" and peak_kind(precision) == "fp8"
    asked = []

    def fake_peak(fmt, device=None, *, refresh=False):
        asked.append(fmt)
        return 1e12

    monkeypatch.setattr(meter_mod, "format_peak_flops", fake_peak)
    monkeypatch.setattr("mixprec.policy.peak.format_peak_flops", fake_peak)
    logger = MetricsLogger(tmp_path, tensorboard=False)
    meter = meter_mod.IntervalMeter(SingleDeviceStrategy(), precision, GatedNet(), logger)
    meter.add(StepOutput(torch.tensor(1.0), None, False, 1.0, 64))
    meter.log(StepOutput(torch.tensor(1.0), None, False, 1.0, 64), step=1, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    cluster.estimate("tiny", tokens="1M", gpu="cpu", num_gpus=1, precision="fp8-tensorwise")
    assert asked == ["fp8", "fp8"]                      # fit()'s MFU and estimate: one rule
    assert read_metrics(tmp_path)[0]["mfu"] is not None


def test_without_fp8_gemms_an_fp8_run_records_no_mfu_rather_than_a_bf16_one(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device may have FP8 tensor cores")
    logger = MetricsLogger(tmp_path, tensorboard=False)
    meter = meter_mod.IntervalMeter(SingleDeviceStrategy(), mp.Precision("fp8-tensorwise"), GatedNet(), logger)
    assert meter.peak is None
    meter.add(StepOutput(torch.tensor(1.0), None, False, 1.0, 64))
    meter.log(StepOutput(torch.tensor(1.0), None, False, 1.0, 64), step=1, epoch=0, lr=1e-3, val_loss=None)
    logger.close()
    assert read_metrics(tmp_path)[0]["mfu"] is None


def test_cheap_questions_of_the_mode_build_no_loss_scaler():
    precision = mp.Precision("16-mixed")
    assert precision.recipe.scales_loss and precision.layers.peak_format == "fp16"
    assert precision.recipe.param_dtype == torch.float32
    assert precision._scaler is None
    assert precision.scaler.is_enabled() and precision._scaler is not None
