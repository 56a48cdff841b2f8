"""``what_if`` / ``mixprec whatif``: every Linear in every format, the safe choice, CSV and heat-map."""
from __future__ import annotations

import csv
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.cli import main
from mixprec.errors import ConfigError

OUTLIER = "blocks.1.proj"


class _Block(nn.Module):
    def __init__(self, d: int, h: int, outliers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, h)
        self.proj = nn.Linear(h, d)
        boost = torch.ones(h)
        boost[list(outliers)] = 1e4          # activation channels 10^4 times the rest ...
        self.register_buffer("boost", boost)
        with torch.no_grad():                # ... undone by the weights: the same function in FP32
            self.proj.weight[:, list(outliers)] /= 1e4

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))) * self.boost)


class _Net(nn.Module):
    def __init__(self, d: int = 64, h: int = 128, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(_Block(d, h, (3, 50, 90) if i == 1 else ()) for i in range(n))
        self.head = nn.Linear(d, 256)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _batches(n: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(n)]
    return [(x, (7 * x + 3) % 256) for x in xs]


@pytest.fixture(scope="module")
def outlier_report():
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for x, y in _batches(20, seed=1):        # a few steps: at initialisation no layer matters
        opt.zero_grad()
        net(x, y).backward()
        opt.step()
    return mp.plan.what_if(net, _batches(), gpu="B200")


def test_outlier_layer_is_unsafe_in_fp4_and_safe_in_bf16(outlier_report):
    row = {r.name: r for r in outlier_report.rows}[OUTLIER]
    for fmt in ("mxfp4", "nvfp4"):
        assert row.cells[fmt].available and not row.cells[fmt].safe
        assert row.cells[fmt].loss_change > 10 * outlier_report.tolerance
        assert row.cells[fmt].underflow > 0.2            # the outlier channels' blocks flush the rest
    assert row.cells["bf16"].safe and row.cells["bf16"].loss_change < outlier_report.tolerance
    assert row.choice not in ("mxfp4", "nvfp4")
    ordinary = {r.name: r for r in outlier_report.rows}["blocks.2.fc"]
    assert ordinary.cells["nvfp4"].loss_change < row.cells["nvfp4"].loss_change / 10


def test_every_format_is_a_column_group_and_the_rules_say_where_one_cannot_run(outlier_report):
    assert outlier_report.formats == list(mp.plan.WHATIF_FORMATS)
    head = {r.name: r for r in outlier_report.rows}["head"]
    assert not head.cells["nvfp4"].available and "head" in head.cells["nvfp4"].reason
    assert head.cells["bf16"].available and head.choice == "bf16"
    fc = {r.name: r for r in outlier_report.rows}["blocks.0.fc"]
    assert fc.cells["nvfp4"].speedup == 4.0 and fc.cells["mxfp8"].speedup == 2.0   # B200: FP4/BF16, FP8/BF16
    assert fc.cells["bf16"].sqnr_out > fc.cells["mxfp8"].sqnr_out > fc.cells["mxfp4"].sqnr_out
    assert 0 <= outlier_report.choice_loss_change < 1 and outlier_report.choice_speedup > 1


def test_csv_and_heatmap_are_written(outlier_report, tmp_path):
    path = outlier_report.write_csv(tmp_path / "w.csv")
    rows = list(csv.reader(path.open()))
    assert rows[0][:3] == ["layer", "flops_per_token", "fp8-tensorwise:available"]
    assert "nvfp4:loss_change_frac" in rows[0] and rows[0][-1] == "choice"
    assert [r[0] for r in rows[1:-1]] == [r.name for r in outlier_report.rows]
    png = outlier_report.heatmap(tmp_path / "w.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
    assert "choice:" in outlier_report.table()


def test_a_plain_user_module_with_a_loss_fn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    batches = [(torch.randn(16, 32), torch.randn(16, 32)) for _ in range(2)]
    report = mp.plan.what_if(model, batches, formats=("mxfp8", "nvfp4", "bf16"), gpu="GB200",
                        loss_fn=F.mse_loss)
    assert [r.name for r in report.rows] == ["0", "2"]
    assert all(r.cells["mxfp8"].available and r.cells["nvfp4"].available for r in report.rows)
    assert report.gpu == "GB200"


def test_a_tiny_hugging_face_llama_from_its_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 32), generator=g)
    report = mp.plan.what_if(model, [(x[:, :-1], x[:, 1:])], formats=("fp8-rowwise", "nvfp4", "bf16"))
    names = {r.name: r for r in report.rows}
    assert "model.layers.0.mlp.down_proj" in names
    assert not names["lm_head"].cells["nvfp4"].available
    assert names["model.layers.1.self_attn.k_proj"].cells["nvfp4"].available


