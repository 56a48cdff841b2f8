"""A too-small init_scale names init_scale as given and the min_scale it is checked against."""
import pytest

from mixprec.errors import ConfigError
from mixprec.train.config import TrainConfig


def test_init_scale_below_the_default_min_scale_names_init_scale_and_says_lower_min_scale():
    # Before: "min_scale must be in (0, init_scale], got 1.0" although only init_scale was set.
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny", init_scale=1e-6).validate()
    msg = str(e.value)
    assert msg.startswith("init_scale=1e-06 is below min_scale=1 (the default)")
    assert "lower min_scale too (e.g. init_scale=1e-06 min_scale=1e-06)" in msg and "\n" not in msg
    TrainConfig(model="tiny", init_scale=1e-6, min_scale=1e-6).validate()        # the fix works


def test_init_scale_below_a_given_min_scale_and_a_non_positive_min_scale():
    with pytest.raises(ConfigError, match=r"^init_scale=8 is below min_scale=16, the floor"):
        TrainConfig(model="tiny", init_scale=8.0, min_scale=16.0).validate()
    with pytest.raises(ConfigError, match=r"^min_scale must be > 0, got 0$"):
        TrainConfig(model="tiny", min_scale=0.0).validate()
