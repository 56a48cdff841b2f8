"""8-bit Adam moments (mixprec.optim.moments): block-wise int8 and FP8 E4M3 / E5M2 with range expansion.

Numerics against FP32 with stated tolerances: one encode/decode keeps the first moment within
2.5 % (relative L2) and never turns a positive second moment into zero; a short training run
ends within 2 % of the FP32-moment loss. Checkpoints hold the 8-bit codes and resume exactly.
"""
from __future__ import annotations

import io

import pytest
import torch

import mixprec as mp
from mixprec.optim import AdamW
from mixprec.optim import moments as M


def _train(model, opt, steps) -> None:
    """Plain steps of a language model over ``steps`` (each a (B, T + 1) token batch)."""
    for x in steps:
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-e5m2"])
def test_one_round_trip_keeps_the_moments_close_and_v_positive(fmt):
    g = torch.Generator().manual_seed(0)
    p = torch.zeros(3000)
    st = [M.new_state(p, fmt)]
    m = torch.randn(3000, generator=g) * 1e-3
    v = (torch.randn(3000, generator=g) * 1e-3) ** 2 * torch.logspace(-6, 6, 3000)  # 12 decades
    v[::97] = 0.0
    M.encode_(st, "exp_avg", [m], fmt, g)
    M.encode_(st, "exp_avg_sq", [v], fmt, g)
    m2, v2 = torch.empty_like(m), torch.empty_like(v)
    M.decode_(st, "exp_avg", [m2], fmt)
    M.decode_(st, "exp_avg_sq", [v2], fmt)
    assert ((m2 - m).norm() / m.norm()).item() < 0.025
    assert torch.equal(v2 == 0, v == 0)                   # zero stays zero, positive stays positive
    assert st[0]["exp_avg"].element_size() == 1 and st[0]["exp_avg_sq"].element_size() == 1


def test_int8_rounding_is_unbiased():
    g = torch.Generator().manual_seed(1)
    p = torch.zeros(256)
    x = torch.full((256,), 0.3)
    x[0] = 1.0                                            # the block's scale: codes of 1/127
    out = torch.zeros(256)
    acc = torch.zeros(256)
    for _ in range(400):
        st = [M.new_state(p, "int8")]
        M.encode_(st, "exp_avg", [x], "int8", g)
        M.decode_(st, "exp_avg", [out], "int8")
        acc += out
    assert (acc / 400)[1:].mean().item() == pytest.approx(0.3, rel=2e-3)


