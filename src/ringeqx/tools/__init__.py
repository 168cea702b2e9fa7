"""ringeqx.tools: questions about ring-attention programs, apart from the core.

Planning (`plan`, `longest_context`), compile-only target meshes (`target_mesh`), what a
compiled program communicates and overlaps (`comm_report`, `permute_stats`,
`ring_overlap`), profiles of a run (`profile_program`), the work each device does at each
ring step (`schedule`) and plots. The core (`ring_attention`, the masks, strategies,
kernels, `ringeqx.nn`) never imports this package, as Equinox keeps `eqx.debug` and
`eqx.internal` apart from its layers.
"""

from ._cost import RingCost as RingCost, table2 as table2
from ._hardware import HARDWARE as HARDWARE, Hardware as Hardware
from ._hlo._overlap import OverlapReport as OverlapReport, ring_overlap as ring_overlap
from ._hlo._parse import permute_stats as permute_stats
from ._hlo._report import (
    CollectiveRow as CollectiveRow,
    CommReport as CommReport,
    comm_report as comm_report,
)
from ._hlo._trace import (
    ProgramProfile as ProgramProfile,
    ThreadTime as ThreadTime,
    profile_program as profile_program,
)
from ._planner._compiled import NoFit as NoFit, measure_memory as measure_memory
from ._planner._model import MemoryBreakdown as MemoryBreakdown
from ._planner._plan import (
    CompiledMemory as CompiledMemory,
    Plan as Plan,
    PlanOverlap as PlanOverlap,
)
from ._planner._search import (
    ContextSearch as ContextSearch,
    longest_context as longest_context,
    plan as plan,
)
from ._plot import plot_layout as plot_layout, plot_schedule as plot_schedule
from ._schedule import Schedule as Schedule, schedule as schedule
from ._targets import target_mesh as target_mesh
