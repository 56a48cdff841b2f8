"""locate_nonfinite attributes the first NaN/Inf to the module and direction that made it."""
import json
import math

import pytest
import torch
from torch import nn

from mixprec.monitor.trace import capture_rng_state, locate_nonfinite, replay_rng_state


def _step(model, x):
    def run():
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss
    return run


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               for m in model.modules())


def test_clean_step_returns_none_and_leaves_no_hooks_or_grads(tiny):
    x = torch.randn(4, 8)
    assert locate_nonfinite(tiny, _step(tiny, x)) is None
    assert _hooks(tiny) == 0
    assert all(p.grad is None for p in tiny.parameters())
    assert all(not p._backward_hooks for p in tiny.parameters())


@pytest.mark.parametrize("where", ["blocks.1.fc2", "blocks.0.fc1", "blocks.2.fc1"])
def test_inf_injected_in_forward_output_is_attributed_to_that_module(tiny, where):
    tiny.get_submodule(where).poison = "forward"
    ev = locate_nonfinite(tiny, _step(tiny, torch.randn(4, 8)), loss_scale=1024.0, step=7)
    assert (ev.module, ev.direction, ev.kind, ev.dtype, ev.tensor) == (where, "forward", "inf", "fp32", "output")
    assert ev.input_absmax is not None and 0 < ev.input_absmax < 1e3
    assert ev.message(scale_after=512) == f"step 7 skipped: inf first at {where} (forward, fp32) — loss scale 1024 -> 512"


@pytest.mark.parametrize("where", ["blocks.1.fc2", "blocks.0.fc1", "blocks.2.fc2"])
def test_inf_injected_in_backward_gradient_is_attributed_to_that_module(tiny, where):
    tiny.get_submodule(where).poison = "backward"
    ev = locate_nonfinite(tiny, _step(tiny, torch.randn(4, 8)))
    assert (ev.module, ev.direction, ev.kind, ev.tensor) == (where, "backward", "inf", "grad_input")
    assert ev.input_absmax is not None and ev.input_absmax > 0  # its grad_output was finite


def test_replay_restores_grads_buffers_and_existing_hooks(tiny):
    bn = nn.BatchNorm1d(8)
    model = nn.Sequential(tiny.inp, bn, tiny.head)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    mean = bn.running_mean.clone()
    marker = model[0].register_forward_hook(lambda *a: None)
    model[0].poison = None
    assert locate_nonfinite(model, _step(model, x)) is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(bn.running_mean, mean)
    assert list(model[0]._forward_hooks) == [marker.id]


class HalfSoftmax(nn.Module):
    """softmax written naively in FP16: exp overflows for logits > ~11, giving inf/inf = NaN."""

    def forward(self, x):
        e = x.half().exp()
        return e / e.sum(-1, keepdim=True)


class ToFloat(nn.Module):
    def forward(self, x):
        return x.float()


class HalfSumSquares(nn.Module):
    """An unscaled FP16 reduction: the sum of squares passes 65504 long before the inputs do."""

    def forward(self, x):
        return x.half().pow(2).sum(-1, keepdim=True)


def test_nan_from_fp16_exp_overflow_is_traced_to_the_naive_softmax():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 8))
    model.add_module("attn", nn.Sequential())
    model.attn.add_module("softmax", HalfSoftmax())
    model.add_module("cast", ToFloat())
    model.add_module("out", nn.Linear(8, 1))
    x = torch.randn(4, 8) * 40  # logits of order 100: FP32 softmax is fine, FP16 exp is inf
    assert torch.isfinite(torch.softmax(model.proj(x), -1)).all()
    ev = locate_nonfinite(model, _step(model, x))
    assert (ev.module, ev.direction, ev.kind, ev.dtype) == ("attn.softmax", "forward", "nan", "fp16")
    assert ev.input_absmax > 11  # the finite input range shows why: exp(>11.1) overflows FP16


def test_fp16_overflow_in_unscaled_reduction_is_traced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), HalfSumSquares(), ToFloat(), nn.Linear(1, 1))
    x = torch.randn(4, 8) * 200
    ev = locate_nonfinite(model, _step(model, x))
    assert (ev.module, ev.direction, ev.kind, ev.dtype) == ("1", "forward", "inf", "fp16")
    assert ev.input_absmax < 65504  # every input was representable: the reduction overflowed


