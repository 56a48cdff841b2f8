"""How well does the planner's estimate predict the measured loss change? (issue 24's table)

For each model -- mixprec's ``small`` Transformer, a nanoGPT-style GPT written here, a tiny Hugging
Face Llama -- plain and with activation outliers injected into one layer (``plan_outliers.py``'s
function-preserving injection: three input channels x gain, the matching weight columns / gain):

1. train it briefly in FP32 on the built-in corpus (at initialisation no layer matters to the
   loss, docs/per-layer.md), inject the outliers (the FP32 function does not change),
2. run :func:`mixprec.plan.plan_precision` (candidates fp32/bf16/fp8-tensorwise, H100 target) on
   ``--batches`` batches (the last third held out),
3. per Linear in ``fp8-tensorwise``: the estimated loss change (diagonal Fisher) against the
   measured single-layer change: Spearman rank correlation, and the median ratio measured/est,
4. uniform FP8 (every eligible Linear in ``fp8-tensorwise``) as a whole: summed estimates against
   the measured whole-plan change (calibration batches),
5. where the outlier layer ranks by the planner's sensitivity (gates, then estimate) and by the
   estimate alone, and what the plan at ``--budget`` did with it and what it measured held out.

    python benchmarks/plan_calibration.py --steps 150 --batches 6 --seed 0
"""
from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_outliers import inject_outliers  # noqa: E402

import mixprec as mp  # noqa: E402


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads)
        self.mlp = nn.Sequential()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.gelu = nn.GELU(approximate="tanh")
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A GPT in nanoGPT's shape: token + position embeddings, pre-norm blocks, tied head;
    ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self, *, layers: int = 4, d: int = 128, heads: int = 4, vocab: int = 256,
                 block: int = 128) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


