"""One rule, one place: no file outside the decider (mixprec/precision/) decides a precision rule
itself (reads the ``keep_in_fp32`` tag, tests for a norm by class, for a gate by name); it asks
the rule book or the per-layer table. The counting is tools/precision_counts.py's."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("precision_counts", ROOT / "tools" / "precision_counts.py")
counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(counts)

ALLOWED: dict[str, str] = {}
"""``{file: why}``: files allowed to branch on a rule outside the decider (none today)."""


def test_no_file_outside_the_decider_branches_on_a_precision_rule():
    found = counts.rule_branches(ROOT)
    assert {f: lines for f, lines in found.items() if f not in ALLOWED} == {}


def test_the_counter_catches_a_tag_read_a_norm_test_and_a_gate_name(tmp_path):
    pkg = tmp_path / "mixprec" / "optim"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text(
        "def f(p, m, name):\n"
        "    if getattr(p, 'keep_in_fp32', False):\n"
        "        return 1\n"
        "    if isinstance(m, nn.LayerNorm):\n"
        "        return 2\n"
        "    return name.endswith(('gate', 'router'))\n")
    (pkg / "fine.py").write_text('"""Prose may say keep_in_fp32 and isinstance(m, nn.LayerNorm)."""\n'
                                 "class N:\n    keep_in_fp32 = True\n")
    (tmp_path / "mixprec" / "precision").mkdir()
    (tmp_path / "mixprec" / "precision" / "rules.py").write_text("x = getattr(m, 'keep_in_fp32', 0)\n")
    found = counts.rule_branches(tmp_path)
    assert list(found) == ["mixprec/optim/bad.py"]
    assert [line.split(": ")[1] for line in found["mixprec/optim/bad.py"]] == \
        ["tag read", "norm by class", "gate by name"]
