"""Bit for bit against torchao's reference quantizers (``torchao.prototype.mx_formats``), live:
skipped where torchao is not installed (it is not in the dev extras; CI checks the same agreement
from stored vectors in ``test_mx_golden.py``). Also pins the three deliberate differences."""
from __future__ import annotations

import pytest
import torch

from mixprec.formats import quantize_mx, quantize_nvfp4

mx_formats = pytest.importorskip("torchao.prototype.mx_formats")
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale  # noqa: E402


def _tensors():
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(64, 256, generator=g)
    outliers = normal.clone()
    outliers[::7, ::13] *= 1e3                                  # a few huge values per row
    wide = torch.randn(32, 128, generator=g) * torch.logspace(-30, 30, 128)  # every binade
    ties = torch.randint(-24, 25, (16, 64), generator=g).float() / 4   # many exact midpoints
    return {"normal": normal, "outliers": outliers, "wide": wide, "ties": ties}


@pytest.mark.parametrize("name", list(_tensors()))
@pytest.mark.parametrize("element,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
                                           ("e2m1", torch.float4_e2m1fn_x2)])
def test_mx_matches_torchao_floor_scaling_bit_for_bit(name, element, dtype):
    x = _tensors()[name]
    scale_ref, data_ref = to_mx(x, dtype, 32)
    q = quantize_mx(x, element)
    assert torch.equal(q.scale_bits, scale_ref.view(torch.uint8))
    if element == "e2m1":
        assert torch.equal(q.codes, unpack_uint4(data_ref.view(torch.uint8)))
    else:
        assert torch.equal(q.codes.view(torch.uint8), data_ref.view(torch.uint8))


@pytest.mark.parametrize("name", list(_tensors()))
def test_nvfp4_matches_torchao_with_a_tensor_scale_bit_for_bit(name):
    x = _tensors()[name]
    pts = per_tensor_amax_to_scale(x.abs().amax())
    scale_ref, data_ref = nvfp4_quantize(x, 16, per_tensor_scale=pts)
    q = quantize_nvfp4(x)
    assert torch.equal(q.tensor_scale, pts)
    assert torch.equal(q.scale_bits.view(torch.uint8), scale_ref.view(torch.uint8))
    assert torch.equal(q.codes, unpack_uint4(data_ref.view(torch.uint8)))


def test_deliberate_difference_the_smallest_e8m0_scale_is_used_as_itself():
    # A block whose shared exponent is -127: torchao quantizes with 2**-126 but dequantizes with
    # 2**-127, which halves the block; mixprec uses 2**-127 both ways (the value round-trips).
    x = torch.zeros(1, 32)
    x[0, 0] = 1.5 * 2.0 ** -119                                # floor(log2) - 8 = -127
    scale_ref, data_ref = to_mx(x, torch.float8_e4m3fn, 32)
    ours = quantize_mx(x, "e4m3")
    assert scale_ref.view(torch.uint8).item() == ours.scale_bits.item() == 0
    ref_value = data_ref.float()[0, 0] * 2.0 ** -127            # torchao's own dequantization
    assert float(ref_value) == 0.75 * 2.0 ** -119
    assert float(ours.dequantize()[0, 0]) == 1.5 * 2.0 ** -119


def test_deliberate_difference_inf_is_poisoned_where_torchao_saturates():
    x = torch.ones(1, 32)
    x[0, 0] = float("inf")
    scale_ref, data_ref = to_mx(x, torch.float8_e4m3fn, 32)
    assert scale_ref.view(torch.uint8).item() != 255            # torchao: a finite scale ...
    assert data_ref.float()[0, 0] == 448                        # ... and the inf saturated
    assert quantize_mx(x, "e4m3").scale_bits.item() == 255      # mixprec: NaN scale


def test_the_stored_golden_vectors_are_what_torchao_gives_now():
    import sys
    from pathlib import Path
    from safetensors.torch import load_file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
    import make_mx_golden as gold
    stored = load_file(str(gold.OUT))
    for name, x in gold.inputs().items():
        assert torch.equal(stored[f"{name}:x"], x)
        for element, dtype in gold.ELEMENT_DTYPES.items():
            scale, data = to_mx(x, dtype, 32)
            assert torch.equal(stored[f"{name}:{element}:scale"], scale.view(torch.uint8))
            assert torch.equal(stored[f"{name}:{element}:data"], data.view(torch.uint8))
