"""Which GEMM path an FP8 layer runs, decided once (at conversion, or when the layer moves to
another device) and stored on the layer: ``forward`` decides nothing, logs nothing and queries
no hardware.

This is the one decider: :class:`~mixprec.formats.Fp8Linear` asks it for its own plan and
:func:`~mixprec.precision.convert_to_fp8`'s report shows the converted layers' plans. The paths:

* ``cuda-scaled-mm`` -- ``torch._scaled_mm`` (tensorwise, rowwise) on a GPU with FP8 tensor
  cores; blockwise there runs one GEMM in torch's native block-scaled ``scaled_mm`` where this
  torch has it, else in mixprec's Triton kernel (:mod:`mixprec.formats.fp8_triton`, when Triton
  imports), stored as :attr:`GemmPlan.block_kernel`;
* ``cpu-scaled-mm`` -- PyTorch's CPU FP8 kernel, only when forced with ``backend="scaled-mm"``
  (it tests the GPU path's layouts and scales on a CPU; tensorwise and rowwise);
* ``emulated`` -- quantize, dequantize, one FP32 GEMM (:mod:`mixprec.formats.emulation`):
  numerics, not speed. Blockwise takes it when neither block-scaled kernel can run on the
  device (the native one is probed once per device, below); the reason says so.

Probes (each a few tiny GEMMs, cached per device for the process): whether rowwise
``_scaled_mm`` emits FP32 (older CUTLASS kernels emit only BF16; then FP32 results pass through
BF16, said once here) and which scale layout, if any, the native block-scaled GEMM accepts.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch

from mixprec.errors import ConfigError
from mixprec.formats.fp8_config import Fp8Config
from mixprec.formats.fp8_gemm import block_gemm_agrees, block_scaled_available
from mixprec.policy import hardware

__all__ = ["GemmPlan", "plan_gemms"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmPlan:
    """What an FP8 layer's three GEMMs run on, and why (frozen, decided once)."""

    path: str
    """``cuda-scaled-mm``, ``cpu-scaled-mm`` or ``emulated``."""
    reason: str
    """Why this path (shown in the conversion log line and ``Fp8Linear.execution_reason``)."""
    block_layout: int | None = None
    """Blockwise on a scaled-mm path: the native block-scaled GEMM's scale layout (probed)."""
    block_kernel: str | None = None
    """Blockwise on a scaled-mm path: ``native`` (torch's block-scaled ``scaled_mm``) or
    ``triton`` (:func:`mixprec.formats.fp8_triton.block_scaled_mm`); None elsewhere."""
    rowwise_out_fp32: bool = True
    """Rowwise ``_scaled_mm`` emits FP32 results itself (else they pass through BF16)."""
    compile_casts: bool = False
    """Run the casts through ``torch.compile`` (CUDA with Triton): one fused kernel per cast."""


@functools.cache
def _rowwise_support(device: str) -> str | None:
    """What rowwise ``_scaled_mm`` emits on ``device`` with this torch: ``"fp32"``, ``"bf16"``
    only, or None where it takes per-tensor scales only (torch 2.11's CPU kernel)."""
    dev = torch.device(device)
    a = torch.ones(16, 16, device=dev).to(torch.float8_e4m3fn)
    s = torch.ones(16, 1, device=dev)
    for out in (torch.float32, torch.bfloat16):
        try:
            torch._scaled_mm(a, a.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=out)
            return "fp32" if out == torch.float32 else "bf16"
        except RuntimeError:
            continue
    return None


def _rowwise_emits_fp32(device: str) -> bool:
    return _rowwise_support(device) == "fp32"


@functools.cache
def _block_layout(device: str) -> int | None:
    return block_scaled_available(torch.device(device))


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_gemm_available() -> bool:
    """Whether mixprec's Triton block-scaled GEMM imports (Triton installed and working); asked
    at set-up on CUDA only, so the CPU package never imports Triton."""
    try:
        import mixprec.formats.fp8_triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _triton_gemm_agrees(device: str) -> bool:
    """Whether the Triton kernel runs on ``device`` and agrees with the emulation, probed once per
    device as torch's native kernel is (:func:`~mixprec.formats.fp8_gemm.block_gemm_agrees`): it
    has been validated under Triton's interpreter only, so a GPU where it fails to compile or
    disagrees keeps blockwise on the emulation, and the reason says so."""
    from mixprec.formats.fp8_triton import block_scaled_mm   # optional: Triton
    return block_gemm_agrees(lambda a, b: block_scaled_mm(a, b, torch.float32), torch.device(device))


