"""`mixprec memory --params`: the same count parser as `estimate --params`, and a sane shape."""
import argparse
import dataclasses

import pytest

from mixprec.cli import memory as memory_cmd
from mixprec.errors import ConfigError
from mixprec.estimate.memory import MOE_67B
from mixprec.estimate.sizing import shape_for_params


def _memory(capsys, *argv: str) -> str:
    p = argparse.ArgumentParser()
    memory_cmd.configure(p)
    assert memory_cmd.run(p.parse_args([*argv, "--precision", "bf16-mixed"])) == 0
    return capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("written", ["7B", "7e9", "7000000000", "7000M"])
def test_memory_params_reads_counts_as_estimate_does(capsys, written):
    assert _memory(capsys, "--params", written) == _memory(capsys, "--params", "7e9")


def test_memory_params_refuses_what_estimate_refuses_in_one_line():
    p = argparse.ArgumentParser()
    memory_cmd.configure(p)
    with pytest.raises(ConfigError, match=r"^--params '7 billion' is not a number \(write e.g. 14.8T"):
        memory_cmd.run(p.parse_args(["--params", "7 billion"]))


def test_params_alone_grows_width_with_depth_like_gpt3_not_35305_layers_of_the_toy_width(capsys):
    line = _memory(capsys, "--params", "7B")
    assert "(33 layers, d=4224)" in line            # GPT-3 6.7B: 32 layers of 4096
    from mixprec.estimate.cluster import resolve_model
    shape = shape_for_params(resolve_model("small").shape, 7e9)
    assert shape.d_model == 128 * shape.num_layers and shape.d_model // shape.num_heads == 128
    assert abs(shape.num_parameters() - 7e9) < 0.05 * 7e9


def test_params_with_a_width_solves_depth_and_with_a_depth_solves_width():
    from mixprec.estimate.cluster import resolve_model
    small = resolve_model("small").shape
    deep = shape_for_params(small, 7e9, d_model=4096)
    assert (deep.d_model, deep.num_layers) == (4096, 35)
    wide = shape_for_params(small, 7e9, layers=32)
    assert (wide.num_layers, wide.d_model, wide.num_heads) == (32, 4224, 33)
    with pytest.raises(ConfigError, match="at most one of them"):
        shape_for_params(small, 7e9, layers=32, d_model=4096)


def test_params_with_a_named_model_keeps_its_width(capsys):
    assert shape_for_params(MOE_67B, 67e9, keep_width=True) == MOE_67B    # 30 blocks of 4096: 67.3B
    assert "(30 layers, d=4096, 16 experts top-2)" in _memory(capsys, "--model", "moe-67b", "--params", "67B")


@pytest.mark.parametrize("target", [1.0, 3e5, 1e8, 1e12])
def test_the_sized_shape_is_the_nearest_count_of_its_family(target):
    from mixprec.estimate.cluster import resolve_model
    small = resolve_model("small").shape
    shape = shape_for_params(small, target)
    for n in (shape.num_layers - 1, shape.num_layers + 1):
        if n >= 1:
            other = dataclasses.replace(small, num_layers=n, d_model=128 * n, num_heads=n)
            assert abs(other.num_parameters() - target) >= abs(shape.num_parameters() - target)
