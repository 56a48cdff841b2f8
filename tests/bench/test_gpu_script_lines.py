"""What benchmarks/gpu/overlap_step.py and fp8_linear.py print on a CPU (the --cpu-smoke summary):
no overlapped/plain ratio where nothing overlaps, and throughputs below 1 TF not printed as "0 TF"."""
from __future__ import annotations

import importlib.util
from pathlib import Path

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ROW = {"mode": "bf16-mixed", "accum": 1, "plain_ms": 10.0, "overlap_ms": 7.2, "ratio_median": 0.722,
       "ratio_min": 0.7, "ratio_max": 0.75, "bit_identical": True}


def test_overlap_ratio_is_not_printed_on_a_cpu():
    line = _script("overlap_step").result_line(ROW, "cpu")
    assert "0.722" not in line and "not meaningful on a CPU" in line and line.endswith("bit-identical: True")
    gpu = _script("overlap_step").result_line(ROW, "cuda")
    assert "overlapped/plain 0.722 (0.700-0.750), bit-identical: True" in gpu


def test_fp8_table_prints_gigaflops_below_one_teraflop():
    throughput = _script("fp8_linear").throughput
    assert throughput(0.0123) == "12.3 GF" and throughput(0.0004) == "0.4 GF"
    assert throughput(812.4) == "812 TF"


def test_fp8_table_times_the_triton_block_kernel_next_to_a_native_one_only(monkeypatch, capsys):
    """A ``blockwise-triton`` row where blockwise runs torch's native kernel and Triton can run
    too; none where blockwise already is the Triton kernel (said once), or off CUDA."""
    from mixprec.formats import fp8_path
    fp8 = _script("fp8_linear")
    assert fp8.block_kinds() == []                                        # the CPU smoke
    monkeypatch.setattr(fp8, "DEVICE", "cuda")
    monkeypatch.setattr(fp8_path.hardware, "cuda_supports_fp8", lambda: True)
    monkeypatch.setattr(fp8_path, "_triton_gemm_available", lambda: True)
    monkeypatch.setattr(fp8_path, "_triton_gemm_agrees", lambda device: True)
    monkeypatch.setattr(fp8_path, "_block_layout", lambda device: 0)
    assert fp8.block_kinds() == ["blockwise-triton"]
    monkeypatch.setattr(fp8_path, "_block_layout", lambda device: None)
    assert fp8.block_kinds() == []
    assert "blockwise itself runs cuda-scaled-mm" in capsys.readouterr().out
    monkeypatch.setattr(fp8_path, "_triton_gemm_available", lambda: False)
    assert fp8.block_kinds() == []
    assert "blockwise-triton: not run" in capsys.readouterr().out
