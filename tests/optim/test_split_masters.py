"""Split FP32 masters (BF16 param + 16-bit remainder) give bit-identical weights to full FP32 masters.

The reference is today's ``bf16-true`` step: ``mixprec.optim.AdamW(split_masters=False)``, FP32
masters and FP32 master gradients. Every scenario compares the BF16 parameters, the FP32 masters
and the Adam moments bit for bit (tolerance 0) after a few steps.
"""
from __future__ import annotations

import pytest
import torch

import mixprec as mp
from mixprec.amp import GradScaler, clip_grad_norm_
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.split import join, join_many, split_, split_many_

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = mp.models.Transformer(num_layers=2, d_model=32, num_heads=2, max_seq_len=16)
    return mp.Precision("bf16-true").setup_module(model)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
            for _ in range(n)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _train(split: bool, *, clip: float | None = None, accum: int = 1, scale: float | None = None,
           skip_at: int | None = None, moments: torch.dtype = torch.float32, lr: float = 3e-3):
    model = _model()
    opt = AdamW(model.parameters(), lr=lr, split_masters=split, moments_dtype=moments, seed=3)
    scaler = GradScaler(init_scale=scale or 1.0, growth_interval=2) if scale else GradScaler.from_policy("bf16-true")
    batches = _batches(STEPS * accum)
    skipped = []
    for step in range(STEPS):
        for x, y in batches[step * accum:(step + 1) * accum]:
            _, loss = model(x, y)
            scaler.scale(loss / accum).backward()
        if step == skip_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        if clip is not None:
            clip_grad_norm_(scaler, opt, clip)
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
        opt.zero_grad()
    return model, opt, skipped


