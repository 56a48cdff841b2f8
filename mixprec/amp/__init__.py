"""Loss scaling: the :class:`DynamicLossScaler` state machine, the torch.amp-compatible
:class:`GradScaler` built on it, gradient clipping that respects the scale, and ``autocast``."""
from mixprec.amp.clip import clip_grad_norm_
from mixprec.amp.grad_scaler import GradScaler
from mixprec.amp.unscale import optimizer_grads
from mixprec.amp.loss_scale import DynamicLossScaler, LossScaleConfig, LossScaleState, Transition, transition
from mixprec.precision.autocast import autocast

__all__ = [
    # scaling
    "GradScaler", "DynamicLossScaler", "LossScaleConfig", "LossScaleState", "Transition", "transition",
    # gradients
    "clip_grad_norm_", "optimizer_grads",
    # forward
    "autocast",
]
