"""FP8 on a GPU with FP8 tensor cores: every ``torch._scaled_mm`` recipe computes what its
emulation computes (forward and both backward GEMMs), and a precision mode's Linears take the
tensor-core path, never silently the emulation."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.formats import Fp8Config, Fp8Linear, sqnr_db
from mixprec.policy.hardware import cuda_supports_fp8

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not cuda_supports_fp8(), reason="needs FP8 tensor cores (sm89+)")]
DEV = torch.device("cuda")


def _problem(k: int, n: int, tokens: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * k ** -0.5)
    x = torch.randn(tokens, k, generator=g)
    grad = torch.randn(tokens, n, generator=g)
    return lin.to(DEV), x.to(DEV), grad.to(DEV)


def _run(lin, cfg, x, g):
    m = Fp8Linear.from_linear(lin, cfg)
    x = x.clone().requires_grad_()
    lin.zero_grad(set_to_none=True)
    y = m(x)
    y.backward(g)
    return m, (y.detach(), x.grad, lin.weight.grad.clone())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("k, n", [(256, 512), (320, 192), (1024, 1024)])
def test_scaled_mm_on_the_gpu_matches_the_emulation(recipe, k, n, monkeypatch):
    # Equal up to FP32 summation order; a kernel that only writes BF16 (rowwise on some builds)
    # rounds the output to 8 bits of mantissa, ~50 dB: 45 dB leaves room for that, and a wrong
    # scale layout or transposition lands near 0 dB.
    lin, x, g = _problem(k, n)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)   # the emulation in FP32
    _, emu = _run(lin, Fp8Config.from_recipe(recipe, backend="emulated"), x, g)
    m, smm = _run(lin, Fp8Config.from_recipe(recipe), x, g)
    # Block-scaled GEMMs take in/out features that are multiples of 128 (plan_gemms): 320 -> 192
    # is emulated in blockwise, and says so.
    ragged = recipe == "blockwise" and (k % 128 or n % 128)
    assert m.execution_path == ("emulated" if ragged else "cuda-scaled-mm"), m.execution_reason
    for what, e, s in zip(("output", "grad_input", "grad_weight"), emu, smm):
        assert sqnr_db(e.float(), s.float()) >= 45.0, f"{recipe} {what}: {sqnr_db(e.float(), s.float()):.1f} dB"


def test_an_fp8_mode_runs_its_linears_on_the_tensor_cores_and_trains(tmp_path):
    torch.manual_seed(0)
    model = mp.models.Transformer(num_layers=2, d_model=128, num_heads=4, max_seq_len=64)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))
            for _ in range(6)]
    result = mp.fit(model, data, mixed_precision="fp8-tensorwise", max_steps=6, lr=3e-3, warmup_steps=0,
                    progress=False, audit=False, ckpt_interval=0, eval_interval=0,
                    run_dir=str(tmp_path / "run"))
    assert result.steps == 6 and result.skipped_steps == 0 and result.final_loss < 6.0
    paths = {m.execution_path for m in model.modules() if isinstance(m, Fp8Linear)}
    assert paths == {"cuda-scaled-mm"}
