"""``mixprec estimate``: FLOPs, time, energy and cost against hand-computed values, memory from the
``mixprec memory`` estimator, a Hugging Face config read to the parameter, and one-line errors."""
from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.estimate.cluster import ModelSpec, estimate, model_from_hf_config, parse_count
from mixprec.estimate.memory import ModelShape, estimate_memory
from mixprec.cli import main
from mixprec.errors import ConfigError
from mixprec.models import Transformer

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK_V3 = ROOT / "examples" / "configs" / "deepseek-v3.json"
ONE_B = ModelSpec(name="1B dense", total_params=1e9, active_params=1e9)


def test_dense_flops_time_energy_cost_by_hand():
    # 6 N D = 6 * 1e9 * 1e12 = 6e21 FLOPs; 8 H100 at 989.5 TFLOPS (BF16 dense) and 50 % MFU
    # run at 3.958e15 FLOP/s: 6e21 / 3.958e15 = 1,515,917.1 s = 17.545 days, 3,368.7 GPU-hours,
    # x 700 W x PUE 1.2 = 2.8297 MWh, x $2 = $6,737.4.
    e = estimate(ONE_B, tokens="1T", gpu="H100", num_gpus=8, precision="bf16-mixed", mfu=0.5,
                 global_batch_tokens="4M", seq=4096, attention_flops=False)
    assert e.flops_per_token == 6e9 and e.total_flops == 6e21
    assert e.peak_flops == 989.5e12
    assert e.days == pytest.approx(17.5453, rel=1e-4)
    assert e.gpu_hours == pytest.approx(3368.70, rel=1e-5)
    assert e.energy_mwh == pytest.approx(2.82971, rel=1e-5)
    assert e.cluster_mw == pytest.approx(8 * 700 * 1.2 / 1e6)
    assert e.cost_usd == pytest.approx(6737.40, rel=1e-5)
    # step: 4e6 tokens x 6e9 / 3.958e15 = 6.0637 s; 4e6 / 6.0637 = 659,667 tokens/s
    assert e.step_s == pytest.approx(6.06367, rel=1e-5)
    assert e.tokens_per_s == pytest.approx(659_666.7, rel=1e-5)


def test_moe_counts_active_parameters_only():
    # 2 blocks, d=64, 4 experts top-1, no biases, untied head. Active per block: attention 4*64^2
    # = 16,384 + one expert 2*64*256 = 32,768 + router 64*4 = 256 + two norms 128 = 49,536;
    # x2 + final norm 64 + head 256*64 = 16,384 -> 115,520 (the embedding look-up is free).
    shape = ModelShape(num_layers=2, d_model=64, num_heads=4, vocab_size=256, max_seq_len=64,
                       num_experts=4, top_k=1, bias=False, tie_embeddings=False)
    assert shape.active_parameters() == 115_520
    spec = ModelSpec.from_shape("moe", shape)
    e = estimate(spec, tokens=1e9, gpu="H100", num_gpus=1, mfu=0.5, seq=64, global_batch_tokens=64,
                 attention_flops=False)
    assert e.flops_per_token == 6 * 115_520
    assert e.total_flops == 6 * 115_520 * 1e9


def test_flops_per_token_is_the_trainers():
    """The estimate's FLOPs per token are Transformer.flops_per_token's, so a measured MFU carries over."""
    model = Transformer.from_preset("tiny", vocab_size=256, max_seq_len=128)
    e = estimate("tiny", tokens=2048, gpu="cpu", peak_tflops=0.1, num_gpus=1, precision="32-true",
                 mfu=0.5, seq=128, global_batch_tokens=2048, parallelism="ddp")
    assert e.flops_per_token == model.flops_per_token() == 797_184
    assert e.total_params == model.num_parameters()


def test_deepseek_v3_config_gives_671b_total_and_37b_active():
    # Hand count (docs/estimates.md): per block MLA attention 187,107,328, two norms 14,336; dense
    # MLP 3*7168*18432 = 396,361,728; MoE: 257 experts of 3*7168*2048 = 44,040,192 + router
    # 1,835,008. 3 dense + 58 MoE blocks + embedding and head 2*129280*7168 + final norm 7,168.
    spec = model_from_hf_config(DEEPSEEK_V3)
    assert spec.total_params == 671_026_404_352
    # active: 8 routed + 1 shared expert per MoE block; without the embedding (0.93B)
    assert spec.active_params == 36_625_603_584


