"""Equinox layers built on ring attention."""

from ._attention import RingAttention as RingAttention
from ._options import AttentionOptions as AttentionOptions
from ._rope import apply_rope as apply_rope
from ._save import load_model as load_model, save_model as save_model
from ._transformer import (
    RingTransformerLM as RingTransformerLM,
    TransformerBlock as TransformerBlock,
)
