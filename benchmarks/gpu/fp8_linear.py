"""FP8 on a Hopper-class GPU: Fp8Linear vs BF16 nn.Linear, and a Transformer training step.

    python benchmarks/gpu/fp8_linear.py            # ~5-7 minutes on one H200
    python benchmarks/gpu/fp8_linear.py --cpu-smoke  # seconds: checks the script on a CPU

1. Correctness first: on one shape, every recipe's ``cuda-scaled-mm`` result (output and both
   gradients) is compared with the emulated result (SQNR, dB; max relative error) and with the
   FP32 reference. Blockwise says which one-GEMM kernel ran (torch's native block-scaled
   ``scaled_mm`` or mixprec's Triton kernel); where both can run, ``blockwise-triton`` (the
   Triton kernel forced, ``Fp8Config(block_kernel="triton")``) is checked and timed next to it.
2. Linear forward+backward throughput (3 GEMMs: 6*M*K*N FLOPs per iteration) of BF16 ``nn.Linear``
   vs ``Fp8Linear`` (tensorwise, rowwise, blockwise; eager, its casts compiled on CUDA), and,
   when torchao is importable, torchao's ``Float8Linear`` (tensorwise, rowwise; eager and
   ``torch.compile``d), same shapes, same run: square shapes 4096/8192/16384 and LLM-like
   shapes (16384 tokens x FFN projections). CUDA events, warm-up, median of repeats; TFLOPS
   counts the whole layer including quantization, as a user sees it. ``--no-torchao`` skips it.
3. A mid-sized Transformer (mixprec.models.Transformer) training step: bf16-mixed vs the fp8-*
   policies; median step time and the speed-up.

Prints tables and writes ``fp8_linear.json`` to ``$OUT`` (or ``./bench-out``). A time budget
(``--budget-s``, default 450) skips what would not fit and says so in the output.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mixprec.errors import ConfigError  # noqa: E402
from mixprec.formats import Fp8Config, Fp8Linear, plan_gemms, sqnr_db  # noqa: E402
from mixprec.precision import prepare_fp8  # noqa: E402
from mixprec.precision import autocast, get_policy  # noqa: E402
from mixprec.policy.hardware import cuda_supports_fp8  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise")
BLOCK_KINDS: list[str] = []
"""``["blockwise-triton"]`` when the Triton kernel runs here next to a native blockwise (set in main)."""
SQUARE = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384)]
LLM = [(16384, 4096, 14336), (16384, 14336, 4096), (16384, 8192, 28672), (16384, 4096, 6144)]
T0 = time.perf_counter()
DEVICE = "cuda"
BACKEND = "auto"  # --cpu-smoke forces "scaled-mm" so the CPU runs the GPU code path


def elapsed() -> float:
    return time.perf_counter() - T0


def time_cuda(fn, *, warmup: int, iters: int, repeats: int) -> list[float]:
    """Seconds per call, one value per repeat (each the mean over ``iters`` calls)."""
    for _ in range(warmup):
        fn()
    out = []
    if DEVICE == "cpu":  # --cpu-smoke: wall clock
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) / iters)
        return out
    torch.cuda.synchronize()
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / iters)
    return out


TORCHAO_RECIPES = ("tensorwise", "rowwise")


def torchao_kinds(enabled: bool) -> list[str]:
    """``torchao-<recipe>`` and ``torchao-<recipe>-compiled`` when torchao's float8 imports."""
    if not enabled:
        return []
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return []
    return [f"torchao-{r}{c}" for r in TORCHAO_RECIPES for c in ("", "-compiled")]


def block_kinds() -> list[str]:
    """``["blockwise-triton"]`` where blockwise's own plan is torch's native block-scaled GEMM and
    the Triton kernel can run too (both are then measured); says what blockwise runs otherwise."""
    if DEVICE != "cuda":
        return []
    auto = plan_gemms(Fp8Config.from_recipe("blockwise"), DEVICE, 4096, 4096)
    try:
        plan_gemms(Fp8Config.from_recipe("blockwise", block_kernel="triton"), DEVICE, 4096, 4096)
    except ConfigError as e:
        print(f"blockwise-triton: not run: {e}", flush=True)
        return []
    if auto.block_kernel != "native":
        print(f"blockwise-triton: not a separate row: blockwise itself runs {auto.path} "
              f"({auto.reason})", flush=True)
        return []
    return ["blockwise-triton"]


def _config(kind: str, backend: str) -> Fp8Config:
    if kind == "blockwise-triton":
        return Fp8Config.from_recipe("blockwise", backend=backend, block_kernel="triton")
    return Fp8Config.from_recipe(kind, backend=backend)


