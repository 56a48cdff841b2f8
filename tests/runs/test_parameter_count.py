"""The start line names the model's size in a unit that says something for tiny models too
(a new-user trial saw ``model: 0.00M parameters``)."""
from mixprec.runs.events import _count


def test_small_models_print_their_exact_parameter_count():
    assert _count(1_234) == "1,234"
    assert _count(99_999) == "99,999"


def test_larger_models_print_millions():
    assert _count(860_000) == "0.86M"
    assert _count(27_400_000) == "27.40M"
