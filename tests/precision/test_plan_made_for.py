"""A plan file records the Linear layers it was planned for; another model is refused in one line,
and a plan file that does not record them (older, hand-written) still loads."""
import json

import pytest
from torch import nn

from mixprec import Precision
from mixprec.errors import ConfigError
from mixprec.policy.overrides import write_plan


def _net(n: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(n)])


def test_a_plan_applied_to_a_model_with_other_linear_layers_is_refused_naming_what_differs(tmp_path):
    plan = write_plan(tmp_path / "plan.json", "32-true", (("0", "bf16"), ("1", "bf16")),
                      made_for="model=two", linears=["0", "1"])
    with pytest.raises(ConfigError) as e:                   # patterns match: not refused before
        Precision(f"plan:{plan}", device="cpu").setup(_net(3))
    msg = str(e.value)
    assert "\n" not in msg and f"plan {plan} was made for another model (made for model=two" in msg
    assert "1 Linear layers the plan does not know (2)" in msg and "make a plan for this model" in msg
    Precision(f"plan:{plan}", device="cpu").setup(_net(2))  # its own model: fine


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_plan_file_records_what_it_was_made_for_in_both_forms(tmp_path, suffix):
    plan = write_plan(tmp_path / f"plan{suffix}", "32-true", (("0", "bf16"),), made_for="model=two",
                      linears=["0", "1"])
    with pytest.raises(ConfigError, match="1 planned ones are not in it"):
        Precision(f"plan:{plan}", device="cpu").setup(_net(1))


def test_an_old_plan_file_without_its_linear_layers_still_loads(tmp_path):
    plan = tmp_path / "old.json"
    plan.write_text(json.dumps({"precision": "32-true", "overrides": [["0", "bf16"]]}))
    p = Precision(f"plan:{plan}", device="cpu")
    p.setup(_net(3))
    assert p.layers.formats["0"] == "bf16"
