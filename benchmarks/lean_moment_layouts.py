"""One encode/decode of real Adam moments in candidate 8-bit layouts (block length, scale dtype,
FP8 flavour): relative L2 error of m, sqrt(v) and the update m / (sqrt(v) + eps), averaged over 3
rounding seeds. The moments are those of the tiny model after 150 FP32-moment AdamW steps on the
built-in corpus (issue 27; docs/lean.md). Usage:
    python benchmarks/lean_moment_layouts.py
"""
import torch, mixprec as mp
from mixprec.optim import moments as M
torch.manual_seed(0); torch.set_num_threads(1)
model = mp.models.Transformer.from_preset("tiny", max_seq_len=64)
opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
corpus = mp.data.builtin_corpus(); ds = mp.data.TokenDataset(corpus.train_path, max_length=64)
g = torch.Generator().manual_seed(0)
for s in range(150):
    rows = torch.randint(0, len(ds), (8,), generator=g)
    x, y = map(torch.stack, zip(*(ds[int(i)] for i in rows)))
    _, loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
ps = [p for p in model.parameters()]
ms = [opt.state[p]["exp_avg"].clone() for p in ps]; vs = [opt.state[p]["exp_avg_sq"].clone() for p in ps]
cat = lambda xs: torch.cat([x.reshape(-1) for x in xs])
u_ref = cat(ms) / (cat(vs).sqrt() + 1e-8)
def trial(name, lay):
    M.LAYOUTS[name] = lay
    errs = {"m": [], "v": [], "u": []}
    for rep in range(3):
        gen = torch.Generator().manual_seed(rep)
        sts = [M.new_state(p, name) for p in ps]
        M.encode_(sts, "exp_avg", ms, name, gen); M.encode_(sts, "exp_avg_sq", vs, name, gen)
        m2 = [torch.empty_like(m) for m in ms]; v2 = [torch.empty_like(v) for v in vs]
        M.decode_(sts, "exp_avg", m2, name); M.decode_(sts, "exp_avg_sq", v2, name)
        u = cat(m2) / (cat(v2).sqrt() + 1e-8)
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()
        errs["m"].append(rel(cat(m2), cat(ms))); errs["v"].append(rel(cat(v2).sqrt(), cat(vs).sqrt())); errs["u"].append(rel(u, u_ref))
    print(f"{name:9s} block {lay.block:5d} scale {str(lay.scale_dtype)[6:]:9s} B/param {lay.bytes_per_param():.4f}  "
          + "  ".join(f"{k} {sum(v)/3*100:.2f}%" for k, v in errs.items()), flush=True)
L = M.Layout
for b in (256, 1024, 2048):
    for sd in (torch.float32, torch.bfloat16):
        trial("int8", L(codes=(torch.int8, torch.uint8), block=b, scale_dtype=sd))
for codes, nm in (((torch.float8_e4m3fn,)*2, "fp8"), ((torch.float8_e5m2,)*2, "fp8-e5m2")):
    for b in (256, 1024):
        for sd in (torch.float32, torch.bfloat16):
            trial(nm, L(codes=codes, block=b, scale_dtype=sd, scales=2))
