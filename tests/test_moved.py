"""Import paths retired in 0.4 fail in one line naming their new home; the new homes exist; the
CHANGELOG's migration table lists every one."""
import importlib
import importlib.machinery
import re
import sys
from pathlib import Path

import pytest

import mixprec
from mixprec._moved import MOVED_MODULES, MOVED_NAMES, MovedFinder, MovedPathError

CHANGELOG = Path(mixprec.__file__).parent.parent / "CHANGELOG.md"


def _line(old: str, new: str) -> str:
    return f"^{re.escape(old)} moved to {re.escape(new)} in 0\\.4; see CHANGELOG\\.md$"


def _first_moved(path: str) -> str:
    """The shortest prefix of ``path`` that moved (``mixprec.fp8`` for ``mixprec.fp8.linear``)."""
    parts = path.split(".")
    return next(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in MOVED_MODULES)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_importing_an_old_module_path_names_its_new_home(old):
    first = _first_moved(old)          # a module of a retired package: the package's line
    with pytest.raises(ModuleNotFoundError, match=_line(first, MOVED_MODULES[first])) as caught:
        importlib.import_module(old)
    assert "\n" not in str(caught.value) and old not in sys.modules


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_from_package_import_an_old_module_names_its_new_home(old):
    package, _, name = old.rpartition(".")
    first = _first_moved(old)          # a module of a retired package: the package's line
    with pytest.raises(ImportError, match=_line(first, MOVED_MODULES[first])):
        exec(f"from {package} import {name}", {})


@pytest.mark.parametrize("old", sorted(MOVED_NAMES))
def test_importing_an_old_name_names_its_new_home(old):
    package, _, name = old.rpartition(".")
    with pytest.raises(ImportError, match=_line(old, MOVED_NAMES[old])):
        exec(f"from {package} import {name}", {})
    with pytest.raises(ImportError, match=_line(old, MOVED_NAMES[old])):
        getattr(importlib.import_module(package), name)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_named_as_an_attribute_names_its_new_home(old):
    package, _, name = _first_moved(old).rpartition(".")
    with pytest.raises(ImportError, match=_line(f"{package}.{name}", MOVED_MODULES[f"{package}.{name}"])):
        getattr(importlib.import_module(package), name)


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
    assert set(rows) == set(MOVED_MODULES) | set(MOVED_NAMES)
    for old, new in {**MOVED_MODULES, **MOVED_NAMES}.items():
        homes = re.findall(r"mixprec(?:\.\w+)+", new)
        assert homes and all(f"`{h}`" in rows[old] for h in homes), (old, rows[old])


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
    with pytest.raises(MovedPathError, match=_line("mixprec.fp8", "mixprec.formats")):
        importlib.import_module("mixprec.fp8")


def test_the_public_names_are_the_documented_ones():
    assert len(mixprec.__all__) == len(set(mixprec.__all__)) == 21
    for name in mixprec.__all__:
        assert getattr(mixprec, name).__module__.startswith("mixprec.")
    readme = (CHANGELOG.parent / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in mixprec.__all__)
