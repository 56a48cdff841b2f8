"""Transformer: the contract (forward, loss, presets, accounting), precision declarations,
activation checkpointing and sampling."""
import importlib.util
import math
import os

import pytest
import torch
import torch.nn.functional as F

from mixprec import autocast
from mixprec.errors import ConfigError
from mixprec.models import MODEL_PRESETS, Transformer, TransformerConfig, get_model_config
from mixprec.nn import MixedPrecisionLayerNorm, MoEGate, RMSNorm
from mixprec.precision import cast_module, get_policy

GPT_REF = "/work/shared/bench/gpt_ref.py"


def batch(B=2, T=16, V=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer.from_preset("tiny", **kw)


def test_forward_returns_fp32_logits_and_fp32_cross_entropy():
    model = tiny()
    idx, tgt = batch()
    logits, loss = model(idx, tgt)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 256), tgt.reshape(-1)))
    assert abs(loss.item() - math.log(256)) < 0.1  # GPT-2 init: near-uniform predictions
    logits2, none = model(idx)
    assert none is None and torch.equal(logits, logits2)


def test_loss_is_fp32_under_bf16_autocast_and_close_to_fp32():
    model = tiny()
    idx, tgt = batch()
    _, ref = model(idx, tgt)
    with autocast("bf16-mixed"):
        logits, loss = model(idx, tgt)
    assert logits.dtype == torch.float32 and loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 1e-2


def test_amp_disabled_model_ignores_enclosing_autocast():
    model = tiny(amp_enabled=False)
    idx, _ = batch()
    ref, _ = model(idx)
    with autocast("bf16-mixed"):
        inside, _ = model(idx)
    assert torch.equal(inside, ref)


def test_moe_aux_loss_is_added_and_kept():
    model = tiny(num_experts=4, top_k=2)
    idx, tgt = batch()
    logits, loss = model(idx, tgt)
    ce = F.cross_entropy(logits.reshape(-1, 256), tgt.reshape(-1))
    assert model.aux_loss is not None and model.aux_loss > 0
    torch.testing.assert_close(loss - ce, model.aux_loss)
    loss.backward()
    assert model.blocks[0].mlp.gate.weight.grad is not None


@pytest.mark.parametrize("kw", [{}, {"num_experts": 4}, {"dropout": 0.1}, {"norm": "rmsnorm"}])
def test_activation_checkpointing_gives_identical_gradients(kw):
    idx, tgt = batch(T=8)
    grads = []
    for ckpt in (False, True):
        model = tiny(gradient_checkpointing=ckpt, **kw)
        model.train()
        torch.manual_seed(123)  # same dropout masks; checkpoint replays the RNG state
        _, loss = model(idx, tgt)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name  # bitwise


def test_cast_module_bf16_true_keeps_norms_and_gate_fp32():
    model = tiny(num_experts=2, top_k=1)
    cast_module(model, get_policy("bf16-true"))
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            keep = isinstance(module, (MixedPrecisionLayerNorm, RMSNorm, MoEGate))
            assert p.dtype == (torch.float32 if keep else torch.bfloat16), name
    idx, tgt = batch(T=8)
    with autocast("bf16-true"):
        _, loss = model(idx, tgt)
    assert torch.isfinite(loss)


def test_fp32_embeddings_are_declared_to_the_policy():
    model = tiny(fp32_embeddings=True, tie_embeddings=False)
    cast_module(model, get_policy("16-true"))
    assert model.wte.weight.dtype == model.wpe.weight.dtype == model.head.weight.dtype == torch.float32
    assert model.blocks[0].attn.qkv.weight.dtype == torch.float16


def test_gpt2_init_scales_residual_projections():
    model = Transformer(num_layers=8, d_model=128, num_heads=4)
    std = lambda t: t.float().std().item()  # noqa: E731
    assert abs(std(model.blocks[0].attn.qkv.weight) - 0.02) < 0.002
    assert abs(std(model.blocks[0].attn.proj.weight) - 0.02 / math.sqrt(16)) < 0.001
    assert abs(std(model.blocks[0].mlp.proj.weight) - 0.02 / math.sqrt(16)) < 0.001


def test_tied_head_counts_once():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert tied.head.weight is tied.wte.weight
    assert untied.num_parameters() - tied.num_parameters() == 256 * 64


def _load_gpt_ref():
    spec = importlib.util.spec_from_file_location("gpt_ref", GPT_REF)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not os.path.exists(GPT_REF), reason="shared reference model not present")
def test_gpt_ref_preset_matches_reference_shapes_and_flops():
    ref_mod = _load_gpt_ref()
    ref = ref_mod.GPT()
    ours = Transformer.from_preset("gpt-ref")
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())
    B, T = 8, 256
    assert ours.flops_per_token(T) == ref_mod.flops_per_step(ref, B, T) / (B * T)


