"""Block-scaled micro formats, bit-exact: MXFP8 (E4M3/E5M2), MXFP4 (E2M1) and NVFP4.

A *block* is a run of elements along a matrix row (the GEMM's reduction dimension) sharing one
scale; NVFP4 weights may use square ``16x16`` blocks instead. Each format is a pair
(element format, scale format):

======  ==============  ===========  =====  ==================================================
name    elements        block scale  block  second level
======  ==============  ===========  =====  ==================================================
mxfp8   E4M3 or E5M2    E8M0         1x32   none
mxfp4   E2M1            E8M0         1x32   none
nvfp4   E2M1            E4M3         1x16   one FP32 scale per tensor
======  ==============  ===========  =====  ==================================================

**MX scales (OCP Microscaling Formats v1.0, section 6.3).** For a block ``V`` the shared exponent
is ``floor(log2(max|V|)) - emax_elem`` (``emax_elem``: exponent of the element format's largest
power of two: 8 for E4M3, 15 for E5M2, 2 for E2M1), clamped to E8M0's range ``[-127, 127]``
(an all-zero block gets ``-127``). Elements are ``V / 2**shared_exp`` rounded to the element
format, values beyond its largest magnitude clamped to it (this *does* happen: a block max of
``1.9 * 2**k`` maps to ``1.9 * 2**emax``, above E4M3's 448). E8M0 stores ``shared_exp + 127``;
255 is NaN.

**NVFP4 (NVIDIA's recipe).** The FP32 tensor scale is ``amax(tensor) / (448 * 6)``, so the largest
block scale lands on E4M3's 448. A block's scale is ``(max|V| / 6) / tensor_scale`` rounded to
E4M3 (clamped to ``[2**-6, 448]``: E4M3's smallest normal up to its max), and the elements are
``V * ((1 / tensor_scale) / block_scale)`` clamped to ``+-6`` and rounded to E2M1. The value is
``element * block_scale * tensor_scale``.

**Rounding.** ``"nearest"``: round to nearest, ties to even (the hardware's conversion).
``"stochastic"``: round up with probability equal to the distance from the lower neighbour over
the gap (unbiased in expectation); NVIDIA's recipe uses it for gradients. Both on the finite grid
of the element format, so every result is a representable value.

**Decisions where specifications leave room (each tested in tests/formats/):**

* a block holding inf or NaN gets a NaN scale (E8M0 255; a NaN E4M3 scale for NVFP4): everything
  computed from it is NaN and the step's non-finite check skips it. An inf is never saturated to
  a finite value (torchao's MX quantizer saturates a block holding inf; NVFP4 does likewise for a
  block scale): hiding an overflow would be silently different;
* the E8M0 scale ``2**-127`` is used as itself when quantizing (torchao divides by ``2**-126``
  there but multiplies by ``2**-127`` when dequantizing, which halves such blocks' values);
* an all-zero NVFP4 tensor gets a tensor scale from amax ``EPS`` instead of 0 (a zero tensor scale
  makes every element NaN).

Elsewhere the results equal ``torchao.prototype.mx_formats``' reference quantizers (MX FLOOR
scaling, NVFP4 with a per-tensor scale) bit for bit; the tests check it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixprec.errors import ConfigError

__all__ = ["ElementFormat", "ELEMENTS", "E2M1_VALUES", "BlockScaledTensor", "quantize_mx",
           "quantize_nvfp4", "round_to_grid", "lost_share", "SATURATION_LIMIT", "MX_BLOCK", "NVFP4_BLOCK",
           "EPS"]

MX_BLOCK = 32
NVFP4_BLOCK = 16
EPS = 1e-12
"""Floor for an NVFP4 tensor amax (all-zero tensors), as the FP8 quantizer floors its amax."""

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative E2M1 values in code order (code = index; bit 3 is the sign)."""

