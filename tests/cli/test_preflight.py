"""The pre-flight guard of `mixprec train` asks the memory estimator about a whole step (states and
activations at batch_size x seq_len), and says when a long seq_len grows the model and its FLOPs."""
import pytest

from mixprec.errors import ConfigError
from mixprec.train.config import TrainConfig


def _build(cfg):
    from mixprec.models import Transformer
    return lambda: Transformer.from_preset(cfg.model, max_seq_len=cfg.seq_len)


def test_a_long_sequence_that_does_not_fit_is_refused_with_the_numbers(monkeypatch):
    from mixprec.cli import train as command
    monkeypatch.setattr(command, "_available_memory_bytes", lambda: 2**30)
    monkeypatch.setattr(command.torch.cuda, "is_available", lambda: False)
    cfg = TrainConfig(model="tiny", seq_len=100_000, batch_size=1, precision="32-true")
    # weights, gradients and Adam state alone are ~0.1 GiB: only the activations do not fit
    with pytest.raises(ConfigError) as info:
        command._check_fits_in_memory(_build(cfg), 256, cfg)
    message = str(info.value)
    assert "batch_size=1 x seq_len=100000" in message and "GiB activations" in message
    assert "but 1.0 GiB are free; lower seq_len or batch_size" in message and "\n" not in message


def test_a_seq_len_beyond_the_presets_positions_warns_in_one_line(monkeypatch, capsys):
    from mixprec.cli import train as command
    monkeypatch.setattr(command, "_available_memory_bytes", lambda: None)
    cfg = TrainConfig(model="tiny", seq_len=100_000, batch_size=1, precision="32-true")
    command._check_fits_in_memory(_build(cfg), 256, cfg, say=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1
    line = lines[0]
    assert "position table grows to 100000 rows" in line and "6.52M parameters" in line
    assert "TFLOP" in line and "99% of it attention" in line and "lower seq_len" in line


def test_an_ordinary_run_prints_no_warning(monkeypatch, capsys):
    from mixprec.cli import train as command
    cfg = TrainConfig(model="tiny", seq_len=32, batch_size=4)
    command._check_fits_in_memory(_build(cfg), 256, cfg, say=True)
    assert "warning" not in capsys.readouterr().err


def test_the_default_seq_len_on_tiny_prints_no_warning(monkeypatch, capsys):
    """`mixprec train model=tiny` (seq_len 128 against the preset's 64 positions) grows the model by
    8k parameters: after the merge of the long-sequence warning every such run warned."""
    from mixprec.cli import train as command
    monkeypatch.setattr(command, "_available_memory_bytes", lambda: None)
    cfg = TrainConfig(model="tiny", precision="32-true")
    assert cfg.seq_len > 64
    command._check_fits_in_memory(_build(cfg), 256, cfg, say=True)
    assert "warning" not in capsys.readouterr().err


def test_the_shape_only_model_draws_no_random_numbers_and_real_models_still_do():
    """The check builds the model on the meta device; torch's ``normal_`` there loads its Python
    meta kernels (sympy included, ~2 s of CPU at every start), so the check skips the draws: the
    meta weights hold no values anyway. Off the meta device nothing changes."""
    import torch
    from mixprec.cli import train as command
    from mixprec.models import Transformer
    with torch.device("meta"), command._NoDrawsOnMeta():
        meta = Transformer.from_preset("tiny")
        w = torch.empty(3, 4)
        assert torch.nn.init.normal_(w) is w and w.is_meta
    assert meta.wte.weight.is_meta and meta.num_parameters() == Transformer.from_preset("tiny").num_parameters()
    with command._NoDrawsOnMeta():
        torch.manual_seed(0)
        drawn = torch.nn.init.normal_(torch.zeros(1000))
        assert 0.9 < float(drawn.std()) < 1.1
