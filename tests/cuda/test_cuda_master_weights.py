"""Every master-weight layout on a GPU is bit-identical to an FP32 reference computed on the same
GPU: ``MasterWeights`` around torch optimizers (foreach and fused), mixprec's ``AdamW`` with full
FP32 masters, with split masters (BF16 parameter + 16-bit remainder) and with low-bit moments.
The same synthetic gradients are fed to both sides (no backward: only the optimizer math is
compared, and a GPU backward need not repeat bit for bit)."""
from __future__ import annotations

import pytest
import torch

from mixprec.optim import AdamW, MasterWeights

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
SHAPES = [(64, 48), (48,), (300, 17)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, dtype)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(DEV, dtype) for s in SHAPES]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


OPTIMIZERS = [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
              (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3}),
              (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
              (torch.optim.Adam, {"lr": 1e-2, "fused": True})]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS,
                         ids=[f"{c.__name__}{'-fused' if k.get('fused') else ''}" for c, k in OPTIMIZERS])
def test_master_weights_follow_the_fp32_optimizer_on_the_same_gpu_bit_for_bit(cls, kwargs, dtype):
    params = _params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    opt = MasterWeights(cls, params, **kwargs)
    ref_opt = cls(ref, **kwargs)
    for step in range(5):
        for p, r, g in zip(params, ref, _grads(step, dtype)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref):
        assert opt.master_of(p).device.type == "cuda"
        assert torch.equal(opt.master_of(p), r.detach())          # the FP32 optimizer's math
        assert torch.equal(p.detach(), r.detach().to(dtype))      # the model: the master rounded


@pytest.mark.parametrize("impl", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=str)
def test_mixprecs_adamw_on_fp32_params_is_torchs_adamw_on_the_same_gpu(impl):
    params, ref = _params(torch.float32), _params(torch.float32)
    opt = AdamW(params, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, **impl)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, **impl)
    for step in range(5):
        for p, r, g in zip(params, ref, _grads(step, torch.float32)):
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    assert all(torch.equal(p, r) for p, r in zip(params, ref))


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8", "fp8"])
def test_split_masters_are_bit_identical_to_full_fp32_masters_on_the_gpu(moments):
    runs = []
    for split in (False, True):
        params = _params(torch.bfloat16)
        opt = AdamW(params, lr=3e-3, split_masters=split, moments=moments, seed=3)
        for step in range(5):
            for p, g in zip(params, _grads(step, torch.bfloat16)):
                p.grad = g
            opt.step()
        runs.append((params, opt))
    (pa, oa), (pb, ob) = runs
    assert ob.split and not oa.split
    for a, b in zip(pa, pb):
        assert a.device.type == "cuda" and torch.equal(_bits(a), _bits(b))
        assert torch.equal(_bits(oa.master_of(a)), _bits(ob.master_of(b)))
