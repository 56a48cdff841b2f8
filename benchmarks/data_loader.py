"""Is the data pipeline ever the bottleneck? Loader throughput vs a training step's consumption,
and resident memory when a ~1 GB token file is opened.

    .venv/bin/python benchmarks/data_loader.py [--repeats 5] [--batches 200] [--rss-gb 1.0]

1. Step time of the default-sized CPU model (4 layers, d_model 128, 4 heads, vocab 256, FP32,
   AdamW) at batch 16 x 128 and 8 x 256: tokens per second a training step consumes.
   Also compared with an assumed idle-machine step of ``--assumed-step-s`` (0.1 s), since a
   shared machine inflates the measured step and so flatters the loader.
2. DistributedDataLoader over the built-in corpus (TokenDataset, memory-mapped) with 0 and 2
   workers at the same shapes: tokens per second delivered. Contenders alternate within each
   repeat; medians and min-max over repeats are printed.
3. In a fresh subprocess: open a ~1 GB token file (created in /tmp, deleted afterwards), report
   the time to open, RSS before/after opening and after reading 1,000 random windows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = [(16, 128), (8, 256)]


def _model(seq_len: int) -> tuple[torch.nn.Module, str]:
    try:
        from mixprec.models import Transformer

        return Transformer(num_layers=4, d_model=128, num_heads=4, vocab_size=256, max_seq_len=seq_len,
                           amp_enabled=False), "mixprec.models.Transformer"
    except Exception as e:  # the models room may not be importable in every checkout
        print(f"(mixprec Transformer unavailable: {e}; using a torch.nn.TransformerEncoder stand-in)")

    class _LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, 128)
            self.pos = torch.nn.Embedding(seq_len, 128)
            layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True, norm_first=True)
            self.body = torch.nn.TransformerEncoder(layer, 4)
            self.head = torch.nn.Linear(128, 256)

        def forward(self, idx, targets):
            t = idx.shape[1]
            x = self.emb(idx) + self.pos(torch.arange(t))
            mask = torch.nn.Transformer.generate_square_subsequent_mask(t)
            logits = self.head(self.body(x, mask=mask, is_causal=True))
            return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return _LM(), "torch.nn.TransformerEncoder (stand-in)"


def step_times(batch: int, seq: int, repeats: int, steps: int = 3) -> tuple[list[float], str]:
    torch.manual_seed(0)
    model, name = _model(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))

    def step() -> None:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        out.append((time.perf_counter() - t0) / steps)
    return out, name


def loader_rates(train_path: str, repeats: int, batches: int) -> dict[tuple[int, int, int], list[float]]:
    from mixprec.data import DistributedDataLoader, TokenDataset

    loaders = {}
    for b, t in SHAPES:
        for w in (0, 2):
            loader = DistributedDataLoader(TokenDataset(train_path, max_length=t), b, num_workers=w, seed=0,
                                           rank=0, world_size=1)
            loaders[(b, t, w)] = [loader, iter(loader)]
    rates: dict[tuple[int, int, int], list[float]] = {k: [] for k in loaders}

    def take(key, n):
        loader, it = loaders[key]
        for _ in range(n):
            try:
                next(it)
            except StopIteration:
                loaders[key][1] = it = iter(loader)
                next(it)

    for key in loaders:  # warm-up: start the workers, touch the pages
        take(key, 20)
    for _ in range(repeats):
        for key in loaders:  # alternate contenders within each repeat
            t0 = time.perf_counter()
            take(key, batches)
            rates[key].append(key[0] * key[1] * batches / (time.perf_counter() - t0))
    return rates


_RSS_CHILD = r"""
import json, random, sys, time
def rss_mb():
    # (total, anonymous, file-backed) resident MiB; file-backed pages are page cache the kernel can drop
    f = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("Rss")}
    return f["RssAnon"] + f["RssFile"] + f.get("RssShmem", 0), f["RssAnon"], f["RssFile"]