def test_bad_arguments_are_refused_in_one_line():
    model = nn.Sequential(nn.Linear(32, 32))
    batches = [(torch.randn(4, 32), torch.randn(4, 32))]
    with pytest.raises(ConfigError, match="unknown GPU"):
        mp.plan.what_if(model, batches, gpu="B2000", loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="unknown layer format"):
        mp.plan.what_if(model, batches, formats=("nvfp5",), loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="tolerance"):
        mp.plan.what_if(model, batches, tolerance=5, loss_fn=F.mse_loss)


def test_cli_writes_table_csv_heatmap_and_plan(tmp_path, capsys):
    out = tmp_path / "w.csv"
    plan = tmp_path / "plan.json"
    rc = main(["whatif", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1",
               "--formats", "mxfp4,bf16", "-o", str(out), "--plan", str(plan)])
    assert rc == 0
    assert out.exists() and out.with_suffix(".png").exists()
    captured = capsys.readouterr()
    assert "choice:" in captured.out and "1 batches of 2x32 tokens (64 tokens)" in captured.err
    p = mp.Precision(f"plan:{plan}")
    assert p.policy.overrides and all(f in ("mxfp4", "bf16", "fp32") for _, f in p.policy.overrides)


def test_gpu_table_has_blackwell_fp4_peaks_and_hopper_refuses_fp4():
    from mixprec.estimate.gpus import format_peak_kind, get_gpu, peak_kind
    assert get_gpu("B200").peak_flops("fp4") == 2 * get_gpu("B200").peak_flops("fp8")
    assert get_gpu("gb200").fp4_tflops == 10000.0 and "GB200" in get_gpu("GB200").source
    with pytest.raises(ConfigError, match="H100 has no FP4 tensor cores.*B200, GB200"):
        get_gpu("H100").peak_flops("fp4")
    assert [format_peak_kind(f) for f in ("nvfp4", "mxfp4", "mxfp8", "fp8-rowwise", "bf16", "fp32")] == \
        ["fp4", "fp4", "fp8", "fp8", "bf16", "fp32"]
    assert peak_kind(mp.Precision("nvfp4")) == "fp4" and peak_kind(mp.Precision("mxfp8")) == "fp8"


@pytest.mark.parametrize("fmt", ["nvfp4", "bf16", "fp8-tensorwise"])
def test_replayed_layer_outputs_and_blocks_give_the_same_losses_as_running_them(fmt):
    # The loss pass reuses the variant's outputs on the recorded FP32 inputs (computed once for
    # the SQNR), and the outputs of the blocks whose inputs are unchanged, instead of running
    # them again: the losses must be those of the model run in place, bit for bit; the layer and
    # the block before it are replayed on every batch, the block after it never.
    import copy
    from mixprec.models.objective import make_objective
    from mixprec.plan.measure import Call, Replay, block_list, layer_alone, losses_with, reference_pass
    torch.manual_seed(0)
    net, batches = _Net(), _batches()
    ref = copy.deepcopy(net)
    mp.Precision("32-true").setup(ref)
    objective = make_objective(ref, mp.Precision("32-true"), None)
    blocks = block_list(ref, [OUTLIER, "blocks.0.fc", "blocks.2.fc"])
    assert blocks == ["blocks.0", "blocks.1", "blocks.2"]
    calls: dict[str, list[Call]] = {}
    _, records = reference_pass(ref, batches, objective, [OUTLIER], 0, blocks, calls)
    trial = copy.deepcopy(net)
    mp.Precision("32-true", overrides=(("*", fmt),)).setup(trial)
    variant = trial.get_submodule(OUTLIER)
    raw: list[torch.Tensor] = []
    layer_alone(variant, records[OUTLIER], raw, input_grad=False)
    replay = Replay(variant, [Call(args=(r[0],), kwargs={}, output=y) for r, y in zip(records[OUTLIER], raw)])
    mods = dict(ref.named_modules())
    others = {b: Replay(mods[b], calls[b]) for b in ("blocks.0", "blocks.2")}
    assert losses_with(ref, OUTLIER, replay, batches, objective, 0, others) == \
        losses_with(ref, OUTLIER, variant, batches, objective, 0)
    assert replay.replayed == len(batches)
    assert others["blocks.0"].replayed == len(batches) and others["blocks.2"].replayed == 0


