"""ringeqx: exact ring attention for JAX, as typed, immutable Equinox modules."""

import importlib.metadata

from ._comm import RingConfig as RingConfig
from ._kernels._base import AbstractAttentionKernel as AbstractAttentionKernel
from ._kernels._select import select_kernel as select_kernel
from ._kernels._xla import XlaKernel as XlaKernel
from ._layout import Layout as Layout, layout_from_order as layout_from_order
from ._masks import (
    AbstractMask as AbstractMask,
    And as And,
    Causal as Causal,
    Document as Document,
    Full as Full,
    Or as Or,
)
from ._reference import reference_attention as reference_attention
from ._ring import num_ring_steps as num_ring_steps, ring_attention as ring_attention
from ._score_mods import AbstractScoreMod as AbstractScoreMod
from ._strategies._base import AbstractShardingStrategy as AbstractShardingStrategy
from ._strategies._uniform import Uniform as Uniform
from ._tokens import BlockSummary as BlockSummary, TokenInfo as TokenInfo


__version__ = importlib.metadata.version("ringeqx")
