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


def _two_runs_ending_at_different_steps(tmp_path, **b_extra):
    """A logs at 10, 20, 30; B stops at step 16 (rows at 10 and 16): one common step, 10."""
    g = torch.Generator().manual_seed(0)
    loader = [(x, (3 * x) % 256) for x in (torch.randint(0, 256, (4, 8), generator=g) for _ in range(4))]
    runs = [tmp_path / "A", tmp_path / "B"]
    for run, steps, extra in zip(runs, (30, 16), ({}, b_extra)):
        mp.train.fit(_Net(), loader, mixed_precision="32-true", max_steps=steps, run_dir=str(run),
                     progress=False, audit=False, log_interval=10, eval_interval=0, ckpt_interval=0,
                     **extra)
    return runs


def test_runs_whose_last_steps_differ_are_compared_at_the_last_common_step_and_say_so(tmp_path, capsys):
    """It printed "final loss vs first's final -29.65 %": step 30 of one run against step 16 of a
    run stopped early, with nothing saying the steps differ."""
    runs = _two_runs_ending_at_different_steps(tmp_path)
    assert main(["report", str(runs[0]), str(runs[1]), "-o", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "final loss vs first's final" not in header and "loss vs first at step 10 (%)" in header
    note = "note: the runs' last loss steps differ (A: step 30, B: step 16): compared at step 10 only, " \
           "the last step every run logged"
    assert note in out.splitlines()
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert "final loss vs first&#x27;s final" not in page and "A: step 30, B: step 16" in page


def test_a_relative_loss_plot_with_one_common_step_spans_the_runs_and_says_so(tmp_path):
    """It drew one dot on an x-axis from 9.6 to 10.4, titled as if it were a curve."""
    from mixprec.report.compare import _plots, load_run
    loaded = [load_run(r) for r in _two_runs_ending_at_different_steps(tmp_path)]
    (tmp_path / "plots").mkdir()
    captured = {}
    import mixprec.report.compare as compare
    real_save = compare.save
    compare.save = lambda fig, path: captured.setdefault(path.name, fig) and real_save(fig, path)
    try:
        _plots(loaded, tmp_path / "plots")
    finally:
        compare.save = real_save
    ax = captured["compare_loss_relative.png"].axes[0]
    assert ax.get_xlim() == (0, 30)
    assert ax.get_title().endswith("at step 10 only, the one step the runs logged in common")
    assert [t.get_text() for t in ax.texts] and ax.texts[0].get_text().endswith(" %")


def test_settings_that_do_not_change_training_are_listed_apart_not_left_out(tmp_path, capsys):
    """monitor_every=10 was left out of "settings unlike the first's" without a word; log_interval
    (which changes what a row's mean loss covers) was left out too."""
    from mixprec.report.compare import settings_that_differ
    ref = {"lr": 1e-3, "log_interval": 10, "monitor_every": 0, "run_dir": "a", "precision": "32-true"}
    other = {"lr": 1e-3, "log_interval": 5, "monitor_every": 10, "run_dir": "b", "precision": "bf16-true"}
    assert settings_that_differ(other, ref) == "log_interval=5"
    assert settings_that_differ(other, ref, training=False) == "monitor_every=10"
    runs = _two_runs_ending_at_different_steps(tmp_path, monitor_every=10)
    assert main(["report", str(runs[0]), str(runs[1]), "-o", str(tmp_path / "cmp")]) == 0
    b = capsys.readouterr().out.splitlines()[2]
    assert b.split(" | ")[2].strip() == "max_steps=16; not training: monitor_every=10"
