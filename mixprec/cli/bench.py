"""``mixprec bench matmul|train``."""
from __future__ import annotations

import argparse
import importlib

_SUB = {
    "matmul": ("mixprec.cli.bench_matmul", "GEMM throughput per dtype (warm-up, synchronised, 2n^3/t)"),
    "train": ("mixprec.cli.bench_train", "training step per precision mode (and peers): time, MFU, memory"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, (module, help_) in _SUB.items():
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=parser.formatter_class)
        p.set_defaults(_bench_module=module)
        importlib.import_module(module).configure(p)


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._bench_module).run(args)
