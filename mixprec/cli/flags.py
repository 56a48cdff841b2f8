"""Flags shared by several sub-commands: one name per concept, the same as ``mixprec train``'s
settings (``batch_size=`` is ``--batch-size``, ``seq_len=`` is ``--seq-len``), and the old names
kept as deprecated aliases that say so in one line."""
from __future__ import annotations

import argparse
import sys

__all__ = ["add_batch_size", "add_seq_len", "add_deprecated_alias"]


class _DeprecatedAlias(argparse.Action):
    """An old flag name: stores into the new flag's ``dest`` and prints one line naming the new flag."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"mixprec: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, *, dest: str,
                         type=None) -> None:
    """``old`` works as ``new`` (hidden from ``--help``) and prints one line saying to use ``new``."""
    parser.add_argument(old, dest=dest, type=type, action=_DeprecatedAlias, new=new,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_batch_size(parser: argparse.ArgumentParser, *, default: int, help: str,
                   old: tuple[str, ...] = ()) -> None:
    """``--batch-size N`` (train's ``batch_size=``), with the command's old names as aliases."""
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=default, help=help)
    for name in old:
        add_deprecated_alias(parser, name, "--batch-size", dest="batch_size", type=int)


def add_seq_len(parser: argparse.ArgumentParser, *, default: int | None, help: str,
                old: tuple[str, ...] = ("--seq",)) -> None:
    """``--seq-len N`` (train's ``seq_len=``), with ``--seq`` as a deprecated alias."""
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=default, help=help)
    for name in old:
        add_deprecated_alias(parser, name, "--seq-len", dest="seq_len", type=int)