def test_deepseek_v3_implied_mfu_reproduces_the_reported_gpu_hours():
    # 6 x 37e9 x 14.8e12 = 3.2856e24 FLOPs. 2.788M H800 GPU-hours (DeepSeek-V3 report) at the
    # FP8 peak 1979 TFLOPS: MFU = 3.2856e24 / (1979e12 * 3600 * 2.788e6) = 0.16541.
    spec = ModelSpec(name="v3", total_params=671e9, active_params=37e9)
    e = estimate(spec, tokens="14.8T", gpu="H800", num_gpus=2048, precision="fp8-blockwise", mfu=0.16541,
                 seq=4096, global_batch_tokens=15360 * 4096, attention_flops=False)
    assert e.total_flops == pytest.approx(3.2856e24)
    assert e.gpu_hours == pytest.approx(2.788e6, rel=1e-4)
    assert e.days == pytest.approx(2.788e6 / 2048 / 24, rel=1e-4)      # 56.7 days, not 18


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed", "bf16-true", "fp8-blockwise"])
def test_memory_is_the_memory_estimators(mode):
    shape = ModelShape.from_config(Transformer.from_preset("small").config)
    e = estimate(ModelSpec.from_shape("small", shape), tokens=1e6, gpu="H100", num_gpus=8, precision=mode,
                 seq=256, micro_batch=4, parallelism="fsdp", global_batch_tokens=8 * 4 * 256)
    assert e.memory == estimate_memory(shape, mode, batch=4, seq=256, shards=8)


def test_sharding_and_tensor_pipeline_degrees_divide_the_states():
    # 1e9 params x 16 B (FP32 masters/params + Adam) = 16 GB in every mode
    def states(**kw):
        return estimate(ONE_B, tokens=1e9, gpu="H100", seq=4096, **kw).memory.states
    assert states(num_gpus=8, parallelism="fsdp") == pytest.approx(16e9 / 8)
    assert states(num_gpus=8, parallelism="ddp") == pytest.approx(16e9)
    assert states(num_gpus=8, parallelism="ddp", tp=2, pp=2) == pytest.approx(16e9 / 4)
    assert states(num_gpus=8, parallelism="fsdp", tp=2, pp=2) == pytest.approx(16e9 / 8)
    shape = ModelShape.from_config(Transformer.from_preset("small").config)
    one, two = (estimate_memory(shape, "bf16-mixed", batch=2, seq=256, tp=t) for t in (1, 2))
    assert two.activations == pytest.approx(one.activations / 2)      # sequence parallelism


def test_parse_count():
    assert parse_count("14.8T") == pytest.approx(14.8e12)
    assert parse_count("671B") == 671e9 and parse_count("4M") == 4e6 and parse_count("6.7e10") == 6.7e10
    with pytest.raises(ConfigError, match="not a number"):
        parse_count("lots")


def test_compare_prints_modes_side_by_side(capsys):
    rc = main(["estimate", "--params", "1B", "--tokens", "1T", "--gpu", "H100", "--gpus", "8", "--mfu", "0.5",
               "--seq-len", "4096", "--no-attention-flops", "--compare", "32-true,bf16-mixed,fp8-blockwise"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "bf16-mixed" in line and "fp8-blockwise" in line)
    assert header.split() == ["32-true", "bf16-mixed", "fp8-blockwise"]
    rows = {line[:24].strip(): line[24:].split() for line in lines if line[:24].strip()}
    assert rows["peak TFLOPS/GPU (dense)"] == ["67", "989.5", "1979"]
    # 6e21 / (8 x {67, 989.5, 1979} TFLOPS x 0.5) / 86400 s
    assert rows["days"] == ["259.1", "17.55", "8.773"]
    assert rows["memory/GPU GB"] == ["2.50*", "2.50*", "2.50*"]     # states only: 16 B x 1e9 / 8 + scratch


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "H1000"], "unknown GPU 'H1000' (did you mean 'H100'?)"),
    (["--mfu", "1.5"], "--mfu must be in (0, 1]"),
    (["--mfu", "0"], "--mfu must be in (0, 1]"),
    (["--tokens", None], "--tokens is required"),
    (["--model", "smal"], "unknown model 'smal' (did you mean 'small'?)"),
    (["--gpu", "A100", "--precision", "fp8-blockwise"], "A100 has no FP8 tensor cores"),
    (["--gpus", "6", "--tp", "4"], "multiple of --tp x --pp"),
    (["--parallelism", "fsdb"], "did you mean 'fsdp'?"),
])
def test_bad_input_is_one_line_error(argv, message, capsys):
    base = {"--tokens": "1T", "--gpus": "8", "--model": "tiny"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    args = ["estimate"] + [x for k, v in base.items() if v is not None for x in (k, v)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mixprec: error: ") and message in err, err


def test_config_without_shape_fields_is_one_line_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 768}')
    assert main(["estimate", "--model", str(tmp_path / "config.json"), "--tokens", "1B"]) == 2
    assert "has no positive integer 'num_hidden_layers'" in capsys.readouterr().err


def test_cross_check_arithmetic_with_the_recorded_cpu_run():
    """docs/estimates.md: `mixprec train model=tiny max_steps=60 ...` logged, for steps 31-40,
    9,815.6 tokens/s (2.0865 s for 10 steps of 16 x 128 tokens) and MFU 0.33034 against the cached
    FP32 peak of 23.687 GFLOPS. Fed back, the estimate predicts the step time within 20 %."""
    e = estimate("tiny", tokens=60 * 2048, gpu="cpu", peak_tflops=23.687365253992233e-3, num_gpus=1,
                 precision="32-true", mfu=0.3303393806373168, seq=128, micro_batch=16,
                 global_batch_tokens=2048, parallelism="ddp")
    measured = 2.086466513 / 10
    assert e.step_s == pytest.approx(measured, rel=0.20)
