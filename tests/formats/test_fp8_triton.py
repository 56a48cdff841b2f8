"""mixprec's Triton block-scaled FP8 GEMM (mixprec/formats/fp8_triton.py) and where the decider
sends blockwise layers.

The kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, on the CPU) in ONE subprocess
per module (the variable must be set before Triton is imported, and this process may have
imported Triton already): it computes every case and saves the operands and results; the tests
here compare them with :func:`~mixprec.formats.emulated_mm` (FP32, promotion interval 128).

Tolerance, FP32 output: ``max |kernel - emulation| <= 1e-5 * max |emulation|`` (FP32 summation
order only: the kernel sums each 128-block's FP8 products in one ``tl.dot`` and then scales, the
emulation dequantizes and then sums; measured 3.1e-7 to 4.8e-7 on these shapes and the layer,
interpreter, triton 3.5, 2-core x86 avx512_bf16, 2026-12-04). BF16 output: bit-identical to the
kernel's FP32 result rounded to nearest even, as the GPU's ``cvt.rn.bf16.f32`` does.

Two shims make the interpreter (triton 3.5) run as the GPU would, applied in the subprocess only:
its scalar arguments are 1-element arrays that numpy >= 2.3 refuses to ``int()`` (a ``for`` loop
over a runtime bound fails), and its FP32 -> BF16 truncation drops bits where the GPU rounds to
nearest even.

The kernel tests skip where Triton is not importable (CI has none); the decider tests do not need it.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.formats import Fp8Config, Fp8Linear, emulated_mm, fp8_gemm, fp8_path, quantize
from mixprec.formats.fp8_quantize import Fp8Tensor

from tests.triton_interpreter import INTERPRETER_SHIMS

REPO = Path(__file__).resolve().parents[2]
FP32_REL_TOL = 1e-5

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not importable here (CI has none); the kernel "
                                         "is checked under its interpreter where it is")

# (name, M, N, K, B's block, layout): "rows" row-major operands; "transposed" strided views, as
# the layers' backward GEMMs pass them; "wide" views into wider buffers whose extra columns hold
# byte 0x7F (E4M3 NaN on a GPU; the interpreter reads it as 480): a K mask that let those bytes
# into the products would change the result. (Either operand's K mask alone zeroes the products of
# finite values, so only losing both shows here; the kernel masks both, for NaN bytes on a GPU.)
CASES = [
    ("aligned-128x128", 256, 256, 384, (128, 128), "rows"),
    ("aligned-1x128", 256, 128, 256, (1, 128), "rows"),
    ("ragged-128x128", 200, 136, 300, (128, 128), "rows"),
    ("ragged-1x128", 37, 129, 129, (1, 128), "rows"),
    ("k-below-one-block", 64, 160, 72, (128, 128), "rows"),
    ("transposed-views", 136, 384, 256, (128, 128), "transposed"),
    ("ragged-k-in-wider-buffers", 72, 200, 200, (128, 128), "wide"),
]

_SCRIPT = INTERPRETER_SHIMS + r'''

from torch import nn
from mixprec.formats import Fp8Config, Fp8Linear, GemmPlan, fp8_gemm, quantize
from mixprec.formats import fp8_linear
from mixprec.formats.fp8_triton import block_scaled_mm

out_path, cases = sys.argv[1], ast.literal_eval(sys.argv[2])   # literals only, never eval
g = torch.Generator().manual_seed(0)

def widened(q):
    buf = torch.full((q.shape[0], q.shape[1] + 56), 0x7F, dtype=torch.uint8)   # 0x7F: E4M3 NaN
    buf[:, :q.shape[1]] = q.data.view(torch.uint8)
    return type(q)(buf.view(q.data.dtype)[:, :q.shape[1]], q.scale, q.block)

def operands(M, N, K, b_block, layout="rows"):
    if layout == "transposed":   # a cast along tokens, transposed (wgrad/dgrad); W^T of a 128x128 cast
        a = quantize(torch.randn(K, M, generator=g), block=(128, 1)).t()
        b = quantize(torch.randn(K, N, generator=g) * 3, block=(b_block[1], b_block[0])).t()
        return a, b
    a = quantize(torch.randn(M, K, generator=g), block=(1, 128))
    b = quantize(torch.randn(N, K, generator=g) * 3, block=b_block)
    return (widened(a), widened(b)) if layout == "wide" else (a, b)

def flat(q):
    return {"data": q.data, "scale": q.scale, "block": q.block}

res = {}
for name, M, N, K, b_block, layout in cases:
    a, b = operands(M, N, K, b_block, layout)
    res[name] = {"a": flat(a), "b": flat(b), "views": not a.data.is_contiguous(),
                 "fp32": block_scaled_mm(a, b, torch.float32),
                 "bf16": block_scaled_mm(a, b, torch.bfloat16)}

# an inf in one 1x128 tile of A (row 3, second block)
x = torch.randn(64, 256, generator=g); x[3, 200] = float("inf")
a, b = quantize(x, block=(1, 128)), quantize(torch.randn(128, 256, generator=g), block=(128, 128))
res["nonfinite"] = {"a": flat(a), "b": flat(b), "fp32": block_scaled_mm(a, b, torch.float32)}

# fp8_gemm with a Triton plan reaches the kernel
a, b = operands(96, 128, 256, (128, 128), False)
cfg = Fp8Config.from_recipe("blockwise")
res["dispatch"] = {
    "kernel": block_scaled_mm(a, b, torch.bfloat16),
    "fp8_gemm": fp8_gemm(a, b, path="cuda-scaled-mm", config=cfg, out_dtype=torch.bfloat16,
                         block_kernel="triton")}

# refusals
refused = {}
e5 = quantize(torch.randn(32, 256, generator=g), torch.float8_e5m2, block=(1, 128))
rw = quantize(torch.randn(32, 256, generator=g), block=(1, None))
w = quantize(torch.randn(128, 256, generator=g), block=(128, 128))
for what, (p, q, dt) in {"e5m2": (e5, w, torch.float32), "rowwise": (rw, w, torch.float32),
                         "int-out": (quantize(torch.randn(32, 256, generator=g), block=(1, 128)),
                                     w, torch.int32)}.items():
    try:
        block_scaled_mm(p, q, dt)
        refused[what] = ""
    except ValueError as e:
        refused[what] = str(e)
res["refused"] = refused

# an Fp8Linear whose stored plan says Triton: forward and both backward GEMMs through the kernel
torch.manual_seed(0)
lin = nn.Linear(256, 384)
x = torch.randn(200, 256)
gy = torch.randn(200, 384)
def run(layer):
    xx = x.clone().requires_grad_()
    y = layer(xx)
    dx, dw = torch.autograd.grad(y, (xx, layer.weight), gy)
    return [y.detach(), dx, dw]
emu = run(Fp8Linear.from_linear(lin, Fp8Config.from_recipe("blockwise", backend="emulated")))
fp8_linear.plan_gemms = lambda *a, **k: GemmPlan("cpu-scaled-mm", "test", block_kernel="triton")
layer = Fp8Linear.from_linear(lin, Fp8Config.from_recipe("blockwise", backend="emulated"))
calls = []
_kernel = sys.modules["mixprec.formats.fp8_triton"].block_scaled_mm
def counted(a, b, dt):
    calls.append((tuple(a.shape), tuple(b.shape)))
    return _kernel(a, b, dt)
sys.modules["mixprec.formats.fp8_triton"].block_scaled_mm = counted
res["layer"] = {"emulated": emu, "triton": run(layer), "kernel_calls": calls,
                "block_kernel": layer.gemm_plan.block_kernel}
torch.save(res, out_path)
'''


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), repr(CASES)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _fp8(d: dict) -> Fp8Tensor:
    return Fp8Tensor(d["data"], d["scale"], d["block"])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


# --- the kernel under the interpreter -----------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_kernel_matches_the_emulation_in_fp32(interpreted, case):
    r = interpreted[case]
    ref = emulated_mm(_fp8(r["a"]), _fp8(r["b"]), promotion_interval=128)
    assert r["fp32"].dtype == torch.float32 and r["fp32"].shape == ref.shape
    assert _rel_err(r["fp32"], ref) <= FP32_REL_TOL


@needs_triton
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_bf16_output_is_the_fp32_result_rounded_to_nearest_even(interpreted, case):
    r = interpreted[case]
    assert r["bf16"].dtype == torch.bfloat16
    assert torch.equal(r["bf16"], r["fp32"].to(torch.bfloat16))


@needs_triton
def test_strided_operands_are_checked_as_views_not_copies(interpreted):
    assert interpreted["transposed-views"]["views"] and interpreted["ragged-k-in-wider-buffers"]["views"]
    assert not interpreted["aligned-128x128"]["views"]


@needs_triton
def test_a_nonfinite_tile_makes_the_same_outputs_nonfinite_as_the_emulation(interpreted):
    r = interpreted["nonfinite"]
    ref = emulated_mm(_fp8(r["a"]), _fp8(r["b"]))
    finite = torch.isfinite(ref)
    assert not finite[3].any() and finite[:3].all()
    assert torch.equal(torch.isfinite(r["fp32"]), finite)
    assert _rel_err(r["fp32"][finite], ref[finite]) <= FP32_REL_TOL


@needs_triton
def test_fp8_gemm_with_a_triton_plan_runs_the_kernel(interpreted):
    r = interpreted["dispatch"]
    assert torch.equal(r["fp8_gemm"], r["kernel"])


@needs_triton
def test_the_kernel_refuses_operands_it_was_not_written_for(interpreted):
    r = interpreted["refused"]
    assert "E4M3" in r["e5m2"]
    assert "1x128" in r["rowwise"]
    assert "BF16, FP16 or FP32" in r["int-out"]


@needs_triton
def test_an_fp8_linear_planned_on_triton_runs_its_three_gemms_there_and_matches_the_emulation(interpreted):
    r = interpreted["layer"]
    assert r["block_kernel"] == "triton"
    # forward (200x256 @ 384x256^T), dgrad (200x384 @ 256x384^T), wgrad (384x200 @ 256x200^T)
    assert sorted(r["kernel_calls"]) == sorted([((200, 256), (384, 256)), ((200, 384), (256, 384)),
                                                ((384, 200), (256, 200))])
    for emu, tri in zip(r["emulated"], r["triton"]):
        assert _rel_err(tri, emu) <= FP32_REL_TOL


# --- the decider ---------------------------------------------------------------------------------

_PROBE = fp8_path._triton_gemm_agrees


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device with FP8 tensor cores (as far as the decider asks), no native block-scaled
    GEMM and a working Triton kernel; tests flip the last two."""
    monkeypatch.setattr(fp8_path.hardware, "cuda_supports_fp8", lambda: True)
    monkeypatch.setattr(fp8_path, "_block_layout", lambda device: None)
    monkeypatch.setattr(fp8_path, "_triton_gemm_available", lambda: True)
    monkeypatch.setattr(fp8_path, "_triton_gemm_agrees", lambda device: True)
    return monkeypatch


