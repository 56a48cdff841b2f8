"""A setting given twice on one command line (`mixprec train lr=1 lr=2`) is refused in one line;
it was taken silently, the last value winning."""
import pytest

from mixprec.cli import main
from mixprec.errors import ConfigError
from mixprec.train.config import parse_overrides


def test_a_setting_given_twice_with_different_values_is_refused_in_one_line(capsys):
    assert main(["train", "model=tiny", "lr=1", "lr=2"]) == 2
    err = capsys.readouterr().err
    assert "lr given twice: lr=1 and lr=2; pass one" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_setting_given_twice_is_refused_under_either_spelling_and_kept_when_equal():
    with pytest.raises(ConfigError, match="^max_steps given twice: max-steps=1 and max_steps=2; pass one$"):
        parse_overrides(["max-steps=1", "max_steps=2"])
    assert parse_overrides(["lr=1", "lr=1"]) == {"lr": "1"}
