"""Fidelity of the lean options: final validation loss vs 32-true, several seeds (issue 27).

Each (seed, variant) trains the same model on the built-in corpus for STEPS steps with the same
batches and evaluates on the same held-out batches. The noise band is how far bf16-mixed lands
from 32-true on the same seed. Usage:
    python benchmarks/lean_fidelity.py --model tiny --steps 1000 --seeds 0,1,2 --out fid.jsonl
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import mixprec as mp
from mixprec.train.config import FitConfig
from mixprec.train.trainer import Trainer

VARIANTS = {
    "32-true": dict(precision="32-true"),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "32-true+bf16moments": dict(precision="32-true", moments="bf16"),
    "32-true+int8moments": dict(precision="32-true", moments="int8"),
    "32-true+fp8moments": dict(precision="32-true", moments="fp8"),
    "32-true+fp8e5m2moments": dict(precision="32-true", moments="fp8-e5m2"),
    "32-true+int8moments@256": dict(precision="32-true", moments="int8", int8_block=256),
    "32-true+fp8acts": dict(precision="32-true", fp8_activations=True),
    "bf16-true+int8moments+fp8acts": dict(precision="bf16-true", moments="int8", fp8_activations=True),
    "torchao-adamw8bit": dict(precision="32-true", peer="torchao"),
    "bnb-adamw8bit": dict(precision="32-true", peer="bnb"),
    "bnb-adamw32bit": dict(precision="32-true", peer="bnb32"),   # bitsandbytes' update with 32-bit states
    "torch-adamw": dict(precision="32-true", peer="torch"),      # the control for the peers' path
}


from mixprec.optim import moments as _M  # noqa: E402

DEFAULT_INT8 = _M.LAYOUTS["int8"]
BETAS = (FitConfig.beta1, FitConfig.beta2)   # the trainer's own AdamW betas: peers get the same


def _groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainer's groups: weight decay on matrices only (mixprec.train.trainer)."""
    ps = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def run(model_name: str, variant: str, seed: int, steps: int, batch: int, seq: int) -> dict:
    spec = dict(VARIANTS[variant])
    peer = spec.pop("peer", None)
    int8_block = spec.pop("int8_block", None)
    from mixprec.optim import moments as M
    M.LAYOUTS["int8"] = M.Layout(codes=(torch.int8, torch.uint8), block=int8_block or DEFAULT_INT8.block)
    corpus = mp.data.builtin_corpus()
    train = mp.data.TokenDataset(corpus.train_path, max_length=seq)
    val = mp.data.TokenDataset(corpus.val_path, max_length=seq)
    g = torch.Generator().manual_seed(1000 + seed)
    idx = torch.randint(0, len(train), (steps, batch), generator=g)
    vidx = torch.randint(0, len(val), (10, batch), generator=torch.Generator().manual_seed(7))
    def batch_of(ds, rows):
        xs, ys = zip(*(ds[int(i)] for i in rows))
        return torch.stack(xs), torch.stack(ys)
    torch.manual_seed(seed)
    model = mp.models.Transformer.from_preset(model_name, max_seq_len=seq)
    cfg = FitConfig(lr=2e-3, warmup_steps=30, audit=False, progress=False, trace_nonfinite=False,
                    clip_grad_norm=1.0, seed=seed, **spec)
    opt = None
    if peer == "torchao":
        from torchao.optim import AdamW8bit
        opt = AdamW8bit(_groups(model, 0.1), lr=2e-3, betas=BETAS)
    elif peer == "bnb":
        import bitsandbytes as bnb
        # like for like: the trainer's groups, and 8-bit states for every tensor of >= 256 elements
        # (bitsandbytes' default keeps 32-bit states below 4096 elements: most of the tiny model)
        opt = bnb.optim.AdamW8bit(_groups(model, 0.1), lr=2e-3, betas=BETAS, min_8bit_size=256)
    elif peer == "bnb32":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW(_groups(model, 0.1), lr=2e-3, betas=BETAS, optim_bits=32)
    elif peer == "torch":
        opt = torch.optim.AdamW(_groups(model, 0.1), lr=2e-3, betas=BETAS)
    trainer = Trainer(model, config=cfg, strategy="single", optimizer=opt)
    trainer.prepare(total_steps=steps)
    t0 = time.time()
    for s in range(steps):
        trainer.train_step([batch_of(train, idx[s])])
        trainer.step += 1
    train_s = time.time() - t0
    val_loss = trainer.evaluate([batch_of(val, r) for r in vidx])
    return {"variant": variant, "seed": seed, "steps": steps, "val_loss": val_loss, "train_s": train_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="lean_fidelity.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with open(a.out, "a") as f:
        for seed in map(int, a.seeds.split(",")):
            for v in a.variants.split(","):        # alternate variants inside each seed
                r = run(a.model, v, seed, a.steps, a.batch, a.seq)
                print(json.dumps(r), flush=True)
                f.write(json.dumps(r) + "\n")
                f.flush()


if __name__ == "__main__":
    main()
