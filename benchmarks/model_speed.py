"""Transformer speed vs the shared reference GPT, and activation memory saved by checkpointing.

Usage (from the repository root):

    .venv/bin/python benchmarks/model_speed.py fp32     # gpt-ref shapes, FP32, ours vs reference
    .venv/bin/python benchmarks/model_speed.py bf16     # reduced shape, BF16 autocast, ours vs reference
    .venv/bin/python benchmarks/model_speed.py small    # train-step time of the "small" preset
    .venv/bin/python benchmarks/model_speed.py memory   # peak RSS with / without checkpointing
    .venv/bin/python benchmarks/model_speed.py all

Speed: forward + backward (cross-entropy on FP32 logits for both models) timed side by side in
one process, contenders alternating, ``--repeats`` rounds after a warm-up; medians, ratio, min-max.

Memory: each configuration runs in a fresh subprocess (so no earlier peak hides this one). The
subprocess builds the model, allocates zeroed gradients, does a tiny no-grad forward to load the
kernels, records its resident set size, then runs one forward + backward; the activation peak is
peak RSS (``VmHWM``, not ``ru_maxrss``) minus that baseline (with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed activations leave
the RSS; see ``memory()``). It also reports the bytes autograd saved for backward. On a GPU the same run reports ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from mixprec.models import Transformer

GPT_REF = os.environ.get("MIXPREC_GPT_REF", "/work/shared/bench/gpt_ref.py")


def load_ref():
    spec = importlib.util.spec_from_file_location("gpt_ref", GPT_REF)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ours_step(model, idx, tgt):
    _, loss = model(idx, tgt)
    loss.backward()


def ref_step(model, idx, tgt):
    logits = model(idx)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1))
    loss.backward()


def timed(fn, autocast_dtype):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        fn()
    return time.perf_counter() - t0


def side_by_side(L, d, h, V, T, B, repeats, autocast_dtype):
    ref_mod = load_ref()
    torch.manual_seed(0)
    ref = ref_mod.GPT(V=V, d=d, L=L, h=h, T=T)
    ours = Transformer(num_layers=L, d_model=d, num_heads=h, vocab_size=V, max_seq_len=T, tie_embeddings=False)
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, V, (B, T + 1), generator=g)
    idx, tgt = data[:, :-1], data[:, 1:]
    runs = {"ours": lambda: ours_step(ours, idx, tgt), "ref": lambda: ref_step(ref, idx, tgt)}
    for fn in runs.values():  # warm-up
        timed(fn, autocast_dtype)
    times = {k: [] for k in runs}
    for i in range(repeats):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for k in order:
            times[k].append(timed(runs[k], autocast_dtype))
    flops = ours.flops_per_token(T) * B * T
    out = {"shape": dict(L=L, d=d, h=h, V=V, T=T, B=B), "dtype": str(autocast_dtype or "fp32"),
           "repeats": repeats, "flops_per_step": flops}
    for k, ts in times.items():
        med = statistics.median(ts)
        out[k] = {"median_s": round(med, 4), "min_s": round(min(ts), 4), "max_s": round(max(ts), 4),
                  "gflops": round(flops / med / 1e9, 2)}
    out["ratio_ours_over_ref"] = round(out["ours"]["median_s"] / out["ref"]["median_s"], 4)
    paired = [a / b for a, b in zip(times["ours"], times["ref"])]
    out["paired_ratio_min_max"] = [round(min(paired), 4), round(max(paired), 4)]
    return out


def small_train_step(repeats):
    torch.manual_seed(0)
    model = Transformer.from_preset("small")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    B, T = 16, 128
    times, cpu = [], []
    for i in range(repeats + 2):
        data = torch.randint(0, 256, (B, T + 1), generator=g)
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    med = statistics.median(times)
    return {"preset": "small", "params": model.num_parameters(), "B": B, "T": T, "repeats": repeats,
            "median_s": round(med, 4), "min_s": round(min(times), 4), "max_s": round(max(times), 4),
            "est_500_steps_min": round(500 * med / 60, 2),
            "process_cpu_s_median": round(statistics.median(cpu), 4)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """Peak RSS of this process image: ``VmHWM`` (per address space, fresh after exec).

    Not ``ru_maxrss``: Linux carries the parent's peak RSS across fork + exec into the child's
    ``ru_maxrss``, so a child started by a parent that had run the gpt-ref speed test (RSS ~1.6 GB,
    ``all``) reported that parent's peak for both configurations.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def memory_child(ckpt: bool, L, d, h, V, T, B) -> dict:
    """Runs inside a fresh process: one forward + backward, peak memory above the baseline."""
    torch.manual_seed(0)
    model = Transformer(num_layers=L, d_model=d, num_heads=h, vocab_size=V, max_seq_len=T,
                        tie_embeddings=False, gradient_checkpointing=ckpt)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    data = torch.randint(0, V, (B, T + 1), device=device)
    with torch.no_grad():
        model(data[:1, :8])
    base = _rss_bytes()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    saved = [0]

    def pack(t):  # count the bytes autograd keeps for backward (outside recomputed regions)
        saved[0] += t.numel() * t.element_size()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = _peak_rss_bytes()
    res = {"checkpointing": ckpt, "device": device, "step_s": round(elapsed, 3),
           "baseline_rss_mb": round(base / 2**20, 1), "activation_peak_mb": round((peak - base) / 2**20, 1),
           "autograd_saved_mb": round(saved[0] / 2**20, 1)}
    if device == "cuda":
        res["cuda_activation_peak_mb"] = round((torch.cuda.max_memory_allocated() - base_cuda) / 2**20, 1)
    return res


