"""Bit for bit against torchao without torchao: mixprec's MX and NVFP4 quantizers reproduce the
scales and element codes that ``torchao.prototype.mx_formats`` (0.18) gave for fixed inputs,
stored in ``tests/golden/mx_torchao.safetensors`` by ``tests/golden/make_mx_golden.py`` (normal,
outlier, every-binade, exact-tie and near-smallest-scale tensors; MX with FLOOR scaling for E4M3,
E5M2 and E2M1, NVFP4 with the per-tensor scale of the amax). ``test_mx_torchao.py`` checks, where
torchao is installed, that the file is still what torchao gives."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mixprec.formats import quantize_mx, quantize_nvfp4

GOLDEN = load_file(str(Path(__file__).resolve().parents[1] / "golden" / "mx_torchao.safetensors"))
NAMES = sorted({k.split(":")[0] for k in GOLDEN})


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte, the first element in the low nibble (torchao's packing)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def test_the_golden_file_holds_every_input_and_format():
    assert NAMES == ["normal", "outliers", "ties", "tiny", "wide"]
    assert len(GOLDEN) == len(NAMES) * (1 + 3 * 2 + 3)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_mx_reproduces_torchao_scales_and_codes(name, element):
    x = GOLDEN[f"{name}:x"]
    q = quantize_mx(x, element)
    assert torch.equal(q.scale_bits, GOLDEN[f"{name}:{element}:scale"])
    data = GOLDEN[f"{name}:{element}:data"]
    codes = _unpack_e2m1(data) if element == "e2m1" else data
    assert torch.equal(q.codes.view(torch.uint8), codes)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "tiny"])
def test_nvfp4_reproduces_torchao_scales_and_codes(name):
    x = GOLDEN[f"{name}:x"]
    q = quantize_nvfp4(x)
    assert torch.equal(q.tensor_scale.reshape(1), GOLDEN[f"{name}:nvfp4:tensor_scale"])
    assert torch.equal(q.scale_bits.view(torch.uint8), GOLDEN[f"{name}:nvfp4:scale"])
    assert torch.equal(q.codes, _unpack_e2m1(GOLDEN[f"{name}:nvfp4:data"]))


def test_deliberate_difference_an_nvfp4_amax_below_1e_12_is_floored():
    # mixprec floors the NVFP4 tensor amax at 1e-12 (as its FP8 quantizer floors amax), so a
    # tensor whose largest magnitude is below that (here ~2**-108) gets a larger tensor scale
    # than torchao's amax / (448 * 6) and its elements flush towards zero; torchao keeps them.
    x = GOLDEN["tiny:x"]
    assert float(x.abs().amax()) < 1e-12
    q = quantize_nvfp4(x)
    assert float(q.tensor_scale) == pytest.approx(1e-12 / (448 * 6), rel=1e-6)
    assert float(GOLDEN["tiny:nvfp4:tensor_scale"]) == pytest.approx(float(x.abs().amax()) / (448 * 6), rel=1e-6)
