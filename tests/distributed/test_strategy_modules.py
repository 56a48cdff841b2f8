"""How the strategies package is put together: env.py is a leaf (the launch environment only), the
factory lives in the package, the process-group mixin in base.py, and old import paths still work."""
import ast
from pathlib import Path

import mixprec.strategies as strategies

ROOT = Path(strategies.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_env_module_imports_no_sibling_strategy_module():
    siblings = {n for n in _imported_modules(ROOT / "env.py") if n.startswith("mixprec.strategies")}
    assert siblings == set()


def test_factory_and_mixin_live_in_package_and_base_and_old_paths_still_import():
    from mixprec.strategies import STRATEGIES, ProcessGroupStrategy, get_strategy
    from mixprec.strategies import base, env
    assert get_strategy.__module__ == "mixprec.strategies"
    assert ProcessGroupStrategy.__module__ == "mixprec.strategies.base"
    assert base.ProcessGroupStrategy is ProcessGroupStrategy
    assert env.get_strategy is get_strategy and env.STRATEGIES is STRATEGIES
    assert env.ProcessGroupStrategy is ProcessGroupStrategy
    assert issubclass(strategies.MirroredStrategy, ProcessGroupStrategy)
    assert issubclass(strategies.FSDPStrategy, ProcessGroupStrategy)
