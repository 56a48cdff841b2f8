"""Peak memory of training steps per contender, each in a fresh process (measure_peak_memory of
``mixprec bench train``: peak RSS growth on a CPU), contenders alternated over rounds; one JSON
line each. Usage (issue 27, docs/performance.md):
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/lean_peaks.py MODEL BATCH SEQ STEPS MODE,MODE,... [ROUNDS]
The environment variable fixes glibc's mmap threshold, so freed large tensors go back to the OS
(without it glibc raises the threshold after the first large free and keeps later tensors in a heap
that does not shrink: the RSS peak then counts freed memory; docs/performance.md).
"""
import sys, os, json, time
from mixprec.bench.modes import TrainBenchConfig, measure_peak_memory
from mixprec.estimate.memory import ModelShape, estimate_memory
from mixprec.models.config import get_model_config
model, B, T, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
modes = sys.argv[5].split(",")
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 1
cfg = TrainBenchConfig(model=model, modes=tuple(modes), batch=B, seq=T, threads=1, device="cpu")
for r in range(rounds):
    for m in (modes if r % 2 == 0 else modes[::-1]):
        t0 = time.time()
        peak = measure_peak_memory(m, cfg, steps=steps, timeout=float(os.environ.get("PEAK_TIMEOUT", 2400)))
        print(json.dumps({"model": model, "B": B, "T": T, "mode": m, "peak_mib": peak / 2**20,
                          "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "s": round(time.time() - t0)}), flush=True)
