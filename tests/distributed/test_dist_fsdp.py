"""FSDPStrategy (FSDP2 fully_shard) on CPU with gloo, 2 real processes.

Job 1 trains a small block model sharded across two ranks (FP32 policy, checked against one
process on the same global batch), checks the global gradient norm, saves the full model and
optimizer state on rank 0, and trains on. Job 2 — fresh processes — loads that checkpoint (rank 0
reads the file, rank 1 passes None) and must continue exactly where job 1 went. A bf16-mixed run
checks the policy mapping: BF16 compute, FP32 shards (masters), FP32 LayerNorm islands.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_harness import run_distributed

pytestmark = pytest.mark.distributed

WORLD, LOCAL_B, LR = 2, 8, 1e-2
BEFORE, AFTER = 3, 2          # steps before and after the checkpoint


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_data(n: int = 128):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def adam(params):
    return torch.optim.Adam(params, lr=LR)


def _step(model, opt, x, y, rows) -> float:
    loss = nn.functional.mse_loss(model(x[rows]).float(), y[rows])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(norm)


def rows_for(step: int, rank: int) -> slice:
    start = step * LOCAL_B * WORLD + rank * LOCAL_B
    return slice(start, start + LOCAL_B)


def full_params(strategy, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strategy.model_state_dict(model).items()}


def train_and_save(rank: int, path: str) -> dict:
    from mixprec.strategies import FSDPStrategy

    x, y = make_data()
    strategy = FSDPStrategy("32-true")
    model, opt = strategy.setup(make_model(), adam)   # optimizer built on the shards
    out = {"sharded": all(hasattr(p, "placements") for p in model.parameters()),
           "norms": [_step(model, opt, x, y, rows_for(s, rank)) for s in range(BEFORE)]}
    state = {"model": strategy.model_state_dict(model),
             "optim": strategy.optimizer_state_dict(model, opt)}
    if strategy.is_main:
        torch.save(state, path)
        out["saved"] = {k: v.clone() for k, v in state["model"].items()}
    else:
        out["nonmain_state_empty"] = not state["model"]
    for s in range(BEFORE, BEFORE + AFTER):
        _step(model, opt, x, y, rows_for(s, rank))
    out["final"] = full_params(strategy, model)

    # bf16-mixed: BF16 compute and all-gather, FP32 shards and reduce, FP32 norm islands
    mixed = FSDPStrategy("bf16-mixed")
    m2, o2 = mixed.setup(make_model(), adam)
    dtypes_seen: set[torch.dtype] = set()
    def seen(kind):
        return lambda mod, args, *out: dtypes_seen.add((kind, (out[0] if out else args[0]).dtype))
    kinds = [(mod, "LayerNorm" if isinstance(mod, nn.LayerNorm) else "Linear")
             for mod in m2.modules() if isinstance(mod, (nn.Linear, nn.LayerNorm))]
    hooks = [h for mod, kind in kinds   # FSDP's own hooks run first: these see its casts
             for h in (mod.register_forward_pre_hook(seen(kind + ".in")),
                       mod.register_forward_hook(seen(kind + ".out")))]
    losses = []
    for epoch in range(3):
        for s in range(len(x) // (LOCAL_B * WORLD)):
            rows = rows_for(s, rank)
            loss = nn.functional.mse_loss(m2(x[rows]).float(), y[rows])
            loss.backward()
            o2.step()
            o2.zero_grad()
            losses.append(mixed.reduce_mean(loss))
            for h in hooks:
                h.remove()
            hooks = []
    out["mixed"] = {"losses": losses, "dtypes": dtypes_seen,
                    "shard_dtypes": {p.dtype for p in m2.parameters()},
                    "stats": mixed.comm_stats()}
    return out


def resume(rank: int, path: str) -> dict:
    from mixprec.strategies import FSDPStrategy

    x, y = make_data()
    strategy = FSDPStrategy("32-true")
    model, opt = strategy.setup(make_model(seed=123), adam)     # different init: must be overwritten
    state = torch.load(path, weights_only=True) if rank == 0 else None
    strategy.load_model_state_dict(model, state and state["model"])
    strategy.load_optimizer_state_dict(model, opt, state and state["optim"])
    out = {"loaded": full_params(strategy, model)}
    for s in range(BEFORE, BEFORE + AFTER):
        _step(model, opt, x, y, rows_for(s, rank))
    out["final"] = full_params(strategy, model)
    out["guard"] = guarded_fit(rank, path)
    return out


def guarded_fit(rank: int, path: str) -> dict:
    """``fit(guard=True)`` under FSDP2 (this job's process group): refused before the run starts."""
    import os

    import mixprec as mp
    from mixprec.errors import ConfigError
    from mixprec.strategies import FSDPStrategy

    x, y = make_data()
    model = make_model()
    run_dir = os.path.join(os.path.dirname(path), f"guarded-{rank}")
    trainer = mp.Trainer(model, strategy=FSDPStrategy(), guard=True, max_steps=2, run_dir=run_dir,
                         progress=False, audit=False, loss_fn=lambda out, t: nn.functional.mse_loss(out, t))
    try:
        trainer.fit([(x[:8], y[:8]), (x[8:16], y[8:16])])
    except ConfigError as e:
        return {"error": str(e), "exit_code": getattr(e, "exit_code", 2), "run_dir_exists": os.path.exists(run_dir),
                "model_sharded": any(hasattr(p, "placements") for p in model.parameters()),
                "steps": trainer.step}
    return {"error": None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp") / "ckpt.pt")
    first = run_distributed(train_and_save, path)
    second = run_distributed(resume, path)
    return first, second


def reference():
    """One process, the whole global batch per step: the norms and final weights."""
    x, y = make_data()
    model = make_model()
    opt = adam(model.parameters())
    norms = []
    for s in range(BEFORE + AFTER):
        rows = slice(s * LOCAL_B * WORLD, (s + 1) * LOCAL_B * WORLD)
        norms.append(_step(model, opt, x, y, rows))
    return norms, {k: v.detach() for k, v in model.state_dict().items()}


def test_fsdp_shards_parameters_and_matches_one_process(runs):
    first, _ = runs
    ref_norms, ref_final = reference()
    assert all(r["sharded"] for r in first)
    final = first[0]["final"]
    assert final.keys() == ref_final.keys()
    for k in ref_final:
        torch.testing.assert_close(final[k], ref_final[k], rtol=1e-5, atol=1e-5)
    for r in first:  # clip_grad_norm_ on DTensor grads is the global norm on every rank
        assert r["norms"] == pytest.approx(ref_norms[:BEFORE], rel=1e-5)


def test_full_state_is_gathered_on_rank0_only(runs):
    first, _ = runs
    assert first[1]["nonmain_state_empty"]
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in first[0]["saved"].values())


def test_checkpoint_resumes_in_fresh_processes(runs):
    first, second = runs
    saved = first[0]["saved"]
    for k, v in second[0]["loaded"].items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    for k, v in second[0]["final"].items():   # optimizer state came back too: same trajectory
        torch.testing.assert_close(v, first[0]["final"][k], rtol=1e-6, atol=1e-7)


def test_bf16_mixed_computes_in_bf16_with_fp32_shards_and_norms(runs):
    first, _ = runs
    mixed = first[0]["mixed"]
    assert mixed["shard_dtypes"] == {torch.float32}
    seen = {kind: dt for kind, dt in mixed["dtypes"]}
    assert seen["Linear.out"] == torch.bfloat16
    assert seen["LayerNorm.in"] == torch.float32      # FP32 island: input cast up ...
    assert seen["LayerNorm.out"] == torch.bfloat16    # ... output cast back to the compute dtype
    losses = mixed["losses"]
    assert losses[-1] < 0.7 * losses[0]
    assert first[1]["mixed"]["losses"] == losses
    net = make_model()
    n_all = sum(p.numel() for p in net.parameters())
    n_norm = sum(p.numel() for b in net.blocks for p in b.norm.parameters())
    stats = mixed["stats"]   # bf16 all-gathers (fp32 for norms), twice per step; fp32 reduce
    assert stats["reduce_scatter_bytes_per_step"] == 4 * n_all
    assert stats["allgather_bytes_per_step"] == 2 * (2 * (n_all - n_norm) + 4 * n_norm)


def test_guard_under_fsdp2_is_refused_in_one_line_and_the_run_does_not_start(runs):
    for out in (r["guard"] for r in runs[1]):
        assert out["error"] is not None, "fit(guard=True) under FSDP2 started"
        assert "\n" not in out["error"] and out["error"].startswith("guard=true swaps Linear modules")
        assert "strategy=ddp or single, or guard=false" in out["error"]
        assert out["exit_code"] == 2                      # mixprec train: one line, exit 2
        assert not out["run_dir_exists"] and not out["model_sharded"] and out["steps"] == 0
