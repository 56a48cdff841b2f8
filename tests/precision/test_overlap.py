"""overlap_optimizer=true: the per-module update is bit-identical to the one-shot step.

Each scenario trains the tiny Transformer 10 steps twice from the same seed and batches, once
with the plain step and once with the step issued per module (mixprec.optim.overlap), and
requires every parameter, every optimizer state tensor (moments, step counters, FP32 masters) and
the LR to be *equal* (tolerance 0). In 16-mixed an inf is forced into the forward of step 5: that
step must be skipped by both, and with overlap it must issue no partial step at all.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.optim import OverlappedUpdate
from mixprec.optim.overlap import module_units
from mixprec.errors import ConfigError
from mixprec.models import Transformer
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.parts import check_separable, step_in_parts
from mixprec.train.config import FitConfig
from mixprec.train.trainer import Trainer

STEPS = 10
OVERFLOW_AT = 5          # 0-based step whose forward makes an inf (16-mixed only)


def _batches(accum: int, vocab: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    return [[(torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, vocab, (4, 16), generator=g))
             for _ in range(accum)] for _ in range(STEPS)]


def _train(mode: str, overlap: bool, accum: int, overflow: bool):
    torch.manual_seed(0)
    model = Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
    cfg = FitConfig(precision=mode, overlap_optimizer=overlap, grad_accum_steps=accum, lr=3e-3,
                    warmup_steps=2, clip_grad_norm=1.0, log_interval=1, audit=False,
                    progress=False, trace_nonfinite=False, init_scale=2.0**8)
    trainer = Trainer(model, config=cfg, strategy="single")
    trainer.prepare(total_steps=STEPS)
    base = getattr(trainer.optimizer, "inner", trainer.optimizer)
    calls = []
    base.register_step_pre_hook(lambda *_: calls.append(trainer.step))
    poison = {"on": False}

    def make_inf(module, args, out):
        return (out[0] * float("inf"), *out[1:]) if poison["on"] else out
    trainer.raw_model.blocks[0].register_forward_hook(make_inf)
    skipped = []
    for i, batches in enumerate(_batches(accum, 64)):
        poison["on"] = overflow and i == OVERFLOW_AT
        out = trainer.train_step(batches)
        trainer.step += 1
        skipped.append(out.skipped)
    trainer.settle()
    return trainer, calls, skipped


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    for (name, p), q in zip(a.raw_model.named_parameters(), b.raw_model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), f"{name} differs"
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa.keys() == sb.keys()                     # the checkpoint format is unchanged
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        for key, t in st.items():
            assert torch.equal(t, sb["state"][k][key]), f"state {k}.{key} differs"
    masters_a = sa.get("master_weights", {}).get("tensors", [])
    masters_b = sb.get("master_weights", {}).get("tensors", [])
    assert len(masters_a) == len(masters_b)
    for x, y in zip(masters_a, masters_b):
        assert torch.equal(x, y)
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)       # small tensors: threads only contend on a shared machine
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("mode,accum", [("32-true", 1), ("bf16-mixed", 1), ("16-mixed", 1),
                                        ("bf16-true", 1), ("bf16-mixed", 2), ("16-mixed", 2)])
def test_overlapped_step_is_bit_identical_to_the_plain_step(mode, accum):
    overflow = mode == "16-mixed"
    plain, plain_calls, plain_skips = _train(mode, False, accum, overflow)
    over, over_calls, over_skips = _train(mode, True, accum, overflow)
    _assert_same_state(plain, over)
    assert plain_skips == over_skips
    assert any(over_skips) == overflow
    n_parts = sum(1 for g in over.overlap.groups if g)
    assert n_parts > 1
    taken = STEPS - sum(over_skips)
    # One optimizer step per taken step, one partial step (at least) per module group; split FP32
    # masters issue the inner optimizer once per param group and chunk, so count distinct steps.
    # Without overlap a mixprec master-weight optimizer also issues a skipped step, masked on the
    # device (StepInputs.found_inf, no host read first); with overlap the host decides first.
    masked = {i for i, s in enumerate(plain_skips) if s} if isinstance(plain.optimizer, MasterWeights) else set()
    assert set(plain_calls) - set(over_calls) == masked and set(over_calls) <= set(plain_calls)
    assert len(set(over_calls)) == taken
    per_step = len(plain_calls) // len(set(plain_calls))
    assert len(plain_calls) == len(set(plain_calls)) * per_step
    assert len(over_calls) >= taken * n_parts
    if overflow:
        assert OVERFLOW_AT not in over_calls          # the skipped step issued nothing
    assert plain.precision.scaler.num_skipped_steps == over.precision.scaler.num_skipped_steps


def test_tied_weights_are_updated_once_and_waited_for_by_both_modules():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.scale = nn.Parameter(torch.ones(4))   # the root's own parameter
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    engine = OverlappedUpdate(model, opt)
    names = [n for n, _, _ in module_units(model)]
    assert names == ["", "emb", "blocks.0", "blocks.1", "head"]
    flat = [id(p) for g in engine.groups for p in g]
    assert len(flat) == len(set(flat)) == len(list(model.parameters()))
    head = names.index("head")
    assert engine.groups[head] == []                   # its weight is the embedding's
    assert engine.waits_for[head] == (names.index("emb"),)


def test_a_step_split_by_module_is_exact_with_masters_and_fused_defaults():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    b = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    b.load_state_dict(a.state_dict())
    oa, ob = AdamW(a.parameters(), lr=0.1), AdamW(b.parameters(), lr=0.1)
    for _ in range(3):
        for m in (a, b):
            m(torch.ones(2, 8, dtype=torch.bfloat16)).square().sum().backward()
        oa.step()
        step_in_parts(ob, [list(b[1].parameters()), list(b[0].parameters())])
        oa.zero_grad()
        ob.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert oa.state_dict().keys() == ob.state_dict().keys()


def test_optimizers_that_are_not_elementwise_are_refused_with_the_fix():
    p = [nn.Parameter(torch.ones(3))]
    with pytest.raises(ConfigError, match="stochastic"):
        check_separable(AdamW(p, moments_dtype=torch.bfloat16))
    check_separable(AdamW(p, moments_dtype=torch.bfloat16, stochastic_rounding=False))

    class Global(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            pass
    with pytest.raises(ConfigError, match="overlap_optimizer=false"):
        check_separable(Global(p))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams: needs a GPU")
def test_on_cuda_the_side_stream_update_is_bit_identical():
    def run(overlap: bool):
        torch.manual_seed(0)
        model = Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16)
        cfg = FitConfig(precision="bf16-mixed", overlap_optimizer=overlap, lr=3e-3, audit=False,
                        progress=False, trace_nonfinite=False)
        t = Trainer(model, config=cfg, strategy="single")
        t.prepare(total_steps=STEPS)
        for batches in _batches(2, 64):
            t.train_step([(x.cuda(), y.cuda()) for x, y in batches])
            t.step += 1
        t.settle()
        torch.cuda.synchronize()
        return t
    a, b = run(False), run(True)
    assert b.overlap.streams and b.overlap.per_module
    _assert_same_state(a, b)
