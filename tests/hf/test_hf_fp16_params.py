"""``mixprec.optim.AdamW(model.parameters(), fp16_params=True)`` on a Hugging Face model (issue 28).

An optimizer sees parameters, not modules, so it cannot recognise ``LlamaRMSNorm`` or GPT-2's
``LayerNorm``: their weights went to FP16 with the matrices, silently. Keeping every 1-D
parameter FP32 instead breaks the plain forward of both models (an FP32 norm output meets an FP16
Linear: ``mat1 and mat2 must have the same dtype``), so the optimizer says so in one line at its
first step, naming the two fixes; ``Precision.setup`` (and ``fit()``) keep the norms FP32 and say
nothing."""
import warnings

import pytest
import torch

import mixprec as mp

ARCHS = ["gpt2", "llama"]


def _norm_params(model):
    return {n: p for n, p in model.named_parameters() if "norm" in n or ".ln_" in n}


def _bare_step(model, opt, batch):
    x, y = batch
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bare_fp16_params_adamw_says_in_one_line_that_the_norms_went_to_16_bits(hf_model, batches, arch):
    model = hf_model(arch)
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    assert {p.dtype for p in _norm_params(model).values()} == {torch.float16}
    vectors = sum(p.dim() == 1 for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches(2, seq=8):
            _bare_step(model, opt, batch)           # two steps: said once
    [w] = caught
    text = str(w.message)
    assert "\n" not in text and f"all {vectors} one-dimensional parameters" in text
    assert "mixprec.Precision('16-true').setup(model, optimizer)" in text
    assert "mixprec.precision.mark_fp32_params(model)" in text


@pytest.mark.parametrize("arch", ARCHS)
def test_precision_setup_keeps_the_norms_fp32_and_the_optimizer_says_nothing(hf_model, batches, arch):
    model = hf_model(arch)
    reference = {n: p.detach().clone() for n, p in _norm_params(model).items()}
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    precision = mp.Precision("16-true")
    model, opt = precision.setup(model, opt)
    norms = _norm_params(model)
    assert {p.dtype for p in norms.values()} == {torch.float32}
    assert all(torch.equal(norms[n], reference[n]) for n in reference)   # exact FP32 values back
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = batches(1, seq=8)[0]
        with precision.autocast():
            loss = model(input_ids=x, labels=y).loss
        precision.backward(loss)
        assert precision.step(opt)
    assert not [w for w in caught if "fp16_params" in str(w.message)]
    assert all(torch.equal(opt.master_of(p), p) for p in norms.values())   # stepped in FP32


def test_marking_the_fp32_params_first_keeps_llama_norms_fp32_without_a_warning(hf_model, batches):
    model = hf_model("llama")
    mp.precision.mark_fp32_params(model)        # LlamaRMSNorm is a norm by the one rule
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    assert {p.dtype for p in _norm_params(model).values()} == {torch.float32}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = batches(1, seq=8)[0]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=x, labels=y).loss
        loss.float().backward()
        opt.step()
    assert not [w for w in caught if "fp16_params" in str(w.message)]


def test_fit_with_a_bare_fp16_params_adamw_trains_llama_with_fp32_norms_and_no_warning(
        hf_model, batches, tmp_path):
    model = hf_model("llama")
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = mp.fit(model, batches(2, seq=8), optimizer=opt, max_steps=2, progress=False,
                        audit=False, run_dir=str(tmp_path / "r"), ckpt_interval=0)
    assert result.policy == "16-true" and result.steps == 2
    assert {p.dtype for p in _norm_params(model).values()} == {torch.float32}
    assert not [w for w in caught if "fp16_params" in str(w.message)]
