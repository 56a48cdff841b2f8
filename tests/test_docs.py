"""Every ```python block in docs/*.md runs as written: the blocks of one page in order, in one
session (a reader following the page), in a scratch folder."""
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = {p.name: re.findall(r"```python\n(.*?)```", p.read_text(), flags=re.S)
         for p in sorted(DOCS.glob("*.md"))}
PAGES = {name: blocks for name, blocks in PAGES.items() if blocks}


def test_the_docs_have_python_examples():
    assert len(PAGES) >= 5


@pytest.mark.parametrize("page", sorted(PAGES))
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(PAGES[page]):
        exec(compile(block, f"docs/{page} block {i}", "exec"), namespace)
