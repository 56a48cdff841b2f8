"""Loss scaling: the :class:`DynamicLossScaler` state machine, the torch.amp-compatible
:class:`GradScaler` built on it, and gradient clipping that respects the scale. ``autocast``
lives in :mod:`mixprec.precision`."""
from mixprec import _moved
from mixprec.amp.clip import clip_grad_norm_
from mixprec.amp.grad_scaler import GradScaler
from mixprec.amp.grads import HasDeferredGrads, HasMasterGrads
from mixprec.amp.unscale import optimizer_grads
from mixprec.amp.loss_scale import (DynamicLossScaler, LossScaleConfig, LossScaleState, StuckLossScaleWarning,
                                    Transition, transition)

__all__ = [
    # scaling
    "GradScaler", "DynamicLossScaler", "LossScaleConfig", "LossScaleState", "Transition", "transition",
    "StuckLossScaleWarning",
    # gradients
    "clip_grad_norm_", "optimizer_grads", "HasMasterGrads", "HasDeferredGrads",
]


def __getattr__(name: str):
    _moved.refuse(__name__, name)     # ``mixprec.amp.autocast`` (until 0.4): one line saying where
