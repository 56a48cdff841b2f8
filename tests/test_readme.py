"""Every ```python block in the README runs as written (in a scratch folder)."""
import re
import runpy
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    runpy.run_path(str(script), run_name="__readme__")
    captured = capsys.readouterr()
    assert captured.out.strip()  # each block prints what it shows
    # A newcomer's example runs clean: no audit warning, no note that it asks something odd.
    assert "WARNING" not in captured.err and "longer than the run" not in captured.err, captured.err
