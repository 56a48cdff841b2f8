"""What the terminal shows while a run trains (issue #30 item 19): the progress bar's fields, the
plain line of a pipe, one layer list, samples/s for batches without tokens, no bare headers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.cli.train import settings_lines
from mixprec.models.objective import count_samples
from mixprec.monitor.audit import Finding
from mixprec.precision import Precision
from mixprec.runs.events import RunEvents
from mixprec.runs.metrics import MetricsLogger
from mixprec.strategies import SingleDeviceStrategy
from mixprec.train.config import TrainConfig


def _events(tmp_path, mode: str, *, bar: bool = False) -> RunEvents:
    events = RunEvents(SingleDeviceStrategy("cpu"), Precision(mode),
                       MetricsLogger(tmp_path, tensorboard=False), progress=False)
    events.progress = bar              # pytest's stderr is no terminal: ask for the bar directly
    return events


def test_piped_line_carries_elapsed_time_and_eta_and_no_scale_without_a_scaler(tmp_path, capsys):
    events = _events(tmp_path, "bf16-mixed")
    events.open_progress(total=60, initial=0)
    events.interval(20, 60, loss=4.5, val_loss=4.2, lr=1.4e-3, tokens_per_s=6776.0)
    line = capsys.readouterr().err
    assert "step 20/60" in line and "val 4.2000" in line and "6,776 tok/s" in line and "lr 0.0014" in line
    assert "elapsed 00:00" in line and "ETA 00:00" in line
    assert "scale" not in line                               # bf16: no loss scaler, scale is always 1


def test_fp16_lines_show_the_loss_scale(tmp_path, capsys):
    events = _events(tmp_path, "16-mixed")
    events.open_progress(total=10, initial=0)
    events.interval(5, 10, loss=3.0, val_loss=None, lr=1e-3, tokens_per_s=100.0)
    assert "scale 65536" in capsys.readouterr().err


def test_bar_shows_throughput_lr_loss_and_keeps_each_evaluation_above_it(tmp_path, capsys):
    events = _events(tmp_path, "bf16-mixed", bar=True)
    events.open_progress(total=60, initial=0)
    events.advance()
    events.interval(10, 60, loss=5.2358, val_loss=None, lr=7.33e-4, tokens_per_s=11839.0)
    postfix = events._bar.postfix
    assert "11,839 tok/s" in postfix and "lr 0.000733" in postfix and "loss 5.2358" in postfix
    assert "scale" not in postfix
    assert "remaining" in events._bar.bar_format               # tqdm's ETA
    assert "val" not in capsys.readouterr().err                 # no history line without an evaluation
    events.interval(20, 60, loss=4.6548, val_loss=4.2193, lr=1.4e-3, tokens_per_s=6776.0)
    events.close()
    written = capsys.readouterr().err
    # tqdm.write puts the evaluation line above the bar; the bar's redraw does not erase it.
    assert "[mixprec] step 20/60  loss 4.6548  val 4.2193" in written


def test_batches_without_tokens_report_samples_per_second(tmp_path, capsys):
    events = _events(tmp_path, "32-true")
    events.open_progress(total=4, initial=0)
    events.interval(2, 4, loss=2.3, val_loss=None, lr=1e-3, tokens_per_s=None, samples_per_s=12.5)
    line = capsys.readouterr().err
    assert "12.5 samples/s" in line and "tok/s" not in line


def test_samples_are_counted_from_the_leading_dimension_of_the_inputs():
    images, labels = torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.long)
    assert count_samples((images, labels)) == 8
    assert count_samples({"pixel_values": images, "labels": labels}) == 8
    assert count_samples(images) == 8
    assert count_samples(object()) is None


def test_no_settings_header_when_every_setting_is_the_default():
    cfg = TrainConfig()
    assert settings_lines(cfg, {"lr": "default", "precision": "default"}) == []
    lines = settings_lines(TrainConfig(lr=0.01), {"lr": "command line"})
    assert lines[0] == "settings (non-default):" and "lr = 0.01  (command line)" in lines[1]


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(16, 16), nn.Linear(16, 16)


def test_per_layer_formats_are_listed_once(tmp_path, capsys):
    precision = Precision("bf16-mixed", overrides={"head": "fp32"})
    model = precision.setup_module(_Two())
    events = RunEvents(SingleDeviceStrategy("cpu"), precision,
                       MetricsLogger(tmp_path, tensorboard=False), progress=False)
    events.start(model=model, step=0, total=1, run_dir=tmp_path)
    events.findings([Finding(code="layer-formats", severity="info", message="Linear layers compute "
                             "in: fc=bf16, head=fp32", fix="-")], step=0)
    err = capsys.readouterr().err
    assert err.count("head  fp32") == 1 and "layer formats:" in err
    assert "compute in: fc=bf16" not in err                         # the audit's copy of the table: recorded only


def test_the_fifth_skip_line_says_the_rest_are_in_events_jsonl_and_scales_read_alike(tmp_path, capsys):
    # A trial: "done: 40 steps (7 skipped)" but only steps 1-5 had a line, without a word why; the
    # skip lines said "loss scale 999999995904 -> 499999997952", the progress lines "scale 9.76562e+08".
    from types import SimpleNamespace
    from mixprec.monitor.trace import format_scale
    scaler = SimpleNamespace(scale=1e12, num_skipped_steps=0, get_scale=lambda: scaler.scale)
    precision = SimpleNamespace(scaler=scaler, recipe=SimpleNamespace(scales_loss=True, compute_dtype=torch.float16))
    events = RunEvents(SingleDeviceStrategy("cpu"), precision, MetricsLogger(tmp_path, tensorboard=False),
                       progress=False)
    for step in range(1, 8):
        before = scaler.get_scale()
        scaler.scale = before / 2
        scaler.num_skipped_steps += 1
        events.skip(step, SimpleNamespace(scale_before=before), None)
    err = capsys.readouterr().err.splitlines()
    assert [l for l in err if "skipped:" in l][0].endswith("loss scale 1e+12 -> 5e+11")
    assert len([l for l in err if "skipped:" in l]) == 5
    (said,) = [i for i, l in enumerate(err) if "further skipped steps are recorded in events.jsonl only" in l]
    assert "step 5 skipped" in err[said - 1] and said == len(err) - 1       # once, right after the fifth
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert sum('"kind": "skip"' in l for l in lines) == 7                    # every one recorded
    events.open_progress(total=40, initial=0)
    events.interval(8, 40, loss=3.0, val_loss=None, lr=1e-3, tokens_per_s=100.0)
    assert "scale 7.812e+09" in capsys.readouterr().err                       # 1e12 / 2^7, same format
    assert [format_scale(x) for x in (65536.0, 0.5, 2.0**40, 9.765625e8)] == ["65536", "0.5", "1.1e+12", "9.766e+08"]
