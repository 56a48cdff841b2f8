"""Hugging Face GPT-2 and Llama through fit() in every kind of precision mode, with no glue."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp
from mixprec.formats import Fp8Conv1D, Fp8Linear
from mixprec.precision import is_norm

transformers = pytest.importorskip("transformers")

MODES = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "fp8-tensorwise"]


def _fit(model, data, mode, tmp_path, **kw):
    opts = dict(mixed_precision=mode, max_steps=len(data), lr=3e-3, warmup_steps=0, progress=False,
                audit=False, ckpt_interval=0, eval_interval=0, run_dir=str(tmp_path / mode), seed=0)
    return mp.fit(model, data, **{**opts, **kw})


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", MODES)
def test_fit_trains_hf_models_in_every_mode_with_fp32_norms(arch, mode, hf_model, batches, tmp_path):
    model = hf_model(arch)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    seq = 8 if mode == "16-mixed" else 16          # FP16 is emulated on CPUs: keep it tiny
    result = _fit(model, batches(3, seq=seq), mode, tmp_path)
    assert result.steps == 3 and result.skipped_steps == 0
    assert result.final_loss is not None and torch.isfinite(torch.tensor(result.final_loss))
    norms = [(n, m) for n, m in model.named_modules() if is_norm(m)]
    assert len(norms) == 5
    for name, norm in norms:
        assert all(p.dtype == torch.float32 for p in norm.parameters()), f"{mode}: {name}"
    precision = mp.Precision(mode)
    first = (model.transformer.h[0].mlp.c_fc if arch == "gpt2" else model.model.layers[0].mlp.up_proj)
    assert first.weight.dtype == precision.recipe.param_dtype
    if mode.startswith("fp8"):
        assert isinstance(first, Fp8Conv1D if arch == "gpt2" else Fp8Linear)
    after = model.state_dict()          # (on the device fit() trained on; ``before`` on the CPU)
    assert not torch.equal(before[next(k for k in before if "mlp" in k and k.endswith("weight"))].float(),
                           after[next(k for k in after if "mlp" in k and k.endswith("weight"))].float().cpu())


def _text_batches(path, n: int, batch: int, seq: int, start: int = 0):
    data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
    out = []
    for i in range(n):
        rows = [data[start + (i * batch + j) * seq: start + (i * batch + j + 1) * seq + 1]
                for j in range(batch)]
        s = torch.stack(rows)
        out.append((s[:, :-1], s[:, 1:]))
    return out


def test_bf16_mixed_final_loss_is_within_1_percent_of_32_true_after_30_steps(hf_model, corpus_file,
                                                                             tmp_path):
    """Same seed, same data; only the precision changes. Tolerance: 1 % of the FP32 loss."""
    data = _text_batches(corpus_file, 30, batch=4, seq=32)
    held_out = _text_batches(corpus_file, 4, batch=4, seq=32, start=100_000)
    losses = {}
    for mode in ("32-true", "bf16-mixed"):
        model = hf_model("llama")
        result = _fit(model, data, mode, tmp_path, val_loader=held_out, eval_batches=4)
        losses[mode] = result.final_val_loss
    assert losses["32-true"] < 4.5                         # it learned (uniform is ln 256 = 5.55)
    assert abs(losses["bf16-mixed"] / losses["32-true"] - 1) < 0.01, losses


def _weights_after_fit(seed: int, tmp_path, hf_model, *, global_rng: int) -> dict:
    model = hf_model("gpt2", seed=123, dropout=0.1)           # same init every time
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (24, 17), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True)
    torch.manual_seed(global_rng)                             # fit() must not depend on this
    mp.fit(model, loader, mixed_precision="32-true", epochs=2, lr=3e-3, warmup_steps=0,
           progress=False, audit=False, ckpt_interval=0, eval_interval=0,
           run_dir=str(tmp_path / f"seed{seed}-{global_rng}"), seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_same_seed_gives_identical_weights_and_another_seed_differs(hf_model, tmp_path):
    """Dropout and a shuffling torch DataLoader both follow FitConfig.seed."""
    a = _weights_after_fit(0, tmp_path, hf_model, global_rng=1)
    b = _weights_after_fit(0, tmp_path, hf_model, global_rng=2)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c = _weights_after_fit(1, tmp_path, hf_model, global_rng=1)
    assert any(not torch.equal(a[k], c[k]) for k in a)
