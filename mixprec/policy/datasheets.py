"""NVIDIA's datasheet figures per accelerator: dense peak throughput per GEMM format, memory, power.

Data, used twice: ``mixprec estimate`` plans with these peaks (:mod:`mixprec.estimate.gpus`), and
the measured-peak cache (:mod:`mixprec.policy.peak`) refuses to keep a measurement far below
them (a GEMM timed while another job held the GPU). Every figure is NVIDIA's own, from the
datasheet named in ``source``. Datasheets print the Hopper and Blackwell tensor-core figures
*with 2:4 structured sparsity*; training GEMMs are dense, so the table holds half of those (A100's
datasheet prints dense figures beside the sparse ones). ``fp32`` is the non-tensor-core FP32 rate
(what ``32-true`` GEMMs run at), ``tf32``/``bf16``/``fp8``/``fp4`` the dense tensor-core rates
(FP16 equals BF16 on all of these; Blackwell runs MXFP8 at its FP8 rate and NVFP4 / MXFP4 at its
FP4 rate). ``tdp_w`` is the maximum thermal design power of the SXM module, the default
power-draw assumption of the energy estimate.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from mixprec.errors import ConfigError

__all__ = ["GpuSpec", "GPUS", "TFLOPS", "datasheet_for"]

TFLOPS = 1e12


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator's datasheet figures (dense, per GPU)."""

    name: str
    fp32_tflops: float
    """FP32 without tensor cores."""
    tf32_tflops: float
    """TF32 tensor cores, dense."""
    bf16_tflops: float
    """BF16/FP16 tensor cores, dense."""
    fp8_tflops: float | None
    """FP8 tensor cores, dense; None where the GPU has none (A100)."""
    fp4_tflops: float | None = None
    """FP4 (NVFP4 / MXFP4) tensor cores, dense; None before Blackwell."""
    memory_gb: float
    """HBM capacity in GB (10^9 bytes, as NVIDIA prints it)."""
    tdp_w: float
    """Maximum thermal design power of the module, W."""
    source: str
    """Where the figures come from."""

    def peak_flops(self, kind: str) -> float:
        """Dense FLOP/s for ``kind`` (``fp32``, ``tf32``, ``bf16``, ``fp8`` or ``fp4``)."""
        value = getattr(self, f"{kind}_tflops")
        if value is None:
            has = ", ".join(g.name for g in GPUS.values() if getattr(g, f"{kind}_tflops") is not None)
            raise ConfigError(f"{self.name} has no {kind.upper()} tensor cores; pick a bf16 mode or a "
                              f"GPU with {kind.upper()} ({has})")
        return value * TFLOPS


_HOPPER = "NVIDIA {} Tensor Core GPU datasheet, SXM column (sparse tensor-core figures halved)"

GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(name="H100", fp32_tflops=67.0, tf32_tflops=494.5, bf16_tflops=989.5, fp8_tflops=1979.0,
            memory_gb=80, tdp_w=700, source=_HOPPER.format("H100")),
    GpuSpec(name="H200", fp32_tflops=67.0, tf32_tflops=494.5, bf16_tflops=989.5, fp8_tflops=1979.0,
            memory_gb=141, tdp_w=700, source=_HOPPER.format("H200")),
    # H800: the H100 silicon for the Chinese market; the datasheet cuts FP64 (to 1 TFLOPS) and
    # NVLink (to 400 GB/s) and keeps the tensor-core and FP32 figures of the H100 SXM.
    GpuSpec(name="H800", fp32_tflops=67.0, tf32_tflops=494.5, bf16_tflops=989.5, fp8_tflops=1979.0,
            memory_gb=80, tdp_w=700, source=_HOPPER.format("H800")),
    GpuSpec(name="A100", fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, fp8_tflops=None,
            memory_gb=80, tdp_w=400, source="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column (dense)"),
    GpuSpec(name="B200", fp32_tflops=75.0, tf32_tflops=1100.0, bf16_tflops=2250.0, fp8_tflops=4500.0,
            fp4_tflops=9000.0, memory_gb=180, tdp_w=1000,
            source="NVIDIA HGX B200 datasheet, per-GPU column (sparse tensor-core figures halved; "
                   "FP4 18 PFLOPS sparse)"),
    # GB200: the NVL72 rack datasheet's per-superchip column (2 Blackwell GPUs + 1 Grace CPU)
    # halved for one GPU, then the sparse tensor-core figures halved: FP4 40 -> 10 PFLOPS dense,
    # FP8 20 -> 5, BF16 10 -> 2.5, TF32 5 -> 1.25; FP32 160 -> 80 TFLOPS; HBM3e 372 -> 186 GB.
    # The datasheet gives no per-GPU power: 1200 W is an assumption (roughly half of the
    # superchip's configurable maximum of 2700 W, which includes the Grace CPU), used only as the
    # energy estimate's default; `mixprec estimate --power-w` replaces it.
    GpuSpec(name="GB200", fp32_tflops=80.0, tf32_tflops=1250.0, bf16_tflops=2500.0, fp8_tflops=5000.0,
            fp4_tflops=10000.0, memory_gb=186, tdp_w=1200,
            source="NVIDIA GB200 NVL72 datasheet, GB200 superchip column per GPU (sparse tensor-core "
                   "figures halved)"),
)}


def datasheet_for(device_name: str) -> GpuSpec | None:
    """The table entry whose name is a word of ``device_name`` (``torch.cuda.get_device_name``:
    ``NVIDIA H100 80GB HBM3`` -> H100, ``NVIDIA A100-SXM4-80GB`` -> A100; GB200 is not B200), or
    None for a GPU the table does not hold. PCIe parts match their SXM row, whose figures are
    higher: a comparison against it must leave room (see :mod:`mixprec.policy.peak`)."""
    for name in sorted(GPUS, key=len, reverse=True):
        if re.search(rf"(?<![A-Z0-9]){name}(?![0-9])", device_name.upper()):
            return GPUS[name]
    return None