def _plan(device="cuda", **overrides):
    return fp8_path.plan_gemms(Fp8Config.from_recipe("blockwise", **overrides), device, 256, 512)


def test_blockwise_on_cuda_without_native_block_gemm_plans_the_triton_kernel(gpu):
    plan = _plan()
    assert (plan.path, plan.block_kernel, plan.block_layout) == ("cuda-scaled-mm", "triton", None)
    assert "no native block-scaled scaled_mm on cuda" in plan.reason
    assert "Triton kernel (one GEMM)" in plan.reason


def test_blockwise_on_cuda_with_native_block_gemm_keeps_torchs_kernel(gpu):
    gpu.setattr(fp8_path, "_block_layout", lambda device: 1)
    plan = _plan()
    assert (plan.path, plan.block_kernel, plan.block_layout) == ("cuda-scaled-mm", "native", 1)
    assert "torch's block-scaled scaled_mm" in plan.reason


def test_blockwise_on_cuda_without_native_gemm_or_triton_is_emulated_and_says_why(gpu):
    gpu.setattr(fp8_path, "_triton_gemm_available", lambda: False)
    plan = _plan()
    assert (plan.path, plan.block_kernel) == ("emulated", None)
    assert "no native block-scaled" in plan.reason and "Triton is not importable" in plan.reason


