"""Import paths retired in 0.4 fail in one line naming their new home; the new homes exist; the
CHANGELOG's migration table lists every one."""
import importlib
import importlib.machinery
import re
import sys
import traceback
from pathlib import Path

import pytest

import mixprec
from mixprec._moved import MOVED_MEMBERS, MOVED_MODULES, MOVED_NAMES, SPLIT, MovedAttributeError, MovedFinder, MovedPathError

CHANGELOG = Path(mixprec.__file__).parent.parent / "CHANGELOG.md"
ROWS = {**MOVED_MODULES, **MOVED_NAMES}
"""Every old path (CHANGELOG's table) -> its new home."""

FORMS = ("import {old}", "from {package} import {name}", "from {old} import anything")
"""``import a.b``, ``from a import b``, ``from a.b import c``."""

OLD_ALL = {
    # mixprec/fp8/__init__.py's __all__ in 0.3 (git show 9215ad3^:mixprec/fp8/__init__.py)
    "mixprec.fp8": ["Fp8Config", "RECIPES", "SCALINGS", "FORMATS", "Fp8Linear", "Fp8Conv1D", "is_conv1d",
                    "convert_to_fp8", "prepare_fp8", "Fp8ConversionReport", "Fp8Tensor", "quantize",
                    "dequantize", "compute_amax", "scale_from_amax", "sqnr_db", "fp8_gemm", "GemmPlan",
                    "plan_gemms", "emulated_mm", "limited_precision_matmul", "round_mantissa",
                    "found_nonfinite", "reset_nonfinite", "nonfinite_layers", "MicroConfig", "MICRO_RECIPES",
                    "BF16_SHARE", "quantize_mx", "quantize_nvfp4", "BlockScaledTensor", "ElementFormat",
                    "ELEMENTS", "E2M1_VALUES", "round_to_grid", "MicroLinear", "quantize_operand",
                    "hadamard_matrix", "convert_to_micro", "MicroConversionReport", "block_index"],
    "mixprec.engine": ["Precision", "OptimizerSpec", "OverlappedUpdate"],
}
"""What the retired packages held (their names' homes: SPLIT)."""


def _first_moved(path: str) -> str:
    """The shortest prefix of ``path`` that moved (``mixprec.fp8`` for ``mixprec.fp8.linear``):
    Python imports (or looks up) the parent first, so that is what is refused."""
    parts = path.split(".")
    return next(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in ROWS)


def _assert_names_where_it_went(line: str, old: str) -> None:
    """One line that names where ``old`` went: its own line, or its split package's line with
    ``old -> its home`` in it."""
    new = ROWS[old]
    assert "\n" not in line and line.endswith("; see CHANGELOG.md"), line
    first = _first_moved(old)
    if first not in SPLIT:
        assert first == old and line == f"{old} moved to {new} in 0.4; see CHANGELOG.md"
    elif first == old:                              # the split package itself: every home
        assert line.startswith(f"{old} was split in 0.4: ")
        assert all(f" -> {home};" in line for home in SPLIT[old]), line
    else:                                           # one of its modules: its own entry
        assert line.startswith(f"{first} was split in 0.4: ") and f"; {old} -> {new};" in line, line


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("old", sorted(ROWS))
def test_every_import_form_of_an_old_path_names_where_that_path_went(old, form):
    package, _, name = old.rpartition(".")
    with pytest.raises(ImportError) as caught:
        exec(form.format(old=old, package=package, name=name), {})
    _assert_names_where_it_went(str(caught.value), old)
    assert old not in sys.modules and _first_moved(old) not in sys.modules


@pytest.mark.parametrize("package", sorted(SPLIT))
def test_a_name_imported_from_a_split_package_is_told_its_own_home(package):
    """``from mixprec.fp8 import convert_to_fp8`` names mixprec.precision, not mixprec.formats."""
    for home, names in SPLIT[package].items():
        for name in names or [n for n in OLD_ALL[package] if not any(n in ns for ns in SPLIT[package].values())]:
            with pytest.raises(ImportError) as caught:
                exec(f"from {package} import {name}", {})
            group = re.search(rf"(?:: |; )([^;:]*) -> {re.escape(home)};", str(caught.value)).group(1)
            shown = dict(re.fullmatch(r"(\w+)(?: \(now (\w+)\))?", item).groups("")
                         for item in group.split(", ")) if names else {}
            assert name in shown if names else group == "its other names"
            now = shown.get(name) or name             # renamed in its new home too: its new name
            assert now in importlib.import_module(home).__all__, (name, now, home)