def _assert_same(a, b) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    assert sa == sb
    for (name, pa), pb in zip(ma.named_parameters(), mb.parameters()):
        assert pa.dtype == pb.dtype
        assert torch.equal(_bits(pa), _bits(pb)), name
    for qa, qb in zip(oa.masters, ob.masters):
        assert torch.equal(_bits(qa), _bits(qb))
    for sa_, sb_ in zip(oa.state_dict()["state"].values(), ob.state_dict()["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(sa_[key]), _bits(sb_[key])), key


def test_split_and_remainder_rebuild_every_fp32_value_including_ties():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50_000, generator=g) * torch.logspace(-38, 38, 50_000)
    hi = torch.randn(500, generator=g).to(torch.bfloat16).float().view(torch.int32)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.4e38, -3.39e38, 1e-45, -1e-45])
    w = torch.cat([w, special, (hi + 0x8000).view(torch.float32), (hi - 0x8000).view(torch.float32)])
    p = torch.empty(w.shape, dtype=torch.bfloat16)
    lo = torch.empty(w.shape, dtype=torch.int16)
    ties = split_(w, p, lo)
    assert torch.equal(p, w.to(torch.bfloat16))               # the param is the usual rounding
    assert ties.numel() >= 250                                # the ties that rounded down
    assert torch.equal(join(p, lo, ties).view(torch.int32), w.view(torch.int32))
    # The chunked versions (one flat buffer, one nonzero) agree, ties split per tensor.
    ws = [w[:30_000].clone(), w[30_000:].clone().view(-1, 1)]
    his = [torch.empty(x.shape, dtype=torch.bfloat16) for x in ws]
    los = [torch.empty(x.shape, dtype=torch.int16) for x in ws]
    tie_lists = split_many_(ws, his, los)
    assert sum(t.numel() for t in tie_lists) == ties.numel() and tie_lists[1].numel() > 0
    for a, b in zip(ws, join_many(his, los, tie_lists)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_split_masters_are_on_by_default_and_hold_no_fp32_copy():
    model = _model()
    opt = AdamW(model.parameters())
    assert opt.split and "split" in repr(opt)
    bf16 = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert all(opt._master_of[id(p)].numel() == 0 for p in bf16)
    assert all(opt.master_of(p).dtype == torch.float32 for p in bf16)


@pytest.mark.parametrize("case", [
    {}, {"clip": 0.05}, {"accum": 3}, {"skip_at": 1}, {"scale": 1024.0, "clip": 0.5},
    {"moments": torch.bfloat16}, {"moments": torch.bfloat16, "clip": 0.05},
], ids=["plain", "clip", "accumulation", "skipped-step", "loss-scale+clip", "bf16-moments",
        "bf16-moments+clip"])
def test_split_masters_are_bit_identical_to_fp32_masters(case):
    full, split = _train(False, **case), _train(True, **case)
    _assert_same(full, split)
    if case.get("skip_at") is not None:
        assert split[2][case["skip_at"]] and sum(split[2]) == 1


def test_small_updates_accumulate_in_the_remainder():
    # lr so small that every update is below half a BF16 ULP: the params stay, the masters move.
    full, split = _train(False, lr=1e-7), _train(True, lr=1e-7)
    _assert_same(full, split)
    before = _model()
    moved = [not torch.equal(a.float(), m) for a, m in zip(before.parameters(), split[1].masters)
             if a.dtype == torch.bfloat16]
    assert any(moved)


def test_checkpoints_move_between_split_and_full_masters():
    for src_split in (True, False):
        a_model, a_opt, _ = _train(src_split)
        b_model = _model()
        b_model.load_state_dict(a_model.state_dict())
        b_opt = AdamW(b_model.parameters(), lr=3e-3, split_masters=not src_split)
        b_opt.load_state_dict(a_opt.state_dict())
        for qa, qb in zip(a_opt.masters, b_opt.masters):
            assert torch.equal(_bits(qa), _bits(qb))
        for pa, pb in zip(a_model.parameters(), b_model.parameters()):
            assert torch.equal(_bits(pa), _bits(pb))
        sd = a_opt.state_dict()
        assert all(t.dtype == torch.float32 for t in sd["master_weights"]["tensors"])


def test_torch_grad_scaler_works_through_master_grads():
    # torch.amp.GradScaler unscales param_groups' grads: master_grads() widens them for the step.
    results = []
    for split in (False, True):
        model = _model()
        opt = AdamW(model.parameters(), lr=3e-3, split_masters=split)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for x, y in _batches(2):
            _, loss = model(x, y)
            scaler.scale(loss).backward()
            opt.master_grads()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append([_bits(p) for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_precision_wraps_torch_optimizers_in_split_masters():
    model = mp.models.Transformer(num_layers=1, d_model=32, num_heads=2, max_seq_len=16)
    _, opt = mp.Precision("bf16-true").setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert isinstance(opt, MasterWeights) and opt.split


def test_split_true_refuses_an_optimizer_that_is_not_elementwise():
    class Global(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(mp.errors.ConfigError, match="split=True"):
        MasterWeights(Global, [p], split=True)
    assert not MasterWeights(Global, [p]).split


def test_numerics_monitor_sees_the_updates_of_split_masters():
    from mixprec.monitor import NumericsMonitor
    model = _model()
    opt = AdamW(model.parameters(), lr=1e-3)
    mon = NumericsMonitor(model, every=1, compute_dtype="bf16",
                          module_filter_fn=lambda m, fqn: fqn == "blocks.0.mlp.fc")
    x, y = _batches(1)[0]
    with mon.sample(0) as s:
        _, loss = model(x, y)
        loss.backward()
        with mon.track_updates(opt):
            opt.step()
    row = next(r for r in s.rows if (r.module, r.kind) == ("blocks.0.mlp.fc", "update"))
    assert row.absmax > 0 and row.underflow_frac < 1.0   # the FP32 update, read after the step


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_trainer_with_split_masters_matches_full_masters(moments):
    from mixprec.train.config import FitConfig
    from mixprec.train.trainer import Trainer
    out = []
    for split in (False, True):
        torch.manual_seed(0)
        model = mp.models.Transformer.from_preset("tiny", vocab_size=64, max_seq_len=16, d_model=32)
        cfg = FitConfig(precision="bf16-true", split_masters=split, moments=moments, grad_accum_steps=2,
                        lr=3e-3, warmup_steps=1, clip_grad_norm=0.5, audit=False, progress=False,
                        trace_nonfinite=False)
        trainer = Trainer(model, config=cfg, strategy="single")
        trainer.prepare(total_steps=3)
        assert trainer.optimizer.split == split
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            trainer.train_step([(torch.randint(0, 64, (2, 16), generator=g),
                                 torch.randint(0, 64, (2, 16), generator=g)) for _ in range(2)])
            trainer.step += 1
        out.append([_bits(p) for p in trainer.raw_model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_moments_need_mixprecs_adamw():
    from mixprec.errors import ConfigError
    with pytest.raises(ConfigError, match="moments=bf16 needs mixprec's AdamW"):
        mp.Precision(mp.get_policy("bf16-true").replace(master_weights=False)).make_optimizer(
            [{"params": [torch.nn.Parameter(torch.ones(2))]}], moments="bf16")


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_moments_under_fsdp2_step_the_fp32_shards_with_mixprecs_adamw(moments):
    """FSDP2's FP32 shards are the masters: 8-bit / BF16 moments go on mixprec's FP32-math AdamW
    stepping them directly (they used to be refused)."""
    from mixprec.optim.adamw import _AdamWFP32Math
    prec = mp.Precision("bf16-mixed")
    opt = prec.make_optimizer([{"params": [torch.nn.Parameter(torch.ones(4, 32))]}],
                              sharded=True, moments=moments, lr=1e-3)
    assert type(opt) is _AdamWFP32Math and opt.moments == moments
    assert any(f"steps the FP32 shards with moments={moments}" in n for n in prec.notes)


def test_split_masters_under_fsdp2_say_why_they_do_nothing():
    """FSDP2's FP32 shards are the masters (4 bytes per parameter, the same as split masters'
    2 + 2): the step is torch's AdamW on them, and the notes (the run's start lines) say so."""
    prec = mp.Precision("bf16-true")
    opt = prec.make_optimizer([{"params": [torch.nn.Parameter(torch.ones(2))]}], sharded=True)
    assert type(opt) is torch.optim.AdamW
    assert any("nothing to split under FSDP2" in n for n in prec.notes)
    quiet = mp.Precision("bf16-true")
    quiet.make_optimizer([{"params": [torch.nn.Parameter(torch.ones(2))]}], sharded=True, split_masters=False)
    assert not any("FSDP2" in n for n in quiet.notes)


@pytest.mark.parametrize("precision, said", [("32-true", False), ("bf16-mixed", False), ("bf16-true", True)])
def test_the_split_note_is_said_only_where_a_bf16_parameter_has_a_split_master(precision, said):
    """Every run, 32-true included, used to print "FP32 masters of BF16 parameters split"."""
    prec = mp.Precision(precision)
    model = prec.setup_module(torch.nn.Linear(4, 4))
    prec.make_optimizer([{"params": list(model.parameters())}], model=model)
    assert any("masters of BF16 parameters split" in n for n in prec.notes) is said