def plan_gemms(config: Fp8Config, device: torch.device | str | None, in_features: int,
               out_features: int, *, owner: str = "Fp8Linear", fqn: str = "") -> GemmPlan:
    """The plan of a layer ``in_features -> out_features`` with ``config`` on ``device``.

    Raises :class:`~mixprec.errors.ConfigError` when ``backend="scaled-mm"`` is forced on a shape
    FP8 kernels cannot take."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "meta":
        return GemmPlan("emulated", "not on a device yet (decided when the weights arrive)")
    aligned = in_features % 16 == 0 and out_features % 16 == 0
    if config.backend == "scaled-mm" and not aligned:
        raise ConfigError(f"{owner} '{fqn or '<unnamed>'}' ({in_features}->{out_features}) needs "
                          "in/out features that are multiples of 16 for torch._scaled_mm; use "
                          "backend='auto' or leave this layer unconverted")
    if config.backend == "emulated":
        return GemmPlan("emulated", "backend='emulated' requested")
    if config.backend == "scaled-mm":
        path, reason = f"{dev.type}-scaled-mm", "backend='scaled-mm' requested"
    elif dev.type != "cuda":
        return GemmPlan("emulated", f"no FP8 GEMM hardware on {dev.type} (emulation: numerics, "
                                    "not speed)")
    elif not hardware.cuda_supports_fp8():
        return GemmPlan("emulated", "this GPU has no FP8 tensor cores (needs compute capability "
                                    ">= 8.9)")
    elif config.limited_accumulation:
        return GemmPlan("emulated", "accum_mantissa_bits asks for accumulation emulation")
    elif config.format == "e5m2":
        return GemmPlan("emulated", "torch._scaled_mm cannot multiply two E5M2 operands")
    elif not aligned:
        return GemmPlan("emulated", "in/out features are not multiples of 16")
    else:
        path, reason = "cuda-scaled-mm", "FP8 tensor cores available"
    compile_casts = dev.type == "cuda" and config.compile_casts and _triton_available()
    if config.scaling == "blockwise":
        if in_features % 128 or out_features % 128:
            return GemmPlan("emulated", f"{reason}, but block-scaled GEMMs need in/out features "
                                        "that are multiples of 128: blockwise runs emulated "
                                        "(dequantize, one FP32 GEMM)", compile_casts=compile_casts)
        return _plan_blocks(config, dev, path, reason, compile_casts, owner, fqn)
    if config.scaling == "rowwise" and _rowwise_support(str(dev)) is None:
        if config.backend == "scaled-mm":
            raise ConfigError(f"{owner} '{fqn or '<unnamed>'}': torch {torch.__version__}'s "
                              f"{dev.type} _scaled_mm takes per-tensor scales only, not rowwise; use "
                              "backend='auto' (emulated here) or a torch with rowwise scaled_mm")
        return GemmPlan("emulated", f"torch {torch.__version__}'s {dev.type} _scaled_mm has no "
                                    "rowwise scales: rowwise runs emulated", compile_casts=compile_casts)
    if config.scaling == "rowwise" and not _rowwise_emits_fp32(str(dev)):
        return GemmPlan(path, f"{reason}; rowwise scaled_mm emits BF16 only on this build: FP32 "
                              "results pass through BF16", rowwise_out_fp32=False,
                        compile_casts=compile_casts)
    return GemmPlan(path, reason, compile_casts=compile_casts)


def _plan_blocks(config: Fp8Config, dev: torch.device, path: str, reason: str,
                 compile_casts: bool, owner: str, fqn: str) -> GemmPlan:
    """Blockwise on a scaled-mm path (in/out features multiples of 128): torch's native
    block-scaled GEMM, else the Triton kernel on CUDA, else the emulation; ``block_kernel``
    forces one (refused on CUDA when it cannot run)."""
    want = config.block_kernel
    if config.activation_block != (1, 128) or config.weight_block != (128, 128):
        return GemmPlan("emulated", f"{reason}, but block-scaled GEMM kernels take 1x128 tiles and "
                                    f"128x128 blocks, not {config.activation_block} / "
                                    f"{config.weight_block}: blockwise runs emulated",
                        compile_casts=compile_casts)
    layout = _block_layout(str(dev)) if want != "triton" else None
    if layout is not None:
        return GemmPlan(path, f"{reason}; 1x128/128x128 blocks in torch's block-scaled scaled_mm "
                              "(one GEMM)", block_layout=layout, block_kernel="native",
                        compile_casts=compile_casts)
    why_not = "block_kernel='triton' requested" if want == "triton" else \
        f"torch {torch.__version__} has no native block-scaled scaled_mm on {dev.type}"
    if want != "native":
        if dev.type != "cuda":
            triton_no = "the Triton kernel runs on CUDA only"
        elif config.format != "e4m3":
            triton_no = f"the Triton kernel takes E4M3 operands, not format '{config.format}'"
        elif not _triton_gemm_available():
            triton_no = "Triton is not importable"
        elif not _triton_gemm_agrees(str(dev)):
            triton_no = "mixprec's Triton kernel failed or disagreed with the emulation in its probe"
        else:
            return GemmPlan(path, f"{reason}; {why_not}: 1x128/128x128 blocks in mixprec's "
                                  "Triton kernel (one GEMM)", block_kernel="triton",
                            compile_casts=compile_casts)
        why_not = f"{why_not} and {triton_no}"
    if want != "auto" and dev.type == "cuda":
        raise ConfigError(f"{owner} '{fqn or '<unnamed>'}': block_kernel='{want}' cannot run here "
                          f"({why_not}); use block_kernel='auto'")
    return GemmPlan("emulated", f"{why_not}: blockwise runs emulated (dequantize, one FP32 GEMM)",
                    compile_casts=compile_casts)


def log_plan(plan: GemmPlan, owner: str, fqn: str, in_features: int, out_features: int,
             recipe: str) -> None:
    """The one line a layer logs when its path is decided."""
    log.info("%s %s (%d->%d, %s): %s path (%s)", owner, fqn or "<unnamed>", in_features,
             out_features, recipe, plan.path, plan.reason)
