"""Imports point down: a room of mixprec imports only rooms below it in docs/ARCHITECTURE.md's
order, at module level and inside functions alike; no module imports itself back through others
(no circles); nothing inside mixprec imports an old-path shim."""
import ast
from pathlib import Path

import mixprec

ORDER = ["policy", "amp", "optim", "nn", "formats", "precision", "models", "data", "strategies",
         "monitor", "estimate", "plan", "runs", "train", "integrations", "report", "bench", "cli"]
"""Lowest first. ``errors``, ``hints`` and ``_compat`` may be imported by everyone; ``mixprec/__init__.py``
and ``__main__.py`` sit above everything."""

SHIM_UP = {
    # Old import paths kept working by re-exporting from a room above (lazily, on first use):
    "mixprec/amp/__init__.py": {"precision"},    # mixprec.amp.autocast
    "mixprec/monitor/__init__.py": {"plan"},     # mixprec.monitor.LayerReplanner / FormatSwitch
    "mixprec/formats/__init__.py": {"precision"},  # mixprec.formats.convert_to_fp8 / prepare_fp8
    # Not a shim: micro-format conversion asks the rule book lazily; it belongs next to
    # precision/fp8_convert.py (to move).
    "mixprec/formats/mx_convert.py": {"precision"},
}
"""The only imports allowed to point up, each listed with its reason."""

SHIM_PACKAGES = ("engine", "fp8")
"""Old package paths, now pure re-exports (``mixprec.engine`` -> precision/optim, ``mixprec.fp8`` ->
formats). Only ``mixprec/__init__.py`` may import them."""

ROOT = Path(mixprec.__file__).parent


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "mixprec" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER or parts[1] in SHIM_PACKAGES else None


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, package: str, root: Path) -> list[tuple[str, int]]:
    """Every ``mixprec`` module ``path`` imports (``from pkg import sub`` counts as ``pkg.sub``
    when ``sub`` is a module), with the line."""
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
            base_dir = root.parent.joinpath(*name.split("."))
            for a in node.names:
                sub = base_dir / a.name
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    found.append((f"{name}.{a.name}", node.lineno))
                else:
                    found.append((name, node.lineno))
    return [(n, line) for n, line in found if n.split(".")[0] == "mixprec"]


def _files(root: Path):
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        yield path, module, package


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path, module, package in _files(root):
        rel = path.relative_to(root.parent)
        own = _room(module)
        for name, line in _imports(path, package, root):
            other = _room(name)
            if other in SHIM_PACKAGES and own is not None and own != other:
                bad.append(f"{rel}:{line} ({own}) imports the old-path shim {name}")
                continue
            if own is None or other is None or other == own or own in SHIM_PACKAGES:
                continue
            if ORDER.index(other) > ORDER.index(own) and other not in SHIM_UP.get(rel.as_posix(), ()):
                bad.append(f"{rel}:{line} ({own}) imports {name} ({other})")
    return bad


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Groups of modules that import each other, directly or through others (module level and
    inside functions alike); package ``__init__`` files count as the package's module. The lazy
    re-exports listed in :data:`SHIM_UP` are not edges."""
    graph: dict[str, set[str]] = {}
    for path, module, package in _files(root):
        shim_up = SHIM_UP.get(path.relative_to(root.parent).as_posix(), ())  # listed, lazy: not edges
        graph.setdefault(module, set()).update(n for n, _ in _imports(path, package, root)
                                               if n != module and _room(n) not in shim_up)
    for targets in graph.values():  # ``import mixprec.a.b`` of a name, not a module: the package
        targets.intersection_update(graph)
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


ALLOWED_CIRCLES = {
    # ``Transformer.fit(loader, ...)``, the seed's API (docs/CONTRACTS.md), calls the public
    # ``mixprec.fit`` lazily: the model room itself never imports the training loop.
    ("mixprec", "mixprec.models", "mixprec.models.transformer"),
}


def test_every_room_imports_only_rooms_below_it():
    assert violations() == []


def test_no_module_imports_itself_back():
    assert [g for g in import_circles() if tuple(g) not in ALLOWED_CIRCLES] == []


def test_the_checker_catches_an_upward_import(tmp_path):
    fake = tmp_path / "mixprec" / "policy"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from mixprec.train import fit\n")
    (fake / "ok.py").write_text("from mixprec.policy.dtypes import parse_dtype\nimport mixprec.errors\n")
    assert violations(tmp_path / "mixprec") == ["mixprec/policy/bad.py:2 (policy) imports mixprec.train (train)"]


def test_the_checker_catches_a_circle_and_a_shim_import(tmp_path):
    fake = tmp_path / "mixprec" / "report"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from mixprec.report.b import g\n")
    (fake / "b.py").write_text("def g():\n    from mixprec.report.a import f\n")
    (fake / "c.py").write_text("from mixprec.fp8 import quantize\n")
    assert import_circles(tmp_path / "mixprec") == [["mixprec.report.a", "mixprec.report.b"]]
    assert violations(tmp_path / "mixprec") == ["mixprec/report/c.py:1 (report) imports the old-path shim mixprec.fp8"]


def test_the_old_import_paths_still_work():
    import mixprec.engine.precision
    import mixprec.fp8.linear
    import mixprec.precision.policy
    import mixprec.train.checkpoint
    from mixprec.amp import GradScaler, autocast
    from mixprec.engine import OverlappedUpdate, Precision
    from mixprec.fp8 import Fp8Linear, prepare_fp8  # noqa: F401
    from mixprec.monitor import LayerReplanner
    from mixprec.precision import Policy, get_policy, hardware  # noqa: F401
    from mixprec.train import fit  # noqa: F401

    assert Precision is mixprec.Precision and GradScaler is mixprec.GradScaler
    assert mixprec.precision.policy.Policy is Policy is mixprec.policy.Policy
    assert mixprec.fp8.linear is mixprec.formats.fp8_linear and Fp8Linear is mixprec.formats.Fp8Linear
    assert mixprec.engine.precision is mixprec.precision.precision
    assert mixprec.train.checkpoint is mixprec.runs.checkpoint
    assert OverlappedUpdate is mixprec.optim.OverlappedUpdate
    assert LayerReplanner is mixprec.plan.LayerReplanner and autocast is mixprec.precision.autocast
