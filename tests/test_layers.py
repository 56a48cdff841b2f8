"""Imports point down: a room of mixprec imports only rooms below it in ARCHITECTURE.md's order
(docs/CONTRACTS.md), at module level and inside functions alike."""
import ast
from pathlib import Path

import mixprec

ORDER = ["precision", "amp", "optim", "nn", "fp8", "engine", "models", "data", "strategies",
         "monitor", "train", "bench", "plan", "cli"]
"""Lowest first. ``errors`` may be imported by everyone; ``mixprec/__init__.py`` and
``__main__.py`` sit above everything."""

ALLOWED_UP = {
    # The seed's ``model.fit(...)`` API: the model delegates to the trainer, lazily.
    ("models", "train"),
    # Guarded training (issue 24): the trainer builds the guard, lazily; in the layout of issue
    # 23 ``plan`` sits below ``train`` and this entry goes.
    ("train", "plan"),
}

ROOT = Path(mixprec.__file__).parent


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "mixprec" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else None


def _imports(path: Path, package: str) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            if name == "mixprec":  # from mixprec import train
                found += [(f"mixprec.{a.name}", node.lineno) for a in node.names]
    return found


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        module = ".".join(rel.with_suffix("").parts)
        own = "cli" if module == "mixprec.cli" else _room(module)
        if own is None:
            continue
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name, line in _imports(path, package):
            other = "cli" if name == "mixprec.cli" else _room(name)
            if other is None or other == own:
                continue
            if ORDER.index(other) > ORDER.index(own) and (own, other) not in ALLOWED_UP:
                bad.append(f"{rel}:{line} ({own}) imports {name} ({other})")
    return bad


def test_every_room_imports_only_rooms_below_it():
    assert violations() == []


def test_the_checker_catches_an_upward_import(tmp_path):
    fake = tmp_path / "mixprec" / "precision"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from mixprec.train import fit\n")
    (fake / "ok.py").write_text("from mixprec.precision.dtypes import parse_dtype\nimport mixprec.errors\n")
    assert violations(tmp_path / "mixprec") == ["mixprec/precision/bad.py:2 (precision) imports mixprec.train (train)"]