SATURATION_LIMIT: dict[str, float] = {"e4m3": 448.0 + 16.0, "e5m2": 57344.0 + 4096.0, "e2m1": 6.0 + 1.0}
"""Per element format, in element units: its largest value plus half its last step. A scaled value
beyond it was clamped, not rounded (saturation)."""

_E8M0_BIAS = 127
_E8M0_NAN = 255
_E4M3_TINY = 2.0 ** -6       # smallest normal E4M3
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


@dataclass(frozen=True)
class ElementFormat:
    """A block-scaled format's element type."""

    name: str
    emax: int
    """Exponent of the largest power of two the format holds (OCP MX ``emax_elem``)."""
    max: float
    """Largest finite magnitude."""
    dtype: torch.dtype | None
    """The torch dtype that stores it (None for E2M1: stored as 4-bit codes in uint8)."""

    def grid(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Every finite non-negative value, ascending (code order)."""
        if self.dtype is None:
            return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
        vals = torch.arange(128, dtype=torch.uint8, device=device).view(self.dtype).float()
        return vals[torch.isfinite(vals)]


ELEMENTS: dict[str, ElementFormat] = {f.name: f for f in (
    ElementFormat(name="e4m3", emax=8, max=448.0, dtype=torch.float8_e4m3fn),
    ElementFormat(name="e5m2", emax=15, max=57344.0, dtype=torch.float8_e5m2),
    ElementFormat(name="e2m1", emax=2, max=6.0, dtype=None),
)}


def _element(name: str) -> ElementFormat:
    if name not in ELEMENTS:
        raise ConfigError(f"unknown element format '{name}'; valid: {', '.join(ELEMENTS)}")
    return ELEMENTS[name]


def round_to_grid(a: torch.Tensor, grid: torch.Tensor, *, rounding: str = "nearest",
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Index into ``grid`` (ascending, non-negative) of each ``a`` (non-negative, at most
    ``grid[-1]``): nearest with ties to the even index, or stochastic."""
    n = grid.numel()
    lo_i = (torch.bucketize(a, grid, right=True) - 1).clamp_(0, n - 2)
    lo, hi = grid[lo_i], grid[lo_i + 1]
    if rounding == "nearest":
        d_lo, d_hi = a - lo, hi - a
        up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo_i % 2 == 1))   # tie: the even neighbour
    elif rounding == "stochastic":
        u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        up = u * (hi - lo) < (a - lo)
    else:
        raise ConfigError(f"rounding must be 'nearest' or 'stochastic', not '{rounding}'")
    return lo_i + up.to(lo_i.dtype)


def _to_elements(v: torch.Tensor, elem: ElementFormat, rounding: str,
                 generator: torch.Generator | None) -> torch.Tensor:
    """Scaled FP32 values (already clamped to +-max; NaN allowed) -> element storage."""
    if elem.dtype is not None and rounding == "nearest":
        return v.to(elem.dtype)                          # the hardware conversion (RNE)
    if elem.dtype is None:
        return _to_e2m1(v, rounding, generator)
    grid = elem.grid(v.device)
    a = torch.nan_to_num(v.abs(), nan=0.0)
    idx = round_to_grid(a, grid, rounding=rounding, generator=generator)
    if elem.dtype is None:                               # E2M1 code: sign in bit 3
        return (idx | (torch.signbit(v).to(idx.dtype) << 3)).to(torch.uint8)
    out = torch.copysign(grid[idx], v)
    return torch.where(torch.isnan(v), v, out).to(elem.dtype)


