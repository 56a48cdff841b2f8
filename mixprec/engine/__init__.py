"""Old import path (a shim): the decider moved to :mod:`mixprec.precision`, the overlapped update
to :mod:`mixprec.optim.overlap` (docs/ARCHITECTURE.md)."""
from mixprec import _compat
from mixprec.optim import overlap
from mixprec.optim.overlap import OverlappedUpdate
from mixprec.precision import layer_formats, precision
from mixprec.precision.precision import OptimizerSpec, Precision

_compat.alias(__name__, precision=precision, layer_formats=layer_formats, overlap=overlap)

__all__ = ["Precision", "OptimizerSpec", "OverlappedUpdate"]
