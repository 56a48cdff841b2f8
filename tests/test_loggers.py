"""Every logger of the package is named for its module (``logging.getLogger(__name__)``), so a
user who configures ``mixprec.formats`` or ``mixprec.policy`` gets those rooms' lines. The FP8
path lines were logged as ``mixprec.fp8``, a package retired in 0.4, and the peak lookup as
``mixprec.peak``: neither a room a user could find."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mixprec"


def test_every_logger_is_named_for_its_module():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getLogger" and node.args
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__")):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, wrong