@pytest.mark.parametrize("package", sorted(SPLIT))
def test_a_split_package_names_a_home_for_every_name_it_held(package):
    named = [n for names in SPLIT[package].values() for n in names]
    assert set(named) <= set(OLD_ALL[package]) and len(named) == len(set(named))
    every_other = [home for home, names in SPLIT[package].items() if not names]
    assert len(every_other) == (0 if set(named) == set(OLD_ALL[package]) else 1)


@pytest.mark.parametrize("old", sorted(ROWS))
def test_an_old_path_named_as_an_attribute_is_an_attribute_error_with_the_line(old):
    first = _first_moved(old)
    package, _, name = first.rpartition(".")
    module = importlib.import_module(package)
    with pytest.raises(AttributeError) as caught:
        getattr(module, name)
    assert isinstance(caught.value, MovedAttributeError) and not isinstance(caught.value, ImportError)
    _assert_names_where_it_went(str(caught.value), first)
    assert not hasattr(module, name) and getattr(module, name, None) is None


@pytest.mark.parametrize("old", sorted(ROWS))
def test_the_finder_hides_no_module_that_exists(old):
    """The finder refuses old names as module paths too (``from mixprec import plan_precision``
    asks for ``mixprec.plan_precision``): none of them may be a file of the package."""
    root = Path(mixprec.__file__).parent.parent
    path = root / old.replace(".", "/")        # (a stale __pycache__ of an old checkout is no module)
    assert not path.with_suffix(".py").exists() and not any(path.glob("*.py"))


def test_hasattr_and_getattr_with_a_default_answer_for_retired_names():
    assert not hasattr(mixprec, "fp8") and not hasattr(mixprec.amp, "autocast")
    assert getattr(mixprec, "plan_precision", None) is None
    assert getattr(mixprec.plan, "TrainingGuard", "default") == "default"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_every_new_module_home_imports(old):
    for new in re.findall(r"mixprec(?:\.\w+)+", MOVED_MODULES[old]):
        assert importlib.import_module(new).__name__ == new


@pytest.mark.parametrize("old", sorted(MOVED_NAMES))
def test_every_new_name_home_holds_the_name(old):
    package, _, name = MOVED_NAMES[old].rpartition(".")
    module = importlib.import_module(package)
    assert name in module.__all__ and getattr(module, name) is not None


def test_the_changelog_lists_every_old_path_with_its_new_home():
    rows = dict(re.findall(r"^\| `(mixprec[\w.]*)` \| (.+) \|$", CHANGELOG.read_text(), re.M))
    assert set(rows) == set(ROWS)
    for old, new in ROWS.items():
        homes = re.findall(r"mixprec(?:\.\w+)+", new)
        assert homes and all(f"`{h}`" in rows[old] for h in homes), (old, rows[old])
    for package, split in SPLIT.items():          # and which of a split package's names went where
        assert all(f"`{n}`" in rows[package] for names in split.values() for n in names), rows[package]


def test_the_changelog_shows_the_last_traceback_line_users_see():
    shown = re.search(r"^    (mixprec\._moved\.MovedPathError: .+)$", CHANGELOG.read_text(), re.M).group(1)
    with pytest.raises(ImportError) as caught:
        exec("import mixprec.train.checkpoint", {})
    assert traceback.format_exception_only(caught.value)[-1].rstrip("\n") == shown
    with pytest.raises(AttributeError) as caught:
        mixprec.train.checkpoint  # noqa: B018
    assert traceback.format_exception_only(caught.value)[-1].rstrip("\n") == shown.replace(
        "MovedPathError", "MovedAttributeError")
    assert "`mixprec._moved.MovedAttributeError: ...`, an `AttributeError`" in " ".join(CHANGELOG.read_text().split())


def test_a_missing_name_that_never_existed_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        mixprec.formats.nothing  # noqa: B018
    assert not hasattr(mixprec, "nothing") and not hasattr(mixprec.plan, "nothing")


def test_the_finder_runs_before_the_path_finder():
    """First: a folder left at an old path (only ``__pycache__``) must not import as a namespace
    package."""
    mine = next(i for i, f in enumerate(sys.meta_path) if isinstance(f, MovedFinder))
    assert mine < sys.meta_path.index(importlib.machinery.PathFinder)


def test_a_stale_folder_at_an_old_path_is_still_refused(tmp_path, monkeypatch):
    stale = tmp_path / "mixprec" / "fp8" / "__pycache__"
    stale.mkdir(parents=True)
    monkeypatch.setattr(mixprec, "__path__", [*mixprec.__path__, str(tmp_path / "mixprec")])
    with pytest.raises(MovedPathError, match=r"^mixprec\.fp8 was split in 0\.4: .* -> mixprec\.formats; "):
        importlib.import_module("mixprec.fp8")


