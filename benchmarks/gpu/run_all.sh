#!/usr/bin/env bash
# GPU benchmark run (prepared for an H200; budget: under 8 minutes in total).
# Usage, from the repository root:  OUT=/some/folder bash benchmarks/gpu/run_all.sh
# Writes matmul.txt, train/, train.txt, memory.txt and env.txt under $OUT.
set -euo pipefail
OUT="${OUT:-bench-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; "$PY" -c "import torch; print('torch', torch.__version__)"; } > "$OUT/env.txt" 2>&1
# 1) GEMM throughput per dtype at GPU sizes (~1 min).
timeout 150 "$PY" -m mixprec bench matmul --dtypes fp32,tf32,bf16,fp16,fp8 --sizes 4096,8192 \
    --repeats 3 --min-time 0.3 --device cuda > "$OUT/matmul.txt" 2>&1 || echo "matmul: rc=$?" >> "$OUT/matmul.txt"
# 2) Training step per mode and peers, the gpt-ref model at a GPU-sized batch (~3-4 min).
timeout 300 "$PY" -m mixprec bench train --model gpt-ref --modes 32-true,tf32,bf16-mixed,16-mixed,bf16-true \
    --peers --batch 32 --seq 256 --repeats 5 --steps 5 --warmup 3 --device cuda --out "$OUT/train" \
    > "$OUT/train.txt" 2>&1 || echo "train: rc=$?" >> "$OUT/train.txt"
# 3) The estimator at the same shape, to compare with the measured peaks in train/bench_train.csv.
timeout 60 "$PY" -c "import argparse, sys; from mixprec.cli import memory as m; p = argparse.ArgumentParser(); \
m.configure(p); sys.exit(m.run(p.parse_args(['--model', 'gpt-ref', '--batch', '32', '--seq', '256', \
'--precision', '32-true,tf32,bf16-mixed,16-mixed,bf16-true'])))" > "$OUT/memory.txt" 2>&1 || true
echo "done: $(date)" >> "$OUT/env.txt"
