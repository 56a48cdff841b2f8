"""The README's "The library" example, run as users run it (``torchrun --nproc_per_node=2``),
exits 0 on every rank, every time (issue 28).

It builds ``MirroredStrategy()``, passes it to ``fit()`` and ends, with no ``teardown()``. Before
the fix the gloo group it created was left to interpreter shutdown, where it was destroyed with
gloo's threads still around: ``terminate called without an active exception`` and exit -6 after a
successful run, about 3 times in 70 launches. Now the strategy tears its group down in an exit
hook (``ProcessGroupStrategy._teardown_at_exit``). One test checks the cause on every rank (no
group and no DDP wrapper left when the interpreter starts shutting down: it failed on every launch
before the fix); the other counts failures over many launches, as the issue asks.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
README = HERE.parents[1] / "README.md"
LAUNCHES = 30
AT_ONCE = 5              # launches in flight together (short wall time; load makes races likelier)
BOUND_S = 180            # one launch on 2 busy cores takes ~20-40 s; a hang is cut here and counted


def readme_library_example() -> str:
    """The README block under "## The library", as written but for ``max_steps`` (2, not 10)."""
    section = README.read_text().split("## The library", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert "MirroredStrategy()" in block and "teardown" not in block
    assert block.count("max_steps=10") == 1
    return block.replace("max_steps=10", "max_steps=2")       # the exit is what is tested


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    import mixprec as mp
    mp.data.builtin_corpus()      # build the cache once, not in every rank of the first launches
    path = tmp_path_factory.mktemp("readme") / "readme_library.py"
    path.write_text(readme_library_example())
    return path


def _launch(cwd: Path, *command: str) -> subprocess.Popen:
    cwd.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MIXPREC_DIST_TIMEOUT": "60"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", *command], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, started: float) -> tuple[int | None, str, str]:
    try:
        out, err = proc.communicate(timeout=max(1.0, BOUND_S - (time.monotonic() - started)))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()                    # torchrun's agent; it stops its workers
        out, err = proc.communicate()
        return None, out, err


def test_the_readme_example_leaves_no_process_group_to_interpreter_shutdown(tmp_path, script):
    out_dir = tmp_path / "records"
    out_dir.mkdir()
    proc = _launch(tmp_path / "run", str(HERE / "readme_exit_worker.py"), str(script), str(out_dir))
    code, out, err = _finish(proc, time.monotonic())
    assert code == 0, err[-3000:]
    assert out.split() == ["2", "16-true"] * 2
    records = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    assert records == [{"initialized_at_exit": False, "ddp_alive_at_exit": 0}] * 2


def test_the_readme_example_exits_0_on_every_rank_in_30_torchrun_launches(tmp_path, script):
    failures, pending, started_all = [], list(range(LAUNCHES)), time.monotonic()
    while pending:
        wave = [(i, _launch(tmp_path / f"run{i}", str(script)), time.monotonic())
                for i in pending[:AT_ONCE]]
        pending = pending[AT_ONCE:]
        for i, proc, started in wave:
            code, out, err = _finish(proc, started)
            if code != 0 or out.split() != ["2", "16-true"] * 2:
                failures.append(f"launch {i}: exit {code} after {time.monotonic() - started:.0f} s: "
                                f"{err.strip().splitlines()[-3:]}")
    took = time.monotonic() - started_all
    assert not failures, f"{len(failures)} of {LAUNCHES} launches failed ({took:.0f} s): " + \
        "; ".join(failures)
