"""Old import paths kept working after the layout move (docs/ARCHITECTURE.md).

A shim package calls :func:`alias` so that ``import mixprec.<old>.<module>`` returns the module
that now lives in its new room: the same module object, so classes, private helpers and
``monkeypatch`` targets are shared, never copied.
"""
from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["alias"]


def alias(package: str, **modules: ModuleType) -> None:
    """Make each ``package.<name>`` import resolve to ``modules[name]``."""
    parent = sys.modules[package]
    for name, module in modules.items():
        sys.modules.setdefault(f"{package}.{name}", module)
        setattr(parent, name, module)
