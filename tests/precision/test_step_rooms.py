"""``Precision.step`` is the one place that hands data between the rooms: it asks the optimizer
for its gradients (optim/), hands them to the scaler and the clip as tensors and updates the scale
(amp/), then steps the optimizer with everything it needs in ``StepInputs`` (optim/). amp/ never
calls into optim/ during a step; the room sequence is measured as tools/precision_counts.py does."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.amp import GradScaler, clip_grad_norm_
from mixprec.models.transformer import Transformer
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.precision.precision import Precision

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("precision_counts", ROOT / "tools" / "precision_counts.py")
counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(counts)

CASES = {
    # name: (mode, optimizer factory, rooms of one Precision.step)
    "split-masters": ("bf16-true", lambda ps: AdamW(ps, lr=1e-3), ["optim", "amp", "optim"]),
    "full-masters": ("bf16-true", lambda ps: AdamW(ps, lr=1e-3, split_masters=False),
                     ["optim", "amp", "optim"]),
    "int8-moments": ("bf16-true", lambda ps: AdamW(ps, lr=1e-3, moments="int8"), ["optim", "amp", "optim"]),
    "16-mixed-masters": ("16-mixed", lambda ps: AdamW(ps, lr=1e-3), ["optim", "amp", "optim"]),
    # torch's own: the scaler reads their .grad itself; a host-decided step is torch's code
    "torch-foreach": ("bf16-mixed", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
                      ["optim", "amp"]),
    "torch-fused": ("16-mixed", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
                    ["optim", "amp", "optim"]),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Transformer(num_layers=2, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16)


def _backward(precision: Precision, model: nn.Module, i: int, inf: bool = False) -> None:
    with precision.autocast():
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
        loss = model(x, x)[1]
    if inf:
        loss = loss * float("inf")
    precision.backward(loss.float())


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_step_visits_amp_once_and_amp_makes_no_call_into_optim(case, clip):
    mode, make, expected = CASES[case]
    precision = Precision(mode, device="cpu")
    model, opt = precision.setup(_model(), make)
    for i in range(3):                       # the third step: after the first steps' one-time work
        _backward(precision, model, i)
        if i < 2:
            precision.step(opt, clip_grad_norm=clip)
        else:
            rooms, amp_to_optim = counts.step_rooms(
                Precision.step, lambda: precision.step(opt, clip_grad_norm=clip))
        opt.zero_grad()
    assert amp_to_optim == []
    assert rooms == expected


def test_the_profile_sees_amp_call_optim_in_the_torch_style_loop():
    # The check can fail: torch's public loop (scaler.unscale_(optimizer), clip_grad_norm_) keeps
    # its protocol calls, and the same profile sees them as amp/ -> optim/ edges.
    precision = Precision("bf16-true", device="cpu")
    model, opt = precision.setup(_model(), lambda ps: AdamW(ps, lr=1e-3))
    scaler = GradScaler.from_policy("bf16-true")
    _backward(precision, model, 0)

    def torch_style():
        scaler.unscale_(opt)
        clip_grad_norm_(scaler, opt, 1.0)
        scaler.step(opt)
        scaler.update()

    rooms, amp_to_optim = counts.step_rooms(torch_style, torch_style)
    assert ("amp/unscale.py", "optim/split_masters.py") in amp_to_optim
    assert rooms.count("optim") >= 2 and rooms.count("amp") >= 2


def _train(make, *, clip, scaled: bool, overlap: bool = False, steps: int = 5, inf_at: int = 2):
    precision = Precision("bf16-true", device="cpu")
    if scaled:       # a loss scale over BF16 parameters: split masters' deferred unscale factor
        precision._scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    model, opt = precision.setup(_model(), make)
    engine = OverlappedUpdate(model, opt) if overlap else None
    taken = []
    for i in range(steps):
        _backward(precision, model, i, inf=i == inf_at)
        taken.append(bool(precision.step(opt, clip_grad_norm=clip, overlap=engine)))
        opt.zero_grad()
    return model, opt, taken, precision.scaler.get_scale()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_same(a, b) -> None:
    (ma, oa, ta, sa), (mb, ob, tb, sb) = a, b
    assert ta == tb and sa == sb
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))
    sa_, sb_ = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sorted(sa_) == sorted(sb_)
    for k in sa_:                            # by parameter: an overlapped step fills it part by part
        xa, xb = sa_[k], sb_[k]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(xa[key]), _bits(xb[key])), key


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "loss-scale"])
@pytest.mark.parametrize("clip", [None, 0.05, math.inf], ids=["no-clip", "clip", "measure"])
def test_split_masters_get_their_deferred_factors_through_step_inputs_bit_identically(clip, scaled):
    full = _train(lambda ps: AdamW(ps, lr=3e-3, split_masters=False), clip=clip, scaled=scaled)
    split = _train(lambda ps: AdamW(ps, lr=3e-3), clip=clip, scaled=scaled)
    assert isinstance(split[1], MasterWeights) and split[1].split
    assert split[2] == [True, True, False, True, True]
    _assert_same(full, split)


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "loss-scale"])
def test_the_overlapped_step_gets_the_same_step_inputs(scaled):
    plain = _train(lambda ps: AdamW(ps, lr=3e-3), clip=0.05, scaled=scaled)
    over = _train(lambda ps: AdamW(ps, lr=3e-3), clip=0.05, scaled=scaled, overlap=True)
    _assert_same(plain, over)


def test_step_inputs_factors_without_deferred_gradients_are_refused():
    from mixprec.optim.inputs import StepInputs
    model = _model()
    mp.Precision("bf16-true").setup_module(model)
    opt = AdamW(model.parameters(), lr=1e-3, split_masters=False)
    model(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))[1].float().backward()
    with pytest.raises(RuntimeError, match="defers none"):
        opt.step(inputs=StepInputs(clip_coef=torch.ones(())))
