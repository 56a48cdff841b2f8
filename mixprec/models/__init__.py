"""Model family: a decoder-only Transformer built from mixprec's numerics-safe layers."""
from mixprec.models.config import MODEL_PRESETS, TransformerConfig, get_model_config
from mixprec.models.transformer import Block, Transformer

__all__ = ["Transformer", "TransformerConfig", "MODEL_PRESETS", "get_model_config", "Block"]
