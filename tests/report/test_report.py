"""`mixprec report`: plots and a self-contained HTML page from a run folder; clear errors."""
from __future__ import annotations

import argparse
import base64
import math
import re

import pytest

from mixprec.errors import DataError
from mixprec.cli import report as report_cmd
from mixprec.report import report
from mixprec.runs.metrics import MetricsLogger, read_events, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir, *, numerics: bool = True):
    """A short run with an overflow at step 4 (skipped, scale halved) and validation every 3 steps."""
    scale, skipped_total = 2.0 ** 16, 0
    with MetricsLogger(run_dir, tensorboard=False) as log:
        for step in range(1, 10):
            skipped = step == 4
            if skipped:
                scale /= 2
                skipped_total += 1
                log.event({"step": step, "kind": "overflow", "message": f"inf in blocks.1.mlp grad at step {step}; <scale> halved"})
            log.log(step, epoch=0, loss=3.0 - 0.1 * step, val_loss=3.05 - 0.1 * step if step % 3 == 0 else None,
                    lr=1e-3, loss_scale=scale, skipped=skipped, skipped_total=skipped_total,
                    grad_norm=1.0 / step, tokens_per_s=1000.0 + step, mfu=0.2, peak_mem_mb=100.0 + step,
                    time_s=0.5 * step)
            if numerics and step % 2 == 0:
                log.log_numerics([{"step": step, "module": f"blocks.{i}.mlp", "kind": kind,
                                   "absmax": 10.0 ** (i + step / 4), "overflow_frac": 0.01 if (i, step) == (1, 4) else 0.0,
                                   "underflow_frac": 0.0, "dtype": "float16"}
                                  for i in range(3) for kind in ("act", "grad")])


def _run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    report_cmd.configure(parser)
    return report_cmd.run(parser.parse_args(list(argv)))


