"""Equinox layers built on ring attention."""

from ._attention import RingAttention as RingAttention
from ._rope import apply_rope as apply_rope
from ._transformer import (
    RingTransformerLM as RingTransformerLM,
    TransformerBlock as TransformerBlock,
)
