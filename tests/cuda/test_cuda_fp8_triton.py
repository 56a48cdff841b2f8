"""mixprec's Triton block-scaled FP8 GEMM on a GPU (tests/formats/test_fp8_triton.py checks it
under Triton's interpreter): the kernel against the emulation on aligned, ragged and strided
operands, and an Fp8Linear forced onto it (``block_kernel="triton"``) in all three GEMMs.

Tolerance: SQNR >= 60 dB against the FP32 emulation. Inside each 128-wide K block the tensor
cores accumulate in their own precision (about 14 bits on Hopper, DeepSeek-V3 section 3.3.2)
before the kernel promotes the block's sum to FP32, so this is not FP32 summation order only;
torch's native block-scaled GEMM measured 78-80 dB on the H200 (2026-12-04), and a wrong scale
index or transposition lands near 0 dB."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from mixprec.formats import Fp8Config, Fp8Linear, emulated_mm, quantize, sqnr_db
from mixprec.policy.hardware import cuda_supports_fp8

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not cuda_supports_fp8(), reason="needs FP8 tensor cores (sm89+)"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="triton is not importable")]
DEV = torch.device("cuda")
MIN_DB = 60.0


def _operands(M, N, K, b_block, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:
        a = quantize(torch.randn(K, M, generator=g).to(DEV), block=(128, 1)).t()
        b = quantize(torch.randn(K, N, generator=g).to(DEV), block=(b_block[1], b_block[0])).t()
    else:
        a = quantize(torch.randn(M, K, generator=g).to(DEV), block=(1, 128))
        b = quantize(torch.randn(N, K, generator=g).to(DEV), block=b_block)
    return a, b


@pytest.mark.parametrize("M, N, K, b_block, transposed", [
    (512, 512, 1024, (128, 128), False), (512, 384, 1024, (1, 128), False),
    (200, 136, 300, (128, 128), False), (37, 129, 129, (1, 128), False),
    (136, 384, 512, (128, 128), True)])
def test_the_triton_kernel_on_the_gpu_matches_the_emulation(M, N, K, b_block, transposed, monkeypatch):
    from mixprec.formats.fp8_triton import block_scaled_mm
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)   # the emulation in FP32
    a, b = _operands(M, N, K, b_block, transposed)
    ref = emulated_mm(a, b)
    out = block_scaled_mm(a, b, torch.float32)
    assert sqnr_db(ref, out) >= MIN_DB, f"{sqnr_db(ref, out):.1f} dB"
    assert torch.equal(block_scaled_mm(a, b, torch.bfloat16), out.to(torch.bfloat16))


def test_an_fp8_linear_forced_onto_the_triton_kernel_matches_the_emulation(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(512, 384).to(DEV)
    x = torch.randn(200, 512, generator=g).to(DEV)
    gy = torch.randn(200, 384, generator=g).to(DEV)

    def run(cfg):
        m = Fp8Linear.from_linear(lin, cfg)
        xx = x.clone().requires_grad_()
        y = m(xx)
        return m, [y.detach(), *torch.autograd.grad(y, (xx, m.weight), gy)]

    _, emu = run(Fp8Config.from_recipe("blockwise", backend="emulated"))
    m, tri = run(Fp8Config.from_recipe("blockwise", block_kernel="triton"))
    assert (m.execution_path, m.gemm_plan.block_kernel) == ("cuda-scaled-mm", "triton"), m.execution_reason
    for what, e, t in zip(("output", "grad_input", "grad_weight"), emu, tri):
        assert sqnr_db(e, t) >= MIN_DB, f"{what}: {sqnr_db(e, t):.1f} dB"