@pytest.mark.parametrize("kernel", ["agrees", "raises", "wrong"])
def test_the_triton_kernel_is_planned_only_once_its_probe_agrees_with_the_emulation(gpu, kernel):
    # Validated under the interpreter only: on a GPU where it fails to compile or computes
    # nonsense, blockwise must stay on the emulation and say why (not crash or corrupt a run).
    def block_scaled_mm(a, b, out_dtype):
        if kernel == "raises":
            raise RuntimeError("PTX compilation failed")
        out = emulated_mm(a, b)
        return out if kernel == "agrees" else out.flip(0)
    fake = types.ModuleType("mixprec.formats.fp8_triton")
    fake.block_scaled_mm = block_scaled_mm
    gpu.setitem(sys.modules, "mixprec.formats.fp8_triton", fake)
    gpu.setattr(fp8_path, "_triton_gemm_agrees", _PROBE.__wrapped__)          # the probe, uncached
    plan = fp8_path.plan_gemms(Fp8Config.from_recipe("blockwise"), "cpu", 256, 512)  # (no probe off CUDA)
    assert plan.block_kernel is None
    assert fp8_path._triton_gemm_agrees("cpu") is (kernel == "agrees")
    gpu.setattr(fp8_path, "_triton_gemm_agrees", lambda device: kernel == "agrees")
    plan = _plan()
    if kernel == "agrees":
        assert plan.block_kernel == "triton"
    else:
        assert plan.path == "emulated" and "disagreed with the emulation in its probe" in plan.reason


def test_the_triton_kernel_is_never_planned_off_cuda(gpu):
    plan = _plan("cpu", backend="scaled-mm")
    assert (plan.path, plan.block_kernel) == ("emulated", None)
    assert "the Triton kernel runs on CUDA only" in plan.reason
    assert _plan("cpu", block_kernel="triton").path == "emulated"    # forcing is ignored off CUDA