def test_the_public_names_are_the_documented_ones():
    assert len(mixprec.__all__) == len(set(mixprec.__all__)) == 21
    for name in mixprec.__all__:
        assert getattr(mixprec, name).__module__.startswith("mixprec.")
    readme = (CHANGELOG.parent / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in mixprec.__all__)


def test_dir_lists_the_public_names_and_the_sub_packages_only():
    public = {n for n in dir(mixprec) if not n.startswith("__")}
    assert public == {*mixprec.__all__, *mixprec._CORE, *mixprec._TOOLS}
    assert "__version__" in dir(mixprec) and dir(mixprec) == sorted(dir(mixprec))
    assert all(getattr(mixprec, n) is not None for n in public)


ROOT = CHANGELOG.parent
SCANNED = ("README.md", "docs", "benchmarks", "examples", "tools", "mixprec")
"""Where a reader finds a path: the docs, the benchmarks and examples, the package's docstrings
(CHANGELOG.md's table and mixprec/_moved.py list the old paths on purpose; tests/ imports them)."""


def _retired_patterns() -> dict[str, re.Pattern]:
    patterns = {}
    for old in ROWS:
        patterns[old] = re.compile(rf"{re.escape(old)}(?![\w])(?!` logger|\")")   # not the mixprec.fp8 logger
        if old in MOVED_MODULES:                  # the file: mixprec/plan/guard.py, plan/guard.py, mixprec/fp8/
            rel = old.split(".", 1)[1].replace(".", "/")
            patterns[f"{old} (file)"] = re.compile(rf"(?<![\w/])(?:mixprec/{re.escape(rel)}/|(?:mixprec/)?{re.escape(rel)}\.py)")
    return patterns


def _scanned_lines(root: Path):
    """``(where, line)`` of every line of the docs, the benchmarks and the package (``_moved.py``
    aside, which names every old path), ``where`` as ``file:number``."""
    for where in SCANNED:
        path = root / where
        files = [path] if path.is_file() else sorted([*path.rglob("*.md"), *path.rglob("*.py")])
        for file in files:
            if file.name == "_moved.py" and file.parent.name == "mixprec":
                continue
            for number, line in enumerate(file.read_text().splitlines(), 1):
                yield f"{file.relative_to(root)}:{number}", line


def _retired_mentions(root: Path) -> list[str]:
    patterns = _retired_patterns()
    return [f"{where}: {old}" for where, line in _scanned_lines(root)
            if "0.4" not in line                   # a line about the retirement itself
            for old, p in patterns.items() if p.search(line)]


def test_no_doc_benchmark_or_docstring_names_a_retired_path():
    assert _retired_mentions(ROOT) == []


def test_a_retired_path_in_a_doc_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "the guard (`mixprec/plan/guard.py`), gates (`plan/gates.py`), `mixprec.train.checkpoint`,\n"
        "`mixprec/fp8/linear.py:128`, the `mixprec.fp8` logger, getLogger(\"mixprec.fp8\")\n"
        "`mixprec.engine` was retired in 0.4\n")
    assert _retired_mentions(tmp_path) == [
        "docs/page.md:1: mixprec.train.checkpoint", "docs/page.md:1: mixprec.plan.guard (file)",
        "docs/page.md:1: mixprec.plan.gates (file)", "docs/page.md:2: mixprec.fp8 (file)",
        "docs/page.md:2: mixprec.fp8.linear (file)"]


# ------------------------------------------------------------------ members of a class (Precision)

def _retired_member_mentions(root: Path) -> list[str]:
    """``precision.layer_formats``, ``Precision.set_layer_format(``: a retired member named on a
    Precision (a receiver whose name ends in ``precision``, or ``prec``) in the docs, the
    benchmarks and the package's docstrings."""
    members = "|".join(re.escape(old.partition(".")[2]) for old in MOVED_MEMBERS)
    pattern = re.compile(rf"(?<![\w.])(?:[\w.]*[pP]recision|prec)\.({members})(?!\w)")
    return [f"{where}: {m.group(0)}" for where, line in _scanned_lines(root)
            for m in pattern.finditer(line) if not m.group(0).startswith("mixprec.precision.")]


def test_no_doc_benchmark_or_docstring_names_a_retired_precision_member():
    assert _retired_member_mentions(ROOT) == []


def test_a_retired_member_in_a_doc_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "`trainer.precision.layer_formats`, `Precision.set_layer_format(model, n, f)`, `prec.peak_format`\n"
        "`precision.layers.formats`, `precision.recipe.label`, `mixprec.precision.table`, `plan.table()`, `p.label`\n")
    assert _retired_member_mentions(tmp_path) == [
        "docs/page.md:1: trainer.precision.layer_formats", "docs/page.md:1: Precision.set_layer_format",
        "docs/page.md:1: prec.peak_format"]