def build(name: str, seq: int) -> tuple[nn.Module, str]:
    """(FP32 model, the layer that gets the outliers: an MLP down-projection in block 1)."""
    if name == "small":
        return mp.models.Transformer.from_preset("small"), "blocks.1.mlp.proj"
    if name == "nanogpt":
        return NanoGPT(block=seq), "h.1.mlp.c_proj"
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=seq, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg), "model.layers.1.mlp.down_proj"


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def uniform_change(model, batches, seed) -> float:
    """Measured relative loss change of every eligible Linear in fp8-tensorwise (as the planner
    measures a whole plan)."""
    from mixprec.plan.verify import forward_losses, fp32_copy, relative_change
    from mixprec.models.objective import make_objective
    ref = fp32_copy(model)
    mp.Precision("32-true").setup(ref)
    trial = fp32_copy(model)
    mp.Precision("32-true", overrides=(("*", "fp8-tensorwise"),)).setup(trial)
    ref.train()
    trial.train()
    objective = make_objective(ref, mp.Precision("32-true"), None)
    return relative_change(forward_losses(trial, batches, objective, seed),
                           forward_losses(ref, batches, objective, seed))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="small,nanogpt,llama")
    p.add_argument("--steps", type=int, default=150, help="FP32 training steps before planning")
    p.add_argument("--batches", type=int, default=6, help="planner batches (a third held out)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--gain", type=float, default=1e4)
    p.add_argument("--budget", type=float, default=0.1, help="percent")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from mixprec.data import DistributedDataLoader, TokenDataset, builtin_corpus
    corpus = builtin_corpus()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            torch.manual_seed(args.seed)
            model, layer = build(name, args.seq)
            loader = DistributedDataLoader(TokenDataset(corpus.train_path, max_length=args.seq),
                                           batch_size=args.batch, seed=args.seed)
            t0 = time.perf_counter()
            mp.fit(model, loader, mixed_precision="32-true", max_steps=args.steps, lr=3e-3,
                   warmup_steps=args.steps // 10, run_dir=f"{root}/{name}", progress=False,
                   audit=False, eval_interval=0, ckpt_interval=0, log_interval=50)
            train_s = time.perf_counter() - t0
            model = model.float().cpu()
            val = DistributedDataLoader(TokenDataset(corpus.val_path, max_length=args.seq),
                                        batch_size=args.batch, seed=args.seed)
            batches = [b for _, b in zip(range(args.batches), val)]
            for outliers in (False, True):
                m = copy.deepcopy(model)
                if outliers:
                    inject_outliers(m, layer, gain=args.gain)
                t0 = time.perf_counter()
                plan = mp.plan.plan_precision(m, batches, candidates=("fp32", "bf16", "fp8-tensorwise"),
                                         budget=args.budget / 100, target="H100", seed=args.seed)
                f = "fp8-tensorwise"
                ms = [x for x in plan.layers if f in x.loss_change_est]
                est = [x.loss_change_est[f] for x in ms]
                meas = [x.loss_change[f] for x in ms]
                ratios = sorted(b / a for a, b in zip(est, meas) if a > 0)
                n_cal = len(batches) - max(1, len(batches) // 3)
                whole = uniform_change(m, batches[:n_cal], args.seed)
                by_sens = sorted(ms, key=lambda x: x.sensitivity(f), reverse=True)
                by_est = sorted(ms, key=lambda x: x.loss_change_est[f], reverse=True)
                rank = lambda order: next(i + 1 for i, x in enumerate(order) if x.name == layer)  # noqa: E731
                rows.append({
                    "model": name, "outliers": f"x{args.gain:g} in {layer}" if outliers else "none",
                    "layers": len(ms), "spearman": spearman(est, meas),
                    "ratio": statistics.median(ratios), "ratio_lo": ratios[0], "ratio_hi": ratios[-1],
                    "sum_est": sum(est), "whole": whole,
                    "rank_sens": rank(by_sens) if outliers else None,
                    "rank_est": rank(by_est) if outliers else None,
                    "most": by_sens[0].name,
                    "chosen": plan.formats[layer], "held": plan.measured_heldout,
                    "cal": plan.measured_calibration, "fp8": sum(v.startswith("fp8") for v in plan.formats.values()),
                    "n": len(plan.formats), "demoted": len(plan.demoted),
                    "plan_s": time.perf_counter() - t0, "train_s": train_s,
                })
                r = rows[-1]
                print(f"[plan_calibration] {name} outliers={outliers}: spearman {r['spearman']:.2f}, "
                      f"median meas/est {r['ratio']:.3g}, most sensitive {r['most']}, plan "
                      f"{r['fp8']}/{r['n']} fp8 ({r['demoted']} moved back), {layer}={r['chosen']}, "
                      f"held-out {100 * r['held']:.3g}% ({r['plan_s']:.0f} s)", file=sys.stderr, flush=True)
    flags = sorted(set(open("/proc/cpuinfo").read().split()) & {"avx2", "avx512_bf16", "amx_bf16"}) \
        if Path("/proc/cpuinfo").exists() else []
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} "
          f"({', '.join(flags)}), torch {torch.__version__}; {args.steps} FP32 steps of "
          f"{args.batch}x{args.seq} tokens (seed {args.seed}), then the planner on {args.batches} "
          f"validation batches ({args.batches - max(1, args.batches // 3)} calibration, "
          f"{max(1, args.batches // 3)} held out), fp8-tensorwise, H100 target, budget {args.budget:g}%\n")
    print("| model | outliers | Linears | Spearman (est vs measured, per layer) | measured/est per layer: median (range) "
          "| uniform FP8: summed est / measured whole | outlier layer's rank: sensitivity / estimate alone "
          "| plan: FP8 layers, outlier layer, measured held-out |")
    print("|---" * 8 + "|")
    for r in rows:
        rank = f"{r['rank_sens']} / {r['rank_est']} of {r['layers']}" if r["rank_sens"] else "-"
        print(f"| {r['model']} | {r['outliers']} | {r['layers']} | {r['spearman']:.2f} | "
              f"{r['ratio']:.3g} ({r['ratio_lo']:.2g}-{r['ratio_hi']:.3g}) | "
              f"{100 * r['sum_est']:.3g}% / {100 * r['whole']:.3g}% | {rank} | "
              f"{r['fp8']}/{r['n']}, {r['chosen']}, {100 * r['held']:.3g}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