def test_only_e4m3_blockwise_plans_the_triton_kernel(gpu):
    plan = _plan(format="hybrid")
    assert plan.path == "emulated" and "takes E4M3 operands, not format 'hybrid'" in plan.reason
    gpu.setattr(fp8_path, "_rowwise_support", lambda device: "fp32")
    rowwise = fp8_path.plan_gemms(Fp8Config.from_recipe("rowwise"), "cuda", 256, 512)
    assert rowwise.block_kernel is None


def test_blocks_other_than_1x128_and_128x128_are_emulated(gpu):
    plan = _plan(weight_block=(64, 64))
    assert plan.path == "emulated" and "1x128 tiles and 128x128 blocks" in plan.reason


def test_block_kernel_forces_a_kernel_or_is_refused_on_cuda(gpu):
    gpu.setattr(fp8_path, "_block_layout", lambda device: 0)
    assert _plan(block_kernel="triton").block_kernel == "triton"
    assert "block_kernel='triton' requested" in _plan(block_kernel="triton").reason
    assert _plan(block_kernel="native").block_kernel == "native"
    gpu.setattr(fp8_path, "_triton_gemm_available", lambda: False)
    with pytest.raises(ConfigError, match="block_kernel='triton' cannot run here .*Triton is not importable"):
        _plan(block_kernel="triton")
    gpu.setattr(fp8_path, "_block_layout", lambda device: None)
    gpu.setattr(fp8_path, "_triton_gemm_available", lambda: True)
    gpu.setattr(fp8_path, "_triton_gemm_agrees", lambda device: True)
    with pytest.raises(ConfigError, match="block_kernel='native' cannot run here .*no native"):
        _plan(block_kernel="native")


def test_block_kernel_keeps_the_recipe_name_and_is_validated():
    cfg = Fp8Config.from_recipe("blockwise").replace(block_kernel="triton")
    assert cfg.recipe == "blockwise" and "triton block-scaled GEMM" in cfg.describe()
    with pytest.raises(ConfigError, match="block_kernel"):
        Fp8Config(block_kernel="cutlass")


# --- the forward follows the stored plan; Triton is imported only for it --------------------------

def test_an_fp8_linear_forward_follows_its_stored_triton_plan(monkeypatch):
    """The layer stores the decider's plan at conversion; forward hands ``block_kernel`` to
    fp8_gemm, which imports the kernel module then (a stand-in here: no Triton needed)."""
    from mixprec.formats import GemmPlan, fp8_linear
    calls = []

    def fake(a, bt, out_dtype):
        calls.append((tuple(a.shape), tuple(bt.shape), a.block, bt.block))
        return emulated_mm(a, bt).to(out_dtype)

    monkeypatch.setitem(sys.modules, "mixprec.formats.fp8_triton",
                        types.SimpleNamespace(block_scaled_mm=fake))
    monkeypatch.setattr(fp8_linear, "plan_gemms",
                        lambda *a, **k: GemmPlan("cpu-scaled-mm", "test", block_kernel="triton"))
    layer = Fp8Linear.from_linear(nn.Linear(256, 384), Fp8Config.from_recipe("blockwise"))
    x = torch.randn(130, 256, requires_grad=True)
    layer(x).sum().backward()
    assert sorted(calls) == sorted([((130, 256), (384, 256), (1, 128), (128, 128)),
                                    ((130, 384), (256, 384), (1, 128), (128, 128)),
                                    ((384, 130), (256, 130), (1, 128), (1, 128))])


def test_fp8_gemm_without_a_triton_plan_never_imports_the_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "mixprec.formats.fp8_triton", None)   # importing it would fail
    a = quantize(torch.randn(8, 256), block=(1, 128))
    b = quantize(torch.randn(128, 256), block=(128, 128))
    cfg = Fp8Config.from_recipe("blockwise")
    out = fp8_gemm(a, b, path="cuda-scaled-mm", config=cfg, out_dtype=torch.float32)
    assert torch.equal(out, emulated_mm(a, b))            # no kernel planned: the emulation


def test_the_package_converts_and_runs_blockwise_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, mixprec, mixprec.precision\n"
            "from mixprec.formats import Fp8Config, Fp8Linear\n"
            "m = Fp8Linear.from_linear(torch.nn.Linear(256, 256), Fp8Config.from_recipe('blockwise'))\n"
            "m(torch.randn(4, 256)).sum().backward()\n"
            "assert 'mixprec.formats.fp8_triton' not in sys.modules, 'kernel module imported'\n"
            "print(m.execution_path)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "emulated"
