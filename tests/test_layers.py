"""Imports point down: a room of mixprec imports only rooms below it in docs/ARCHITECTURE.md's
order, at module level and inside functions alike, so the core (the library) never imports a tool;
no module imports itself back through others (no circles); ``import mixprec`` loads only the core."""
import ast
import subprocess
import sys
from pathlib import Path

import mixprec

CORE = ["policy", "amp", "optim", "nn", "formats", "precision", "models", "data", "strategies",
        "monitor", "runs", "train"]
"""The library, lowest first."""

TOOLS = ["estimate", "plan", "integrations", "report", "bench", "cli"]
"""What uses the library: above every room of the core."""

ORDER = CORE + TOOLS
"""Lowest first. ``errors``, ``hints`` and ``_moved`` may be imported by everyone; ``mixprec/__init__.py``,
``__main__.py`` and ``launch.py`` sit above everything."""

ROOT_USERS = {
    # ``Transformer.fit(loader, ...)``, the seed's API (docs/CONTRACTS.md), calls the public
    # ``mixprec.fit`` inside the method: the model room never imports the training loop itself.
    "mixprec/models/transformer.py",
}
"""Modules of a room allowed to import the top-level package (which names every room, the loop
included), each with its reason."""

LAZY_IN_CORE = {
    # FSDP2 (torch.distributed.fsdp, DTensor) takes about a second to import: loaded when named.
    "mixprec/strategies/__init__.py": "FSDP2 is slow to import",
    # Transformer.fit, the seed API: through the top-level package (ROOT_USERS).
    "mixprec/models/transformer.py": "Transformer.fit calls mixprec.fit",
    # The Triton block GEMM imports Triton, an optional dependency: only where a plan names it.
    "mixprec/formats/fp8_gemm.py": "the Triton kernel is optional",
    "mixprec/formats/fp8_path.py": "the Triton kernel is optional",
    # The flat step's fused AdamW kernel (mixprec.optim.adamw_triton) imports Triton: only where
    # a chunk takes the kernel (a CUDA device whose probe agreed).
    "mixprec/optim/flat_kernel.py": "the Triton kernel is optional",
}
"""Core modules that may import a mixprec module inside a function, each with its reason; elsewhere
the core imports at module level (a function-level import is for an optional heavy dependency).
``LAZY_ROOMS`` (rooms exempt while #38 reshaped them): none left."""

LAZY_ROOMS: set[str] = set()

EAGER_ROOMS = {"amp", "precision"}
"""Rooms where every function-level import counts, of any package (torch's too), not only mixprec's:
each one left is listed in :data:`LAZY_HEAVY`."""

LAZY_HEAVY = {
    # FSDP2's MixedPrecisionPolicy: torch.distributed.fsdp loads ~600 modules, only where FSDP2 runs.
    "mixprec/precision/plugins/fsdp2.py": {"torch.distributed.fsdp"},
}
"""The optional heavy dependencies a module of :data:`EAGER_ROOMS` imports inside a function."""

SHIM_UP: dict[str, set[str]] = {}
"""Imports allowed to point up, each listed with its reason: none (the last lazy re-exports upward
were retired in 0.4, CHANGELOG.md)."""

ROOT = Path(mixprec.__file__).parent


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "mixprec" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else None


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