def path_of(layer: Fp8Linear) -> str:
    """The layer's path, with the block kernel where one was planned (``cuda-scaled-mm/triton``)."""
    plan = layer.gemm_plan
    return plan.path + (f"/{plan.block_kernel}" if plan.block_kernel else "")


def make_layer(kind: str, K: int, N: int) -> nn.Module:
    lin = nn.Linear(K, N, bias=False, device=DEVICE, dtype=torch.float32)
    if kind == "bf16":
        return lin
    if kind.startswith("torchao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        recipe = kind.split("-")[1]
        # torchao's own emulation stands in for its GPU kernels on the CPU smoke run.
        config = Float8LinearConfig.from_recipe_name(recipe)
        if DEVICE == "cpu":
            import dataclasses
            config = dataclasses.replace(config, emulate=True)
        model = convert_to_float8_training(nn.Sequential(lin), config=config)
        layer = model[0]
        return torch.compile(layer) if kind.endswith("-compiled") else layer
    return Fp8Linear.from_linear(lin, _config(kind, BACKEND))


def linear_step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    params = list(layer.parameters())

    def step():
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(g)
        for p in params:
            p.grad = None
        x.grad = None
    return step


def check_correctness(report: dict) -> None:
    M, K, N = (4096, 4096, 4096) if DEVICE == "cuda" else (96, 256, 128)
    torch.manual_seed(0)
    lin = nn.Linear(K, N, device=DEVICE)
    x = torch.randn(M, K, device=DEVICE)
    g = torch.randn(M, N, device=DEVICE)
    rows = []

    def run(layer):
        xx = x.clone().requires_grad_()
        lin.zero_grad(set_to_none=True)
        y = layer(xx)
        y.backward(g)
        return [y.detach().float(), xx.grad.float(), lin.weight.grad.float().clone()]

    ref = run(lin)
    for kind in (*RECIPES, *BLOCK_KINDS):
        emu_layer = Fp8Linear.from_linear(lin, _config(kind, "emulated"))
        real_layer = Fp8Linear.from_linear(lin, _config(kind, BACKEND))
        emu, real = run(emu_layer), run(real_layer)
        row = {"recipe": kind, "path": path_of(real_layer), "reason": real_layer.execution_reason,
               "vs_emulated_db": [round(sqnr_db(e, r), 1) for e, r in zip(emu, real)],
               "vs_emulated_max_rel": [float((r - e).abs().max() / e.abs().max())
                                       for e, r in zip(emu, real)],
               "vs_fp32_db": [round(sqnr_db(f, r), 1) for f, r in zip(ref, real)]}
        rows.append(row)
        rel = ", ".join(f"{v:.1e}" for v in row["vs_emulated_max_rel"])
        print(f"correctness {kind:>16}: path {row['path']} ({row['reason']}), SQNR (out, dx, dW) "
              f"vs emulated {row['vs_emulated_db']} dB (max rel err {rel}), vs FP32 "
              f"{row['vs_fp32_db']} dB", flush=True)
    report["correctness"] = rows


def throughput(tflops: float) -> str:
    """TFLOP/s as the table prints it: whole TF on a GPU, GF below 1 TF (a CPU smoke run printed
    "0 TF" for every kind, which told nothing)."""
    return f"{tflops:.0f} TF" if tflops >= 1 else f"{tflops * 1e3:.3g} GF"


def bench_linears(report: dict, args: argparse.Namespace) -> None:
    rows = []
    groups = (("square", SQUARE), ("llm", LLM)) if DEVICE == "cuda" else \
        (("square", [(64, 128, 128)]), ("llm", [(96, 128, 256)]))
    for group, shapes in groups:
        for M, K, N in shapes:
            if elapsed() > args.budget_s * 0.6:
                print(f"skipped {M}x{K}x{N}: time budget", flush=True)
                rows.append({"shape": [M, K, N], "skipped": "time budget"})
                continue
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
            flops = 6 * M * K * N
            kinds = ["bf16", *RECIPES, *BLOCK_KINDS, *torchao_kinds(not args.no_torchao)]
            layers = {k: make_layer(k, K, N) for k in kinds}
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.repeats):  # alternate contenders
                for k in kinds:
                    times[k] += time_cuda(linear_step(layers[k], x, g), warmup=2, iters=args.iters,
                                          repeats=1)
            row = {"group": group, "shape": [M, K, N]}
            base = statistics.median(times["bf16"])
            for k in kinds:
                med = statistics.median(times[k])
                row[k] = {"median_ms": med * 1e3, "min_ms": min(times[k]) * 1e3,
                          "max_ms": max(times[k]) * 1e3, "tflops": flops / med / 1e12,
                          "speedup_vs_bf16": base / med}
            paths = {k: path_of(layers[k]) for k in (*RECIPES, *BLOCK_KINDS)}
            row["paths"] = paths
            rows.append(row)
            print(f"{group:>6} M={M:>5} K={K:>5} N={N:>5}: " + "  ".join(
                f"{k} {throughput(row[k]['tflops'])} ({row[k]['speedup_vs_bf16']:.2f}x)" for k in kinds),
                flush=True)
            del layers, x, g
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    report["linear"] = rows


