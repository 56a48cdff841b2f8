"""``what_if`` / ``mixprec whatif``: every Linear in every format, the safe choice, CSV and heat-map."""
from __future__ import annotations

import csv

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
    return mp.what_if(net, _batches(), gpu="B200")


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
    assert "nvfp4:loss_change" in rows[0] and rows[0][-1] == "choice"
    assert [r[0] for r in rows[1:-1]] == [r.name for r in outlier_report.rows]
    png = outlier_report.heatmap(tmp_path / "w.png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
    assert "choice:" in outlier_report.table()


def test_a_plain_user_module_with_a_loss_fn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    batches = [(torch.randn(16, 32), torch.randn(16, 32)) for _ in range(2)]
    report = mp.what_if(model, batches, formats=("mxfp8", "nvfp4", "bf16"), gpu="GB200",
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
    report = mp.what_if(model, [(x[:, :-1], x[:, 1:])], formats=("fp8-rowwise", "nvfp4", "bf16"))
    names = {r.name: r for r in report.rows}
    assert "model.layers.0.mlp.down_proj" in names
    assert not names["lm_head"].cells["nvfp4"].available
    assert names["model.layers.1.self_attn.k_proj"].cells["nvfp4"].available


def test_bad_arguments_are_refused_in_one_line():
    model = nn.Sequential(nn.Linear(32, 32))
    batches = [(torch.randn(4, 32), torch.randn(4, 32))]
    with pytest.raises(ConfigError, match="unknown GPU"):
        mp.what_if(model, batches, gpu="B2000", loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="unknown layer format"):
        mp.what_if(model, batches, formats=("nvfp5",), loss_fn=F.mse_loss)
    with pytest.raises(ConfigError, match="tolerance"):
        mp.what_if(model, batches, tolerance=5, loss_fn=F.mse_loss)


def test_cli_writes_table_csv_heatmap_and_plan(tmp_path, capsys):
    out = tmp_path / "w.csv"
    plan = tmp_path / "plan.json"
    rc = main(["whatif", "model=tiny", "batch_size=2", "seq_len=32", "--batches", "1",
               "--formats", "mxfp4,bf16", "-o", str(out), "--plan", str(plan)])
    assert rc == 0
    assert out.exists() and out.with_suffix(".png").exists()
    assert "choice:" in capsys.readouterr().out
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
def test_replayed_layer_outputs_give_the_same_losses_as_running_the_layer(fmt):
    # The loss pass reuses the variant's outputs on the recorded FP32 inputs (computed once for
    # the SQNR) instead of running the variant again: the losses must be those of the layer run
    # in place, bit for bit, and every call must have been replayed.
    import copy
    from mixprec.models.objective import make_objective
    from mixprec.plan.measure import layer_alone, losses_with, reference_pass
    from mixprec.plan.whatif import _Replay
    torch.manual_seed(0)
    net, batches = _Net(), _batches()
    ref = copy.deepcopy(net)
    mp.Precision("32-true").setup(ref)
    objective = make_objective(ref, mp.Precision("32-true"), None)
    _, records = reference_pass(ref, batches, objective, [OUTLIER], 0)
    trial = copy.deepcopy(net)
    mp.Precision("32-true", overrides=(("*", fmt),)).setup(trial)
    variant = trial.get_submodule(OUTLIER)
    raw: list[torch.Tensor] = []
    layer_alone(variant, records[OUTLIER], raw)
    replay = _Replay(variant, records[OUTLIER], raw)
    assert losses_with(ref, OUTLIER, replay, batches, objective, 0) == \
        losses_with(ref, OUTLIER, variant, batches, objective, 0)
    assert replay.replayed == len(batches)
