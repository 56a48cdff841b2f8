"""Moved to :mod:`mixprec.models.objective` (how a batch becomes a loss); kept for old imports."""
from mixprec.models.objective import Objective, describe_batch, extract_loss, is_causal_lm, make_objective

__all__ = ["Objective", "make_objective", "extract_loss", "is_causal_lm", "describe_batch"]
