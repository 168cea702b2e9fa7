"""ringeqx: exact ring attention for JAX, as typed, immutable Equinox modules.

The core (`ring_attention`, masks, score modifiers, layouts, strategies, kernels,
inference) is exported here, the layers as `ringeqx.nn`, and the tools that answer
questions about programs (planning, targets, HLO readers, schedules, plots) as
`ringeqx.tools`.
"""

import importlib.metadata
import warnings

from . import nn as nn, tools as tools
from ._inference._generate import generate as generate
from ._inference._kvcache import KVCache as KVCache
from ._kernels._base import (
    AbstractAttentionKernel as AbstractAttentionKernel,
    Scores as Scores,
)
from ._kernels._mosaic._kernel import PallasTpuKernel as PallasTpuKernel
from ._kernels._select import select_kernel as select_kernel
from ._kernels._triton._kernel import PallasGpuKernel as PallasGpuKernel
from ._kernels._tune import tune_block_sizes as tune_block_sizes
from ._kernels._xla import XlaKernel as XlaKernel
from ._layout._layout import (
    Layout as Layout,
    contiguous_layout as contiguous_layout,
    layout_from_order as layout_from_order,
)
from ._layout._tokens import BlockSummary as BlockSummary, Runs as Runs, TokenInfo as TokenInfo
from ._masks._base import AbstractMask as AbstractMask, And as And, Or as Or, TileLocal as TileLocal
from ._masks._block_sparse import BlockSparse as BlockSparse
from ._masks._check import check_mask as check_mask
from ._masks._ids import BidirectionalSpans as BidirectionalSpans, Document as Document
from ._masks._positional import (
    Causal as Causal,
    Full as Full,
    PrefixLM as PrefixLM,
    SlidingWindow as SlidingWindow,
)
from ._ring._call import ring_attention as ring_attention
from ._ring._comm import AllGather as AllGather, RingConfig as RingConfig
from ._ring._reference import reference_attention as reference_attention
from ._ring._steps import num_ring_steps as num_ring_steps
from ._score_mods import (
    AbstractScoreMod as AbstractScoreMod,
    ALiBi as ALiBi,
    Chain as Chain,
    Softcap as Softcap,
)
from ._strategies._base import AbstractShardingStrategy as AbstractShardingStrategy
from ._strategies._boundary import Boundary as Boundary
from ._strategies._modality import ModalityAware as ModalityAware
from ._strategies._striped import Striped as Striped
from ._strategies._uniform import Uniform as Uniform
from ._strategies._work_balanced import WorkBalanced as WorkBalanced
from ._strategies._zigzag import Zigzag as Zigzag


__version__ = importlib.metadata.version("ringeqx")


# The tools' old top-level names, kept for one release: each warns once, then is the
# object in `ringeqx.tools`.
_MOVED_TO_TOOLS = frozenset(
    {
        "CollectiveRow",
        "CommReport",
        "CompiledMemory",
        "ContextSearch",
        "HARDWARE",
        "Hardware",
        "MemoryBreakdown",
        "NoFit",
        "OverlapReport",
        "Plan",
        "PlanOverlap",
        "ProgramProfile",
        "RingCost",
        "Schedule",
        "ThreadTime",
        "comm_report",
        "longest_context",
        "measure_memory",
        "permute_stats",
        "plan",
        "plot_layout",
        "plot_schedule",
        "profile_program",
        "ring_overlap",
        "schedule",
        "table2",
        "target_mesh",
    }
)
_warned: set[str] = set()


def __getattr__(name: str):
    if name in _MOVED_TO_TOOLS:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"`ringeqx.{name}` is deprecated: use `ringeqx.tools.{name}` (the tools "
                "moved to `ringeqx.tools`; the top-level name goes in the next release).",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(tools, name)
    raise AttributeError(f"module 'ringeqx' has no attribute {name!r}")
