"""Loss scaling: the :class:`DynamicLossScaler` state machine, the torch.amp-compatible
:class:`GradScaler` built on it, gradient clipping that respects the scale, and (re-exported from
:mod:`mixprec.precision`, where it lives) ``autocast``."""
from mixprec.amp.clip import clip_grad_norm_
from mixprec.amp.grad_scaler import GradScaler
from mixprec.amp.grads import HasDeferredGrads, HasMasterGrads
from mixprec.amp.unscale import optimizer_grads
from mixprec.amp.loss_scale import DynamicLossScaler, LossScaleConfig, LossScaleState, Transition, transition

__all__ = [
    # scaling
    "GradScaler", "DynamicLossScaler", "LossScaleConfig", "LossScaleState", "Transition", "transition",
    # gradients
    "clip_grad_norm_", "optimizer_grads", "HasMasterGrads", "HasDeferredGrads",
    # forward
    "autocast",
]


def __getattr__(name: str):
    # ``mixprec.amp.autocast``: an old import path; autocast lives in the decider, above this room.
    if name == "autocast":
        from mixprec.precision.autocast import autocast
        return autocast
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
