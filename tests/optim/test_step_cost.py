"""The step's cost model (docs/performance.md): what a GPU pays per optimizer step, counted on a CPU.

A GPU pays per dispatched op (a kernel launch) and per host sync; the CPU hides both. So these
tests count the aten ops that ``optimizer.step()`` and ``Precision.step`` dispatch (a
``TorchDispatchMode``) on the tiny Transformer with 2 and with 8 blocks (3.6x the parameters): the
count must not grow with the number of parameters, and no op may read data back to the host or
produce a data-dependent shape. Reads of torch's CPU step counters (``_get_value(step)`` of a
non-capturable torch AdamW; a host tensor, no device sync) are told apart from the others by
identity with the optimizer's state.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as mp
from mixprec.models import Transformer
from mixprec.optim import AdamW, MasterWeights
from mixprec.optim.inputs import StepInputs

SYNCING = {"nonzero", "bincount", "unique", "_unique2", "masked_select", "_local_scalar_dense"}
LAYOUTS = {
    "full": {"split_masters": False},
    "split": {"split_masters": True},
    "bf16": {"moments": "bf16"},
    "int8": {"moments": "int8"},
    "fp8": {"moments": "fp8"},
}


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops by name; remembers the storage of every tensor read by ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.reads: list[int] = []
        self.order: list[tuple[str, int | None]] = []     # (op, storage read by .item())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        read = None
        if name == "_local_scalar_dense":
            read = args[0].untyped_storage().data_ptr()
            self.reads.append(read)
        self.order.append((name, read))
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _step_counters(opt: torch.optim.Optimizer) -> set[int]:
    """Storages of the step counters in ``opt``'s state (the flat twin's, shared by views, too)."""
    out = set()
    inner = getattr(opt, "_inner", None)       # a master-weight optimizer's own torch optimizer
    states = list(opt.state.values()) + (list(inner.state.values()) if inner is not None else [])
    for st in states:
        if isinstance(st.get("step"), torch.Tensor):
            out.add(st["step"].untyped_storage().data_ptr())
    return out


def _syncs(counter: OpCounter, opt: torch.optim.Optimizer) -> dict[str, int]:
    steps = _step_counters(opt)
    out = {k: v for k, v in counter.ops.items() if k in SYNCING - {"_local_scalar_dense"}}
    reads = [r for r in counter.reads if r not in steps]
    if reads:
        out["_local_scalar_dense"] = len(reads)
    return out


def _model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer(num_layers=blocks, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16)
    return mp.Precision("bf16-true").setup_module(model)   # BF16 matrices, FP32 norms


def _backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)
    model(x, x)[1].backward()


def _count_step(blocks: int, layout: dict, masked: bool = False) -> tuple[OpCounter, torch.optim.Optimizer]:
    model = _model(blocks)
    opt = AdamW(model.parameters(), lr=1e-3, seed=0, **layout)
    inputs = StepInputs(found_inf=torch.zeros(())) if masked else None
    for i in range(2):                  # the first step builds the chunks
        _backward(model, i)
        opt.step(inputs=inputs)
        opt.zero_grad()
    _backward(model, 2)
    with OpCounter() as counter:
        opt.step(inputs=inputs)
    return counter, opt


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "found_inf"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_the_step_dispatches_a_fixed_number_of_ops_whatever_the_number_of_parameters(layout, masked):
    small, opt_small = _count_step(2, LAYOUTS[layout], masked)
    large, opt_large = _count_step(8, LAYOUTS[layout], masked)
    assert len(opt_large.state) > 3 * len(opt_small.state) - 8    # 100 vs 28 parameters
    assert large.total <= 1.2 * small.total, (small.total, large.total, large.ops - small.ops)
    assert _syncs(small, opt_small) == {} and _syncs(large, opt_large) == {}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_the_flat_step_is_bit_identical_to_the_per_master_step(layout):
    # The per-master step (mixprec.optim.master, still taken for a step in parts or with a missing
    # grad) is the reference: weights, masters and every state tensor equal bit for bit.
    def run(flat: bool):
        model = _model(2)
        opt = AdamW(model.parameters(), lr=1e-2, seed=1, **LAYOUTS[layout])
        opt._flat_capable = flat
        for i in range(4):
            _backward(model, i)
            opt.step()
            opt.zero_grad()
        return model, opt.state_dict()

    _assert_same_bits(*run(True), *run(False))


def _assert_same_bits(ma, sa, mb, sb) -> None:
    """Two (model, optimizer state dict) pairs hold the same bits: weights, masters, every state."""
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))
    for x, y in zip(sa["master_weights"]["tensors"], sb["master_weights"]["tensors"]):
        assert torch.equal(_bits(x), _bits(y))
    for k, st in sa["state"].items():
        for key, t in st.items():
            u = sb["state"][k][key]
            assert t.dtype == u.dtype and torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("skip_at", [0, 1], ids=["first-step", "later-step"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_a_step_skipped_on_the_device_leaves_what_a_step_not_taken_leaves(layout, skip_at):
    # found_inf > 0 at one step: the masked step (no host read after the first step) and the step
    # the host did not call give the same bits afterwards, also for the steps after it (counters,
    # rounding noise). A skipped first step leaves no state, as torch's.
    def run(on_device: bool):
        model = _model(2)
        opt = AdamW(model.parameters(), lr=1e-2, seed=1, **LAYOUTS[layout])
        for i in range(4):
            _backward(model, i)
            found = torch.tensor(1.0 if i == skip_at else 0.0)
            if on_device:
                opt.step(inputs=StepInputs(found_inf=found))
            elif i != skip_at:
                opt.step()
            opt.zero_grad()
            if i == skip_at and opt.moments not in ("int8", "fp8"):
                assert (len(opt.state) == 0) == (skip_at == 0)
        return model, opt.state_dict()

    _assert_same_bits(*run(True), *run(False))


def test_frozen_parameters_keep_the_flat_step_and_unfreezing_rebuilds_it():
    # Fine-tuning freezes params: they have no grad, torch skips them, the chunks leave them out.
    def run(flat: bool):
        model = _model(2)
        frozen = [model.wte.weight, model.blocks[0].attn.qkv.weight]
        for p in frozen:
            p.requires_grad_(False)
        opt = AdamW(model.parameters(), lr=1e-2)
        opt._flat_capable = flat
        counts = []
        for i in range(5):
            if i == 3:
                for p in frozen:
                    p.requires_grad_(True)
            _backward(model, i)
            with OpCounter() as counter:
                opt.step()
            counts.append(counter.total)
            opt.zero_grad()
        return model, opt, counts

    (ma, oa, ca), (mb, ob, cb) = run(True), run(False)
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))
    assert ca[2] < cb[2] / 3                    # flat while frozen (one chunk, not per parameter)
    # Unfrozen params start at step 0 while the others are at 3: they get chunks of their own
    # (a chunk shares one step counter), and the step stays flat.
    assert oa._flat_capable and ca[4] < cb[4] / 2
    assert len({c.group for c in oa._flat.chunks}) < len(oa._flat.chunks)


@pytest.mark.parametrize("layout", ["full", "split", "int8"], ids=str)
def test_the_step_holds_no_scratch_memory_between_steps(layout):
    # The flat chunks' FP32 scratch and full masters' FP32 grads live only around the step, as
    # the per-master step's did (the estimator counts them in the step phase only).
    model = _model(2)
    opt = AdamW(model.parameters(), lr=1e-3, **LAYOUTS[layout])
    for i in range(2):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    flat = opt._flat
    held = [t for t in flat._scratch + list(flat.pool.values()) + list(opt._grad_of.values())]
    assert held and all(t.untyped_storage().nbytes() == 0 for t in held)


def _precision_step(mode: str, blocks: int, clip: float | None,
                    make=lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)
                    ) -> tuple[OpCounter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(num_layers=blocks, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16)
    precision = mp.Precision(mode, device="cpu")
    model, opt = precision.setup(model, make)
    for i in range(3):
        with precision.autocast():
            g = torch.Generator().manual_seed(i)
            x = torch.randint(0, 64, (2, 16), generator=g)
            loss = model(x, x)[1]
        precision.backward(loss.float())
        if i < 2:
            precision.step(opt, clip_grad_norm=clip)
        else:
            with OpCounter() as counter:
                precision.step(opt, clip_grad_norm=clip)
        opt.zero_grad()
    return counter, opt


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_precision_step_of_bf16_true_has_a_fixed_cost_and_reads_nothing_on_the_host(clip):
    small, opt_small = _precision_step("bf16-true", 2, clip)
    large, opt_large = _precision_step("bf16-true", 8, clip)
    assert isinstance(opt_large, MasterWeights)
    assert large.total <= 1.2 * small.total, (small.total, large.total, large.ops - small.ops)
    for counter, opt in ((small, opt_small), (large, opt_large)):
        syncs = _syncs(counter, opt)
        # The skip is decided on the device and the flag stays there (read lazily, when asked).
        assert syncs == {}, syncs


FUSED = {
    "torch-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    # fit()'s AdamW on CUDA for modes without separate masters (Precision.make_optimizer)
    "mixprec-over-fused": lambda ps: AdamW(ps, lr=1e-3, fused=True),
}
# Precision.step's ops, counted at the third step (docs/performance.md, "The step's cost model"):
# torch's fused AdamW is one kernel (+ the step counters' add and, for the skip, sub); the loss
# scale of 16-mixed moves by torch's _amp_update_scale_ + clamp + reciprocal (+ a clone).
FUSED_OPS = {("16-mixed", None): 16, ("16-mixed", 1.0): 26, ("bf16-mixed", None): 22, ("bf16-mixed", 1.0): 32}


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("mode", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("kind", list(FUSED))
def test_precision_step_of_a_fused_adamw_has_a_fixed_cost_and_reads_nothing_on_the_host(kind, mode, clip):
    small, opt_small = _precision_step(mode, 2, clip, FUSED[kind])
    large, opt_large = _precision_step(mode, 8, clip, FUSED[kind])
    assert large.total == small.total, (small.total, large.total, large.ops - small.ops)
    for counter, opt in ((small, opt_small), (large, opt_large)):
        assert _syncs(counter, opt) == {}           # the skip on the device: no flag read
        assert counter.ops["_fused_adamw_"] == 1 and counter.ops["_foreach_sub_"] == 1
    if kind == "torch-fused":
        assert small.total <= FUSED_OPS[mode, clip], small.ops
    if mode == "16-mixed":
        assert small.ops["_amp_update_scale_"] == 1


def test_precision_step_of_16_mixed_with_masters_reads_nothing_and_keeps_the_scale_exact():
    # FP16 + FP32 masters: the skip and the loss scale's update both on the device; the host
    # state (scale, counters) read lazily is the eager one's, exactly.
    runs = {}
    for lazy in (True, False):
        torch.manual_seed(0)
        model = Transformer(num_layers=2, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16)
        precision = mp.Precision("16-mixed", device="cpu")
        model, opt = precision.setup(model, lambda ps: AdamW(ps, lr=1e-3))
        assert isinstance(opt, MasterWeights)
        precision.scaler.set_growth_interval(2)
        reads, taken = 0, []
        for i in range(7):
            with precision.autocast():
                x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
                loss = model(x, x)[1]
            if i in (2, 3):
                loss = loss * float("inf")               # two overflows: back off twice
            precision.backward(loss.float())
            if lazy:
                with OpCounter() as counter:
                    t = precision.step(opt)
                if i > 0:      # the first step replaces torch's initial step counter (a host read)
                    reads += _syncs(counter, opt).get("_local_scalar_dense", 0)
            else:
                t = precision.step(opt)
                bool(t)
                precision.scaler.resolve()
            taken.append(t)
            opt.zero_grad()
        if lazy:
            assert reads == 0
            assert precision.scaler.pending == 7
        runs[lazy] = ([bool(t) for t in taken], precision.scaler.get_scale(), precision.scaler.num_skipped_steps,
                      precision.scaler.last_step_skipped, precision.scaler.state_dict(),
                      [p.detach().clone() for p in model.parameters()])
        assert precision.scaler.pending == 0
    (ta, sa, na, la, da, pa), (tb, sb, nb, lb, db, pb) = runs[True], runs[False]
    assert ta == tb == [True, True, False, False, True, True, True]
    assert (sa, na, la, da) == (sb, nb, lb, db)
    assert na == 2 and da["num_overflows"] == 2
    assert all(torch.equal(a, b) for a, b in zip(pa, pb))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _train_conv(split: bool, *, drop_grad_at: int | None = None) -> tuple[nn.Module, MasterWeights]:
    model = _conv_net().to(memory_format=torch.channels_last)
    with torch.no_grad():      # exact ties: 1 + 2**-8 is half way between two BF16 values
        model[0].weight.fill_(1.0 + 2.0**-8).mul_(torch.sign(torch.randn_like(model[0].weight)))
    opt = MasterWeights(torch.optim.AdamW, model.parameters(), param_dtype=torch.bfloat16, split=split, lr=1e-2)
    model.to(memory_format=torch.channels_last)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(2, 3, 8, 8, generator=g).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        model(x).float().square().mean().backward()
        if step == drop_grad_at:
            model[3].bias.grad = None           # this step is per master (torch skips that bias)
        opt.step()
        opt.zero_grad()
    return model, opt


def test_channels_last_conv_net_steps_split_masters_bit_identical_to_full_masters():
    # resnet18 with channels_last in bf16-true crashed in split.join_many (a strided view(-1)).
    model = _conv_net().to(memory_format=torch.channels_last)
    with torch.no_grad():
        model[0].weight.fill_(1.0 + 2.0**-8)
    exact = model[0].weight.detach().clone()
    opt = MasterWeights(torch.optim.AdamW, model.parameters(), param_dtype=torch.bfloat16, split=True, lr=1e-2)
    assert torch.equal(opt.master_of(model[0].weight), exact)        # every element is a tie
    for drop in (None, 1):
        (ma, oa), (mb, ob) = _train_conv(True, drop_grad_at=drop), _train_conv(False, drop_grad_at=drop)
        assert oa._flat_capable and ob._flat_capable   # flat again after the per-master step
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            assert torch.equal(_bits(pa), _bits(pb))
        for qa, qb in zip(oa.masters, ob.masters):
            assert torch.equal(_bits(qa), _bits(qb))
        sa, sb = oa.state_dict(), ob.state_dict()
        for k in sa["state"]:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(sa["state"][k][key], sb["state"][k][key])


def test_the_flat_step_equals_the_per_master_step_and_checkpoints_cross_between_them():
    # The per-master step (a step issued in parts, as the overlap engine does) and the flat step
    # give the same bits, and a state saved by one continues bitwise in the other.
    from mixprec.optim.parts import step_in_parts

    def run(parts: bool, steps: int, opt=None, model=None):
        if model is None:
            model = _model(2)
            opt = AdamW(model.parameters(), lr=1e-3)
        for i in range(steps):
            _backward(model, i)
            if parts:
                step_in_parts(opt, [[p] for p in model.parameters()])
            else:
                opt.step()
            opt.zero_grad()
        return model, opt

    (ma, oa), (mb, ob) = run(False, 3), run(True, 3)
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))
    # mix them: two flat steps after the per-master ones, and a round trip through state_dict
    run(False, 2, ob, mb)
    fresh = _model(2)
    fresh.load_state_dict(ma.state_dict())
    fresh_opt = AdamW(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(oa.state_dict())
    run(True, 2, fresh_opt, fresh)
    for pa, pb in zip(fresh.parameters(), mb.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))
    steps = {float(st["step"]) for st in fresh_opt.state_dict()["state"].values()}
    assert steps == {5.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_the_step_makes_no_host_sync_on_cuda(layout):
    torch.manual_seed(0)
    model = Transformer(num_layers=2, d_model=32, num_heads=2, vocab_size=64, max_seq_len=16).cuda()
    model = mp.Precision("bf16-true", device="cuda").setup_module(model)
    opt = AdamW(model.parameters(), lr=1e-3, seed=0, fused=None, **LAYOUTS[layout])
    x = torch.randint(0, 64, (2, 16), device="cuda")
    for i in range(3):
        model(x, x)[1].backward()
        if i == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
