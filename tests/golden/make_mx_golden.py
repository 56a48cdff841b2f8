"""Write ``mx_torchao.safetensors``: torchao's reference MX / NVFP4 quantizations of fixed inputs.

``tests/formats/test_mx_golden.py`` checks mixprec's quantizers against this file bit for bit, so
CI checks the agreement with ``torchao.prototype.mx_formats`` without installing torchao. Run it
again (with torchao installed) only to refresh the file after a deliberate change:

    python tests/golden/make_mx_golden.py            # needs torchao; writes beside this script

The inputs are stored too (not regenerated from a seed), so a change in torch's random streams
cannot move them. For every input ``NAME``: ``NAME:x`` (FP32), ``NAME:ELEMENT:scale`` (E8M0 bits)
and ``NAME:ELEMENT:data`` (E4M3 / E5M2 bits, or E2M1 codes packed two per byte as torchao packs
them) from ``to_mx(x, dtype, 32)`` (FLOOR scaling); ``NAME:nvfp4:tensor_scale`` (FP32),
``NAME:nvfp4:scale`` (E4M3 bits) and ``NAME:nvfp4:data`` (packed E2M1) from ``nvfp4_quantize`` with
the per-tensor scale of the tensor's amax.
"""
from __future__ import annotations

from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "mx_torchao.safetensors"
ELEMENT_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}


def inputs() -> dict[str, torch.Tensor]:
    """Normal, outlier, every-binade and exact-tie tensors (the live torchao test's kinds, smaller)."""
    g = torch.Generator().manual_seed(25)
    normal = torch.randn(32, 128, generator=g)
    outliers = normal.clone()
    outliers[::7, ::13] *= 1e3                                    # a few huge values per row
    wide = torch.randn(32, 128, generator=g) * torch.logspace(-30, 30, 128)  # every binade
    ties = torch.randint(-24, 25, (16, 64), generator=g).float() / 4       # many exact midpoints
    tiny = torch.randn(8, 64, generator=g) * 2.0 ** -110                   # near the smallest scale
    return {"normal": normal, "outliers": outliers, "wide": wide, "ties": ties, "tiny": tiny}


def main() -> None:
    from safetensors.torch import save_file
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    import torchao
    out: dict[str, torch.Tensor] = {}
    for name, x in inputs().items():
        out[f"{name}:x"] = x.contiguous()
        for element, dtype in ELEMENT_DTYPES.items():
            scale, data = to_mx(x, dtype, 32)
            out[f"{name}:{element}:scale"] = scale.view(torch.uint8).contiguous()
            out[f"{name}:{element}:data"] = data.view(torch.uint8).contiguous()
        pts = per_tensor_amax_to_scale(x.abs().amax())
        scale, data = nvfp4_quantize(x, 16, per_tensor_scale=pts)
        out[f"{name}:nvfp4:tensor_scale"] = pts.reshape(1).float().contiguous()
        out[f"{name}:nvfp4:scale"] = scale.view(torch.uint8).contiguous()
        out[f"{name}:nvfp4:data"] = data.view(torch.uint8).contiguous()
    save_file(out, str(OUT), metadata={"torchao": torchao.__version__, "torch": torch.__version__,
                                       "script": "tests/golden/make_mx_golden.py"})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, torchao {torchao.__version__})")


if __name__ == "__main__":
    main()
