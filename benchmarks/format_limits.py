"""Where the per-format guard/plan limits come from (mixprec/formats/limits.py, docs/per-layer.md).

Measures, per format, what the training guard measures (:meth:`mixprec.monitor.TrainingGuard.sample_sqnr`:
a Linear's output SQNR against the same GEMM in FP32 on the same input, and the share of its input
the format flushes to zero or saturates):

1. **synthetic**: one 256 -> 256 Linear (weights N(0, 1/256)) on 512 x 256 inputs drawn from a
   Gaussian and from Student-t with 5 and 3 degrees of freedom (heavy tails, per element);
2. **models trained a little**: mixprec's ``tiny`` and ``small`` Transformers and a tiny Hugging
   Face Llama (2 layers, d=64), ``--steps`` AdamW steps in FP32 on a learnable task, then every
   Linear the format may take in that format; min / median output SQNR and the largest flushed
   share over the layers;
3. **outlier layers**: the guard tests' net with outlier channels grown (``tests/guard_nets.py``,
   ``blocks.0.proj``) and the what-if tests' outlier net (``blocks.1.proj``), both at
   initialisation, to check that they fail the limits in FP4 while their ordinary layers pass;
4. **the planner's gates** (``--plan``) on the trained ``small`` model, without and with
   ``benchmarks/plan_outliers.py``'s outliers in ``blocks.1.mlp.proj``: per layer, the formats
   refused and why, and the choice (target B200, budget 5 %).

    python benchmarks/format_limits.py --steps 30 --plan
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FORMATS = ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "mxfp4", "nvfp4", "bf16", "fp16")


def sample(model: nn.Module, fmt: str, probe) -> tuple[dict[str, float], dict[str, float]]:
    """Per Linear in ``fmt``: (output SQNR dB, flushed share of its input), as the guard samples."""
    import mixprec as mp
    from mixprec.monitor.guard import GuardConfig, TrainingGuard
    from mixprec.plan.verify import fp32_copy
    m = fp32_copy(model)
    precision = mp.Precision("32-true", overrides=(("*", fmt),))
    precision.setup(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard = TrainingGuard(precision, m, opt, sched, config=GuardConfig())
    sqnr = guard.sample_sqnr(lambda: probe(m))
    return ({n: v for n, v in sqnr.items() if precision.layers.formats[n] == fmt},
            {n: v for n, v in guard.last_flush.items() if precision.layers.formats[n] == fmt})


def synthetic(fmt: str, dist: str, seed: int = 0) -> tuple[float, float]:
    g = torch.Generator().manual_seed(seed)
    if dist == "gauss":
        x = torch.randn(512, 256, generator=g)
    elif dist == "gelu":                       # an MLP's second Linear reads GELU(Gaussian)
        x = F.gelu(torch.randn(512, 256, generator=g))
    elif dist == "swiglu":                     # a gated MLP's down projection: SiLU(a) * b
        x = F.silu(torch.randn(512, 256, generator=g)) * torch.randn(512, 256, generator=g)
    else:
        nu = float(dist[1:])
        z = torch.randn(512, 256, generator=g)
        chi2 = torch.distributions.Chi2(nu).sample((512, 256))
        x = z / (chi2 / nu).sqrt()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(256, 256))
    with torch.no_grad():
        net[0].weight.copy_(torch.randn(256, 256, generator=g) / 16)
    sqnr, flush = sample(net, fmt, lambda m: m(x))
    return sqnr["0"], flush["0"]


def trained(name: str, steps: int):
    """(model, probe) of one model trained ``steps`` AdamW steps in FP32."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "hf-llama":
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)

        def loss(m, x):
            return F.cross_entropy(m(input_ids=x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten())
    else:
        import mixprec as mp
        model = mp.Transformer.from_preset(name)

        def loss(m, x):
            return m(x[:, :-1], x[:, 1:])[1]
    # A learnable task: each token is 7 * the previous + 3 (mod 256), starting anywhere.
    def batch():
        start = torch.randint(0, 256, (4, 1), generator=g)
        seq = [start]
        for _ in range(32):
            seq.append((7 * seq[-1] + 3) % 256)
        return torch.cat(seq, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss(model, batch()).backward()
        opt.step()
    x = torch.cat([batch(), batch()])
    return model, (lambda m: loss(m, x)), float(loss(model, x).detach())


def outlier_nets():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from guard_nets import Net, loader
    net = Net(boost=True)
    net.blocks[0].grow_outliers()
    x, y = loader()[0]
    yield "guard_nets boost", net, (lambda m: m(x, y)), "blocks.0.proj"
    from plan.test_whatif import _batches, _Net
    torch.manual_seed(0)
    wnet = _Net()
    (bx, by), = _batches(1)
    yield "whatif _Net", wnet, (lambda m: m(bx, by)), "blocks.1.proj"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default="tiny,small,hf-llama")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--plan", action="store_true", help="also the planner's gates on small (section 4)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fmts = args.formats.split(",")
    flags = sorted({f for f in ("avx2", "avx512_bf16", "amx_bf16") if f in Path("/proc/cpuinfo").read_text()})
    print(f"# format_limits: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"CPU flags {' '.join(flags)}, load {' '.join(f'{v:.1f}' for v in __import__('os').getloadavg())}, "
          f"torch {torch.__version__}")
    t0 = time.perf_counter()
    print("\n## synthetic: one 256->256 Linear, 512 x 256 inputs; output SQNR dB / flushed % of input")
    print("| format | " + " | ".join(("Gaussian", "Student-t 5", "Student-t 3", "GELU(Gaussian)",
                                      "SiLU(a) * b")) + " |")
    print("|---|---|---|---|---|---|")
    for f in fmts:
        cells = [synthetic(f, d) for d in ("gauss", "t5", "t3", "gelu", "swiglu")]
        print(f"| {f} | " + " | ".join(f"{s:.1f} / {100 * fl:.2f}" for s, fl in cells) + " |")
    print(f"\n## models trained {args.steps} AdamW steps in FP32: output SQNR dB min / median, "
          "largest flushed % of a layer's input")
    print("| model (loss) | " + " | ".join(fmts) + " |")
    print("|---|" + "---|" * len(fmts))
    for name in args.models.split(","):
        model, probe, loss = trained(name, args.steps)
        cells = []
        for f in fmts:
            sqnr, flush = sample(model, f, probe)
            cells.append(f"{min(sqnr.values()):.1f} / {statistics.median(sqnr.values()):.1f} / "
                         f"{100 * max(flush.values()):.1f}" if sqnr else "-")
        print(f"| {name} ({loss:.2f}) | " + " | ".join(cells) + " |")
    print("\n## outlier layers: the outlier layer's SQNR dB / flushed %; the other layers' min SQNR / max flushed %")
    print("| net | " + " | ".join(fmts) + " |")
    print("|---|" + "---|" * len(fmts))
    for label, net, probe, bad in outlier_nets():
        cells = []
        for f in fmts:
            sqnr, flush = sample(net, f, probe)
            rest = [n for n in sqnr if n != bad]
            cells.append(f"{sqnr[bad]:.1f} / {100 * flush[bad]:.1f}; "
                         f"{min(sqnr[n] for n in rest):.1f} / {100 * max(flush[n] for n in rest):.1f}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.plan:
        plan_gates(args.steps)
    print(f"\ntook {time.perf_counter() - t0:.0f} s")


def plan_gates(steps: int) -> None:
    import mixprec as mp
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_outliers import inject_outliers
    for outlier in (None, "blocks.1.mlp.proj"):
        model, _, _ = trained("small", steps)
        if outlier:
            inject_outliers(model, outlier)
        g = torch.Generator().manual_seed(5)

        def batch():
            seq = [torch.randint(0, 256, (4, 1), generator=g)]
            for _ in range(32):
                seq.append((7 * seq[-1] + 3) % 256)
            x = torch.cat(seq, 1)
            return x[:, :-1], x[:, 1:]
        plan = mp.plan.plan_precision(model, [batch(), batch()], candidates=FORMATS[:-1], target="B200",
                                 heldout=[], budget=0.05)
        print(f"\n## planner's gates, small trained {steps} steps"
              + (f", outliers in {outlier}" if outlier else "") + ": chosen; refused formats")
        for m in plan.layers:
            extra = ""
            if m.name == outlier:
                extra = " | " + ", ".join(f"{f} {m.sqnr_out[f]:.1f} dB / {100 * m.flush_in[f]:.1f} %"
                                          for f in m.sqnr_out if f != "fp32")
            print(f"{m.name}: {m.chosen}; " + ("; ".join(f"{f}: {w}" for f, w in m.risky.items())
                                               or "-") + extra)


if __name__ == "__main__":
    main()
