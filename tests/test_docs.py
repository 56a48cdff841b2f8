"""The docs run as written.

Every ```python block in docs/*.md runs as written: the blocks of one page in order, in one
session (a reader following the page), in a scratch folder.

Every ```text block of docs/*.md and the README that starts with a ``$ mixprec ...`` command and
goes on with what it printed is run again (in-process, in a scratch folder that sees the
repository's ``examples/``) and must print exactly that. A block too slow for the suite or
tied to this machine says so in the doc source, on the line before its fence:
``<!-- docs-test: skip: <why> -->``; that block is skipped with that reason, never silently.
"""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = {p.name: re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S)
         for p in sorted(DOCS.glob("*.md"))}
PAGES = {name: blocks for name, blocks in PAGES.items() if blocks}

_SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->")
_COMMAND_BLOCK = re.compile(r"^```text\n\$ (mixprec .*?)\n(.*?)^```", flags=re.S | re.M)


def command_blocks(text: str) -> list[tuple[int, str, list[str], str | None]]:
    """``(line, command, printed lines, skip reason)`` of each ``$ mixprec`` block with output."""
    found = []
    for m in _COMMAND_BLOCK.finditer(text):
        printed = m.group(2).rstrip("\n").split("\n") if m.group(2).strip() else []
        if not printed:
            continue                      # a command alone: nothing printed to compare
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        found.append((text[:m.start()].count("\n") + 1, m.group(1), printed, skip.group(1) if skip else None))
    return found


COMMANDS = {f"{p.relative_to(ROOT)}:{line}": (cmd, printed, skip)
            for p in [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
            for line, cmd, printed, skip in command_blocks(p.read_text())}


def test_the_docs_have_python_examples():
    assert len(PAGES) >= 5


@pytest.mark.parametrize("page", sorted(PAGES))
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(PAGES[page]):
        exec(compile(block, f"docs/{page} block {i}", "exec"), namespace)


def test_command_blocks_are_found_and_a_skip_needs_a_reason():
    assert sum(skip is None for _, _, skip in COMMANDS.values()) >= 4
    text = ("<!-- docs-test: skip: trains for minutes -->\n```text\n$ mixprec train x=1\nout\n```\n\n"
            "```text\n$ mixprec estimate --a\nline 1\n  line 2\n```\n```text\n$ mixprec train\n```\n"
            "<!-- docs-test: skip -->\n```text\n$ mixprec memory\nout\n```\n")
    assert command_blocks(text) == [(2, "mixprec train x=1", ["out"], "trains for minutes"),
                                    (7, "mixprec estimate --a", ["line 1", "  line 2"], None),
                                    (16, "mixprec memory", ["out"], None)]   # no reason: not a skip


@pytest.mark.parametrize("where", sorted(COMMANDS))
def test_docs_command_blocks_print_what_they_show(where, tmp_path, monkeypatch, capsys):
    from mixprec.cli.main import main

    command, printed, skip = COMMANDS[where]
    if skip is not None:
        pytest.skip(f"{where}: {skip}")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    assert main(shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    assert [line.rstrip() for line in out.rstrip("\n").split("\n")] == [line.rstrip() for line in printed], \
        f"{where}: `{command}` now prints\n{out}"
