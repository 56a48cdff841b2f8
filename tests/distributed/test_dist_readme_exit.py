"""The README's "The library" example, run as users run it (``torchrun --nproc_per_node=2``),
exits 0 on every rank, every time (issue 28).

It builds ``MirroredStrategy()``, passes it to ``fit()`` and ends, with no ``teardown()``. Before
the fix the gloo group it created was left to interpreter shutdown, where it was destroyed with
gloo's threads still around: ``terminate called without an active exception`` and exit -6 after a
successful run, about 3 times in 70 launches. Now the strategy tears its group down in an exit
hook (``ProcessGroupStrategy._teardown_at_exit``). Each launch checks the cause on every rank (no
group and no DDP wrapper left when the interpreter starts shutting down: that check failed
before the fix) and counts failures over many launches, as the issue asks.
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
# One launch is three interpreters importing torch: ~15 CPU-seconds, ~15 s on 2 idle cores with
# 4 in flight, 20-40 s each at load average 15. The suite runs one wave of 4: the cause is checked
# on every rank of every launch (no group, no DDP wrapper at shutdown), which fails deterministically
# on the old code, so more launches only repeat it. The count of 30 (and more) runs with
# MIXPREC_README_LAUNCHES=30 (waves of 4, each its own test so that none nears the 600 s limit).
AT_ONCE = 4
LAUNCHES = max(AT_ONCE, int(os.environ.get("MIXPREC_README_LAUNCHES", "4")))
WAVES = -(-LAUNCHES // AT_ONCE)
BOUND_S = 300            # a launch that has not ended by then hangs: it is killed and counted


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


def _launch(cwd: Path, script: Path) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node=2 SCRIPT`` through the recording worker."""
    (cwd / "records").mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MIXPREC_DIST_TIMEOUT": "120"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", str(HERE / "readme_exit_worker.py"), str(script),
                             str(cwd / "records")], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _outcome(proc: subprocess.Popen, started: float, cwd: Path) -> str | None:
    """None for a clean launch, else what went wrong (one line)."""
    try:
        out, err = proc.communicate(timeout=max(1.0, BOUND_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        proc.kill()                    # torchrun's agent; it stops its workers
        out, err = proc.communicate()
        return f"no exit within {BOUND_S} s: {err.strip().splitlines()[-3:]}"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {err.strip().splitlines()[-3:]}"
    records = [json.loads(p.read_text()) for p in sorted((cwd / "records").glob("rank*.json"))]
    if records != [{"initialized_at_exit": False, "ddp_alive_at_exit": 0}] * 2:
        return f"left to interpreter shutdown: {records}"
    # Both ranks print "2 <mode>" into one pipe; their characters may interleave. The mode is what
    # mixed_precision=True resolves to on this machine (32-true where BF16 is emulated).
    import mixprec as mp
    if sorted("".join(out.split())) != sorted(f"2{mp.Precision(True).name}" * 2):
        return f"printed {out!r}"
    return None


@pytest.mark.parametrize("wave", range(WAVES))
def test_the_readme_example_exits_0_under_torchrun_and_leaves_no_group_to_shutdown(tmp_path, script, wave):
    """A wave of launches in flight together; every rank of every launch exits 0, prints what the
    README shows, and has neither a process group nor a DDP wrapper left when shutdown begins."""
    n = min(AT_ONCE, LAUNCHES - wave * AT_ONCE)
    launches = [(i, _launch(tmp_path / f"run{i}", script), time.monotonic()) for i in range(n)]
    failures = [f"launch {i}: {why}" for i, proc, started in launches
                if (why := _outcome(proc, started, tmp_path / f"run{i}")) is not None]
    assert not failures, f"{len(failures)} of {n} launches failed: " + "; ".join(failures)
