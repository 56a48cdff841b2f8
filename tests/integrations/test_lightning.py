"""mixprec's Lightning plugin and callback with a real ``lightning.Trainer`` and ``Fabric`` on CPU.

Parity: the plugin delegates every precision decision to ``mixprec.Precision``, and Lightning's
automatic optimization does the same operations in the same order as the hand loop (forward and
loss under ``Precision.autocast``, scaled backward, ``Precision.step``), so the final weights are
compared bit for bit.
"""
import copy
import logging

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

import mixprec as mp  # noqa: E402
from mixprec.errors import ConfigError  # noqa: E402
from mixprec.runs.metrics import read_events, read_numerics  # noqa: E402
from mixprec.integrations.lightning import (MixprecCallback, MixprecFabricPrecision,  # noqa: E402
                                            MixprecPrecision)

STEPS = 4
BATCH = 8


@pytest.fixture(autouse=True)
def _quiet_lightning():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 16))


def make_data(n_batches: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * BATCH, 16, generator=g)
    y = torch.randn(n_batches * BATCH, 16, generator=g)
    return x, y


def loader(x, y):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def loss_of(net, x, y):
    return nn.functional.mse_loss(net(x).float(), y)


class Module(L.LightningModule):
    def __init__(self, net: nn.Module, lr: float = 1e-2, scheduler: bool = False) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.scheduler = scheduler

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.net, *batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(plugin, steps: int = STEPS, callbacks=(), **kw):
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[plugin],
                     callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def hand_loop(mode, net, x, y, *, clip=None, **options):
    precision = mp.Precision(mode, **options)
    net, opt = precision.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for xb, yb in loader(x, y):
        with precision.autocast():
            loss = loss_of(net, xb, yb)
        precision.backward(loss)
        precision.step(opt, clip_grad_norm=clip)
        opt.zero_grad()
    return net, precision


MODES = [("bf16-true", {}), ("16-mixed", {"init_scale": 2.0 ** 8, "growth_interval": 1}),
         ("fp8-tensorwise", {}), ("bf16-mixed", {"overrides": {"*3": "fp32"}})]


@pytest.mark.parametrize("mode,options", MODES, ids=[m for m, _ in MODES])
def test_lightning_trainer_gives_the_hand_loops_weights_bit_for_bit(mode, options):
    x, y = make_data()
    ref, ref_precision = hand_loop(mode, make_net(), x, y, clip=1.0, **options)
    plugin = MixprecPrecision(mode, **options)
    module = Module(make_net())
    trainer(plugin, gradient_clip_val=1.0).fit(module, loader(x, y))
    got, want = module.net.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    assert plugin.mixprec.scaler.get_scale() == ref_precision.scaler.get_scale()
    assert list(plugin.mixprec.layers.formats.values()) == list(ref_precision.layers.formats.values())


