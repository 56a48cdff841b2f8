"""Bytes per parameter of the Adam moments as each optimizer actually allocates them, on a model
preset's own parameter shapes: mixprec's AdamW (``moments=int8`` / ``fp8``) after one step, and
the state buffers bitsandbytes' AdamW8bit and torchao's AdamW8bit / AdamWFp8 create for the same
parameters (their own allocation code: bitsandbytes' ``init_state``, torchao's ``_new_buffer``;
no step, which torchao would ``torch.compile``). Every tensor of the state is counted (codes,
scales, FP32 fall-backs, torchao's per-buffer code maps; bitsandbytes' shared code map once),
the step counters not. Issue 27, docs/lean.md. Usage:
    python benchmarks/lean_state_bytes.py small,gpt-ref
"""
import sys
import torch
import mixprec as mp


def tensors(x):
    """Every distinct tensor inside a state value (torchao's subclasses: their inner tensors)."""
    if not isinstance(x, torch.Tensor):
        return []
    if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
        names, _ = x.__tensor_flatten__()
        return [t for n in names for t in tensors(getattr(x, n))]
    return [x]


def state_bytes(states, skip=("step",)):
    seen, total = set(), 0
    for st in states:
        for k, v in st.items():
            for t in tensors(v):
                if k in skip or t.untyped_storage().data_ptr() in seen:
                    continue
                seen.add(t.untyped_storage().data_ptr())
                total += t.numel() * t.element_size()
    return total


def main(names):
    for name in names:
        torch.manual_seed(0)
        model = mp.models.Transformer.from_preset(name)
        ps = list({id(p): p for p in model.parameters()}.values())
        n = sum(p.numel() for p in ps)
        row = {}
        for moments in ("int8", "fp8"):
            opt = mp.optim.AdamW(ps, lr=1e-3, moments=moments)
            for p in ps:
                p.grad = torch.zeros_like(p)
            opt.step()
            row[f"mixprec {moments}"] = state_bytes(opt.state.values())
            del opt
        try:
            import bitsandbytes as bnb
            opt = bnb.optim.AdamW8bit(ps, lr=1e-3)
            for gi, g in enumerate(opt.param_groups):
                for pi, p in enumerate(g["params"]):
                    opt.init_state(g, p, gi, pi)
            row["bitsandbytes AdamW8bit"] = state_bytes(opt.state.values(), skip=("step", "unorm_vec"))
        except ImportError:
            pass
        try:
            import torchao.optim as ao
            for cls in (ao.AdamW8bit, ao.AdamWFp8):
                opt = cls(ps, lr=1e-3)
                bufs = [{"exp_avg": opt._new_buffer(p, True), "exp_avg_sq": opt._new_buffer(p, False)}
                        for p in ps]          # all alive at once, as in the optimizer
                row[f"torchao {cls.__name__}"] = state_bytes(bufs)
        except ImportError:
            pass
        vec = sum(p.numel() for p in ps if p.dim() < 2)
        print(f"{name}: {n} parameters ({vec / n:.2%} in vectors); moments, bytes per parameter: "
              + ", ".join(f"{k} {b / n:.4f}" for k, b in row.items()), flush=True)


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "small,gpt-ref").split(","))
