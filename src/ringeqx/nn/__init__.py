"""Equinox layers built on ring attention."""

from ._attention import RingAttention as RingAttention
from ._block import TransformerBlock as TransformerBlock
from ._checkpoint import (
    Checkpoint as Checkpoint,
    load_checkpoint as load_checkpoint,
    save_checkpoint as save_checkpoint,
)
from ._config import (
    LLAMA3_8B as LLAMA3_8B,
    LLAMA3_70B as LLAMA3_70B,
    LLAMA_300M as LLAMA_300M,
    TINYLLAMA_1B as TINYLLAMA_1B,
    LMConfig as LMConfig,
)
from ._lm import RingTransformerLM as RingTransformerLM
from ._mlp import AbstractMLP as AbstractMLP, GeluMLP as GeluMLP, SwiGLUMLP as SwiGLUMLP
from ._options import AttentionOptions as AttentionOptions
from ._precision import Precision as Precision
from ._rope import apply_rope as apply_rope
from ._save import load_model as load_model, save_model as save_model
