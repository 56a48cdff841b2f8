"""``mixprec report RUN_A RUN_B``: runs overlaid in one page, differences against the first."""
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.cli import main


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(256, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, idx, targets):
        return F.cross_entropy(self.head(F.gelu(self.fc(self.emb(idx)))).flatten(0, 1), targets.flatten())


def test_report_overlays_runs_with_differences_against_the_first(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    loader = [(x, (3 * x) % 256) for x in (torch.randint(0, 256, (4, 8), generator=g) for _ in range(4))]
    runs = []
    for name, mode in (("fp32", "32-true"), ("fp8", "fp8-tensorwise")):
        runs.append(tmp_path / name)
        mp.train.fit(_Net(), loader, val_loader=loader[:1], mixed_precision=mode, max_steps=4,
                     run_dir=str(runs[-1]), progress=False, audit=False, log_interval=1,
                     eval_interval=2, ckpt_interval=0)
    assert main(["report", str(runs[0]), str(runs[1]), "-o", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("fp32 ", "fp8 "))]
    header = out.splitlines()[0]
    assert lines[0].split(" | ")[5].strip() == "+0.00"              # the reference against itself
    assert "1 fp8-tensorwise" in lines[1]                           # fc in FP8, the head not
    # Columns line up (three runs read at a glance): every row's bars stand where the header's do.
    bars = [i for i, ch in enumerate(header) if ch == "|"]
    assert all([i for i, ch in enumerate(line) if ch == "|"] == bars for line in lines)
    assert lines[0].split(" | ")[1].strip() == "32-true"           # the mode's name in the table,
    # and its whole description under it (which itself contains "; ": it was once cut there).
    assert "  fp32: 32-true (p=f32,c=f32,o=f32,r=f32; master weights off" in out
    assert "loss scaling off)" in out
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert "fp8-tensorwise" in page and "val loss vs first at step 4 (%)" in page
    assert "final loss vs first&#x27;s final (%)" in page and "4 of 4 (complete)" in page
    for name in ("loss", "val_loss", "loss_relative", "skipped", "fp8_share", "lr"):
        assert (tmp_path / "cmp" / f"compare_{name}.png").is_file(), name


def test_the_narrow_format_share_counts_fp8_and_the_block_scaled_formats():
    """compare_fp8_share.png showed 0 % for an nvfp4 run: only 'fp8-*' names were counted."""
    from mixprec.report.compare import _narrow
    assert all(_narrow(f) for f in ("fp8-tensorwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4"))
    assert not any(_narrow(f) for f in ("fp32", "bf16", "fp16"))


def test_runs_labelled_alike_show_the_settings_they_differ_by(tmp_path, capsys):
    """Before: two runs both labelled bf16-true, B trained with another lr and int8 moments, and
    B's loss difference read as a precision effect: nothing said the settings differed."""
    g = torch.Generator().manual_seed(0)
    loader = [(x, (3 * x) % 256) for x in (torch.randint(0, 256, (4, 8), generator=g) for _ in range(4))]
    runs = [tmp_path / "A", tmp_path / "B"]
    for run, extra in zip(runs, ({}, {"lr": 5e-3, "moments": "int8"})):
        mp.train.fit(_Net(), loader, mixed_precision="bf16-true", max_steps=2, run_dir=str(run),
                     progress=False, audit=False, log_interval=1, eval_interval=0, ckpt_interval=0,
                     **extra)
    assert main(["report", str(runs[0]), str(runs[1]), "-o", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    header, a, b = out.splitlines()[:3]
    assert header.split(" | ")[2].strip() == "settings unlike the first's"
    assert a.split(" | ")[2].strip() == "-"
    assert b.split(" | ")[2].strip() == "lr=0.005 moments=int8"
    assert a.split(" | ")[1].strip() == b.split(" | ")[1].strip() == "bf16-true"
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert "<td>lr=0.005 moments=int8</td>" in page
    from mixprec.report.compare import load_run, _plots
    loaded = [load_run(r) for r in runs]
    (tmp_path / "plots").mkdir()
    _plots(loaded, tmp_path / "plots")
    assert [r["legend"] for r in loaded] == ["A", "B (lr=0.005 moments=int8)"]   # the plots' labels
