"""mixprec.Precision: the one object that makes every precision decision, for fit() and for a
hand-written loop alike."""
import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import CheckpointError, ConfigError
from mixprec.optim import MasterWeights
from mixprec.precision.plugins import Fsdp2Plugin

MODES = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return mp.models.Transformer(num_layers=2, d_model=32, num_heads=4, max_seq_len=16, dropout=0.0)


def _batches(n: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g))
            for _ in range(n)]


def _hand_loop(mode: str, batches) -> nn.Module:
    """The README's hand-written loop."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    precision = mp.Precision(mode)
    model, optimizer = precision.setup(model, optimizer)
    for x, y in batches:
        with precision.autocast():
            _, loss = model(x, y)
        precision.backward(loss)
        precision.step(optimizer, clip_grad_norm=1.0)
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("mode", MODES)
def test_hand_written_loop_and_fit_give_bit_identical_weights(mode, tmp_path):
    # Both on the CPU (the hand loop's model stays where it was built; fit() would pick CUDA on a
    # GPU machine): bit-identity is a property of the same kernels on one device, and a GPU's
    # attention backward may accumulate in a different order from one call to the next.
    batches = _batches()
    by_hand = _hand_loop(mode, batches)
    model = _model()
    mp.fit(model, batches, mixed_precision=mode, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
           strategy=mp.SingleDeviceStrategy("cpu"),
           max_steps=len(batches), warmup_steps=0, min_lr_ratio=1.0, clip_grad_norm=1.0,
           run_dir=str(tmp_path / "run"), progress=False, audit=False, ckpt_interval=0, seed=0)
    a, b = by_hand.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"{mode}: {k} differs"


def test_hand_loop_moves_weights_in_every_mode():
    before = _model().state_dict()
    for mode in MODES:
        after = _hand_loop(mode, _batches(2)).state_dict()
        assert not torch.equal(before["blocks.0.mlp.fc.weight"].float(),
                               after["blocks.0.mlp.fc.weight"].float()), mode


def test_true_modes_store_16_bit_params_with_fp32_masters_and_fp32_norms():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mp.Precision("bf16-true").setup(model, opt)
    assert isinstance(opt, MasterWeights)
    assert model.blocks[0].mlp.fc.weight.dtype == torch.bfloat16
    assert model.blocks[0].ln1.weight.dtype == torch.float32
    assert opt.master_of(model.blocks[0].mlp.fc.weight).dtype == torch.float32


def test_setup_is_idempotent_and_refuses_another_mode():
    model = _model()
    p = mp.Precision("bf16-true")
    model, opt = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    again, opt2 = p.setup(model, opt)
    assert again is model and opt2 is opt
    with pytest.raises(ConfigError, match="already set up for precision .*build a new model"):
        mp.Precision("16-true").setup(model)


def test_setup_refuses_an_optimizer_that_has_stepped():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, loss = model(*_batches(1)[0])
    loss.backward()
    opt.step()
    with pytest.raises(ConfigError, match="already stepped"):
        mp.Precision("bf16-true").setup(model, opt)


def test_fp16_params_optimizer_with_auto_precision_builds_16_true_and_says_so():
    model = _model()
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    p = mp.Precision(True, optimizer=opt)          # decided when the recipe is built
    assert p.name == "16-true" and p.recipe.keeps_masters and p.recipe.scales_loss
    assert any("fp16_params=True" in n for n in p.notes)
    p.setup(model, opt)
    assert p.name == "16-true"


def test_auto_precision_built_without_the_fp16_params_optimizer_refuses_it_at_setup():
    """No mode change after construction: the mode `auto` resolved to stays, the optimizer is refused."""
    model = _model()
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    p = mp.Precision(True, device="cpu")
    before = p.recipe
    with pytest.raises(ConfigError, match="Precision\\('auto', optimizer=optimizer\\)") as e:
        p.setup(model, opt)
    assert "\n" not in str(e.value) and p.recipe is before


def test_fp16_params_optimizer_conflicting_with_an_explicit_mode_is_refused():
    model = _model()
    opt = mp.optim.AdamW(model.parameters(), lr=1e-3, fp16_params=True)
    with pytest.raises(ConfigError, match="use precision '16-true'"):
        mp.Precision("bf16-mixed").setup(model, opt)


def test_step_skips_a_non_finite_step_and_backs_off_the_scale():
    model = nn.Sequential(nn.Linear(4, 4))
    p = mp.Precision("16-mixed")
    model, opt = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model[0].weight.detach().clone()
    scale = p.scaler.get_scale()
    loss = model(torch.randn(2, 4)).sum() * float("inf")
    p.backward(loss)
    assert p.step(opt) is False
    assert p.scaler.last_step_skipped and p.scaler.num_skipped_steps == 1 and p.scaler.get_scale() == scale / 2
    assert torch.equal(model[0].weight, before)


def test_state_dict_round_trip_and_mismatch():
    p = mp.Precision("16-mixed", init_scale=1024.0)
    q = mp.Precision("16-mixed")
    q.load_state_dict(p.state_dict())
    assert q.scaler.get_scale() == 1024.0
    with pytest.raises(CheckpointError, match="bf16-mixed"):
        mp.Precision("16-mixed").load_state_dict(mp.Precision("bf16-mixed").state_dict())


def test_decisions_per_mode():
    rows = {m: mp.Precision(m) for m in ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "fp8-rowwise")}
    assert [m for m, p in rows.items() if p.recipe.keeps_masters] == ["bf16-true"]
    assert [m for m, p in rows.items() if p.recipe.scales_loss] == ["16-mixed"]
    assert [m for m, p in rows.items() if p.recipe.autocasts] == ["bf16-mixed", "16-mixed", "bf16-true", "fp8-rowwise"]
    assert rows["fp8-rowwise"].recipe.fp8.scaling == "rowwise"
    assert Fsdp2Plugin(rows["bf16-mixed"].recipe).mixed_precision().param_dtype == torch.bfloat16
    assert Fsdp2Plugin(rows["32-true"].recipe).island_policy() is None
    nomasters = mp.Precision(mp.get_policy("bf16-true").replace(master_weights=False))
    assert nomasters.recipe.loses_small_updates and Fsdp2Plugin(nomasters.recipe).casts_before_sharding
    assert not Fsdp2Plugin(rows["bf16-true"].recipe).casts_before_sharding  # FP32 shards are the masters


def test_fp8_mode_swaps_linears_and_reports():
    model = _model()
    p = mp.Precision("fp8-tensorwise")
    p.setup(model)
    from mixprec.formats import Fp8Linear
    assert isinstance(model.blocks[0].mlp.fc, Fp8Linear)
    assert p.layers.fp8_report is not None and p.layers.fp8_report.converted


def test_step_taken_reads_the_flag_only_when_asked_and_acts_as_a_bool():
    import mixprec as mp
    from mixprec.optim import AdamW
    from mixprec.precision import StepTaken
    model = nn.Linear(4, 4)
    p = mp.Precision("bf16-true", device="cpu")
    model, opt = p.setup(model, lambda ps: AdamW(ps, lr=1e-2))
    results = []
    for bad in (False, True):
        with p.autocast():
            out = model(torch.ones(2, 4))
        p.backward(out.float().sum() * (float("inf") if bad else 1.0))
        t = p.step(opt)
        assert isinstance(t, StepTaken) and not t.known       # nothing read yet
        results.append(t)
        opt.zero_grad()
    assert p.scaler.pending == 2
    assert results[1] == False and not results[1] and results[0] == True and results[0]  # noqa: E712
    assert results[0].known and p.scaler.pending == 0            # one read told both
    assert p.scaler.num_skipped_steps == 1 and p.scaler.last_step_skipped
