"""One optimizer class per master layout, each in its own file, and no ``.data`` swaps (issue #35, item 3).

``MasterWeights`` (full FP32 masters, mixprec/optim/master.py), ``SplitMasterWeights`` (the
masters of BF16 params split, mixprec/optim/split_masters.py) and ``AdamW`` (lean moments,
mixprec/optim/adamw.py) form one chain of single inheritance. The split layout's per-master
fallback steps FP32 tensors of the inner optimizer's own: its empty holders never get storage.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

import mixprec as mp
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.parts import step_in_parts
from mixprec.optim.split_masters import SplitMasterWeights


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = mp.models.Transformer(num_layers=1, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16)
    return mp.Precision("bf16-true").setup_module(model)


def _backward(model: nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)
    (model(x, x)[1] * scale).backward()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _holders(opt: MasterWeights, model: nn.Module) -> list[torch.Tensor]:
    return [opt._master_of[id(p)] for p in model.parameters() if p.dtype == torch.bfloat16]


def test_master_weights_builds_the_split_layout_exactly_where_split_masters_are_exact():
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    q = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    split = MasterWeights(torch.optim.AdamW, [p])
    full = MasterWeights(torch.optim.AdamW, [q], split=False)
    assert type(split) is SplitMasterWeights and isinstance(split, MasterWeights) and split.split
    assert type(full) is MasterWeights and not full.split and full.split_count == 0

    class Global(torch.optim.Optimizer):      # not elementwise: nothing may be split
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

    assert type(MasterWeights(Global, [nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])) is MasterWeights
    assert isinstance(AdamW([nn.Parameter(torch.ones(2))]), SplitMasterWeights)


def test_each_layout_is_one_class_with_one_base_in_a_file_of_its_own():
    chain = [AdamW, SplitMasterWeights, MasterWeights]
    assert [c.__bases__ for c in chain] == [(SplitMasterWeights,), (MasterWeights,), (torch.optim.Optimizer,)]
    files = [inspect.getsourcefile(c) for c in chain]
    assert [f.rsplit("/", 1)[-1] for f in files] == ["adamw.py", "split_masters.py", "master.py"]


def test_master_grads_puts_fp32_tensors_in_the_groups_and_the_holders_stay_empty():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2)
    holders = _holders(opt, model)
    groups_before = [list(g["params"]) for g in opt.param_groups]
    for step in range(2):
        _backward(model, step)
        grads = opt.master_grads()
        stand_ins = [t for g in opt.param_groups for t in g["params"] if not any(t is h for h in holders)
                     and t.dtype == torch.float32 and t.grad is not None]
        # torch's GradScaler unscales what it finds in param_groups: full-size FP32 tensors with grads
        assert sum(t.numel() for t in stand_ins) == sum(p.numel() for p in model.parameters())
        assert len(grads) == len(stand_ins)
        assert all(h.numel() == 0 and h.untyped_storage().nbytes() == 0 for h in holders)
        if step == 0:
            opt.zero_grad()                      # a skipped step: the holders come back, unchanged
            before = [_bits(p) for p in model.parameters()]
        else:
            opt.step()
            opt.zero_grad()
            assert not all(torch.equal(a, _bits(p)) for a, p in zip(before, model.parameters()))
        assert all(a is b for ga, gb in zip(opt.param_groups, groups_before)   # the holders are back
                   for a, b in zip(ga["params"], gb, strict=True))
        assert all(any(k is m for m in groups_before[0]) for k in opt.state)   # state keyed by the holders
        assert all(h.numel() == 0 for h in holders)
    assert len(opt.state) == len(groups_before[0])


def test_a_step_in_parts_steps_fp32_tensors_of_the_inner_optimizers_own():
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-2)
    holders = _holders(opt, model)
    seen: list[tuple[torch.dtype, bool]] = []

    def look(inner, args, kwargs):
        for g in inner.param_groups:
            for t in g["params"]:
                seen.append((t.dtype, t.numel() > 0))
        assert all(h.untyped_storage().nbytes() == 0 for h in holders)

    opt.inner.register_step_post_hook(look)
    for step in range(2):
        _backward(model, step)
        step_in_parts(opt, [[p] for p in model.parameters()])
        opt.zero_grad()
    assert seen and all(dtype == torch.float32 and full for dtype, full in seen)
    assert all(any(k is h for h in holders) or k.dtype == torch.float32 for k in opt.state)
    assert all(h.numel() == 0 for h in holders)
    assert {float(st["step"]) for st in opt.state_dict()["state"].values()} == {2.0}
