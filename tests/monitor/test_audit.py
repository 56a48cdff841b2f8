"""audit(): every finding fires on a seeded misconfiguration and stays silent on a correct setup."""
import importlib

import pytest
import torch
from torch import nn

from mixprec.monitor.audit import Finding, audit, audit_after_first_step, format_findings
from mixprec.precision import Policy, get_policy

audit_mod = importlib.import_module("mixprec.monitor.audit")  # the module, not the function


class RMSNorm(nn.Module):
    """A hand-written RMSNorm (computes in its weight's dtype, like many model zoos' versions)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TinyMoE(nn.Module):
    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):  # x: (N, d)
        w = self.gate(x).float().softmax(-1).to(x.dtype)  # (N, E)
        return sum(w[:, i:i + 1] * e(x) for i, e in enumerate(self.experts))


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = TinyMoE(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.moe(self.norm(x)))


class MasterSGD(torch.optim.SGD):
    """Stands in for a mixprec master-weight optimizer: the audit recognises ``master_grads``."""

    def master_grads(self):
        return []


@pytest.fixture
def native(monkeypatch):
    """Pretend the device computes fp16/bf16/fp8 natively, so hardware findings stay out."""
    monkeypatch.setattr(audit_mod, "bf16_is_fast", lambda device=None: True)
    monkeypatch.setattr(audit_mod, "cpu_has_native_fp16", lambda: True)
    monkeypatch.setattr(audit_mod, "cuda_supports_fp8", lambda: True)


def _codes(findings):
    return sorted(f.code for f in findings)


def _gate_fp32(model):
    model.moe.gate.keep_in_fp32 = True
    return model


def test_clean_fp32_setup_has_no_findings():
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    found = audit(model, policy="32-true", optimizer=opt, loss_fn=lambda: model(torch.randn(2, 8)).sum())
    assert found == []
    assert format_findings(found) == "audit: no precision problems found"


def test_clean_fp16_true_setup_has_no_findings(native):
    model = _gate_fp32(Net())
    policy = get_policy("16-true")
    scaler = torch.amp.GradScaler("cpu")
    opt = MasterSGD(model.parameters(), lr=0.1)
    assert audit(model, policy=policy, optimizer=opt, scaler=scaler, device="cpu") == []


def test_low_precision_params_without_masters():
    model = _gate_fp32(Net())
    found = audit(model, policy="bf16-true", optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  device="cpu")
    f = next(f for f in found if f.code == "no-master-weights")
    assert f.severity == "error" and "moe.experts.0.weight" in f.message and "SGD" in f.message
    assert "head.weight" in f.message or "more" in f.message
    nomasters = get_policy("bf16-true").replace(master_weights=False)
    assert "no-master-weights" in _codes(audit(model, policy=nomasters, device="cpu"))


def test_fp16_model_under_fp16_autocast_is_double_cast(native):
    model = Net().half()
    found = audit(model, policy="16-mixed", scaler=torch.amp.GradScaler("cpu"), device="cpu")
    assert "double-cast" in _codes(found)
    assert "double-cast" not in _codes(audit(Net(), policy="16-mixed", scaler=torch.amp.GradScaler("cpu"),
                                             device="cpu"))


@pytest.mark.parametrize("scaler", [None, torch.amp.GradScaler("cpu", enabled=False)])
def test_fp16_without_loss_scaler(native, scaler):
    found = audit(Net(), policy="16-mixed", scaler=scaler, device="cpu")
    f = next(f for f in found if f.code == "fp16-without-loss-scaler")
    assert f.severity == "error" and "GradScaler" in f.fix
    assert audit(Net(), policy="bf16-mixed", device="cpu") == []  # bf16 needs no scaler


def test_norm_eps_below_what_the_dtype_represents(native):
    model = nn.Sequential(nn.Linear(8, 8), RMSNorm(8, eps=1e-8), nn.Linear(8, 8), RMSNorm(8, eps=1e-5))
    # A policy that lets norms go 16-bit (keep_norms_fp32=False) stores these hand-written norms in fp16.
    fp16_norms = get_policy("16-true").replace(keep_norms_fp32=False)
    found = [f for f in audit(model, policy=fp16_norms, optimizer=MasterSGD(model.parameters(), lr=1),
                              scaler=torch.amp.GradScaler("cpu"), device="cpu")
             if f.code == "norm-eps-underflow"]
    assert [(f.severity, f.message.split()[0]) for f in found] == [("error", "1"), ("warning", "3")]
    # the default keeps them (recognised as norms) in fp32: fine; and in bf16 1e-8 is a normal number
    assert not [f for f in audit(model, policy="16-true", device="cpu") if f.code == "norm-eps-underflow"]
    kept = fp16_norms.replace(keep_fp32_names=("1", "3"))
    assert not [f for f in audit(model, policy=kept, device="cpu") if f.code == "norm-eps-underflow"]
    assert not [f for f in audit(model, policy=fp16_norms.replace(param_dtype=torch.bfloat16,
                compute_dtype=torch.bfloat16, output_dtype=torch.bfloat16), device="cpu")
                if f.code == "norm-eps-underflow"]


def test_norm_in_half_precision(native):
    model = Net()
    model.norm.half()
    found = audit(model, policy="16-mixed", scaler=torch.amp.GradScaler("cpu"), device="cpu")
    assert "half-precision-norm" in _codes(found)
    custom = nn.Sequential(nn.Linear(8, 8), RMSNorm(8, eps=1e-3))  # a hand-written norm
    # bf16-true keeps it fp32 (recognised as a norm), so the audit has nothing to say about it ...
    assert "half-precision-norm" not in _codes(audit(custom, policy="bf16-true", device="cpu"))
    # ... unless the policy lets norms go 16-bit.
    bf16_norms = get_policy("bf16-true").replace(keep_norms_fp32=False)
    assert "half-precision-norm" in _codes(audit(custom, policy=bf16_norms, device="cpu"))


def test_moe_gate_in_half_precision(native):
    # The rule book keeps a gate FP32 when the precision casts the model, so only a gate that is
    # already 16-bit (cast by hand) is in half precision.
    hand = Net().to(torch.bfloat16)
    found = audit(hand, policy="bf16-true", optimizer=MasterSGD(hand.parameters(), lr=1), device="cpu")
    f = next(f for f in found if f.code == "half-precision-gate")
    assert "moe.gate" in f.message
    assert "half-precision-gate" not in _codes(audit(Net(), policy="bf16-true", device="cpu"))
    assert "half-precision-gate" not in _codes(audit(_gate_fp32(Net()), policy="bf16-true", device="cpu"))


def test_loss_in_half_precision_found_by_the_probe(native):
    model = Net()
    x = torch.randn(2, 8)
    found = audit(model, policy="bf16-mixed", device="cpu",
                  loss_fn=lambda: model(x).pow(2).mean())  # the head's output is bf16 under autocast
    assert "half-precision-loss" in _codes(found)
    fine = audit(model, policy="bf16-mixed", device="cpu", loss_fn=lambda: model(x).float().pow(2).mean())
    assert "half-precision-loss" not in _codes(fine)


def test_nonfinite_loss_found_by_the_probe():
    model = Net()
    found = audit(model, policy="32-true", loss_fn=lambda: model(torch.full((2, 8), float("nan"))).sum())
    assert _codes(found) == ["nonfinite-loss"]


@pytest.mark.parametrize("native_bf16, advice", [(False, "'32-true'"), (True, "'bf16-mixed'")])
def test_fp8_without_capable_gpu_advises_the_fast_format_of_the_cpu_it_runs_on(monkeypatch, native_bf16,
                                                                                advice):
    monkeypatch.setattr(audit_mod, "cuda_supports_fp8", lambda: False)
    monkeypatch.setattr(audit_mod, "cpu_has_native_bf16", lambda: native_bf16)
    fp8 = Policy(name="custom", fp8_recipe="fp8-blockwise")
    f = next(f for f in audit(Net(), policy=fp8, device="cpu") if f.code == "fp8-unsupported")
    assert advice in f.fix


@pytest.mark.parametrize("native_bf16, advice", [(False, "'32-true'"), (True, "'bf16-mixed'")])
def test_fp16_on_cpu_advises_bf16_only_where_the_cpu_has_bf16_instructions(monkeypatch, native_bf16,
                                                                            advice):
    monkeypatch.setattr(audit_mod, "cpu_has_native_fp16", lambda: False)
    monkeypatch.setattr(audit_mod, "cpu_has_native_bf16", lambda: native_bf16)
    f = next(f for f in audit(Net(), policy="16-mixed", scaler=torch.amp.GradScaler("cpu"), device="cpu")
             if f.code == "fp16-emulated")
    assert advice in f.fix


def test_fp8_on_a_cpu_says_its_gemms_run_emulated_there_and_what_gpu_has_fp8_tensor_cores():
    """Not "cpu has no FP8 tensor cores (compute capability 8.9+)": a CPU has no compute capability."""
    fp8 = Policy(name="custom", fp8_recipe="fp8-blockwise")
    f = next(f for f in audit(Net(), policy=fp8, device="cpu") if f.code == "fp8-unsupported")
    assert ("FP8 GEMMs run emulated on the CPU (FP8 tensor cores need a GPU of compute capability "
            "8.9+): correct but slower than bf16") in f.message
    assert "cpu has no" not in f.message


def test_cpu_advice_names_the_cpus_own_matrix_flags():
    from mixprec.policy.hardware import cpu_matrix_flags
    fp8 = Policy(name="custom", fp8_recipe="fp8-blockwise")
    f = next(f for f in audit(Net(), policy=fp8, device="cpu") if f.code == "fp8-unsupported")
    assert "16-bit matrix flags: " + (", ".join(cpu_matrix_flags()) or "none") in f.fix


def test_bf16_on_cpu_without_native_bf16_suggests_fp32(monkeypatch):
    monkeypatch.setattr(audit_mod, "bf16_is_fast", lambda device=None: False)
    f = next(f for f in audit(Net(), policy="bf16-mixed", device="cpu") if f.code == "bf16-emulated")
    assert "'32-true'" in f.fix


def test_fp16_on_cpu_without_native_fp16(monkeypatch):
    monkeypatch.setattr(audit_mod, "cpu_has_native_fp16", lambda: False)
    found = audit(Net(), policy="16-mixed", scaler=torch.amp.GradScaler("cpu"), device="cpu")
    assert _codes(found) == ["fp16-emulated"]


def test_hardware_findings_match_this_machine():
    from mixprec.policy.hardware import cpu_has_native_bf16
    found = _codes(audit(Net(), policy="bf16-mixed", device="cpu"))
    assert ("bf16-emulated" in found) == (not cpu_has_native_bf16())


def test_params_without_gradient_after_first_step():
    model = Net()
    model.unused = nn.Linear(3, 3)
    model(torch.randn(2, 8)).sum().backward()
    (f,) = audit_after_first_step(model)
    assert f.code == "no-gradient" and "unused.weight" in f.message and "unused.bias" in f.message
    del model.unused
    assert audit_after_first_step(model) == []


def test_findings_are_sorted_and_formatted(native):
    model = Net().half()
    text = format_findings(audit(model, policy="16-mixed", optimizer=torch.optim.SGD(model.parameters(), lr=1),
                                 device="cpu"))
    assert text.splitlines()[0].startswith("ERROR")
    assert "fix:" in text and text.splitlines()[-1].startswith("audit: 2 errors")
    with pytest.raises(ValueError):
        Finding(code="x", severity="fatal", message="m", fix="f")


def test_per_layer_fp8_without_capable_gpu_warns_as_a_uniform_fp8_mode_does(monkeypatch):
    # A plan file or an override that puts some Linears in FP8 on a bf16-mixed base: emulated all
    # the same (found by trying `mixprec train --precision plan:plan.json` as a user).
    import mixprec as mp
    monkeypatch.setattr(audit_mod, "cuda_supports_fp8", lambda: False)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    precision = mp.Precision("bf16-mixed", overrides={"0": "fp8-tensorwise"})
    model, _ = precision.setup(model)
    f = next(f for f in audit(model, precision=precision, device="cpu") if f.code == "fp8-unsupported")
    assert "fp8-tensorwise" in f.message and "emulated" in f.message
    plain = mp.Precision("bf16-mixed")
    assert "fp8-unsupported" not in _codes(audit(plain.setup(nn.Linear(32, 32))[0], precision=plain,
                                                 device="cpu"))


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_per_layer_fp8_advice_never_suggests_the_base_mode_already_in_use(monkeypatch, cpu_bf16):
    """A plan on a bf16-mixed base was told "fix: use 'bf16-mixed' on this CPU": already the base."""
    import mixprec as mp
    monkeypatch.setattr(audit_mod, "cuda_supports_fp8", lambda: False)
    monkeypatch.setattr(audit_mod, "cpu_has_native_bf16", lambda: cpu_bf16)
    for base in ("bf16-mixed", "32-true"):
        model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        precision = mp.Precision(base, overrides={"0": "fp8-tensorwise"}, device="cpu")
        model, _ = precision.setup(model)
        f = next(f for f in audit(model, precision=precision, device="cpu") if f.code == "fp8-unsupported")
        assert f"use '{base}'" not in f.fix and "take those layers out of FP8" in f.fix
        assert f"override them to {'bf16' if cpu_bf16 else 'fp32'}" in f.fix