def test_report_writes_valid_pngs_and_self_contained_html(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _fake_run(run_dir)
    out = tmp_path / "out"
    assert _run_cli(str(run_dir), "-o", str(out)) == 0
    assert str(out / "report.html") in capsys.readouterr().out
    names = {p.name for p in out.glob("*.png")}
    assert {"loss.png", "loss_scale.png", "grad_norm.png", "throughput.png", "memory.png",
            "numerics_act_absmax.png", "numerics_grad_absmax.png", "numerics_grad_overflow_frac.png",
            "numerics_act_overflow_frac.png"} <= names
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(names)
    assert all(base64.b64decode(i)[:8] == PNG_MAGIC for i in images)
    assert "src=\"http" not in page and "<script" not in page  # nothing fetched from elsewhere
    # summary and events (escaped)
    assert "<th>skipped steps</th><td>1</td>" in page
    assert "<th>best val loss</th><td>2.15</td>" in page
    assert "<th>best val loss at step</th><td>9</td>" in page
    assert "&lt;scale&gt; halved" in page


def test_report_defaults_to_a_folder_inside_the_run_and_skips_unmeasured_plots(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsLogger(run_dir, tensorboard=False) as log:
        for step in range(1, 4):
            log.log(step, loss=2.0 / step, loss_scale=1.0)  # e.g. a bf16 run on CPU: no MFU, no memory
    assert _run_cli(str(run_dir)) == 0
    out = run_dir / "report"
    # no MFU or memory measured, and a scale of 1 throughout: scaling was off, so no scale plot
    assert sorted(p.name for p in out.glob("*.png")) == ["loss.png"]
    assert "No events" in (out / "report.html").read_text()


def test_summary_figures(tmp_path):
    _fake_run(tmp_path, numerics=False)
    s = report.summarize(read_metrics(tmp_path), read_events(tmp_path))
    assert s["last step"] == 9 and s["skipped steps"] == 1 and s["events"] == 1
    # rows of 1001..1009 tokens/s over 0.5..4.5 s: all tokens over all training seconds
    assert s[report.TOKENS_PER_S] == pytest.approx(sum((1000 + k) * k for k in range(1, 10)) / sum(range(1, 10)))
    assert s["peak memory (MiB)"] == 109.0 and s["final val loss"] == pytest.approx(2.15)
    assert report._skipped_steps(read_metrics(tmp_path)) == [4]
    # a skip between two logged rows is known only from its event
    events = [{"step": 6, "kind": "skip", "message": "step 6 skipped"}, {"step": 7, "kind": "scale_growth", "message": "x"}]
    assert report._skipped_steps(read_metrics(tmp_path), events) == [4, 6]
    assert report._scale_at([1, 4, 8], [4.0, 2.0, 8.0], 6) == 2.0


def test_missing_run_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(DataError, match=r"^no run folder at .*nope; pass the folder `mixprec train` printed") as info:
        _run_cli(str(tmp_path / "nope"))
    assert "\n" not in str(info.value)


def test_folder_without_metrics_or_rows_is_a_one_line_error(tmp_path):
    with pytest.raises(DataError, match="has no metrics.csv"):
        _run_cli(str(tmp_path))
    MetricsLogger(tmp_path, tensorboard=False).close()
    with pytest.raises(DataError, match="has no rows yet; train for at least one logging interval"):
        _run_cli(str(tmp_path))


def _capture_figures(monkeypatch) -> dict:
    """Keep the matplotlib figures the report saves, by file name, to inspect legends and axes."""
    figures, save = {}, report.save

    def keep(fig, path):
        figures[path.name] = fig
        return save(fig, path)
    monkeypatch.setattr(report, "save", keep)
    return figures


def test_wall_time_is_the_whole_runs_not_the_last_intervals(tmp_path):
    _fake_run(tmp_path, numerics=False)          # 9 intervals of 0.5 * step seconds
    s = report.summarize(read_metrics(tmp_path), read_events(tmp_path))
    assert s["wall time (s)"] == pytest.approx(0.5 * sum(range(1, 10)))


def test_mfu_is_shown_in_percent_in_the_summary(tmp_path):
    _fake_run(tmp_path, numerics=False)          # mfu = 0.2 in metrics.csv
    assert _run_cli(str(tmp_path)) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<th>MFU (%) (over training time)</th><td>20</td>" in page


def test_summary_throughput_is_all_tokens_over_training_time_not_the_mean_of_row_rates(tmp_path):
    # a slow first row (900 tokens in 9 s) and a fast one (9,100 tokens in 1 s): 10,000 tokens in
    # 10 s is 1,000 tokens/s (the rows' plain mean, 4,600, is no rate the run ever had)
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(10, loss=2.0, tokens_per_s=100.0, mfu=0.01, time_s=9.0)
        log.log(20, loss=1.9, tokens_per_s=9100.0, mfu=0.91, time_s=1.0)
        log.log(30, loss=1.8, tokens_per_s=None, mfu=None, time_s=None)   # nothing measured: left out
    s = report.summarize(read_metrics(tmp_path), read_events(tmp_path))
    assert s["tokens/s (all tokens / training time)"] == pytest.approx(1000.0, rel=1e-12)
    assert s["MFU (%) (over training time)"] == pytest.approx(10.0, rel=1e-12)


def test_summary_names_precision_and_model_from_the_run_config(tmp_path):
    _fake_run(tmp_path, numerics=False)
    (tmp_path / "config.toml").write_text('precision = "16-mixed"\nmodel = "tiny"\nnum_layers = 2\n'
                                          'd_model = 64\n')
    assert _run_cli(str(tmp_path)) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<th>precision</th><td>16-mixed</td>" in page
    assert "<th>model</th><td>tiny (num_layers=2, d_model=64)</td>" in page


def test_no_loss_scale_plot_when_the_precision_does_not_scale(tmp_path):
    _fake_run(tmp_path, numerics=False)
    (tmp_path / "config.toml").write_text('precision = "bf16-mixed"\n')
    assert _run_cli(str(tmp_path)) == 0
    assert not (tmp_path / "report" / "loss_scale.png").exists()
    (tmp_path / "config.toml").write_text('precision = "16-mixed"\n')
    assert _run_cli(str(tmp_path)) == 0
    assert (tmp_path / "report" / "loss_scale.png").exists()


def test_throughput_plot_draws_tokens_and_mfu_in_separate_panels(tmp_path, monkeypatch):
    # MFU is tokens/s times a constant: on one axis the two lines lie on top of each other (a
    # new-user trial saw only the MFU line), so each has its own panel over the same steps.
    figures = _capture_figures(monkeypatch)
    _fake_run(tmp_path, numerics=False)
    assert _run_cli(str(tmp_path)) == 0
    fig = figures["throughput.png"]
    assert [len(a.get_lines()) for a in fig.axes] == [1, 1]
    assert [a.get_ylabel() for a in fig.axes] == ["tokens/s", "MFU (%)"]
    assert list(fig.axes[1].get_lines()[0].get_ydata()) == pytest.approx([20.0] * 9)


def test_activation_and_gradient_heat_maps_list_layers_in_the_same_order(tmp_path, monkeypatch):
    figures = _capture_figures(monkeypatch)
    forward = ["embed", "blocks.0.mlp", "blocks.1.mlp", "head"]
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in (2, 4):
            log.log(step, loss=1.0)
            # activations come in forward order, gradients in backward order
            log.log_numerics([{"step": step, "module": m, "kind": "act", "absmax": 10.0 + i,
                               "overflow_frac": 0.0, "underflow_frac": 0.0, "dtype": "float16"}
                              for i, m in enumerate(forward)]
                             + [{"step": step, "module": m, "kind": "grad", "absmax": 1.0 + i,
                                 "overflow_frac": 0.0, "underflow_frac": 0.0, "dtype": "float16"}
                                for i, m in enumerate(reversed(forward))])
    assert _run_cli(str(tmp_path)) == 0

    def layers(name):
        return [t.get_text() for t in figures[name].axes[0].get_yticklabels()]
    assert layers("numerics_act_absmax.png") == layers("numerics_grad_absmax.png") == forward


def _scaled_grads_run(tmp_path, *, record_scale: bool):
    # An FP16 run's scale moves 2^24 -> 2^16 -> 2^18 while the gradients stay 0.5 (blocks.0) and
    # 0.25 (head): the numerics rows hold them times the scale.
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step, scale in ((10, 2.0 ** 24), (20, 2.0 ** 16), (30, 2.0 ** 18)):
            log.log(step, loss=1.0, loss_scale=scale)
            log.log_numerics([{"step": step, "module": m, "kind": "grad", "absmax": g * scale,
                               "overflow_frac": 0.0, "underflow_frac": 0.0, "dtype": "float16",
                               "loss_scale": scale if record_scale else None}
                              for m, g in (("blocks.0", 0.5), ("head", 0.25))])


def test_fp16_gradient_heat_map_shows_the_gradients_not_the_loss_scale(tmp_path, monkeypatch):
    figures = _capture_figures(monkeypatch)
    _scaled_grads_run(tmp_path, record_scale=True)
    assert _run_cli(str(tmp_path)) == 0
    ax = figures["numerics_grad_absmax.png"].axes[0]
    grid = ax.images[0].get_array()
    assert [row for row in grid.tolist()] == [[pytest.approx(math.log10(g))] * 3 for g in (0.5, 0.25)]
    assert "divided by the loss scale" in ax.get_title()


def test_fp16_gradient_heat_map_without_recorded_scales_says_they_are_scaled(tmp_path, monkeypatch):
    figures = _capture_figures(monkeypatch)
    _scaled_grads_run(tmp_path, record_scale=False)         # an older run's numerics.csv
    assert _run_cli(str(tmp_path)) == 0
    assert "times the loss scale" in figures["numerics_grad_absmax.png"].axes[0].get_title()


def test_every_line_of_every_report_picture_is_named_in_its_legend(tmp_path, monkeypatch):
    """README: "every line named in a legend" (lr.png had none)."""
    figures = _capture_figures(monkeypatch)
    _fake_run(tmp_path)
    assert _run_cli(str(tmp_path)) == 0
    assert "lr.png" in figures
    for name, fig in figures.items():
        lines = [ln for ax in fig.axes for ln in ax.get_lines()]
        if not lines:
            continue                                    # a heat map: its colour bar says it
        legends = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        for line in lines:
            assert line.get_label() in legends, f"{name}: a line named {line.get_label()!r} is not in its legend"


def test_the_summary_names_memory_in_the_plots_unit(tmp_path):
    _fake_run(tmp_path, numerics=False)
    assert _run_cli(str(tmp_path)) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<th>peak memory (MiB)</th><td>109</td>" in page and "(MB)" not in page


def test_the_summary_writes_a_rate_of_tens_of_thousands_without_scientific_notation():
    """A trial's report showed "1.581e+04" tokens/s: `.4g` switches to exponents at 10^4."""
    from mixprec.report.report import _fmt
    assert _fmt(15810.4) == "15,810" and _fmt(9876.5) == "9876" and _fmt(2.773) == "2.773"