def test_gradient_accumulation_matches_the_hand_loop_bit_for_bit():
    # 16-mixed: every micro-batch's loss is scaled; the step unscales once per accumulated step.
    x, y = make_data()
    precision = mp.Precision("16-mixed", init_scale=2.0 ** 8, growth_interval=1)
    ref = make_net()
    ref, opt = precision.setup(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    batches = list(loader(x, y))
    for i in range(0, len(batches), 2):
        for xb, yb in batches[i:i + 2]:
            with precision.autocast():
                loss = loss_of(ref, xb, yb) / 2
            precision.backward(loss)
        precision.step(opt)
        opt.zero_grad()
    plugin = MixprecPrecision("16-mixed", init_scale=2.0 ** 8, growth_interval=1)
    module = Module(make_net())
    trainer(plugin, steps=STEPS // 2, accumulate_grad_batches=2).fit(module, loader(x, y))
    for name, want in ref.state_dict().items():
        assert torch.equal(module.net.state_dict()[name], want), name
    assert plugin.mixprec.scaler.get_scale() == precision.scaler.get_scale() == 2.0 ** 10


def test_bf16_true_keeps_norms_fp32_and_steps_fp32_masters():
    x, y = make_data()
    plugin = MixprecPrecision("bf16-true")
    module = Module(make_net())
    t = trainer(plugin)
    t.fit(module, loader(x, y))
    assert module.net[0].weight.dtype == torch.bfloat16
    assert module.net[1].weight.dtype == torch.float32          # LayerNorm stays FP32
    opt = t.optimizers[0]
    assert isinstance(opt, mp.optim.MasterWeights)
    assert all(m.dtype == torch.float32 for m in opt.masters)


def test_fp8_mode_swaps_linears_to_fp8():
    x, y = make_data()
    plugin = MixprecPrecision("fp8-rowwise")
    module = Module(make_net())
    trainer(plugin, steps=2).fit(module, loader(x, y))
    assert any(f.startswith("fp8-") for f in plugin.mixprec.layers.formats.values())
    assert type(module.net[0]).__name__ == "Fp8Linear"


def poison(net: nn.Module, layer: int, bad_x: torch.Tensor) -> None:
    """Hooks that write inf into ``net[layer]``'s output whenever the batch is ``bad_x`` (so the
    replay of the skipped step sees it too)."""
    seen = {"bad": False}

    def watch(module, args):
        x = args[0]
        seen["bad"] = x.shape == bad_x.shape and torch.equal(x.float(), bad_x.float())

    def inject(module, args, out):
        if seen["bad"]:
            out = out.clone()
            out[0, 0] = float("inf")
            return out

    net.register_forward_pre_hook(watch)
    net[layer].register_forward_hook(inject)


@pytest.mark.parametrize("mode", ["bf16-true", "fp8-tensorwise"])
def test_a_skipped_step_is_traced_to_its_layer_and_the_scheduler_holds(mode, capsys, tmp_path):
    x, y = make_data()
    net = make_net()
    poison(net, 3, x[2 * BATCH:3 * BATCH])                     # the third step's batch
    plugin = MixprecPrecision(mode)
    callback = MixprecCallback(run_dir=tmp_path / "run")
    module = Module(net, scheduler=True)
    t = trainer(plugin, callbacks=[callback])
    t.fit(module, loader(x, y))
    assert plugin.mixprec.scaler.num_skipped_steps == 1
    (event,) = callback.nonfinite
    assert event.module == "net.3" and event.kind == "inf" and event.direction == "forward"
    assert "step 3 skipped: inf first at net.3" in capsys.readouterr().err
    sched = t.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == STEPS - 1                       # the skipped step did not count
    records = read_events(tmp_path / "run")
    assert any(r["kind"] == "skip" and r.get("module") == "net.3" for r in records)


def test_the_callback_samples_per_layer_numerics_into_the_run_folder(tmp_path):
    x, y = make_data()
    callback = MixprecCallback(run_dir=tmp_path / "run", monitor_every=2, audit=False)
    trainer(MixprecPrecision("bf16-true"), callbacks=[callback]).fit(Module(make_net()), loader(x, y))
    rows = read_numerics(tmp_path / "run")
    assert {r["step"] for r in rows} == {2, 4}
    assert {r["kind"] for r in rows} == {"act", "grad", "update"}
    assert {r["module"] for r in rows} >= {"net.0", "net.3", "net.5"}


def test_checkpoint_saved_and_resumed_by_lightning_continues_exactly(tmp_path):
    # 16-true: FP16 parameters with FP32 masters and a growing loss scale, all in the checkpoint.
    x, y = make_data(2)            # two steps per epoch; the checkpoint is taken after epoch 1
    opts = {"init_scale": 2.0 ** 8, "growth_interval": 1}
    straight = Module(make_net(), scheduler=True)
    p_straight = MixprecPrecision("16-true", **opts)
    trainer(p_straight, steps=-1, max_epochs=2).fit(straight, loader(x, y))

    first = Module(make_net(), scheduler=True)
    t1 = trainer(MixprecPrecision("16-true", **opts), steps=-1, max_epochs=1)
    t1.fit(first, loader(x, y))
    ckpt = tmp_path / "epoch1.ckpt"
    t1.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["MixprecPrecision"]["scaler"]["scale"] == 2.0 ** 10
    assert "master_weights" in saved["optimizer_states"][0]

    resumed = Module(make_net(seed=5), scheduler=True)         # other weights: all come from the file
    p_resumed = MixprecPrecision("16-true", **opts)
    trainer(p_resumed, steps=-1, max_epochs=2).fit(resumed, loader(x, y), ckpt_path=ckpt)
    for name, want in straight.net.state_dict().items():
        assert torch.equal(resumed.net.state_dict()[name], want), name
    assert p_resumed.mixprec.scaler.get_scale() == p_straight.mixprec.scaler.get_scale() == 2.0 ** 12


def test_fabric_gives_the_hand_loops_weights_bit_for_bit():
    x, y = make_data()
    precision = mp.Precision("bf16-true")
    ref = make_net()
    ref, opt = precision.setup(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    for xb, yb in loader(x, y):
        with precision.autocast():
            out = precision.convert_output(ref(xb))
        precision.backward(nn.functional.mse_loss(out.float(), yb))
        precision.step(opt, clip_grad_norm=1.0)
        opt.zero_grad()

    plugin = MixprecFabricPrecision("bf16-true", clip_grad_norm=1.0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    model, optimizer = fabric.setup(*plugin.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2)))
    for xb, yb in loader(x, y):
        fabric.backward(nn.functional.mse_loss(model(xb).float(), yb))
        assert optimizer.step() is True                        # taken (False: skipped)
        optimizer.zero_grad()
    for name, want in ref.state_dict().items():
        assert torch.equal(net.state_dict()[name], want), name


def _fabric_hand_loop(mode, *, sched=False, **options):
    x, y = make_data()
    precision = mp.Precision(mode, **options)
    ref = make_net()
    ref, opt = precision.setup(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if sched else None
    for xb, yb in loader(x, y):
        with precision.autocast():
            out = precision.convert_output(ref(xb))
        precision.backward(nn.functional.mse_loss(out.float(), yb))
        if precision.step(opt, clip_grad_norm=1.0) and lr is not None:
            lr.step()
        opt.zero_grad()
    return ref


@pytest.mark.parametrize("mode,options", [("bf16-true", {}), ("fp8-tensorwise", {}),
                                          ("16-mixed", {"init_scale": 2.0 ** 8})])
def test_fabric_standard_setup_gives_the_hand_loops_weights(mode, options):
    # fabric.setup(model, optimizer), as every Fabric loop does: the masters are made at the first step.
    ref = _fabric_hand_loop(mode, sched=True, **options)
    x, y = make_data()
    plugin = MixprecFabricPrecision(mode, clip_grad_norm=1.0, **options)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, optimizer = fabric.setup(net, opt)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xb, yb in loader(x, y):
            fabric.backward(nn.functional.mse_loss(model(xb).float(), yb))
            if optimizer.step():
                sched.step()
            optimizer.zero_grad()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    for name, want in ref.state_dict().items():
        assert torch.equal(net.state_dict()[name], want), name
    if plugin.mixprec.recipe.keeps_masters:
        assert "master_weights" in optimizer.state_dict()       # fabric.save writes the masters


def test_fabric_refuses_an_optimizer_with_state_but_no_masters_in_one_line():
    plugin = MixprecFabricPrecision("bf16-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    opt = torch.optim.AdamW(net.parameters())
    x, y = make_data(1)
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()                                                  # stepped outside mixprec
    opt.zero_grad()
    model, optimizer = fabric.setup(net, opt)
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    with pytest.raises(ConfigError, match="plugin.setup"):
        optimizer.step()


def test_the_callback_without_the_plugin_is_refused():
    x, y = make_data(1)
    t = L.Trainer(max_steps=1, accelerator="cpu", callbacks=[MixprecCallback()], logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match="MixprecPrecision"):
        t.fit(Module(make_net()), loader(x, y))


def test_value_clipping_and_options_with_a_ready_precision_are_refused():
    with pytest.raises(ConfigError, match="ready Precision"):
        MixprecPrecision(mp.Precision("16-mixed"), init_scale=8.0)
    x, y = make_data(1)
    with pytest.raises(ConfigError, match="norm"):
        trainer(MixprecPrecision("bf16-mixed"), steps=1, gradient_clip_val=1.0,
                gradient_clip_algorithm="value").fit(Module(make_net()), loader(x, y))


def test_moving_the_schedule_onto_the_masters_raises_no_torch_scheduler_warning():
    import warnings
    x, y = make_data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(MixprecPrecision("bf16-true")).fit(Module(make_net(), scheduler=True), loader(x, y))
    assert not [w for w in caught if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)], \
        [str(w.message) for w in caught]


def test_fabric_standard_setup_saves_the_masters_and_plugin_setup_loads_them(tmp_path):
    x, y = make_data()
    plugin = MixprecFabricPrecision("bf16-true")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for xb, yb in loader(x, y):
        fabric.backward(nn.functional.mse_loss(model(xb).float(), yb))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})

    plugin2 = MixprecFabricPrecision("bf16-true")
    fabric2 = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin2])
    net2 = make_net(seed=5)
    model2, optimizer2 = fabric2.setup(*plugin2.setup(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2)))
    fabric2.load(tmp_path / "ckpt", {"model": model2, "optimizer": optimizer2})
    masters, masters2 = optimizer.optimizer._mixprec_masters, optimizer2.optimizer
    for a, b in zip(masters.masters, masters2.masters):
        assert torch.equal(a, b)
    for name, want in net.state_dict().items():
        assert torch.equal(net2.state_dict()[name], want), name