def _run(moments: str, steps: int = 60, split: bool | None = None, mode: str = "32-true"):
    torch.manual_seed(0)
    model = mp.models.Transformer(num_layers=1, d_model=32, num_heads=2, max_seq_len=16)
    model = mp.Precision(mode).setup_module(model)
    opt = AdamW(model.parameters(), lr=3e-3, moments=moments, seed=2, split_masters=split)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 64, (32, 17), generator=g)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 32, (8,), generator=g)
        _, loss = model(data[idx, :-1], data[idx, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-e5m2"])
def test_training_with_8bit_moments_tracks_fp32_moments(fmt):
    ref = _run("fp32")[2]
    got = _run(fmt)[2]
    tail = lambda xs: sum(xs[-10:]) / 10  # noqa: E731
    assert got[-1] < got[0] - 0.5                          # it learns
    assert tail(got) == pytest.approx(tail(ref), rel=0.02)


def test_8bit_checkpoint_holds_codes_and_resumes_exactly():
    model, opt, _ = _run("int8", steps=5)
    sd = opt.state_dict()
    st = next(iter(sd["state"].values()))
    assert st["exp_avg"].dtype == torch.int8 and st["exp_avg_sq"].dtype == torch.uint8
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": sd}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    twin = mp.models.Transformer(num_layers=1, d_model=32, num_heads=2, max_seq_len=16)
    twin.load_state_dict(saved["model"])
    opt2 = AdamW(twin.parameters(), lr=3e-3, moments="int8", seed=99)
    opt2.load_state_dict(saved["opt"])
    x = torch.randint(0, 64, (4, 16))
    for m_, o_ in ((model, opt), (twin, opt2)):
        _, loss = m_(x, x)
        loss.backward()
        o_.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_split_masters_with_8bit_moments_are_bit_identical_to_full_masters(fmt):
    a = _run(fmt, steps=4, split=False, mode="bf16-true")
    b = _run(fmt, steps=4, split=True, mode="bf16-true")
    assert b[1].split and not a[1].split
    for p, q in zip(a[0].parameters(), b[0].parameters()):
        assert torch.equal(p, q)


def test_unknown_moments_format_is_refused():
    with pytest.raises(mp.errors.ConfigError, match="moments must be one of"):
        AdamW([torch.nn.Parameter(torch.ones(2))], moments="int4")


def test_8bit_moments_cost_at_most_2_004_bytes_per_param_with_16_bit_scales():
    # int8: 1 + 1 byte of codes, one BF16 scale per 1024-element block and moment
    assert M.state_bytes("int8") == pytest.approx(2 + 2 * 2 / 1024) and M.state_bytes("int8") < 2.004
    st = M.new_state(torch.zeros(3000), "int8")
    assert st["exp_avg_scale"].dtype == torch.bfloat16 and st["exp_avg_scale"].shape == (3,)
    fp8 = M.new_state(torch.zeros(3000), "fp8-e5m2")
    assert fp8["exp_avg"].dtype == torch.float8_e5m2 and fp8["exp_avg_scale"].shape == (12, 2)


def test_bf16_block_scale_is_rounded_up_so_no_code_overflows():
    g = torch.Generator().manual_seed(4)
    x = torch.full((1024,), 0.5)
    x[7] = 1.0 + 2.0 ** -10               # not a BF16 value: rounding the scale to nearest would clip it
    st = [M.new_state(x, "int8")]
    M.encode_(st, "exp_avg", [x], "int8", g)
    out = torch.empty_like(x)
    M.decode_(st, "exp_avg", [out], "int8")
    assert st[0]["exp_avg_scale"].float().item() >= x[7].item()
    assert out[7].item() == pytest.approx(x[7].item(), rel=1 / 127)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-e5m2"])
def test_loaded_8bit_moments_stay_8_bit(fmt):
    # torch's Optimizer.load_state_dict casts every state tensor to the param dtype (FP32): the
    # codes came back as 4-byte floats before the fix.
    model, opt, _ = _run(fmt, steps=2)
    twin = AdamW(model.parameters(), lr=3e-3, moments=fmt, seed=2)
    twin.load_state_dict(opt.state_dict())
    lay = M.LAYOUTS[fmt]
    for st in twin.state_dict()["state"].values():
        if st["exp_avg"].dim() == 1:                       # vectors keep FP32 moments (M.quantizes)
            assert st["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in st
            continue
        assert (st["exp_avg"].dtype, st["exp_avg_sq"].dtype) == lay.codes
        assert st["exp_avg_scale"].dtype == torch.bfloat16


def test_checkpoint_of_the_fp32_scale_layout_is_converted_on_load(monkeypatch):
    monkeypatch.setitem(M.LAYOUTS, "int8", M._LEGACY["int8"])      # save in the earlier layout
    model, opt, _ = _run("int8", steps=3)
    sd = opt.state_dict()
    old = {i: st for i, st in sd["state"].items() if "exp_avg_scale" in st}
    assert next(iter(old.values()))["exp_avg_scale"].dtype == torch.float32
    wide_old = {}
    for i, st in old.items():
        w = torch.empty(st["exp_avg"].shape)
        M.decode_([st], "exp_avg", [w], "int8", layout=M._LEGACY["int8"])
        wide_old[i] = w
    monkeypatch.undo()
    twin = AdamW(model.parameters(), lr=3e-3, moments="int8", seed=2)
    twin.load_state_dict(sd)
    for i, st in twin.state_dict()["state"].items():
        if i not in old:
            continue
        assert st["exp_avg_scale"].dtype == torch.bfloat16 and st["exp_avg"].dtype == torch.int8
        w = torch.empty(st["exp_avg"].shape)
        M.decode_([st], "exp_avg", [w], "int8")
        scale = wide_old[i].abs().max().item()
        assert (w - wide_old[i]).abs().max().item() <= 2 * scale / 127 + 1e-12   # one re-rounding


def test_fp8_checkpoint_into_an_e5m2_optimizer_is_refused():
    model, opt, _ = _run("fp8", steps=1)
    twin = AdamW(model.parameters(), lr=3e-3, moments="fp8-e5m2")
    with pytest.raises(mp.errors.CheckpointError, match="moments=fp8-e5m2"):
        twin.load_state_dict(opt.state_dict())


def test_fp32_moment_checkpoint_loads_into_8bit_moments():
    model, opt, _ = _run("fp32", steps=2)
    twin = AdamW(model.parameters(), lr=3e-3, moments="int8", seed=2)
    twin.load_state_dict(opt.state_dict())
    st = next(iter(twin.state_dict()["state"].values()))
    assert st["exp_avg"].dtype == torch.int8 and st["exp_avg_sq"].dtype == torch.uint8


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_blocks_stay_inside_rows_so_a_dim0_slice_of_the_state_is_the_slice_s_state(fmt):
    # FSDP2 shards dim 0 into whole rows: the rows' codes and scales alone decode those rows.
    g = torch.Generator().manual_seed(5)
    p = torch.zeros(7, 1500)                                # rows of 1500: two blocks each (int8), six (fp8)
    m = torch.randn(7, 1500, generator=g) * torch.logspace(-3, 0, 7).unsqueeze(1)
    st = M.new_state(p, fmt)
    M.encode_([st], "exp_avg", [m], fmt, g)
    assert st["exp_avg_scale"].shape[:2] == (7, (1500 + M.LAYOUTS[fmt].block - 1) // M.LAYOUTS[fmt].block)
    full = torch.empty_like(m)
    M.decode_([st], "exp_avg", [full], fmt)
    for a, b in ((0, 4), (4, 7), (3, 3)):
        part = {k: v[a:b] for k, v in st.items()}
        out = torch.empty(b - a, 1500)
        M.decode_([part], "exp_avg", [out], fmt)
        assert torch.equal(out, full[a:b])


def test_vectors_keep_fp32_moments_and_short_rows_are_one_block():
    assert not M.quantizes((512,), "int8") and not M.quantizes((512, 8), "int8")
    assert M.quantizes((8192, 512), "int8") and not M.quantizes((8192, 512), "bf16")
    st = M.new_state(torch.zeros(8192, 512), "int8")            # a row of 512 < 1024: one block
    assert st["exp_avg_scale"].shape == (8192, 1)
    assert M.state_bytes("int8", row=512) == pytest.approx(2 + 2 * 2 / 512)


def test_checkpoint_of_the_flat_block_layout_is_converted_on_load(monkeypatch):
    monkeypatch.setitem(M.LAYOUTS, "int8", M._FLAT["int8"])        # blocks over the flattened tensor
    model, opt, _ = _run("int8", steps=3)
    sd = opt.state_dict()
    flat = {i: st for i, st in sd["state"].items() if "exp_avg_scale" in st}
    wide = {}
    for i, st in flat.items():
        assert st["exp_avg_scale"].dim() == 1
        wide[i] = torch.empty(st["exp_avg"].shape)
        M.decode_([st], "exp_avg", [wide[i]], "int8", layout=M._FLAT["int8"])
    monkeypatch.undo()
    twin = AdamW(model.parameters(), lr=3e-3, moments="int8", seed=2)
    twin.load_state_dict(sd)
    for i, st in twin.state_dict()["state"].items():
        if i not in flat:
            continue
        assert st["exp_avg_scale"].shape == (st["exp_avg"].shape[0], 1)
        w = torch.empty(st["exp_avg"].shape)
        M.decode_([st], "exp_avg", [w], "int8")
        assert (w - wide[i]).abs().max().item() <= 2 * wide[i].abs().max().item() / 127 + 1e-12


def test_a_name_keyed_sharded_state_loads_in_one_process_with_tied_weights():
    """FSDP2's gathered optimizer state is keyed by parameter name (the first name of a tied
    weight, ``wte.weight``); FSDPStrategy in one process maps it onto the optimizer's slots, so a
    checkpoint saved at world size 2 resumes at 1 (found by resuming a tiny-model fsdp run)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from mixprec.optim.adamw import sharded_adamw
    from mixprec.strategies import FSDPStrategy

    def build():
        torch.manual_seed(0)
        model = mp.models.Transformer(num_layers=1, d_model=32, num_heads=2, max_seq_len=16)
        return model, sharded_adamw(model.parameters(), moments="int8", lr=3e-3, seed=1)

    model, opt = build()
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    named = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert "wte.weight" in named["state"]
    twin, topt = build()
    FSDPStrategy("32-true").load_optimizer_state_dict(twin, topt, named)
    for a, b in zip(opt.state_dict()["state"].values(), topt.state_dict()["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_int8_moments_resume_bit_exact_when_the_optimizer_is_built_after_another_seed():
    """Before: the rounding seed was drawn from the global RNG when the optimizer was built and
    not saved, so a process that built it after another ``torch.manual_seed`` rounded with other
    noise and 4 + 4 steps differed from 8. The seed now travels in the state dict."""
    def build(global_seed: int):
        torch.manual_seed(0)
        model = mp.models.Transformer(num_layers=1, d_model=32, num_heads=2, max_seq_len=16)
        torch.manual_seed(global_seed)                     # the seed is drawn from here (seed=None)
        return model, AdamW(model.parameters(), lr=3e-3, moments="int8")

    data = torch.randint(0, 64, (8, 4, 17), generator=torch.Generator().manual_seed(3))

    straight, opt = build(1)
    _train(straight, opt, data)
    first, opt_a = build(1)
    _train(first, opt_a, data[:4])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed, opt_b = build(7)                               # another process, another seed
    resumed.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    _train(resumed, opt_b, data[4:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert "sr_seed" not in opt_b.param_groups[0]          # the groups stay as torch's
    # A state dict saved before the seed travelled still loads (this optimizer's seed is kept).
    old = opt_a.state_dict()
    old["param_groups"] = [{k: v for k, v in g.items() if k != "sr_seed"} for g in old["param_groups"]]
    _, opt_c = build(7)
    kept = opt_c.state_dict()["param_groups"][0]["sr_seed"]
    opt_c.load_state_dict(old)
    assert opt_c.state_dict()["param_groups"][0]["sr_seed"] == kept


@pytest.mark.parametrize("moments", ["int8", "fp8"])
def test_8bit_moments_of_split_masters_stay_8bit_through_a_resume_and_continue_bit_exact(moments):
    """Before: under bf16-true (split masters, held empty between steps) the loaded state was
    taken for a vector's and widened to FP32, so a hand-loop or ``mixprec train --resume`` run
    continued with FP32 moments and 3 + 3 steps differed from 6."""
    def build():
        torch.manual_seed(0)
        model = mp.Precision("bf16-true").setup_module(
            mp.models.Transformer(num_layers=1, d_model=64, num_heads=2, max_seq_len=16))
        return model, AdamW(model.parameters(), lr=3e-3, moments=moments, seed=5)

    data = torch.randint(0, 64, (6, 4, 17), generator=torch.Generator().manual_seed(3))

    straight, opt = build()
    _train(straight, opt, data)
    first, opt_a = build()
    _train(first, opt_a, data[:3])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed, opt_b = build()
    resumed.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    states = list(opt_b.state_dict()["state"].values())
    matrices = [st for st in states if "exp_avg_scale" in st]          # 8-bit codes and scales
    assert matrices and all(st["exp_avg"].dtype != torch.float32 for st in matrices)
    assert len(matrices) == sum("exp_avg_scale" in st for st in opt_a.state_dict()["state"].values())
    _train(resumed, opt_b, data[3:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
