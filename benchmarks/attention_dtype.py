"""Causal SDPA forward + backward on a CPU: 16-bit inputs to PyTorch's kernel, or cast to FP32.

Why ``mixprec.nn.CausalSelfAttention`` casts BF16/FP16 ``q, k, v`` to FP32 for
``scaled_dot_product_attention`` on CPUs without AMX. For each shape it times, alternating the
contenders, ``--repeats`` rounds of ``--iters`` forward+backward calls of: the 16-bit flash kernel
(``bf16``), PyTorch's math backend on the 16-bit inputs (``bf16-math``), and the FP32 flash kernel
on the inputs cast up, output cast back (``fp32-upcast``, what mixprec does). Prints the median, min
and max milliseconds per call, the speed-up against ``bf16``, and each contender's error against
an FP64 reference on the same BF16 inputs.

    python benchmarks/attention_dtype.py --shapes 16x4x128x32,16x4x256x32,8x12x512x64
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mixprec.policy.hardware import cpu_matrix_flags


def bf16(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def bf16_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def fp32_upcast(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)


CONTENDERS = {"bf16": bf16, "bf16-math": bf16_math, "fp32-upcast": fp32_upcast}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16x4x128x32,16x4x256x32,8x12x512x64",
                   help="comma-separated BxHxTxD")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, CPU matrix flags "
          f"{cpu_matrix_flags() or 'none'}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| B x H x T x D | contender | median ms | min | max | speed-up vs bf16 | rel. RMS error vs FP64 |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        B, H, T, D = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16().requires_grad_() for _ in range(3))
        grad = torch.randn(B, H, T, D, generator=g).bfloat16()
        times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for fn in CONTENDERS.values():                      # warm-up
            fn(q, k, v).backward(grad)
        for _ in range(args.repeats):
            for name, fn in CONTENDERS.items():             # alternated within every round
                start = time.perf_counter()
                for _ in range(args.iters):
                    fn(q, k, v).backward(grad)
                times[name].append((time.perf_counter() - start) / args.iters * 1e3)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
            base = statistics.median(times["bf16"])
            for name, fn in CONTENDERS.items():
                err = float((fn(q, k, v).double() - ref).norm() / ref.norm())
                t = times[name]
                print(f"| {shape} | {name} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} | "
                      f"{base / statistics.median(t):.2f}x | {err:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