def test_replayed_blocks_leave_the_random_numbers_as_running_them_would():
    # Dropout in every block: a replayed block must leave the RNG where the block left it in the
    # reference pass, or the blocks after it would draw other masks (a different loss).
    import copy
    from mixprec.models.objective import make_objective
    from mixprec.plan.measure import Call, Replay, block_list, losses_with, reference_pass

    def block():
        return nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.GELU())
    torch.manual_seed(0)
    net = nn.Sequential(block(), block(), block())
    batches = [(torch.randn(8, 32), torch.randn(8, 32)) for _ in range(2)]
    mp.Precision("32-true").setup(net)
    net.train()
    objective = make_objective(net, mp.Precision("32-true"), F.mse_loss)
    names = ["0.0", "1.0", "2.0"]
    assert block_list(net, names) == ["0", "1", "2"]
    calls: dict[str, list[Call]] = {}
    ref_losses, _ = reference_pass(net, batches, objective, names, 5, ["0", "1", "2"], calls)
    other = copy.deepcopy(net.get_submodule("2.0"))
    with torch.no_grad():
        other.weight.mul_(1.01)
    replays = {"0": Replay(net.get_submodule("0"), calls["0"]), "1": Replay(net.get_submodule("1"), calls["1"])}
    assert losses_with(net, "2.0", other, batches, objective, 5, replays) == \
        losses_with(net, "2.0", other, batches, objective, 5)
    assert replays["0"].replayed == replays["1"].replayed == len(batches)
    same = {"0": Replay(net.get_submodule("0"), calls["0"])}
    assert losses_with(net, "2.0", net.get_submodule("2.0"), batches, objective, 5, same) == ref_losses


def test_cli_measures_a_small_batch_unless_given():
    # A what-if measures, it does not train: training's 16 x 128 default took four times as long
    # as the 8 x 64 the docs' timings use. The model keeps training's position table.
    from mixprec.cli.whatif import measure_config
    from mixprec.train.config import load_config, parse_overrides
    cfg, small = measure_config(*load_config(None, parse_overrides(["model=tiny"])))
    assert (cfg.batch_size, cfg.seq_len, cfg.max_seq_len) == (8, 64, 128)
    assert small == {"batch_size": 8, "seq_len": 64}
    cfg, small = measure_config(*load_config(None, parse_overrides(["model=tiny", "batch_size=2"])))
    assert (cfg.batch_size, cfg.seq_len, cfg.max_seq_len) == (2, 64, 128) and small == {"seq_len": 64}
    cfg, small = measure_config(*load_config(None, parse_overrides(["batch_size=2", "seq_len=32"])))
    assert (cfg.batch_size, cfg.seq_len, cfg.max_seq_len, small) == (2, 32, None, {})


def test_the_table_fits_120_columns_and_the_csv_names_its_units(outlier_report, tmp_path):
    """The table was 235-277 characters wide; the CSV's fractions read like the table's percent."""
    table = outlier_report.table()
    assert max(len(line) for line in table.splitlines()) <= 120
    row = next(line for line in table.splitlines() if line.startswith(OUTLIER + " "))
    assert "!" in row                                  # unsafe in FP4, marked in its cell
    header = next(csv.reader(outlier_report.write_csv(tmp_path / "w.csv").open()))
    assert {"nvfp4:loss_change_frac", "nvfp4:underflow_frac", "nvfp4:saturation_frac",
            "nvfp4:sqnr_out_db", "nvfp4:sqnr_grad_db", "nvfp4:speedup_x"} <= set(header)
    values = {r.name: r for r in outlier_report.rows}[OUTLIER].cells["nvfp4"]
    line = next(r for r in csv.reader((tmp_path / "w.csv").open()) if r[0] == OUTLIER)
    assert float(line[header.index("nvfp4:loss_change_frac")]) == pytest.approx(values.loss_change, rel=1e-5)


def test_a_choice_whose_whole_change_exceeds_the_tolerance_says_so(outlier_report):
    """Each layer's change may be within the tolerance while the whole choice's is not (a user's
    3-layer module: 0.608 % against 0.5 %, and the table said nothing)."""
    within = dataclasses.replace(outlier_report, choice_loss_change=0.5 * outlier_report.tolerance)
    assert "warning: the whole choice" not in within.table()
    over = dataclasses.replace(outlier_report, choice_loss_change=2 * outlier_report.tolerance)
    line = " ".join(over.table().split())
    assert (f"warning: the whole choice changes the loss by {200 * outlier_report.tolerance:.3g}%, more "
            f"than the {100 * outlier_report.tolerance:.3g}% each layer was allowed") in line
    assert "mixprec plan --budget" in line