def _to_e2m1(v: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """E2M1 codes of scaled values in [-6, 6] (NaN -> +0), by arithmetic (the fast path of
    :func:`round_to_grid` on :data:`E2M1_VALUES`, tested equal to it): within a binade E2M1's
    values are multiples of ``step`` (0.5 below 2 and in the subnormals, 1 in [2, 4), 2 in [4, 6]),
    and a multiple's parity is its code's, so ``torch.round`` (half to even) is RNE."""
    a = torch.nan_to_num(v.abs(), nan=0.0)
    _, e = torch.frexp(a)                                # a = m * 2**e, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(a), (e - 2).clamp_(min=-1))
    if rounding == "nearest":
        q = torch.round(a / step) * step
    elif rounding == "stochastic":
        u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        q = torch.floor(a / step + u) * step
    else:
        raise ConfigError(f"rounding must be 'nearest' or 'stochastic', not '{rounding}'")
    idx = torch.where(q <= 2, 2 * q, torch.where(q <= 4, q + 2, 7.0))
    return (idx.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3))


def _element_values(codes: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """Element storage -> FP32 values (before scaling)."""
    if elem.dtype is not None:
        return codes.float()
    table = _E2M1_TABLES.get(codes.device)
    if table is None:
        table = _E2M1_TABLES[codes.device] = torch.tensor(
            E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class BlockScaledTensor:
    """A matrix in a block-scaled format (storage padded to whole blocks)."""

    codes: torch.Tensor
    """Elements, ``(Rb*br, Cb*bc)``: an FP8 tensor, or E2M1 codes in uint8 (bit 3 = sign)."""
    scale_bits: torch.Tensor
    """Block scales as stored, ``(Rb, Cb)``: E8M0 bits in uint8 (MX) or ``float8_e4m3fn`` (NVFP4)."""
    tensor_scale: torch.Tensor | None
    """NVFP4's FP32 second-level scale (0-dim); None for MX."""
    element: str
    block: tuple[int, int]
    shape: tuple[int, int]
    """The unpadded shape."""

    @property
    def scale(self) -> torch.Tensor:
        """FP32 block scales ``(Rb, Cb)`` including the tensor scale (NaN where poisoned)."""
        if self.tensor_scale is None:
            bits = self.scale_bits.to(torch.int32)
            s = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits - _E8M0_BIAS)
            return torch.where(bits == _E8M0_NAN, torch.full_like(s, float("nan")), s)
        return self.scale_bits.float() * self.tensor_scale

    def element_values(self) -> torch.Tensor:
        """Elements as FP32 (before scaling), unpadded."""
        R, C = self.shape
        return _element_values(self.codes, _element(self.element))[:R, :C]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        R, C = self.shape
        br, bc = self.block
        v = _element_values(self.codes, _element(self.element))
        Rb, Cb = self.scale_bits.shape
        if self.tensor_scale is None:
            s = self.scale
            out = v.reshape(Rb, br, Cb, bc) * s[:, None, :, None]
        else:   # as NVFP4 GEMMs apply them: element * block scale, then the tensor scale
            s = self.scale_bits.float()
            out = (v.reshape(Rb, br, Cb, bc) * s[:, None, :, None]) * self.tensor_scale
        return out.reshape(Rb * br, Cb * bc)[:R, :C].to(dtype)

    def saturated(self, source: torch.Tensor) -> torch.Tensor:
        """Where ``source`` (what was quantized) lay beyond the element format's largest value
        plus half its last step once scaled: the clamp, not rounding, decided those elements."""
        return source.float().abs() / self.per_element_scale() > SATURATION_LIMIT[self.element]

    def per_element_scale(self) -> torch.Tensor:
        """The FP32 scale of each element, unpadded ``(R, C)`` (for range statistics)."""
        R, C = self.shape
        br, bc = self.block
        s = self.scale
        return s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(R, C) -> zero-padded (Rb, br, Cb, bc) FP32 view."""
    if x.dim() != 2:
        raise ConfigError(f"block-scaled quantization works on 2-D matrices, got shape "
                          f"{tuple(x.shape)}; flatten leading dimensions first")
    R, C = x.shape
    br, bc = block
    pr, pc = -R % br, -C % bc
    x = x.float()
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    return x.reshape((R + pr) // br, br, (C + pc) // bc, bc)


def quantize_mx(x: torch.Tensor, element: str = "e4m3", *, block: int = MX_BLOCK,
                rounding: str = "nearest", generator: torch.Generator | None = None
                ) -> BlockScaledTensor:
    """OCP MX quantization of a 2-D ``x`` with one E8M0 scale per ``1 x block`` run of a row."""
    elem = _element(element)
    xb = _blocks(x, (1, block))                                   # (R, 1, Cb, block)
    amax = xb.abs().amax(dim=(1, 3))                              # (R, Cb); NaN if any NaN
    finite = torch.isfinite(amax)
    # floor(log2(amax)) exactly, subnormals included: amax = m * 2**e with m in [0.5, 1).
    _, e = torch.frexp(torch.where(finite & (amax > 0), amax, torch.ones_like(amax)))
    shared = torch.where(finite & (amax > 0), e - 1 - elem.emax, torch.full_like(e, -_E8M0_BIAS))
    shared = shared.clamp_(-_E8M0_BIAS, _E8M0_BIAS)
    bits = torch.where(finite, shared + _E8M0_BIAS, torch.full_like(shared, _E8M0_NAN)).to(torch.uint8)
    # V / 2**shared, exact (a power of two); poisoned blocks keep their values (the scale is NaN).
    scaled = torch.ldexp(xb, -shared[:, None, :, None]).clamp_(-elem.max, elem.max)
    codes = _to_elements(scaled, elem, rounding, generator)
    R, C = x.shape
    return BlockScaledTensor(codes=codes.reshape(xb.shape[0], -1), scale_bits=bits,
                             tensor_scale=None, element=element, block=(1, block),
                             shape=(R, C))


def quantize_nvfp4(x: torch.Tensor, *, block: tuple[int, int] = (1, NVFP4_BLOCK),
                   rounding: str = "nearest", generator: torch.Generator | None = None,
                   tensor_amax: torch.Tensor | None = None) -> BlockScaledTensor:
    """NVFP4 quantization of a 2-D ``x``: E2M1 elements, an E4M3 scale per ``block`` (``(1, 16)``,
    or ``(16, 16)`` for NVIDIA's 2-D weight blocks) and an FP32 tensor scale from
    ``tensor_amax`` (default ``amax(|x|)``)."""
    if block not in ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK)):
        raise ConfigError(f"NVFP4 blocks are (1, 16) or (16, 16), not {block}")
    elem = ELEMENTS["e2m1"]
    xb = _blocks(x, block)
    amax_b = xb.abs().amax(dim=(1, 3))
    t_amax = xb.abs().amax() if tensor_amax is None else tensor_amax.float().reshape(())
    t_ok = torch.isfinite(t_amax)
    tensor_scale = torch.where(t_ok, t_amax.clamp_min(EPS) / (_E4M3_MAX * _E2M1_MAX), float("nan"))
    s = ((amax_b / _E2M1_MAX) / tensor_scale).clamp(_E4M3_TINY, _E4M3_MAX)
    s = torch.where(torch.isfinite(amax_b), s, float("nan"))
    s8 = s.to(torch.float8_e4m3fn)
    mult = (1.0 / tensor_scale) / s8.float()
    scaled = (xb * mult[:, None, :, None]).clamp_(-elem.max, elem.max)
    codes = _to_elements(scaled, elem, rounding, generator)
    R, C = x.shape
    return BlockScaledTensor(codes=codes.reshape(xb.shape[0] * block[0], -1), scale_bits=s8,
                             tensor_scale=tensor_scale, element="e2m1", block=block, shape=(R, C))


def lost_share(source: torch.Tensor, q: BlockScaledTensor) -> torch.Tensor:
    """Share of ``source``'s non-zero values that ``q`` flushed to zero or saturated (0-d, no
    host sync)."""
    nz = source != 0
    lost = (nz & (q.dequantize() == 0)) | (nz & q.saturated(source))
    return lost.sum() / nz.sum().clamp(min=1)
