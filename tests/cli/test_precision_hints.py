"""The precision "did you mean" every command gives (train, estimate, audit) stays in the typed format."""
import pytest

from mixprec.cli.main import main


@pytest.mark.parametrize("argv", [
    ["train", "precision=fp16-mixd", "max_steps=1"],
    ["estimate", "--precision", "fp16-mixd", "--params", "1B", "--tokens", "1B"],
    ["audit", "precision=fp16-mixd"],
])
def test_every_command_suggests_fp16_mixed_for_an_fp16_typo(argv, capsys):
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "did you mean 'fp16-mixed'" in err
    assert "did you mean 'bf16" not in err


def test_estimate_accepts_fp16_mixed_as_16_mixed(capsys):
    assert main(["estimate", "--precision", "fp16-mixed", "--params", "1B", "--tokens", "1B"]) == 0
    fp16 = capsys.readouterr().out
    assert main(["estimate", "--precision", "16-mixed", "--params", "1B", "--tokens", "1B"]) == 0
    assert capsys.readouterr().out == fp16.replace("fp16-mixed", "16-mixed")   # same numbers, name as typed