def _function_imports(path: Path, *, any_package: bool = False,
                      allowed: set[str] = frozenset()) -> list[int]:
    """Lines of the ``mixprec`` imports inside functions of ``path`` (with ``any_package``, of
    every package's), those of the modules in ``allowed`` left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):  # a relative import is one of mixprec's
                    names = [node.module or ""] if node.level == 0 else ["mixprec"]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(n not in allowed and (any_package or n.split(".")[0] == "mixprec")
                       for n in names):
                    lines.append(node.lineno)
    return sorted(set(lines))


def lazy_core_imports(root: Path = ROOT) -> list[str]:
    """``file:line`` of each function-level mixprec import in a core room, outside
    :data:`LAZY_IN_CORE` and :data:`LAZY_ROOMS`, and of each function-level import of any package
    in :data:`EAGER_ROOMS`, outside :data:`LAZY_HEAVY`."""
    bad = []
    for path, module, _ in _files(root):
        rel = path.relative_to(root.parent).as_posix()
        room = _room(module)
        if room in EAGER_ROOMS:
            bad += [f"{rel}:{line}" for line in _function_imports(path, any_package=True,
                                                                  allowed=LAZY_HEAVY.get(rel, set()))]
        elif room in CORE and room not in LAZY_ROOMS and rel not in LAZY_IN_CORE:
            bad += [f"{rel}:{line}" for line in _function_imports(path)]
    return bad


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
            if name == "mixprec" and own is not None and rel.as_posix() not in ROOT_USERS:
                bad.append(f"{rel}:{line} ({own}) imports the top-level package mixprec")
                continue
            if own is None or other is None or other == own:
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


def test_every_room_imports_only_rooms_below_it():
    assert violations() == []


def test_the_core_imports_at_module_level():
    assert lazy_core_imports() == []


def test_the_checker_catches_a_lazy_import_in_the_core(tmp_path):
    fake = tmp_path / "mixprec" / "runs"
    fake.mkdir(parents=True)
    (fake / "lazy.py").write_text("import torch\n\ndef f():\n    from mixprec.policy import dtypes\n")
    assert lazy_core_imports(tmp_path / "mixprec") == ["mixprec/runs/lazy.py:4"]


def test_the_checker_catches_any_lazy_import_in_an_eager_room_but_a_listed_heavy_one(tmp_path):
    fake = tmp_path / "mixprec" / "precision" / "plugins"
    fake.mkdir(parents=True)
    (fake / "fsdp2.py").write_text("def f():\n    import math\n    from torch.distributed.fsdp import X\n")
    (fake / "other.py").write_text("def g():\n    from torch.distributed.fsdp import X\n")
    assert lazy_core_imports(tmp_path / "mixprec") == ["mixprec/precision/plugins/fsdp2.py:2",
                                                       "mixprec/precision/plugins/other.py:2"]


def test_importing_precision_and_amp_leaves_fsdp2_unloaded():
    assert _loaded_after("import mixprec.precision, mixprec.amp", "torch.distributed.fsdp") == []
    assert _loaded_after("import torch.distributed.fsdp", "torch.distributed.fsdp") != []


def test_no_module_imports_itself_back():
    assert import_circles() == []


def test_the_checker_catches_an_upward_import(tmp_path):
    fake = tmp_path / "mixprec" / "policy"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from mixprec.train import fit\n")
    (fake / "ok.py").write_text("from mixprec.policy.dtypes import parse_dtype\nimport mixprec.errors\n")
    assert violations(tmp_path / "mixprec") == ["mixprec/policy/bad.py:2 (policy) imports mixprec.train (train)"]


def test_the_checker_catches_a_circle(tmp_path):
    fake = tmp_path / "mixprec" / "report"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from mixprec.report.b import g\n")
    (fake / "b.py").write_text("def g():\n    from mixprec.report.a import f\n")
    assert import_circles(tmp_path / "mixprec") == [["mixprec.report.a", "mixprec.report.b"]]


def test_the_checker_catches_the_core_importing_a_tool(tmp_path):
    fake = tmp_path / "mixprec" / "train"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("def f():\n    from mixprec.plan import plan_precision\n")
    (fake / "root.py").write_text("def g():\n    import mixprec\n    return mixprec.plan\n")
    assert violations(tmp_path / "mixprec") == ["mixprec/train/bad.py:2 (train) imports mixprec.plan (plan)",
                                                "mixprec/train/root.py:2 (train) imports the top-level package mixprec"]


def test_every_room_of_the_package_is_placed():
    rooms = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ORDER)
    assert (tuple(CORE), tuple(TOOLS)) == (mixprec._CORE, mixprec._TOOLS)


def _loaded_after(code: str, prefix: str = "mixprec") -> list[str]:
    """The modules named ``prefix...`` loaded after running ``code`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\n"
                          f"print(*sorted(m for m in sys.modules if m.startswith({prefix!r})))"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def test_import_mixprec_loads_only_the_package_its_errors_and_version():
    assert _loaded_after("import mixprec") == ["mixprec", "mixprec._moved", "mixprec._version",
                                               "mixprec.errors"]


def test_every_public_name_loads_only_core_modules():
    loaded = _loaded_after("import mixprec\nfor n in mixprec.__all__: getattr(mixprec, n)")
    rooms = {m.split(".")[1] for m in loaded if m.count(".")}
    assert "mixprec.precision.precision" in loaded and "mixprec.train.trainer" in loaded
    assert rooms - set(CORE) <= {"_moved", "_version", "errors", "hints"}


def test_a_sub_package_is_imported_when_first_named():
    assert mixprec.formats.Fp8Linear.__module__ == "mixprec.formats.fp8_linear"
    assert mixprec.plan.plan_precision.__module__ == "mixprec.plan.planner"
    assert mixprec.fit is mixprec.train.fit and mixprec.FSDPStrategy.__module__ == "mixprec.strategies.fsdp"


def test_the_optimizers_load_neither_triton_nor_fsdp2():
    # What optim/ still imports inside functions, and why: Triton (optional: the flat step's fused
    # AdamW kernel, mixprec/optim/flat_kernel.py) and FSDP2 / DTensor (about a second each to
    # import, 2-core x86, 2026-12-05: mixprec/optim/overlap.py, sharded.py), loaded when used.
    out = subprocess.run([sys.executable, "-c", "import sys, mixprec.optim\n"
                          "print(*sorted(m for m in sys.modules if m.split('.')[0] == 'triton'\n"
                          "      or m.startswith(('torch.distributed.fsdp', 'torch.distributed.tensor'))))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == []
