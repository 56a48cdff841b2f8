"""``Precision`` members retired in 0.4 fail in one line naming their new home; the new homes
answer; the CHANGELOG's member table lists every one (mixprec._moved.MOVED_MEMBERS)."""
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec._moved import MOVED_MEMBERS, MovedAttributeError
from mixprec.precision import Precision

CHANGELOG = Path(mixprec.__file__).parent.parent / "CHANGELOG.md"


def _member(old: str) -> str:
    return old.split(".", 1)[1]


@pytest.mark.parametrize("old", sorted(MOVED_MEMBERS))
def test_a_retired_member_names_its_new_home_in_one_line(old):
    precision = Precision("bf16-true", device="cpu")
    line = f"{old} moved to {MOVED_MEMBERS[old]} in 0.4; see CHANGELOG.md"
    for owner in (precision, Precision):                # on an instance and on the class
        with pytest.raises(MovedAttributeError) as err:
            getattr(owner, _member(old))
        assert str(err.value) == line and (err.value.old, err.value.new) == (old, MOVED_MEMBERS[old])
        assert not hasattr(owner, _member(old)) and getattr(owner, _member(old), "gone") == "gone"


@pytest.mark.parametrize("old", sorted(MOVED_MEMBERS))
def test_no_retired_member_is_still_defined_on_the_class(old):
    assert _member(old) not in vars(Precision)


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"])
@pytest.mark.parametrize("old", sorted(MOVED_MEMBERS))
def test_every_new_home_answers(old, mode):
    """The right-hand column, evaluated as written (``Precision`` standing for an instance)."""
    precision = Precision(mode, device="cpu")
    model = nn.Linear(4, 4)
    expr = re.sub(r"^Precision\.", "precision.", MOVED_MEMBERS[old])
    env = {"mixprec": mixprec, "precision": precision, "recipe": precision.recipe, "model": model,
           "optimizer": torch.optim.AdamW(model.parameters())}
    if expr.endswith("forget_setup(model)"):
        precision.setup_module(model)
        assert mixprec.precision.setup_identity(model) == mixprec.precision.identity(precision.policy)
    value = eval(expr, env)                                     # noqa: S307 (our own table)
    if old.endswith("_dtype"):
        assert isinstance(value, torch.dtype)
    if expr.endswith("forget_setup(model)"):
        assert mixprec.precision.setup_identity(model) is None


def test_the_new_homes_give_the_old_answers_for_a_16_bit_mode():
    """What 0.3's members said of 16-true and bf16-mixed, read from their new homes."""
    p = Precision("16-true", device="cpu")
    r = p.recipe
    assert (r.param_dtype, r.compute_dtype, r.reduce_dtype) == (torch.float16, torch.float16, torch.float32)
    assert r.stores_low_precision and r.keeps_masters and r.scales_loss and not r.loses_small_updates
    assert (p.scaler.num_skipped_steps, p.scaler.last_step_skipped, p.scaler.last_grad_norm) == (0, False, None)
    assert p.scaler.get_scale() == 2.0 ** 16
    mixed = Precision("bf16-mixed", device="cpu").recipe
    assert mixed.autocasts and mixed.autocast_copies_weights and not mixed.stores_low_precision


def test_reconcile_with_optimizer_of_0_3_names_precision_auto_with_the_optimizer():
    """0.3's mode change after construction is gone: the recipe is built with the optimizer."""
    with pytest.raises(MovedAttributeError, match=r"^Precision.reconcile_with_optimizer moved to "
                       r'mixprec.precision.Precision\("auto", optimizer=optimizer\) in 0.4; see CHANGELOG.md$'):
        Precision("auto", device="cpu").reconcile_with_optimizer
    model = nn.Linear(4, 4)
    home = mixprec.precision.Precision("auto", optimizer=torch.optim.AdamW(model.parameters()))
    assert isinstance(home, Precision)


def test_a_member_that_never_existed_is_a_plain_attribute_error():
    with pytest.raises(AttributeError) as err:
        Precision("32-true", device="cpu").no_such_member
    assert not isinstance(err.value, MovedAttributeError) and "no attribute 'no_such_member'" in str(err.value)


def test_the_changelog_lists_every_retired_member_with_its_new_home():
    rows = dict(re.findall(r"^\| `(Precision\.\w+)` \| `(.+)` \|$", CHANGELOG.read_text(), re.M))
    assert rows == MOVED_MEMBERS
