"""mixprec's fused AdamW chunk kernel (mixprec/optim/adamw_triton.py) on a GPU, where the flat
step (mixprec/optim/flat.py) takes it once its probe agrees with torch's foreach AdamW bit for bit
(tests/optim/test_adamw_triton.py checks it under Triton's interpreter): split vs full masters
through the kernel with tolerance 0, the kernel's masters equal to torch's FP32 AdamW on the same
GPU, no host sync in a steady step, a step skipped on the device equal to a step not taken.
Not yet run on a GPU (written 2026-12-05, no GPU lent)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from mixprec.optim import AdamW, flat_kernel as flat
from mixprec.optim.inputs import StepInputs

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not importable")]
DEV = torch.device("cuda")
SHAPES = [(64, 48), (48,), (300, 17), (1031,)]      # 5151 elements: not a multiple of the block


def _params(dtype: torch.dtype = torch.bfloat16) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEV, dtype)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 1e-2).to(DEV, dtype) for s in SHAPES]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _train(split: bool, moments: str, steps: int = 5, sync_check_from: int | None = None,
           skip_at: int | None = None, on_device: bool = True):
    params = _params()
    opt = AdamW(params, lr=3e-3, split_masters=split, moments=moments, seed=3)
    for i in range(steps):
        for p, g in zip(params, _grads(i)):
            p.grad = g
        inputs = StepInputs(found_inf=torch.tensor(float(i == skip_at), device=DEV)) if skip_at is not None else None
        if sync_check_from is not None and i >= sync_check_from:
            torch.cuda.set_sync_debug_mode("error")       # a host sync raises RuntimeError
        try:
            if i != skip_at or on_device:
                opt.step(inputs=inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return params, opt


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8", "fp8"])
def test_split_and_full_masters_through_the_kernel_are_bit_identical_and_sync_free(moments):
    # Steps 0-1 outside the sync check: the first is the twin's (it makes the state), the second
    # runs the probe (host reads, once per device); steps 2-4 are steady and must not sync.
    (pa, oa), (pb, ob) = (_train(split, moments, sync_check_from=2) for split in (False, True))
    assert oa._flat.kernel_notes == ob._flat.kernel_notes == {str(pa[0].device): "kernel"}
    for a, b in zip(pa, pb):
        assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(_bits(oa.master_of(a)), _bits(ob.master_of(b)))


def test_the_kernels_masters_follow_torchs_fp32_adamw_on_the_same_gpu_bit_for_bit():
    params, opt = _train(True, "fp32")
    ref = [p.detach().float().clone().requires_grad_() for p in _params()]
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, foreach=True)
    for i in range(5):
        for r, g in zip(ref, _grads(i)):
            r.grad = g.float()
        ref_opt.step()
    assert opt._flat.kernel_notes == {str(params[0].device): "kernel"}
    for p, r in zip(params, ref):
        assert torch.equal(opt.master_of(p), r.detach())


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_a_step_the_kernel_skips_on_the_device_leaves_what_a_step_not_taken_leaves(moments):
    (pa, oa), (pb, ob) = (_train(True, moments, skip_at=3, on_device=dev) for dev in (True, False))
    assert oa._flat.kernel_notes == {str(pa[0].device): "kernel"}
    for a, b in zip(pa, pb):
        assert torch.equal(_bits(a), _bits(b))
    for (ka, sa), (kb, sb) in zip(oa.state_dict()["state"].items(), ob.state_dict()["state"].items()):
        for key, t in sa.items():
            assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), sb[key].cpu().reshape(-1).view(torch.uint8)), key


def test_the_probe_agrees_on_this_gpu():
    from mixprec.optim.adamw_triton import adamw_chunk_
    assert flat.kernel_agrees(adamw_chunk_, DEV)
