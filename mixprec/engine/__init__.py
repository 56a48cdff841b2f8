"""The precision engine: :class:`Precision`, the one object that turns a policy into decisions
(storage dtypes, FP32 exemptions, FP8 swap, master weights, loss scaling, what strategies need),
and :class:`OverlappedUpdate`, which issues a taken step per module so it overlaps the next forward."""
from mixprec.engine.overlap import OverlappedUpdate
from mixprec.engine.precision import OptimizerSpec, Precision

__all__ = ["Precision", "OptimizerSpec", "OverlappedUpdate"]