def test_moe_flops_count_only_active_experts():
    dense = tiny()
    moe = tiny(num_experts=4, top_k=1)
    gate = 4 * 64 * 2  # two layers' routers
    assert moe.flops_per_token(64) == pytest.approx(dense.flops_per_token(64) + 6 * gate)


def test_generate_appends_tokens_greedy_is_deterministic():
    model = tiny(max_seq_len=8).eval()
    prompt, _ = batch(B=2, T=5)
    a = model.generate(prompt, 6, temperature=0)
    b = model.generate(prompt, 6, temperature=0)
    assert a.shape == (2, 11) and torch.equal(a, b) and torch.equal(a[:, :5], prompt)
    g = torch.Generator().manual_seed(0)
    s = model.generate(prompt, 10, top_k=5, generator=g)  # beyond max_seq_len: crops the context
    assert s.shape == (2, 15) and int(s.max()) < 256


def test_presets_and_validation():
    assert set(MODEL_PRESETS) == {"tiny", "small", "gpt-ref", "gpt2-124m", "gpt2-355m", "gpt2-774m"}
    for name, millions in (("gpt2-124m", 124), ("gpt2-355m", 355), ("gpt2-774m", 774)):
        with torch.device("meta"):          # GPT-2's parameter counts (vocabulary padded to 50304)
            n = sum(p.numel() for p in Transformer.from_preset(name).parameters())
        assert abs(n / 1e6 - millions) / millions < 0.02, (name, n)
    assert get_model_config("tiny", norm="rmsnorm").norm == "rmsnorm"
    cfg = MODEL_PRESETS["gpt-ref"]
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.vocab_size) == (6, 512, 8, 8192)
    with pytest.raises(ConfigError, match="layernorm"):
        tiny(norm="layernrom")
    with pytest.raises(ConfigError, match="preset"):
        Transformer.from_preset("huge")
    with pytest.raises(ConfigError, match="divisible"):
        TransformerConfig(num_layers=1, d_model=30, num_heads=4)
    with pytest.raises(ConfigError, match="did you mean"):
        get_model_config("tiny", num_layer=3)
    with pytest.raises(ConfigError, match="top_k"):
        tiny(num_experts=2, top_k=3)
    with pytest.raises(ConfigError, match="max_seq_len"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


def test_fit_delegates_to_the_trainer(monkeypatch):
    import mixprec

    model = tiny()
    seen = {}
    monkeypatch.setattr(mixprec, "fit", lambda m, loader, **kw: seen.update(m=m, loader=loader, kw=kw) or 7,
                        raising=False)
    assert model.fit("LOADER", epochs=2) == 7
    assert seen == {"m": model, "loader": "LOADER", "kw": {"epochs": 2}}


def _loss_and_grads(model, precision, x, y, chunk):
    model.loss_chunk = chunk
    model.zero_grad()
    with precision.autocast():
        logits, loss = model(x, y)
    loss.backward()
    return logits, loss.detach(), [p.grad.float().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode, tol", [("32-true", 1e-5), ("bf16-true", 2e-2)])
def test_chunked_loss_matches_the_plain_loss_and_gradients(mode, tol):
    """``loss_chunk``: the same loss (FP32 summation order) and gradients; in bf16-true the head's
    BF16 weight gradient is summed over the slices (one BF16 rounding each): within 2 %."""
    import mixprec as mp
    torch.manual_seed(0)
    precision = mp.Precision(mode)
    model = precision.setup_module(Transformer(num_layers=2, d_model=32, num_heads=2, max_seq_len=16))
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    y[0, :3] = -100                                              # ignored targets are not counted
    _, loss, grads = _loss_and_grads(model, precision, x, y, 0)
    logits, chunked, cgrads = _loss_and_grads(model, precision, x, y, 24)   # 64 tokens: 24 + 24 + 16
    assert logits is None
    assert chunked.item() == pytest.approx(loss.item(), rel=1e-6)
    for g, c in zip(grads, cgrads):
        assert ((g - c).abs().max() / g.abs().max().clamp_min(1e-12)).item() < tol


def test_chunked_loss_keeps_no_batch_sized_logits_for_backward():
    """What autograd keeps for backward: without chunks the (tokens, vocab) log-softmax; with
    them nothing of that size (each slice is recomputed in backward)."""
    torch.manual_seed(0)
    model = Transformer(num_layers=1, d_model=32, num_heads=2, max_seq_len=16)
    x = y = torch.randint(0, 256, (4, 16))
    biggest = {}
    for chunk in (0, 16):
        model.loss_chunk = chunk
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            _, loss = model(x, y)
        loss.backward()
        biggest[chunk] = max(sizes)
    assert biggest[0] == 64 * 256 and biggest[16] < 64 * 256