def memory(repeats, shape):
    results = {False: [], True: []}
    for _ in range(repeats):
        for ckpt in (False, True):
            cmd = [sys.executable, __file__, "_memory_child", json.dumps({"ckpt": ckpt, **shape})]
            # glibc keeps freed large blocks in its heap (its mmap threshold grows after frees), so
            # RSS would not fall when activations are freed and the peak would hide the saving.
            # A fixed threshold makes every block >= 64 KiB its own mapping, returned on free.
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            line = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                  env=env).stdout.strip().splitlines()[-1]
            results[ckpt].append(json.loads(line))
    out = {"shape": shape, "repeats": repeats}
    for ckpt, rs in results.items():
        peaks = [r["activation_peak_mb"] for r in rs]
        steps = [r["step_s"] for r in rs]
        saved = [r["autograd_saved_mb"] for r in rs]
        out["checkpointing" if ckpt else "no_checkpointing"] = {
            "activation_peak_mb_median": statistics.median(peaks), "min_max_mb": [min(peaks), max(peaks)],
            "step_s_median": statistics.median(steps), "step_s_min_max": [min(steps), max(steps)],
            "autograd_saved_mb": statistics.median(saved), "baseline_rss_mb": rs[0]["baseline_rss_mb"]}
    a = out["no_checkpointing"]["activation_peak_mb_median"]
    b = out["checkpointing"]["activation_peak_mb_median"]
    out["saved_mb"] = round(a - b, 1)
    out["saved_frac"] = round((a - b) / a, 3) if a else None
    return out


GPT_REF_SHAPE = dict(L=6, d=512, h=8, V=8192, T=256, B=8)
BF16_SHAPE = dict(L=2, d=128, h=4, V=1024, T=64, B=4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["fp32", "bf16", "small", "memory", "all", "_memory_child"])
    ap.add_argument("arg", nargs="?")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.what == "_memory_child":
        kw = json.loads(args.arg)
        print(json.dumps(memory_child(kw.pop("ckpt"), **kw)))
        return 0
    if args.what in ("fp32", "all"):
        print("fp32", json.dumps(side_by_side(**GPT_REF_SHAPE, repeats=args.repeats, autocast_dtype=None)), flush=True)
    if args.what in ("bf16", "all"):
        print("bf16", json.dumps(side_by_side(**BF16_SHAPE, repeats=args.repeats, autocast_dtype=torch.bfloat16)),
              flush=True)
    if args.what in ("small", "all"):
        print("small", json.dumps(small_train_step(args.repeats)), flush=True)
    if args.what in ("memory", "all"):
        print("memory", json.dumps(memory(max(3, args.repeats // 2), GPT_REF_SHAPE)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
