"""A ready Precision passed to fit() keeps its own settings; a fit() argument that would change one
is refused in one line (the same value is fine), and the precision=... field takes effect."""
import csv

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.errors import ConfigError
from mixprec.train.config import FitConfig


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)


def data(n=2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(n)]


def _fit(tmp_path, **kw):
    kw = {"max_steps": 2, "progress": False, "audit": False, "run_dir": str(tmp_path / "run"),
          "log_interval": 1, **kw}
    return mp.fit(Regressor(), data(), **kw)


@pytest.mark.parametrize("setting, value, option", [
    ("init_scale", 1024.0, "init_scale"),
    ("growth_interval", 10, "growth_interval"),
    ("hysteresis", 3, "hysteresis"),
    ("min_scale", 0.5, "min_scale"),
    ("on_stuck_scale", "warn", "on_min_scale"),
])
def test_a_scaler_setting_that_would_change_a_ready_precision_is_refused_in_one_line(
        setting, value, option, tmp_path):
    ready = mp.Precision("16-mixed")
    with pytest.raises(ConfigError) as e:
        _fit(tmp_path, mixed_precision=ready, **{setting: value})
    msg = str(e.value)
    assert "\n" not in msg and f"{setting}={value!r}" in msg
    assert f"mixprec.Precision('16-mixed', {option}={value!r})" in msg
    # ... also when it comes in a FitConfig (where only values other than the defaults show)
    if getattr(FitConfig(), setting) != value:
        with pytest.raises(ConfigError, match=f"{setting}="):
            _fit(tmp_path, mixed_precision=ready, config=FitConfig(**{setting: value}))


@pytest.mark.parametrize("setting, value", [
    ("init_scale", 2.0**16), ("growth_interval", 2000), ("hysteresis", 1), ("on_stuck_scale", "raise"),
])
def test_a_setting_equal_to_the_ready_precisions_is_accepted(setting, value, tmp_path):
    result = _fit(tmp_path, mixed_precision=mp.Precision("16-mixed"), **{setting: value})
    assert result.steps == 2


def test_a_ready_precision_keeps_its_init_scale(tmp_path):
    _fit(tmp_path, mixed_precision=mp.Precision("16-mixed", init_scale=1024, growth_interval=100))
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert float(rows[0]["loss_scale"]) == 1024.0


def test_precision_and_overrides_of_a_ready_precision_are_refused(tmp_path):
    ready = mp.Precision("bf16-mixed")
    with pytest.raises(ConfigError, match="precision='16-mixed' with a ready Precision\\('bf16-mixed'\\)"):
        _fit(tmp_path, mixed_precision=ready, precision="16-mixed")
    with pytest.raises(ConfigError, match="precision_overrides with a ready Precision"):
        _fit(tmp_path, mixed_precision=ready, precision_overrides={"net": "fp32"})
    assert _fit(tmp_path, mixed_precision=ready, precision="bf16-mixed", overwrite=True).policy == "bf16-mixed"


def test_the_precision_field_takes_effect_and_disagreeing_modes_are_refused(tmp_path):
    """fit(precision=...) used to be overridden by mixed_precision's default (True = auto)."""
    assert _fit(tmp_path, precision="16-mixed").policy == "16-mixed"
    with pytest.raises(ConfigError, match="mixed_precision='bf16-mixed' and precision='16-mixed' disagree"):
        _fit(tmp_path, mixed_precision="bf16-mixed", precision="16-mixed", overwrite=True)
    assert _fit(tmp_path, mixed_precision=True, precision="auto", overwrite=True).steps == 2


def test_fit_built_precision_applies_the_scaler_settings(tmp_path):
    _fit(tmp_path, precision="16-mixed", init_scale=1024)
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert float(rows[0]["loss_scale"]) == 1024.0
