"""ringeqx: exact ring attention for JAX, as typed, immutable Equinox modules."""

import importlib.metadata

from . import nn as nn, tools as tools
from ._call import ring_attention as ring_attention
from ._comm import AllGather as AllGather, RingConfig as RingConfig
from ._generate import generate as generate
from ._kernels._base import (
    AbstractAttentionKernel as AbstractAttentionKernel,
    Scores as Scores,
)
from ._kernels._pallas_gpu import PallasGpuKernel as PallasGpuKernel
from ._kernels._pallas_tpu import PallasTpuKernel as PallasTpuKernel
from ._kernels._select import select_kernel as select_kernel
from ._kernels._tune import tune_block_sizes as tune_block_sizes
from ._kernels._xla import XlaKernel as XlaKernel
from ._kvcache import KVCache as KVCache
from ._layout import (
    Layout as Layout,
    contiguous_layout as contiguous_layout,
    layout_from_order as layout_from_order,
)
from ._mask_check import check_mask as check_mask
from ._masks import (
    AbstractMask as AbstractMask,
    And as And,
    BidirectionalSpans as BidirectionalSpans,
    BlockSparse as BlockSparse,
    Causal as Causal,
    Document as Document,
    Full as Full,
    Or as Or,
    PrefixLM as PrefixLM,
    SlidingWindow as SlidingWindow,
    TileLocal as TileLocal,
)
from ._reference import reference_attention as reference_attention
from ._score_mods import (
    AbstractScoreMod as AbstractScoreMod,
    ALiBi as ALiBi,
    Chain as Chain,
    Softcap as Softcap,
)
from ._steps import num_ring_steps as num_ring_steps
from ._strategies._base import AbstractShardingStrategy as AbstractShardingStrategy
from ._strategies._boundary import Boundary as Boundary
from ._strategies._modality import ModalityAware as ModalityAware
from ._strategies._striped import Striped as Striped
from ._strategies._uniform import Uniform as Uniform
from ._strategies._work_balanced import WorkBalanced as WorkBalanced
from ._strategies._zigzag import Zigzag as Zigzag
from ._tokens import BlockSummary as BlockSummary, Runs as Runs, TokenInfo as TokenInfo
from .tools import (
    HARDWARE as HARDWARE,
    CollectiveRow as CollectiveRow,
    CommReport as CommReport,
    CompiledMemory as CompiledMemory,
    ContextSearch as ContextSearch,
    Hardware as Hardware,
    MemoryBreakdown as MemoryBreakdown,
    NoFit as NoFit,
    OverlapReport as OverlapReport,
    Plan as Plan,
    PlanOverlap as PlanOverlap,
    ProgramProfile as ProgramProfile,
    RingCost as RingCost,
    Schedule as Schedule,
    ThreadTime as ThreadTime,
    comm_report as comm_report,
    longest_context as longest_context,
    measure_memory as measure_memory,
    permute_stats as permute_stats,
    plan as plan,
    plot_layout as plot_layout,
    plot_schedule as plot_schedule,
    profile_program as profile_program,
    ring_overlap as ring_overlap,
    schedule as schedule,
    table2 as table2,
    target_mesh as target_mesh,
)


__version__ = importlib.metadata.version("ringeqx")
