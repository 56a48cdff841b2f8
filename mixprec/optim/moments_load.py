"""A loaded state of mixprec's AdamW math (``adamw._AdamWFP32Math``) put back in the layout of
the optimizer's own moments format: torch's ``Optimizer.load_state_dict`` casts every tensor of the
state to the parameter's dtype (FP32), 8-bit codes and 16-bit scales included, so each tensor is
stored in its saved dtype again; plain moments of a matrix are encoded when the moments are 8-bit,
an earlier 8-bit layout is converted, a vector's 8-bit moments are widened, another format is
refused in one line."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from mixprec.errors import CheckpointError
from mixprec.optim import moments as _moments, sharded as _sharded

__all__ = ["check_formats", "restore_"]


def check_formats(formats: Iterable[str | None], moments: str) -> None:
    """Refuse a state whose param groups hold 8-bit moments of another format than ``moments``."""
    formats = set(formats) - {None}
    if any(_moments.is_quantized(f) for f in formats) and formats != {moments}:
        raise CheckpointError(f"the optimizer state holds moments={', '.join(sorted(formats))}, not this "
                              f"optimizer's moments={moments}; build the optimizer with the "
                              "moments format the checkpoint was saved with")


def restore_(st: dict[str, Tensor], p: Tensor, saved: dict[str, torch.dtype], moments: str,
             moments_dtype: torch.dtype, shape: torch.Size,
             generator: Callable[[torch.device], torch.Generator | None]) -> None:
    """``p``'s loaded state ``st`` (``saved``: the dtypes it was saved in) in the layout of
    ``moments`` (``moments_dtype`` for plain ones); ``shape``: the shape ``p`` is stepped with."""
    if not _moments.is_quantized(moments):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                st[key] = st[key].to(moments_dtype)
        return
    for key, dtype in saved.items():
        if key != "step":
            st[key] = st[key].to(dtype)       # 8-bit codes and scales went through FP32 exactly
    _adopt_quantized_(st, p, moments, shape, generator(p.device))


def _adopt_quantized_(st: dict[str, Tensor], p: Tensor, moments: str, shape: torch.Size,
                      gen: torch.Generator | None) -> None:
    """A loaded state of ``p`` in the layout of 8-bit ``moments``: a matrix's plain moments (a
    checkpoint of FP32 or BF16 moments) are encoded, an earlier 8-bit layout is converted, another
    format refused; a vector's 8-bit moments (saved before vectors kept FP32 moments) are widened."""
    if "exp_avg" not in st:
        return
    if not _sharded.is_dtensor(p):       # FP8 codes saved as bytes (gathered under FSDP2)
        _moments.from_bytes_(st, moments)
    loc = _moments.from_bytes_({k: _sharded.local(v) for k, v in st.items() if k != "step"}, moments)
    keys = ("exp_avg", "exp_avg_sq")
    if not _moments.quantizes(shape, moments):
        if "exp_avg_scale" in loc:
            _moments.widen_(loc, moments)
            for k in ("exp_avg_scale", "exp_avg_sq_scale"):
                st.pop(k)
        st.update(_sharded.like(p, {k: loc[k].float() for k in keys}))
        return
    if "exp_avg_scale" not in loc:                             # plain moments: encode them
        wide = {k: loc[k].float() for k in keys}
        loc = _moments.new_state(wide["exp_avg"], moments)
        for k, w in wide.items():
            _moments.encode_([loc], k, [w], moments, gen)
        st.update(_sharded.like(p, loc))
        return
    want = _moments.LAYOUTS[moments].codes
    got = (loc["exp_avg"].dtype, loc["exp_avg_sq"].dtype)
    if got == want and _moments.upgrade_(loc, moments, gen):
        st.update(_sharded.like(p, loc))
    if got != want or st["exp_avg_scale"].dtype != _moments.LAYOUTS[moments].scale_dtype:
        raise CheckpointError(f"the optimizer state holds 8-bit moments as {got[0]}/{got[1]}, not this "
                              f"optimizer's moments={moments}; build the optimizer with the "
                              "moments format the checkpoint was saved with")