from mixprec.data import TokenDataset
base = rss_mb()
t0 = time.perf_counter()
ds = TokenDataset(sys.argv[1], max_length=1024)
open_s = time.perf_counter() - t0
after_open = rss_mb()
random.seed(0)
t0 = time.perf_counter()
for _ in range(1000):
    ds[random.randrange(len(ds))]
read_s = time.perf_counter() - t0
print(json.dumps(dict(base=base, after_open=after_open, after_reads=rss_mb(), open_s=open_s,
                      read_ms_per_window=read_s, samples=len(ds), tokens=ds.num_tokens)))
"""


def rss_check(gigabytes: float) -> dict:
    import numpy as np

    from mixprec.data import TokenFileWriter

    fd, path = tempfile.mkstemp(suffix=".tokens", dir="/tmp")
    os.close(fd)
    try:
        n = int(gigabytes * 2**30) // 2  # uint16 tokens (vocab 50,257)
        chunk = np.arange(1 << 24, dtype=np.int64) % 50_257
        with TokenFileWriter(path, 50_257) as w:
            for start in range(0, n, chunk.size):
                w.write(chunk[: min(chunk.size, n - start)])
        out = subprocess.run([sys.executable, "-c", _RSS_CHILD, path], capture_output=True, text=True, check=True)
        result = json.loads(out.stdout)
        result["file_mb"] = os.path.getsize(path) / 2**20
        return result
    finally:
        os.unlink(path)


def _fmt(xs: list[float], scale: float = 1.0, nd: int = 0) -> str:
    med = statistics.median(xs) * scale
    return f"{med:,.{nd}f} ({min(xs) * scale:,.{nd}f}-{max(xs) * scale:,.{nd}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=200, help="batches timed per loader per repeat")
    p.add_argument("--assumed-step-s", type=float, default=0.1,
                   help="step time of the default model on an idle CPU, the demanding case (default 0.1 s)")
    p.add_argument("--rss-gb", type=float, default=1.0, help="size of the token file for the RSS check (0: skip)")
    args = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    from mixprec.data import builtin_corpus

    corpus = builtin_corpus()
    print(f"corpus: {corpus.description}")
    steps = {}
    for b, t in SHAPES:
        steps[(b, t)], name = step_times(b, t, args.repeats)
    print(f"\n## training step ({name}, 4 layers, d_model 128, FP32, AdamW, {torch.get_num_threads()} threads)")
    print("| batch x seq | step time s, median (min-max) | tokens/s consumed |")
    print("|---|---|---|")
    for (b, t), xs in steps.items():
        print(f"| {b} x {t} | {_fmt(xs, nd=3)} | {b * t / statistics.median(xs):,.0f} |")

    rates = loader_rates(str(corpus.train_path), args.repeats, args.batches)
    print(f"\n## loader throughput ({args.batches} batches per repeat, {args.repeats} repeats)")
    a = args.assumed_step_s
    print(f"| batch x seq | workers | tokens/s, median (min-max) | x measured step's need | x need of a {a} s step |")
    print("|---|---|---|---|---|")
    for (b, t, w), xs in rates.items():
        need = b * t / statistics.median(steps[(b, t)])
        print(f"| {b} x {t} | {w} | {_fmt(xs)} | {statistics.median(xs) / need:,.0f}x | "
              f"{statistics.median(xs) / (b * t / a):,.1f}x |")

    if args.rss_gb > 0:
        r = rss_check(args.rss_gb)
        print(f"\n## opening a {r['file_mb']:,.0f} MiB token file ({r['tokens']:,} tokens) in a fresh process")
        print(f"open time {r['open_s'] * 1e3:.2f} ms; 1,000 random windows of 1,025 tokens: "
              f"{r['read_ms_per_window']:.3f} ms per window incl. first-touch page faults")
        print("| moment | RSS MiB | anonymous | file-backed (page cache) |")
        print("|---|---|---|---|")
        for label, key in (("after import", "base"), ("after opening", "after_open"),
                           ("after 1,000 windows", "after_reads")):
            total, anon, file = r[key]
            print(f"| {label} | {total:.0f} | {anon:.0f} | {file:.0f} |")


if __name__ == "__main__":
    main()