def test_fp16_backward_overflow_under_a_large_loss_scale_is_traced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)).half()
    with torch.no_grad():
        model[2].weight.fill_(30.0)  # grad_input of layer 2 = grad_output (4096) * 30 > 65504
    x = torch.randn(4, 8, dtype=torch.float16) * 0.1
    scale = 2.0 ** 14  # mean over 4 rows: grad_output of the last layer is 4096 per row

    def run():
        loss = model(x).float().mean()
        (loss * scale).backward()
        return loss

    ev = locate_nonfinite(model, run, loss_scale=scale)
    assert (ev.module, ev.direction, ev.dtype, ev.tensor) == ("2", "backward", "fp16", "grad_input")
    assert ev.input_absmax < 65504
    run_ok = lambda: (model(x).float().mean()).backward()  # noqa: E731  (unscaled: finite)
    assert locate_nonfinite(model, run_ok) is None


def test_nonfinite_loss_from_code_outside_the_model_is_reported_as_loss(tiny):
    x = torch.randn(4, 8)

    def run():
        loss = (tiny(x).half() * 1e3).pow(2).sum()  # FP16 loss overflows
        loss.backward()
        return loss
    ev = locate_nonfinite(tiny, run)
    assert (ev.module, ev.direction) == ("<loss>", "forward")


def test_nonfinite_input_batch_is_reported_as_input(tiny):
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    ev = locate_nonfinite(tiny, _step(tiny, x))
    assert (ev.module, ev.kind) == ("<input>", "nan")


def test_inf_made_by_a_parents_own_code_is_attributed_to_the_parent():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(self.a(x) / 0.0)  # division in the parent's own code

    model = nn.Sequential(Parent())
    ev = locate_nonfinite(model, _step(model, torch.randn(2, 4)))
    assert (ev.module, ev.direction) == ("0", "forward")


def test_replay_rng_state_replays_dropout_and_restores_the_stream():
    drop = nn.Dropout(0.5)
    x = torch.ones(1000)
    state = capture_rng_state()
    first = drop(x)
    after_first = torch.rand(3)
    with replay_rng_state(state):
        again = drop(x)
    assert torch.equal(first, again)
    assert not torch.equal(torch.rand(3), after_first)  # stream continued, not rewound
    with replay_rng_state(state):
        drop(x)
        replayed_next = torch.rand(3)
    assert torch.equal(replayed_next, after_first)


def test_dropout_model_replays_the_same_origin(tiny):
    tiny.blocks[1].fc2.poison = "backward"
    x = torch.randn(4, 8)
    state = capture_rng_state()
    tiny(x)
    ev = locate_nonfinite(tiny, _step(tiny, x), rng_state=state)
    assert ev.module == "blocks.1.fc2"


def test_event_json_round_trips(tiny):
    tiny.blocks[0].fc1.poison = "forward"
    ev = locate_nonfinite(tiny, _step(tiny, torch.randn(4, 8)), loss_scale=65536, step=1234)
    d = json.loads(ev.to_json())
    assert d["module"] == "blocks.0.fc1" and d["step"] == 1234 and d["loss_scale"] == 65536
    assert d["message"].startswith("step 1234 skipped: inf first at blocks.0.fc1 (forward, fp32)")


def _micro_batch_step(model, xs):
    def run():
        total = None
        for x in xs:
            loss = model(x).pow(2).mean() / len(xs)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total
    return run


def _poison_marked_rows(module, args, output):   # inf wherever the batch carries the marker value
    return torch.where(args[0][:, :1] == 1234.0, torch.full_like(output, math.inf), output)


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_inf_made_in_any_micro_batchs_forward_is_attributed_to_its_module(tiny, bad):
    xs = [torch.randn(4, 8) for _ in range(3)]
    xs[bad][0, 0] = 1234.0
    tiny.inp.register_forward_hook(_poison_marked_rows)
    ev = locate_nonfinite(tiny, _micro_batch_step(tiny, xs))
    assert (ev.module, ev.direction, ev.kind) == ("inp", "forward", "inf")
    assert ev.micro_batch == bad


def test_inf_made_in_the_second_micro_batchs_backward_is_attributed_to_its_module(tiny):
    xs = [torch.randn(4, 8) for _ in range(2)]
    calls = []
    fc2 = tiny.blocks[1].fc2

    def poison_second_call(module, args):   # PoisonLinear: inf input-gradient on the 2nd call only
        calls.append(1)
        module.poison = "backward" if len(calls) == 2 else None
    fc2.register_forward_pre_hook(poison_second_call)
    ev = locate_nonfinite(tiny, _micro_batch_step(tiny, xs))
    assert (ev.module, ev.direction, ev.tensor) == ("blocks.1.fc2", "backward", "grad_input")
    assert ev.micro_batch == 1