def bench_transformer(report: dict, args: argparse.Namespace) -> None:
    from mixprec.models import Transformer

    vocab = 32768 if DEVICE == "cuda" else 256
    cfg = dict(num_layers=args.layers, d_model=args.d_model, num_heads=max(1, args.d_model // 128),
               vocab_size=vocab, max_seq_len=args.seq)
    B, T = args.batch, args.seq
    idx = torch.randint(0, vocab, (B, T), device=DEVICE)
    modes = ["bf16-mixed", "fp8-tensorwise", "fp8-rowwise", "fp8-blockwise"]
    models = {}
    for mode in modes:
        torch.manual_seed(0)
        model = Transformer(**cfg).to(DEVICE)
        rep = prepare_fp8(model, get_policy(mode))
        if rep is not None and BACKEND != "auto":
            for m in model.modules():
                if isinstance(m, Fp8Linear):
                    m.config = m.config.replace(backend=BACKEND)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
        models[mode] = (model, opt, rep.num_converted if rep else 0)
    times: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, float] = {}

    def step_fn(mode):
        model, opt, _ = models[mode]
        pol = get_policy(mode)

        def step():
            with autocast(pol):
                _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[mode] = loss.detach()
        return step

    for r in range(args.repeats):
        for mode in modes:
            if elapsed() > args.budget_s:
                break
            times[mode] += time_cuda(step_fn(mode), warmup=2 if r == 0 else 1, iters=3, repeats=1)
    n_params = sum(p.numel() for p in models["bf16-mixed"][0].parameters())
    base = statistics.median(times["bf16-mixed"]) if times["bf16-mixed"] else float("nan")
    rows = []
    for mode in modes:
        if not times[mode]:
            rows.append({"mode": mode, "skipped": "time budget"})
            continue
        med = statistics.median(times[mode])
        rows.append({"mode": mode, "fp8_layers": models[mode][2], "median_ms": med * 1e3,
                     "min_ms": min(times[mode]) * 1e3, "max_ms": max(times[mode]) * 1e3,
                     "tokens_per_s": B * T / med, "speedup_vs_bf16": base / med,
                     "loss": float(losses[mode])})
        print(f"transformer {mode:>15}: {med * 1e3:.1f} ms/step ({base / med:.2f}x), "
              f"{B * T / med:,.0f} tok/s, fp8 layers {models[mode][2]}", flush=True)
    report["transformer"] = {"config": cfg, "batch": B, "params": n_params, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=450)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--skip-transformer", action="store_true")
    p.add_argument("--no-torchao", action="store_true",
                   help="skip torchao's Float8Linear (compared by default when it imports)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU through the scaled-mm code path: checks this script "
                        "runs end to end before spending GPU time (its timings mean nothing)")
    args = p.parse_args()
    global DEVICE, BACKEND, BLOCK_KINDS
    if args.cpu_smoke:
        DEVICE, BACKEND = "cpu", "scaled-mm"
        args.layers, args.d_model, args.seq, args.batch = 1, 128, 32, 2
        args.repeats, args.iters = 2, 1
    elif not cuda_supports_fp8():
        raise SystemExit("needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")
    out_dir = Path(os.environ.get("OUT") or "bench-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda, "python": platform.python_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(args)}
    kinds = torchao_kinds(not args.no_torchao)
    report["torchao"] = __import__("torchao").__version__ if kinds else None
    print(f"{report['device']}, torch {report['torch']}, CUDA {report['cuda']}, torchao "
          f"{report['torchao'] or 'not compared'}", flush=True)
    BLOCK_KINDS = block_kinds()
    report["block_kinds"] = BLOCK_KINDS

    def save():
        report["elapsed_s"] = elapsed()
        (out_dir / "fp8_linear.json").write_text(json.dumps(report, indent=2))

    for part in (check_correctness, lambda r: bench_linears(r, args),
                 None if args.skip_transformer else (lambda r: bench_transformer(r, args))):
        if part is None:
            continue
        try:
            part(report)
        except Exception as e:  # keep what was measured; say what failed
            report.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
            print(f"ERROR: {type(e).__name__}: {e}", flush=True)
        save()
    print(f"\nwrote {out_dir / 'fp8_linear.json'} after {elapsed():.0f}s")


if __name__ == "__main__":
    main()
