"""The monitor with mixprec's own Transformer, GradScaler and master-weight AdamW."""
import importlib

import torch

from mixprec.amp import GradScaler
from mixprec.models import Transformer
from mixprec.monitor import (NumericsMonitor, ScaleWatch, audit, capture_rng_state, locate_nonfinite)
from mixprec.optim import AdamW
from mixprec.precision import cast_module, get_policy

audit_mod = importlib.import_module("mixprec.monitor.audit")  # the module, not the function


def _model():
    torch.manual_seed(0)
    return Transformer(num_layers=2, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


def test_skipped_step_is_traced_and_logged_like_the_trainer_would():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(device="cpu", init_scale=2.0 ** 16)
    watch = ScaleWatch(min_scale=1.0, window=4, max_skip_fraction=0.5)
    x, y = _batch()
    fault = model.blocks[1].mlp.fc.register_forward_hook(lambda m, a, out: out + float("inf"))

    def run_step():
        _, loss = model(x, y)
        scaler.scale(loss).backward()
        return loss

    state = capture_rng_state()
    run_step()
    scale_before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    opt.zero_grad()
    ev = locate_nonfinite(model, run_step, loss_scale=scale_before, step=0, rng_state=state)
    assert ev.message(scale_after=scaler.get_scale()) == \
        "step 0 skipped: inf first at blocks.1.mlp.fc (forward, fp32) — loss scale 65536 -> 32768"
    assert all(p.grad is None for p in model.parameters())  # the replay left no gradients behind
    fault.remove()
    assert watch.observe(0, scaler.get_scale(), True, ev.module) is None


def test_backward_fault_in_attention_is_found_in_the_transformer(inf_grad):
    model = _model()
    x, y = _batch()
    proj = model.blocks[0].attn
    target = next(n for n, m in proj.named_modules() if isinstance(m, torch.nn.Linear))
    lin = proj.get_submodule(target)
    forward = lin.forward
    lin.forward = lambda inp: forward(inf_grad(inp))  # this Linear's input-gradient becomes inf
    ev = locate_nonfinite(model, lambda: model(x, y)[1].backward())
    del lin.forward
    assert (ev.module, ev.direction, ev.tensor) == (f"blocks.0.attn.{target}", "backward", "grad_input")
    assert locate_nonfinite(model, lambda: model(x, y)[1].backward()) is None


def test_update_rows_use_fp32_masters_against_fp16_storage():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    scaler = GradScaler(device="cpu")
    mon = NumericsMonitor(model, every=1, compute_dtype="fp16",
                          module_filter_fn=lambda m, fqn: fqn in ("blocks.0.mlp.fc", "blocks.0.ln1"))
    x, y = _batch()
    with mon.sample(0) as s:
        _, loss = model(x, y)
        scaler.scale(loss).backward()
        with mon.track_updates(opt):
            scaler.step(opt)
        scaler.update()
    rows = {(r.module, r.kind): r for r in s.rows}
    fc, ln = rows[("blocks.0.mlp.fc", "update")], rows[("blocks.0.ln1", "update")]
    assert fc.dtype == "fp16"  # checked against the storage dtype, although the masters are fp32
    assert ln.dtype == {torch.float16: "fp16", torch.float32: "fp32"}[model.blocks[0].ln1.weight.dtype]
    # Adam's first step moves every weight by ~lr = 1e-3: below half an fp16 ULP only for |w| >= 1
    assert 0.0 <= fc.underflow_frac < 0.5
    assert rows[("blocks.0.mlp.fc", "grad")].absmax > 1.0  # scaled gradients (scale 65536)


def test_audit_of_a_correct_fp16_setup_is_clean(monkeypatch):
    model = _model()
    policy = get_policy("16-true")
    cast_module(model, policy)  # fp16 Linears/embeddings, fp32 norms (keep_in_fp32)
    opt = AdamW(model.parameters(), lr=1e-3)  # 16-bit params get fp32 masters
    scaler = GradScaler.from_policy(policy, device="cpu")
    monkeypatch.setattr(audit_mod, "cpu_has_native_fp16", lambda: True)
    x, y = _batch()
    assert audit(model, policy=policy, optimizer=opt, scaler=scaler, device="cpu",
                 loss_fn=lambda: model(x, y)[1]) == []
    plain = torch.optim.AdamW(model.parameters())
    codes = {f.code for f in audit(model, policy=policy, optimizer=plain, device="cpu")}
    assert {"no-master-weights", "fp16-without-loss-scaler"} <= codes


def test_fp16_params_keep_transformer_norms_fp32_so_the_audit_stays_silent(monkeypatch):
    model = _model()
    AdamW(model.parameters(), lr=1e-3, fp16_params=True)  # norms/router are tagged keep_in_fp32
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".ln" in n or "ln_f" in n)
    monkeypatch.setattr(audit_mod, "cpu_has_native_fp16", lambda: True)
    found = audit(model, policy="16-true", scaler=GradScaler(device="cpu"), device="cpu")
    assert found == []


def test_audit_flags_norms_cast_to_fp16_by_hand(monkeypatch):
    model = _model()
    for m in model.modules():
        if m.__class__.__name__.endswith("LayerNorm"):
            m.half()
    AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    monkeypatch.setattr(audit_mod, "cpu_has_native_fp16", lambda: True)
    found = audit(model, policy="16-true", scaler=GradScaler(device="cpu"), device="cpu")
    assert [f.code for f in found] == ["half-precision-norm"]  # eps is fine: these norms upcast


def test_tracing_survives_activation_checkpointing(inf_grad):
    torch.manual_seed(0)
    model = Transformer(num_layers=2, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16,
                        gradient_checkpointing=True)
    x, y = _batch()
    fc = model.blocks[1].mlp.fc
    forward = fc.forward
    fc.forward = lambda inp: forward(inf_grad(inp))
    ev = locate_nonfinite(model, lambda: model(x, y)[1].backward())
    del fc.forward
    assert (ev.module, ev.direction, ev.tensor) == ("blocks.1.mlp.fc", "backward", "grad_input")
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