def test_a_too_large_loss_scale_is_traced_to_the_layer_not_the_whole_model():
    """The scaled loss overflows the head's FP16 output-gradient (the cast back to FP16 is the
    model's own code): the origin is the head, never ``<Transformer>``."""
    from mixprec.models import Transformer
    torch.manual_seed(0)
    model = Transformer.from_preset("tiny")
    x = torch.randint(0, 256, (2, 16))

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, x)
        (loss.float() * 1e30).backward()
        return loss

    ev = locate_nonfinite(model, step)
    assert (ev.module, ev.direction, ev.tensor, ev.kind) == ("head", "backward", "grad_output", "inf")


def test_an_fp32_weight_gradient_inf_under_fp16_autocast_names_the_fp16_weight_gradient_gemm():
    """16-mixed: the FP16 weight-gradient GEMM overflows (a sum over 256 rows) and the FP32
    gradient only receives its inf. Before: "inf first at 1 (backward, fp32)", the wrong format."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 1, bias=False))
    x = torch.full((256, 8), 30.0)

    def run():
        with torch.autocast("cpu", dtype=torch.float16):
            y = model(x)
        loss = y.float().sum()
        (loss * 100.0).backward()
        return loss

    ev = locate_nonfinite(model, run, loss_scale=100.0)
    assert (ev.module, ev.direction, ev.tensor, ev.kind) == ("1", "backward", "grad of weight", "inf")
    assert ev.dtype == "fp16" and ev.made_by == "weight-gradient GEMM"
    assert "inf first at 1 (backward, fp16 weight-gradient GEMM)" in ev.message(3)
    assert ev.tied_to == ()                   # not shared: nothing else named
    assert json.loads(ev.to_json())["made_by"] == "weight-gradient GEMM"


class _TiedHead(nn.Module):
    """An embedding kept in FP32 whose weight the output head shares (a tied head)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(4, 8)
        self.head = nn.Linear(8, 4, bias=False)
        self.head.weight = self.wte.weight
        with torch.no_grad():
            self.wte.weight.fill_(1.0)

    def forward(self, idx):
        return self.head(self.wte(idx))


def test_a_tied_heads_fp16_weight_gradient_inf_names_the_head_tied_to_the_embedding():
    """16-mixed, head tied to wte: the head's FP16 weight-gradient GEMM sums 1024 rows of 100 and
    overflows; its input-gradient (4 x 100) and the embedding's FP32 backward stay finite. The
    shared parameter's hook sees only the sum of both owners' contributions. Before: "inf first at
    wte (backward, fp32 weight-gradient GEMM)", the embedding and a format nothing ran in."""
    model = _TiedHead()
    idx = torch.zeros(1024, dtype=torch.long)

    def run():
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx)
        loss = logits.float().sum()
        (loss * 100.0).backward()
        return loss

    ev = locate_nonfinite(model, run, loss_scale=100.0)
    assert (ev.module, ev.direction, ev.tensor, ev.kind) == ("head", "backward", "grad of weight", "inf")
    assert ev.tied_to == ("wte",)
    assert ev.dtype == "fp16" and ev.made_by == "weight-gradient GEMM"
    assert "inf first at head (tied to wte) (backward, fp16 weight-gradient GEMM)" in ev.message(16)
    assert ev.input_absmax == 100.0          # the head's output-gradient, not the embedding's
    assert json.loads(ev.to_json())["tied_to"] == ["wte"]


def test_a_tied_parameter_used_by_one_owner_only_names_that_owner_alone():
    """Only the embedding runs (the head is never called): its FP32 backward sums 8 rows of 3e38
    into one token's row and overflows; its gradient alone reached the shared weight, so the
    origin is ``wte`` with nobody in ``tied_to``."""
    model = _TiedHead()
    idx = torch.zeros(8, dtype=torch.long)

    def run():
        loss = model.wte(idx).sum()
        (loss * 3e38).backward()
        return loss

    ev = locate_nonfinite(model, run)
    assert (ev.module, ev.tensor, ev.dtype, ev.tied_to) == ("wte", "grad of weight", "fp32", ())
    assert "inf first at wte (backward, fp32" in ev.message(1)
