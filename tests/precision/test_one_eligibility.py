"""One eligibility function: every caller that decides whether a layer may run in an FP8 or micro
format gives the answer of :func:`mixprec.precision.eligibility.refusal`, on a model holding every
kind of layer it refuses (too small, features not a multiple of the format's, a tied head, a head
by name, a gate, a layer inside a module kept FP32, a layer the user filters out, the last block
under the NVFP4 recipe), and no other module re-implements its divisibility or isinstance rule."""
import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.formats import Fp8Config, MicroConfig
from mixprec.monitor.audit import audit
from mixprec.plan.measure import format_variants
from mixprec.precision import Precision, convert_to_fp8, convert_to_micro, get_policy
from mixprec.precision.eligibility import model_facts, refusal

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ["fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"]


class Kept(nn.Module):
    keep_in_fp32 = True

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 128)
        self.out = nn.Linear(128, 64)


class Zoo(nn.Module):
    """Every kind of layer the rules keep out, beside eligible ones."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(256, 64)
        self.blocks = nn.ModuleList(Block() for _ in range(4))   # nvfp4 keeps the last in BF16
        self.small = nn.Linear(64, 24)          # too small: 24 is no multiple of 16
        self.odd = nn.Linear(48, 64)            # a multiple of 16, not of MX's 32-element block
        self.gate = nn.Linear(64, 16)           # an MoE gate, by name
        self.kept = Kept()                      # its Linear sits in a module kept FP32
        self.filtered = nn.Linear(64, 64)       # the user's filter (keep_fp32_names / module_filter_fn)
        self.proj_out = nn.Linear(64, 256, bias=False)
        self.proj_out.weight = self.wte.weight  # a head tied to the embedding
        self.lm_head = nn.Linear(64, 256)       # a head by name


def _policy(fmt: str):
    """A precision running ``fmt`` everywhere the rules allow, with a user filter by name."""
    return get_policy(fmt).replace(keep_fp32_names=("filtered",))


def _config(precision: Precision, fmt: str):
    return Fp8Config.from_recipe(fmt) if fmt.startswith("fp8-") else precision.recipe.micro_config(fmt)


def _answers(fmt: str, *, explicit: bool = False, policy=None, module_filter_fn=None) -> dict[str, str | None]:
    """The function's answer for every Linear of a fresh Zoo."""
    precision = Precision(policy or _policy(fmt))
    model = Zoo()
    facts = model_facts(model)
    config = _config(precision, fmt)
    return {n: refusal(n, m, config, facts, keeps_fp32=precision.layers.keep_fp32_reason,
                       module_filter_fn=module_filter_fn, explicit=explicit)
            for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_the_zoo_holds_every_kind_of_refusal():
    fp8, nvfp4, mx = _answers("fp8-tensorwise"), _answers("nvfp4"), _answers("mxfp8")
    assert "multiples of 16" in fp8["small"] and fp8["odd"] is None
    assert "32-element block" in mx["odd"]
    assert fp8["proj_out"] == "output head tied to an embedding"
    assert fp8["lm_head"] == "output head (named 'lm_head')"
    assert "MoE gate" in fp8["gate"] and "keep_in_fp32" in fp8["kept.proj"]
    assert fp8["filtered"] == "kept in FP32 by the precision policy (keep_fp32_names 'filtered')"
    assert "last 1 of 4 blocks" in nvfp4["blocks.3.fc"] and nvfp4["blocks.0.fc"] is None
    assert fp8["blocks.3.fc"] is None                       # the blocks rule is a micro recipe's


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_table_before_and_after_setup_and_the_conversion_report_give_the_functions_answer(fmt):
    want = _answers(fmt)
    precision = Precision(_policy(fmt))
    model = Zoo()
    before = precision.resolve(model)
    assert {n: before[n].refused or None for n in want} == want
    precision.setup(model)
    report = precision.layers.fp8_report if fmt.startswith("fp8-") else precision.layers.micro_report
    assert set(report.converted) == {n for n, why in want.items() if why is None}
    assert {n: why for n, why in report.skipped if n in want} == \
        {n: why for n, why in want.items() if why is not None}
    after = precision.resolve(model)
    assert {n: after[n].refused or None for n in want} == want
    assert {n for n in want if after[n].compute == fmt} == {n for n, why in want.items() if why is None}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_layer_switch_re_planning_and_the_guard_make_gives_the_functions_answer(fmt):
    # set_layer_format (LayerReplanner, TrainingGuard, mixprec plan's verification) names the
    # layer and its format: explicit, so a recipe's first/last-blocks rule does not apply.
    policy = get_policy("32-true").replace(keep_fp32_names=("filtered",))
    want = _answers(fmt, explicit=True, policy=policy)
    precision = Precision(policy)
    model = Zoo()
    precision.setup(model)
    got = {n: precision.layers.set_format(model, n, fmt) for n in want}
    assert {n for n, f in got.items() if f == fmt} == {n for n, why in want.items() if why is None}
    assert all(f in ("fp32", fmt) for f in got.values())


@pytest.mark.parametrize("fmt", ["fp8-rowwise", "mxfp4"])
def test_direct_conversion_with_a_user_filter_gives_the_functions_answer(fmt):
    def keep_out(module, name):
        return name != "filtered"

    policy = get_policy("32-true")
    want = _answers(fmt, policy=policy, module_filter_fn=keep_out)
    assert want["filtered"] == "excluded by module_filter_fn"
    model = Zoo()
    if fmt.startswith("fp8-"):
        report = convert_to_fp8(model, config=Fp8Config.from_recipe(fmt), module_filter_fn=keep_out)
    else:
        report = convert_to_micro(model, config_fn=lambda name: MicroConfig.from_recipe(fmt),
                                  module_filter_fn=keep_out)
    assert set(report.converted) == {n for n, why in want.items() if why is None}
    assert {n: why for n, why in report.skipped if n in want} == \
        {n: why for n, why in want.items() if why is not None}


def test_the_audit_and_the_planner_report_the_functions_refusals():
    fmt = "fp8-tensorwise"
    precision = Precision("32-true", overrides=(("*", fmt),))
    want = _answers(fmt, explicit=True, policy=precision.policy)
    refused = {n: why for n, why in want.items() if why is not None}
    model = Zoo()
    message = next(f.message for f in audit(model, precision=precision) if f.code == "fp8-override-refused")
    assert all(f"{n} ({why})" in message for n, why in refused.items())
    assert not any(f" {n} (" in message or message.endswith(n) for n in want if n not in refused)
    _, by_format = format_variants(Zoo(), [fmt], torch.device("cpu"))
    assert by_format[fmt] == refused


# ---------------------------------------------------------------- architecture: one place

ELIGIBILITY = "mixprec/precision/eligibility.py"
ALLOWED_DIVISIBILITY = {
    "mixprec/formats/fp8_path.py": "the path decider: which kernel an FP8 layer's GEMMs run on "
                                   "(alignment to 16/128), not whether it is converted",
    "mixprec/bench/modes.py": "torchao's own module filter for the peer benchmark, not mixprec's rule",
}
ALLOWED_KIND = {
    "mixprec/precision/rules.py": "the rule book's kind 'GEMM layer' (is_gemm_layer: a Linear or "
                                  "Conv1D in any format takes a per-layer format at all), which "
                                  "the eligibility function narrows per family",
}
_FEATURES = {"in_features", "out_features"}
_SWAPPED_TO = {"Fp8Linear", "Fp8Conv1D", "MicroLinear"}


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _layer_dims(node: ast.AST) -> bool:
    """Whether ``node`` reads a layer's GEMM dims: ``in_features``/``out_features``, a weight's
    ``shape``, or a bare ``shape`` variable (a tensor's ``x.shape`` is not a layer's)."""
    return any(isinstance(n, ast.Attribute) and (n.attr in _FEATURES or n.attr == "shape" and
                                                 getattr(n.value, "attr", "") == "weight")
               or isinstance(n, ast.Name) and n.id in _FEATURES | {"shape"} for n in ast.walk(node))


def _class_args(call: ast.Call) -> set[str]:
    """The class names an ``isinstance(x, C)`` call tests for."""
    return _names(call.args[1]) if len(call.args) == 2 else set()


def _findings(path: Path) -> list[str]:
    """Where ``path`` re-implements the eligibility rules: divides a layer's features, or tests a
    module for nn.Linear and for an FP8/micro class (or Hugging Face's Conv1D) in one condition,
    or swaps a layer into an FP8/micro module without asking the one function."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _layer_dims(node.left):
            out.append(f"{node.lineno}: divisibility of a layer's features")
        if isinstance(node, ast.BoolOp):
            tested: set[str] = set()
            for value in ast.walk(node):
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                    if value.func.id == "isinstance":
                        tested |= _class_args(value)
                    elif value.func.id == "is_conv1d":
                        tested.add("Conv1D")
                if isinstance(value, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot)) for o in value.ops) \
                        and isinstance(value.left, ast.Call) and getattr(value.left.func, "id", "") == "type":
                    tested |= _names(value.comparators[0])
            if "Linear" in tested and tested & (_SWAPPED_TO | {"Conv1D"}):
                out.append(f"{node.lineno}: which modules a conversion swaps (isinstance rule)")
    swaps = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("from_linear", "from_conv1d")
             and isinstance(n.value, ast.Name) and n.value.id in _SWAPPED_TO]
    asks = any(isinstance(n, ast.ImportFrom) and n.module == "mixprec.precision.eligibility"
               and any(a.name == "refusal" for a in n.names) for n in ast.walk(tree))
    if swaps and not asks:
        out.append(f"{swaps[0].lineno}: swaps a layer to {swaps[0].value.id} without asking refusal")
    return out


def test_no_module_but_the_eligibility_function_decides_eligibility():
    found = {}
    for path in sorted((ROOT / "mixprec").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = [line for line in _findings(path) if rel != ELIGIBILITY
                 and not (rel in ALLOWED_DIVISIBILITY and "divisibility" in line)
                 and not (rel in ALLOWED_KIND and "isinstance rule" in line)]
        if lines:
            found[rel] = lines
    assert found == {}


def test_the_check_catches_a_divisibility_an_isinstance_rule_and_an_unasked_swap(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def eligible(m):\n"
        "    return isinstance(m, nn.Linear) and not isinstance(m, Fp8Linear) and m.in_features % 16 == 0\n"
        "def by_shape(shape):\n"
        "    return shape[0] % 32 or shape[1] % 32\n"
        "def also(m):\n"
        "    return type(m) is nn.Linear or is_conv1d(m)\n"
        "def swap(m, c):\n"
        "    return MicroLinear.from_linear(m, c)\n")
    assert sorted(_findings(bad)) == [
        "2: divisibility of a layer's features", "2: which modules a conversion swaps (isinstance rule)",
        "4: divisibility of a layer's features", "4: divisibility of a layer's features",
        "6: which modules a conversion swaps (isinstance rule)",
        "8: swaps a layer to MicroLinear without asking refusal"]
    fine = tmp_path / "fine.py"
    fine.write_text("from mixprec.precision.eligibility import refusal\n"
                    "def swap(m, c, facts):\n"
                    "    return None if refusal('x', m, c, facts) else MicroLinear.from_linear(m, c)\n"
                    "names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]\n")
    assert _findings(fine) == []
