"""Wall and CPU time of ``mixprec whatif`` on the three models of issue #25's "done when": the
``small`` model, a tiny Hugging Face Llama (from ``examples/configs/hf-llama-tiny.json``, no
weights downloaded) and a user's ``nn.Sequential``. Each case is its own process (imports
included, as a user runs it); CPU is user + sys of that process (``getrusage`` of the child), the
load average is read before and after each run.

    python benchmarks/whatif_time.py --repeats 2                       # this checkout
    python benchmarks/whatif_time.py --code old=/path/a --code new=/path/b --repeats 2

With several ``--code NAME=PATH`` (a checkout each, put first on PYTHONPATH) the runs alternate
between them inside each repeat, so a change in the machine's load hits both alike.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

USER_MODULE = """
import torch, torch.nn.functional as F
from torch import nn
import mixprec as mp
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
batches = [(torch.randn(64, 256), torch.randint(0, 10, (64,))) for _ in range(2)]
report = mp.plan.what_if(model, batches, loss_fn=F.cross_entropy)
report.write_csv("user.csv"); report.heatmap("user.png")
print(report.table().splitlines()[-3])
"""

CASES = {
    "small": ["-m", "mixprec", "whatif", "model=small", "batch_size=8", "seq_len=64", "-o", "small.csv"],
    "hf-llama-tiny": ["-m", "mixprec", "whatif", f"model=hf:{ROOT / 'examples/configs/hf-llama-tiny.json'}",
                      "batch_size=4", "seq_len=64", "-o", "hf.csv"],
    "user-module": ["-c", USER_MODULE],
}


def run_case(name: str, code: Path, workdir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    load0 = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *CASES[name]], cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = [line for line in done.stdout.splitlines() if "took" in line]
    return {"case": name, "rc": done.returncode, "wall_s": wall,
            "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
            "load_before": load0, "load_after": os.getloadavg()[0],
            "whatif_s": took[-1].rsplit("took ", 1)[-1].split(" s")[0] if took else "",
            "err": done.stderr[-400:] if done.returncode else ""}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--code", action="append", default=None, metavar="NAME=PATH",
                   help="a checkout to time (repeatable; default: this one)")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    codes = [c.split("=", 1) for c in (args.code or [f"this={ROOT}"])]
    print("| repeat | code | case | wall s | CPU s (user+sys) | what-if's own s | load before / after | rc |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for case in args.cases.split(","):
                for label, path in codes:
                    r = run_case(case, Path(path), Path(tmp))
                    print(f"| {rep + 1} | {label} | {case} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                          f"{r['whatif_s']} | {r['load_before']:.1f} / {r['load_after']:.1f} | {r['rc']} |",
                          flush=True)
                    if r["rc"]:
                        print(r["err"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
