"""The recipe's master layout chooses the class (issue #38, the ``split_masters`` walk).

``Precision``'s params plugin passes ``layout=SplitMasterWeights`` (``recipe.masters == "split"``)
or ``layout=MasterWeights`` (``full``) to mixprec's AdamW or around the user's optimizer; the
layout's class stores the masters its way (``SplitMasters``: split wherever exact). The users'
flags (``MasterWeights(split=...)``, ``AdamW(split_masters=...)``) stay thin constructors over
the same classes: same bits, same state dicts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.optim import AdamW, MasterWeights, SplitMasterWeights
from mixprec.optim import split as split_module
from mixprec.optim.master_table import Masters
from mixprec.optim.split_masters import SplitMasters


class _Global(torch.optim.Optimizer):
    """Not elementwise (no chunk-exact marker): split masters cannot be exact under it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()]).clone()


def _same(a, b) -> None:
    """Two state dicts equal to the bit: same keys, values, dtypes (masters under STATE_KEY too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [_bits(p) for p in model.parameters()]


@pytest.mark.parametrize("split_masters, table", [(True, SplitMasters), (False, Masters)])
def test_precision_builds_the_layout_class_without_the_split_flag_logic(monkeypatch, split_masters, table):
    def refused(*args, **kwargs):
        raise AssertionError("the Precision path re-decided the layout (split.resolve_split)")

    monkeypatch.setattr(split_module, "resolve_split", refused)
    precision = mp.Precision("bf16-true", device="cpu", split_masters=split_masters)
    model = precision.setup_module(_model())
    opt = precision.make_optimizer([{"params": list(model.parameters())}], model=model)
    assert type(opt) is AdamW and type(opt._table) is table and opt.split is split_masters
    assert bool(opt.split_count) is split_masters
    _, wrapped = precision.setup(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    assert type(wrapped) is (SplitMasterWeights if split_masters else MasterWeights)
    assert type(wrapped._table) is table


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_adamw_by_layout_class_steps_and_saves_as_by_the_flag(moments):
    """``AdamW(layout=...)`` (the Precision path) against ``AdamW(split_masters=...)`` (the user's
    flag), and the full layout against the split one: every bit of the parameters and of the
    state dicts equal (tolerance 0)."""
    runs = {}
    for name, kwargs in {"flag-full": {"split_masters": False}, "class-full": {"layout": MasterWeights},
                         "flag-split": {}, "class-split": {"layout": SplitMasterWeights}}.items():
        model = _model().to(torch.bfloat16)
        opt = AdamW(model.parameters(), lr=1e-2, moments=moments, seed=3, **kwargs)
        runs[name] = (_train(model, opt), opt.state_dict(), opt.split_count)
    assert runs["class-full"][2] == runs["flag-full"][2] == 0 and runs["class-split"][2] > 0
    ref_bits, ref_sd, _ = runs["flag-full"]
    for bits, sd, _ in runs.values():
        assert all(torch.equal(a, b) for a, b in zip(ref_bits, bits, strict=True))
        _same(sd, ref_sd)


def test_a_checkpoint_of_the_full_class_resumes_in_the_split_class_bit_for_bit():
    a, b, c = _model().to(torch.bfloat16), _model().to(torch.bfloat16), _model().to(torch.bfloat16)
    oa = AdamW(a.parameters(), lr=1e-2, layout=MasterWeights)
    _train(a, oa, 2)
    ob = AdamW(b.parameters(), lr=1e-2, layout=SplitMasterWeights)
    b.load_state_dict(a.state_dict())
    ob.load_state_dict(oa.state_dict())
    oc = AdamW(c.parameters(), lr=1e-2, layout=MasterWeights)
    c.load_state_dict(a.state_dict())
    oc.load_state_dict(oa.state_dict())
    assert ob.split_count > 0 and oc.split_count == 0
    assert all(torch.equal(x, y) for x, y in zip(_train(b, ob, 2), _train(c, oc, 2), strict=True))


def test_the_split_layout_splits_only_where_exact_by_its_own_rule():
    bf16 = lambda: nn.Parameter(torch.ones(4, dtype=torch.bfloat16))   # noqa: E731
    sgd = MasterWeights(torch.optim.SGD, [bf16()], layout=SplitMasterWeights, lr=0.1)
    other = MasterWeights(_Global, [bf16()], layout=SplitMasterWeights)
    fp16 = MasterWeights(torch.optim.SGD, [nn.Parameter(torch.ones(4, dtype=torch.float16))],
                         layout=SplitMasterWeights, lr=0.1)
    assert all(type(o) is SplitMasterWeights for o in (sgd, other, fp16))
    assert (sgd.split, sgd.split_count) == (True, 1)
    assert (other.split, other.split_count) == (False, 0)       # not elementwise: full masters
    assert fp16.split and fp16.split_count == 0                  # FP16: nothing to split
    full = MasterWeights(torch.optim.SGD, [bf16()], layout=MasterWeights, lr=0.1)
    assert type(full) is MasterWeights and not full.split and full.split_count == 0


def test_a_layout_its_class_cannot_step_is_refused_in_one_line():
    class Mine(MasterWeights):
        pass

    with pytest.raises(ConfigError, match="cannot step the SplitMasterWeights layout; use SplitMasterWeights"):
        Mine(torch.optim.SGD, [nn.Parameter(torch.ones(2, dtype=torch.bfloat16))],
             layout=SplitMasterWeights, lr=0.1)


@pytest.mark.parametrize("split, layout", [(False, "SplitMasterWeights"), (True, "MasterWeights")])
def test_a_split_flag_that_contradicts_the_layout_class_is_refused_in_one_line(split, layout):
    # Both given used to let the layout win silently (found in review, 2026-12-05).
    from mixprec.errors import ConfigError
    from mixprec.optim import AdamW, MasterWeights, SplitMasterWeights
    cls = {"SplitMasterWeights": SplitMasterWeights, "MasterWeights": MasterWeights}[layout]
    params = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))]
    with pytest.raises(ConfigError, match=f"split \\(split_masters\\)={split} and layout={layout} disagree"):
        AdamW(params, split_masters=split, layout=cls)
    with pytest.raises(ConfigError, match="disagree"):
        MasterWeights(torch.optim.AdamW, [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))],
                      split=split, layout=cls)
