"""state_dict()/load_state_dict(): masters round-trip exactly, in this process and a fresh one."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mixprec.errors import CheckpointError
from mixprec.optim import AdamW, MasterWeights

CONFIGS = {
    "adamw-fp32-moments": {"moments_dtype": torch.float32},
    "adamw-bf16-moments": {"moments_dtype": torch.bfloat16, "seed": 7},
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> None:
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(5, 6, generator=gen).half()
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip_into_a_fresh_model_and_optimizer_continues_bitwise(name):
    kwargs = CONFIGS[name]
    model = _model(0)
    opt = AdamW(model.parameters(), lr=1e-2, fp16_params=True, **kwargs)
    _train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    _train(model, opt, 3, first=3)

    fresh = _model(123)  # different initial weights: the masters must overwrite them
    fresh_opt = AdamW(fresh.parameters(), lr=1e-2, fp16_params=True, **kwargs)
    fresh_opt.load_state_dict(saved)
    for p, m in zip(fresh.parameters(), fresh_opt.masters):
        assert torch.equal(p.detach(), m.half())  # masters rounded into the model params
    _train(fresh, fresh_opt, 3, first=3)

    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
    for m, n in zip(opt.masters, fresh_opt.masters):
        assert torch.equal(m, n)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_state_dict_holds_exact_masters_and_model_stays_their_rounding():
    model = _model(0).half()
    opt = MasterWeights(torch.optim.SGD, model.parameters(), lr=1e-4)
    _train(model, opt, 2)
    sd = opt.state_dict()
    assert sd["master_weights"]["index"] == [0, 1, 2, 3]
    assert all(t.dtype == torch.float32 for t in sd["master_weights"]["tensors"])
    assert any(not torch.equal(t, t.half().float()) for t in sd["master_weights"]["tensors"])  # not FP16 values


def test_fresh_process_loads_the_checkpoint_with_weights_only(tmp_path):
    model = _model(0)
    opt = AdamW(model.parameters(), lr=1e-2, fp16_params=True, moments_dtype=torch.bfloat16, seed=3)
    _train(model, opt, 3)
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "state.pt")
    _train(model, opt, 2, first=3)
    torch.save([p.detach() for p in model.parameters()], tmp_path / "expected.pt")

    script = textwrap.dedent(f"""
        import torch, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_optim_state_dict import _model, _train
        from mixprec.optim import AdamW
        state = torch.load({str(tmp_path / 'state.pt')!r}, weights_only=True)
        model = _model(99)
        opt = AdamW(model.parameters(), lr=1e-2, fp16_params=True, moments_dtype=torch.bfloat16, seed=3)
        opt.load_state_dict(state["optimizer"])
        _train(model, opt, 2, first=3)
        expected = torch.load({str(tmp_path / 'expected.pt')!r}, weights_only=True)
        assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected)), "diverged"
        print("resumed-ok")
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed-ok" in result.stdout


def test_plain_torch_state_dict_loads_and_keeps_the_masters():
    model = _model(0)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    ref_opt.step()
    model_fp16 = copy.deepcopy(model)
    opt = AdamW(model_fp16.parameters(), lr=1e-2, fp16_params=True, moments_dtype=torch.bfloat16)
    masters = [m.clone() for m in opt.masters]
    opt.load_state_dict(ref_opt.state_dict())
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, masters))
    for st, ref_st in zip(opt.state.values(), ref_opt.state.values()):
        assert st["exp_avg"].dtype == torch.bfloat16  # moments stored narrow again after load
        torch.testing.assert_close(st["exp_avg"].float(), ref_st["exp_avg"], rtol=1e-2, atol=0)


def test_loading_into_a_different_architecture_raises_checkpoint_error():
    small = _model(0).half()
    opt = MasterWeights(torch.optim.SGD, small.parameters(), lr=0.1)
    big = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2)).half()
    other = MasterWeights(torch.optim.SGD, big.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="shape"):
        other.load_state_dict(opt.state_dict())
    one = MasterWeights(torch.optim.SGD, [torch.nn.Parameter(torch.ones(2).half())], lr=0.1)
    with pytest.raises(CheckpointError):
        one.load_state_dict(opt.state_dict())
