"""`ringeqx.tools.plan`: tile sizes, rematerialisation and a sharding strategy chosen so that ring
attention (or a `RingTransformerLM` training step) fits a per-device memory budget."""

import math
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray

from ..._kernels._pallas_gpu import PallasGpuKernel
from ..._kernels._pallas_tpu import PallasTpuKernel
from ..._kernels._xla import XlaKernel
from ..._masks import AbstractMask, Causal, Full
from ..._numbers import as_int, check_size, is_int
from ..._steps import ring_window
from ..._strategies._base import AbstractShardingStrategy
from ..._strategies._uniform import Uniform
from ..._strategies._work_balanced import WorkBalanced
from ..._strategies._zigzag import Zigzag
from ...nn import AttentionOptions, RingTransformerLM
from .._hlo._report import HARDWARE, float_itemsize
from ._model import (
    CATEGORIES,
    LMShapes,
    MemoryBreakdown,
    Shapes,
    family,
    headroom,
    predict_attention,
    predict_lm,
    uncalibrated,
)


Remat = Literal["none", "attention", "block"]
_REMATS: tuple[Remat, ...] = ("none", "attention", "block")
_MIB = 2**20


class Problem(NamedTuple):
    """What a plan is for, checked: the problem's sizes, the mask, the device profile
    and the budget (the fields of `Plan` that the search does not choose)."""

    kind: Literal["attention", "lm"]
    seq_len: int
    num_devices: int
    batch: int
    batch_devices: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int | None
    dim: int | None
    num_layers: int | None
    hidden: int | None
    scan_layers: bool
    mask: AbstractMask
    device: str
    max_memory_usage: int


class CompiledMemory(NamedTuple):
    """What the target's compiler allocates for a planned program, in bytes per chip
    (`compiled.memory_analysis()`: `outputs` counts those not aliased to a donated
    argument), and how long the compile took."""

    arguments: int
    outputs: int
    temp: int
    seconds: float

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temp


class PlanOverlap(NamedTuple):
    """Whether the ring's transfers hide behind its compute, for a compiled plan: the
    Ring Attention paper's condition with the chip's published FLOP rate and link
    bandwidth ([`ringeqx.tools.RingCost`][]), and the compiled program's schedule
    ([`ringeqx.tools.ring_overlap`][]).

    **Fields:** `shard` (tokens a device holds on the ring); `min_shard`,
    `min_shard_backward` (the shortest shard whose forward, or backward, step computes
    for longer than it sends: the condition holds when `shard` reaches them);
    `scheduled` (every collective-permute of the ring's loops encloses a kernel in the
    compiled schedule); `permutes` (how many the loops have: a ring of 2 devices has no
    loop, XLA unrolls its one hop, so 0 and `scheduled` False).
    """

    shard: int
    min_shard: int
    min_shard_backward: int
    scheduled: bool
    permutes: int

    @property
    def hides(self) -> bool:
        """The condition, forward and backward."""
        return self.shard >= max(self.min_shard, self.min_shard_backward)


def kernel_tiles(cfg: "Problem") -> tuple[int, int]:
    """The forward tiles of the Pallas kernel an accelerator's mesh picks (its defaults
    on a TPU, its tuned table on a GPU, for the problem's dtype and head_dim); a
    ValueError where that kernel does not take the problem's head_dim."""
    kernel = PallasTpuKernel() if cfg.device.startswith("tpu") else PallasGpuKernel()
    expected = kernel.unsupported_head_dim(cfg.head_dim)
    if expected is not None:
        lm = " (the LM's `dim` / `heads`)" if cfg.kind == "lm" else ""
        raise ValueError(
            f"`head_dim`={cfg.head_dim}{lm} is not a width {type(kernel).__name__}, the "
            f"kernel of {cfg.device!r} devices, takes: expected {expected}."
        )
    if isinstance(kernel, PallasTpuKernel):
        return kernel.block_q, kernel.block_kv
    return kernel.launch("forward", cfg.dtype, cfg.head_dim)[:2]


def _tiles(cfg: "Problem") -> tuple[int, ...]:
    """Square tiles to try, preferred first: 256 on the CPU (as fast as 512 there, see
    docs/design.md), smaller ones only save memory. On an accelerator the Pallas kernel's
    own tiles: they live in on-chip memory, so smaller ones would save no HBM."""
    if family(cfg.device) == "cpu":
        return (256, 128, 64)
    return (kernel_tiles(cfg)[0],)


def suggest_strategy(mask: AbstractMask, block: int) -> AbstractShardingStrategy:
    """The strategy that balances `mask`'s work: `WorkBalanced` when it reads segments
    (packed documents), `Uniform` when it is bounded behind (a window: contiguous shards
    let the ring stop early), `Zigzag` when it looks nowhere ahead (causal), else
    `Uniform` (full attention is balanced as it is)."""
    if "segments" in mask.reads():
        return WorkBalanced(chunk=block)
    if mask.max_distance() is not None:
        return Uniform()
    if mask.max_lookahead() == 0:
        return Zigzag()
    return Uniform()


class Plan(eqx.Module):
    """A memory plan: how to run ring attention (or train a `RingTransformerLM`) within
    `max_memory_usage` bytes per device, and what it is predicted to use.

    Made by [`ringeqx.tools.plan`][]. Build the model with `plan.model(key=...)`, the kernel
    with `plan.kernel()` and the layout with `plan.layout(...)`;
    [`ringeqx.tools.measure_memory`][] compiles the planned program and reads what XLA
    allocates.

    **Fields:**

    - `kind`: `"attention"` (ring attention forward + backward) or `"lm"` (a training step:
        loss, gradients, Adam update).
    - `seq_len`, `num_devices` (the ring), `batch`, `batch_devices` (the `"batch"` mesh
        axis), `heads`, `kv_heads`, `head_dim`, `dtype` (of q/k/v; LMs run in float32):
        the problem.
    - `vocab_size`, `dim`, `num_layers`, `hidden`: the LM's sizes (None for attention).
    - `scan_layers`: the LM's layers stacked and scanned
        ([`ringeqx.nn.RingTransformerLM`][]'s `scan_layers`).
    - `mask`: the attention mask.
    - `strategy`: the suggested sharding strategy for the mask.
    - `block_q`, `block_kv`: the kernel's tiles, used by the forward and the backward.
    - `remat`: what each block rematerialises: `"none"`, `"attention"` (projections and
        MLP matmuls kept, attention recomputed) or `"block"` (only the block's input kept).
    - `device`: the device profile (`"cpu"` or a key of [`ringeqx.tools.HARDWARE`][]).
    - `max_memory_usage`: the budget in bytes per device.
    - `memory`: the predicted [`ringeqx.tools.MemoryBreakdown`][] per device.
    - `target`: the cluster the plan was compiled for (`"v5p:4x4x4"`, `"h100:8"`), or
        None for a plan from the model alone.
    - `compiled`: with a `target`, the compiler's bytes per chip for the planned
        program (`arguments`, `outputs`, `temp`, `total`) and the compile's seconds.
    - `overlap`: with a `target`, the overlap condition and the compiled schedule's
        answer to it ([`ringeqx.tools.PlanOverlap`][]).
    """

    kind: Literal["attention", "lm"] = eqx.field(static=True)
    seq_len: int = eqx.field(static=True)
    num_devices: int = eqx.field(static=True)
    batch: int = eqx.field(static=True)
    batch_devices: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    vocab_size: int | None = eqx.field(static=True)
    dim: int | None = eqx.field(static=True)
    num_layers: int | None = eqx.field(static=True)
    hidden: int | None = eqx.field(static=True)
    scan_layers: bool = eqx.field(static=True)
    mask: AbstractMask
    strategy: AbstractShardingStrategy
    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)
    remat: Remat = eqx.field(static=True)
    device: str = eqx.field(static=True)
    max_memory_usage: int = eqx.field(static=True)
    memory: MemoryBreakdown
    target: str | None = eqx.field(static=True, default=None)
    compiled: CompiledMemory | None = eqx.field(static=True, default=None)
    overlap: PlanOverlap | None = eqx.field(static=True, default=None)

    @property
    def forward_tiles(self) -> tuple[int, int]:
        """`(block_q, block_kv)` of the forward pass."""
        return self.block_q, self.block_kv

    @property
    def backward_tiles(self) -> tuple[int, int]:
        """`(block_q, block_kv)` of the backward pass (`XlaKernel` uses one pair for
        both)."""
        return self.block_q, self.block_kv

    def kernel(self) -> XlaKernel | Literal["auto"]:
        """The kernel the prediction is calibrated for, with the planned tiles; for a
        plan for a TPU or GPU (a `target`, or an accelerator's `device` profile),
        `"auto"`: the Pallas kernel of the mesh's platform, with its own tiles (which
        live in on-chip memory, not in HBM)."""
        if self.target is not None or family(self.device) != "cpu":
            return "auto"
        return XlaKernel(self.block_q, self.block_kv)

    def model(self, *, key: PRNGKeyArray) -> RingTransformerLM:
        """The [`ringeqx.nn.RingTransformerLM`][] this plan (of kind `"lm"`) describes:
        its sizes, its mask, the kernel `plan.kernel()` names, the planned remat as
        `checkpoint`, and `scan_layers` as planned.

        Shard its inputs with `plan.layout(...)` (the plan's strategy) and pass that
        layout to `loss` / `__call__`. (The plan builds the model, rather than the model
        reading a plan, so that `ringeqx.nn` needs none of the tools.)

        **Arguments:**

        - `key`: a `jax.random` key.

        **Example:**

        ```python
        p = ringeqx.tools.plan(65536, 8, heads=8, dim=512, num_layers=4, vocab_size=32000,
                               max_memory_usage=2**30)
        model = p.model(key=jax.random.key(0))
        ```
        """
        if self.kind != "lm":
            raise ValueError(
                "`plan` must be an LM plan (ringeqx.tools.plan(..., dim=, num_layers=, "
                f"vocab_size=)); got a plan of kind {self.kind!r}."
            )
        assert self.vocab_size and self.dim and self.num_layers
        attention = AttentionOptions(mask=self.mask, kernel=self.kernel(), head_dim=self.head_dim)
        return RingTransformerLM(
            self.vocab_size,
            self.dim,
            self.heads,
            self.num_layers,
            num_kv_heads=self.kv_heads,
            hidden=self.hidden,
            checkpoint=self.remat,
            attention=attention,
            scan_layers=self.scan_layers,
            key=key,
        )

    def layout(self, segment_ids=None):
        """The strategy's [`ringeqx.Layout`][] for this sequence and ring."""
        return self.strategy.layout(self.seq_len, self.num_devices, segment_ids=segment_ids)

    def checkpoint_policy(self):
        """The `jax.checkpoint` policy of each block (None: no checkpoint)."""
        policies = jax.checkpoint_policies
        return {
            "none": None,
            "attention": policies.dots_with_no_batch_dims_saveable,
            "block": policies.nothing_saveable,
        }[self.remat]

    def to_dict(self) -> dict:
        """The plan as plain JSON-able values."""
        out = {
            "kind": self.kind,
            "seq_len": self.seq_len,
            "num_devices": self.num_devices,
            "batch": self.batch,
            "batch_devices": self.batch_devices,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "dim": self.dim,
            "num_layers": self.num_layers,
            "hidden": self.hidden,
            "scan_layers": self.scan_layers if self.kind == "lm" else None,
            "mask": type(self.mask).__name__,
            "strategy": repr(self.strategy),
            "forward_tiles": list(self.forward_tiles),
            "backward_tiles": list(self.backward_tiles),
            "remat": self.remat,
            "device": self.device,
            "max_memory_usage": self.max_memory_usage,
        }
        memory = {name: getattr(self.memory, name) for name in CATEGORIES}
        out["memory"] = memory | {"total": self.memory.total}
        if self.target is not None:
            out["target"] = self.target
        if self.compiled is not None:
            out["compiled"] = self.compiled._asdict() | {"total": self.compiled.total}
        if self.overlap is not None:
            out["overlap"] = self.overlap._asdict() | {"hides": self.overlap.hides}
        return out

    def table(self) -> str:
        """The plan as a Markdown table (sizes in MiB per device)."""
        d = self.to_dict()
        memory = d.pop("memory")
        compiled = d.pop("compiled", None)
        overlap = d.pop("overlap", None)
        d["max_memory_usage"] = f"{self.max_memory_usage / _MIB:,.1f} MiB"
        rows = [(k, str(v)) for k, v in d.items() if v is not None]
        rows += [(f"memory: {k}", f"{v / _MIB:,.1f} MiB") for k, v in memory.items()]
        if compiled is not None:
            seconds = compiled.pop("seconds")
            rows += [(f"compiled: {k}", f"{v / _MIB:,.1f} MiB") for k, v in compiled.items()]
            rows += [("compiled in", f"{seconds:.1f} s")]
        if overlap is not None:
            rows += [(f"overlap: {k}", str(v)) for k, v in overlap.items()]
        lines = ["| setting | value |", "|---|---|"]
        return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows])


def _ring_size(
    strategy: AbstractShardingStrategy, mask: AbstractMask, seq_len: int, num_devices: int
) -> tuple[int, int]:
    """`(capacity, num_steps)`: slots per shard of the strategy's layout and the ring
    steps the mask needs (shapes only: no layout is computed)."""
    layout = jax.eval_shape(lambda: strategy.layout(seq_len, num_devices))
    return layout.capacity, ring_window(mask, layout)[1]


def _shapes(cfg: Problem, block: int, num_devices: int) -> Shapes:
    strategy = suggest_strategy(cfg.mask, block)
    capacity, num_steps = _ring_size(strategy, cfg.mask, cfg.seq_len, num_devices)
    return Shapes(
        batch=cfg.batch // cfg.batch_devices,
        capacity=capacity,
        num_steps=num_steps,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        itemsize=jnp.dtype(cfg.dtype).itemsize,
        block_q=block,
        block_kv=block,
        dense=isinstance(cfg.mask, Full),
        family=family(cfg.device),
        zigzag=isinstance(strategy, Zigzag),
    )


def _problem(cfg: Problem, block: int, remat: Remat, num_devices: int) -> Shapes | LMShapes:
    shapes = _shapes(cfg, block, num_devices)
    if cfg.kind == "attention":
        return shapes
    # On an accelerator the parameters and Adam state are sharded over every chip.
    chips = 1 if shapes.family == "cpu" else cfg.batch_devices * num_devices
    return LMShapes(
        shapes, cfg.vocab_size, cfg.dim, cfg.num_layers, cfg.hidden, remat, chips, cfg.scan_layers
    )


def predict(cfg: Problem, block: int, remat: Remat, num_devices: int) -> MemoryBreakdown:
    problem = _problem(cfg, block, remat, num_devices)
    if isinstance(problem, LMShapes):
        return predict_lm(problem)
    return predict_attention(problem)


def plan_problem(p: Plan) -> Shapes | LMShapes:
    """The per-device sizes the model predicts `p` from (for calibration)."""
    cfg = Problem(*(getattr(p, name) for name in Problem._fields))
    return _problem(cfg, p.block_q, p.remat, p.num_devices)


def make_plan(
    cfg: Problem,
    block: int,
    remat: Remat,
    memory: MemoryBreakdown,
    *,
    tiles: tuple[int, int] | None = None,
    target: str | None = None,
    compiled: CompiledMemory | None = None,
    overlap: PlanOverlap | None = None,
) -> Plan:
    """The plan of `cfg` with these knobs (`tiles`: the kernel's, when not `block`'s)."""
    block_q, block_kv = (block, block) if tiles is None else tiles
    return Plan(
        **cfg._asdict(),
        strategy=suggest_strategy(cfg.mask, block),
        block_q=block_q,
        block_kv=block_kv,
        remat=remat,
        memory=memory,
        target=target,
        compiled=compiled,
        overlap=overlap,
    )


def _remats(cfg: Problem, remat: Remat | None) -> tuple[Remat, ...]:
    if remat is not None:
        return (remat,)
    return _REMATS if cfg.kind == "lm" else ("none",)


def _search(cfg: Problem, remat: Remat | None, block: int | None) -> Plan | None:
    """The first (remat, tile) that fits, cheapest in compute first: no remat with
    smaller tiles before remat."""
    blocks = _tiles(cfg) if block is None else (block,)
    # On an accelerator `_tiles` is the kernel's own pair, whose block_kv may differ.
    tiles = None if family(cfg.device) == "cpu" or block is not None else kernel_tiles(cfg)
    for r in _remats(cfg, remat):
        for b in blocks:
            memory = predict(cfg, b, r, cfg.num_devices)
            if _fits(cfg, memory, cfg.num_devices):
                return make_plan(cfg, b, r, memory, tiles=tiles)
    return None


def _headroom(cfg: Problem, num_devices: int) -> float:
    """The model's headroom for `cfg` on a ring of `num_devices`: its kind's, or an LM
    step on one chip's."""
    one_chip = cfg.batch_devices * num_devices == 1
    return headroom(cfg.kind, cfg.device, one_chip=one_chip)


def _fits(cfg: Problem, memory: MemoryBreakdown, num_devices: int) -> bool:
    """Whether the prediction on `num_devices`, with the model's headroom, is within the
    budget."""
    return memory.total * (1 + _headroom(cfg, num_devices)) <= cfg.max_memory_usage


def _no_fit_message(cfg: Problem, remat: Remat | None, block: int | None) -> str:
    """What would fit: more devices on the ring, or a larger budget."""
    r = _remats(cfg, remat)[-1]
    b = _tiles(cfg)[-1] if block is None else block
    p, budget = cfg.num_devices, cfg.max_memory_usage
    least = predict(cfg, b, r, p)
    fixed = least.parameters + least.optimizer_state
    spare = _headroom(cfg, p)
    need = least.total * (1 + spare)
    head = (
        f"Nothing fits in max_memory_usage={budget / _MIB:,.1f} MiB per device: "
        f"seq_len={cfg.seq_len} on num_devices={p} needs at least "
        f"{need / _MIB:,.1f} MiB (remat={r!r}, tiles {b}x{b}, with the model's "
        f"{spare:.0%} headroom)"
    )
    if fixed >= budget:
        return (
            f"{head}; parameters and optimizer state alone take {fixed / _MIB:,.1f} MiB "
            "on every device, whatever the ring size: raise max_memory_usage or shrink "
            "the model."
        )
    more = p
    while more < 2**16 * p:
        more *= 2
        memory = predict(cfg, b, r, more)
        if _fits(cfg, memory, more):
            return (
                f"{head}. It fits on num_devices={more} ({memory.total / _MIB:,.1f} MiB "
                f"per device), or raise max_memory_usage to {need / _MIB:,.1f} MiB."
            )
    return f"{head}: raise max_memory_usage to {need / _MIB:,.1f} MiB."


# A target's generation (as `ringeqx.tools.target_mesh` names it) -> its device profile.
_PROFILES = {
    "v4": "tpu-v4",
    "v5e": "tpu-v5e",
    "v5p": "tpu-v5p",
    "v6e": "tpu-v6e",
    "a100": "a100-nvlink",
    "h100": "h100",
    "h200": "h200",
}


def target_chips(target: str) -> int:
    """The chip count of `"v5p:4x4x4"` (a slice) or `"h100:8"` (a count), read from the
    name (no compiler needed); a ValueError naming `target` for anything else."""
    name, _, size = target.partition(":") if isinstance(target, str) else ("", "", "")
    dims = size.split("x")
    if name not in _PROFILES or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(
            "`target` must be a TPU generation and slice ('v5p:4x4x4') or a GPU and a "
            f"count ('h100:8'), from {sorted(_PROFILES)}; got {target!r}."
        )
    if name.startswith("v") != (len(dims) > 1):
        what = "a slice like 'v5p:4x4x4'" if name.startswith("v") else "a count like 'h100:8'"
        raise ValueError(f"`target` {target!r}: {name} needs {what}.")
    return math.prod(int(d) for d in dims)


def target_profile(target: str, device: str, devices: int) -> str:
    """The device profile of `target`, checked against `device` (its default or the
    same) and against the plan's `batch_devices * num_devices` (its chip count)."""
    chips = target_chips(target)
    profile = _PROFILES[target.partition(":")[0]]
    if device not in ("cpu", profile):
        raise ValueError(
            f"`device` must be {profile!r} (the profile of `target` {target!r}) or left "
            f"out; got {device!r}."
        )
    if devices != chips:
        raise ValueError(
            f"`batch_devices * num_devices` must be the {chips} chips of `target` "
            f"{target!r}; got {devices}."
        )
    return profile


def _budget(device: str, max_memory_usage: int | None) -> int:
    if device != "cpu" and device not in HARDWARE:
        raise ValueError(f"`device` must be 'cpu' or one of {sorted(HARDWARE)}; got {device!r}.")
    if max_memory_usage is not None:
        max_memory_usage = as_int(max_memory_usage)
        if not is_int(max_memory_usage) or max_memory_usage < 1:
            raise ValueError(
                f"`max_memory_usage` must be a positive int (bytes per device); got "
                f"{max_memory_usage!r}."
            )
        return max_memory_usage
    memory = HARDWARE[device].memory if device != "cpu" else None
    if memory is None:
        raise ValueError(
            f"The device profile {device!r} has no memory size: pass `max_memory_usage` "
            "(bytes per device)."
        )
    return int(memory)


def _float_name(dtype) -> str:
    float_itemsize("dtype", dtype)  # a floating dtype, or an error naming `dtype`
    return jnp.dtype(dtype).name


def _sizes(**given) -> dict[str, int]:
    """The problem's sizes, each an integer >= 1, with the divisibility they need."""
    sizes = {name: check_size(name, value) for name, value in given.items()}
    if sizes["heads"] % sizes["kv_heads"] != 0:
        raise ValueError(
            f"`heads` must be a multiple of `kv_heads`; got heads={sizes['heads']}, "
            f"kv_heads={sizes['kv_heads']}."
        )
    if sizes["batch"] % sizes["batch_devices"] != 0:
        raise ValueError(
            f"`batch`={sizes['batch']} must be divisible by "
            f"`batch_devices`={sizes['batch_devices']}."
        )
    return sizes


def _lm_sizes(heads: int, dim, num_layers, vocab_size, hidden, head_dim) -> dict:
    """The kind of plan and the LM's sizes (all None for an attention plan)."""
    given = {"dim": dim, "num_layers": num_layers, "vocab_size": vocab_size}
    given = {k: None if v is None else check_size(k, v) for k, v in given.items()}
    head_dim = None if head_dim is None else check_size("head_dim", head_dim)
    hidden = None if hidden is None else check_size("hidden", hidden)
    if all(v is None for v in given.values()):
        if head_dim is None:
            raise ValueError("`head_dim` is required for an attention plan (no `dim`).")
        return {"kind": "attention", **given, "hidden": None, "head_dim": head_dim}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"An LM plan needs `dim`, `num_layers` and `vocab_size`; missing {missing}."
        )
    dim = given["dim"]
    if head_dim is None and dim % heads != 0:
        raise ValueError(
            f"`dim`={dim} is not a multiple of `heads`={heads}: the LM splits its width "
            "over its heads (or pass `head_dim`)."
        )
    head_dim = dim // heads if head_dim is None else head_dim
    hidden = 4 * dim if hidden is None else hidden
    return {"kind": "lm", **given, "hidden": hidden, "head_dim": head_dim}


def problem(
    seq_len: int,
    num_devices: int,
    *,
    heads: int,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    batch: int = 1,
    batch_devices: int = 1,
    dtype: DTypeLike = jnp.float32,
    mask: AbstractMask | None = None,
    dim: int | None = None,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    hidden: int | None = None,
    scan_layers: bool = False,
    device: str = "cpu",
    max_memory_usage: int | None = None,
    remat: Remat | None = None,
    target: str | None = None,
) -> tuple[Problem, tuple[Remat, ...]]:
    """`plan`'s arguments checked, as the problem and the remats to try (see
    `ringeqx.tools._planner._search.plan`)."""
    sizes = _sizes(
        seq_len=seq_len,
        num_devices=num_devices,
        batch=batch,
        batch_devices=batch_devices,
        heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
    )
    lm = _lm_sizes(sizes["heads"], dim, num_layers, vocab_size, hidden, head_dim)
    if target is not None:
        device = target_profile(target, device, sizes["batch_devices"] * sizes["num_devices"])
    if scan_layers not in (False, True):
        raise ValueError(f"`scan_layers` must be a bool; got {scan_layers!r}.")
    if scan_layers and lm["kind"] == "attention":
        raise ValueError(
            "`scan_layers=True` needs an LM plan (`dim`, ...): attention alone has no layers."
        )
    cfg = Problem(
        **sizes,
        **lm,
        scan_layers=bool(scan_layers),
        dtype=_float_name(jnp.float32 if lm["kind"] == "lm" else dtype),
        mask=Causal() if mask is None else mask,
        device=device,
        max_memory_usage=_budget(device, max_memory_usage),
    )
    if remat is not None and remat not in _REMATS:
        raise ValueError(f"`remat` must be one of {_REMATS} or None; got {remat!r}.")
    if cfg.kind == "attention" and remat not in (None, "none"):
        raise ValueError(
            f"`remat`={remat!r} needs an LM plan (`dim`, ...): attention alone has no "
            "layers to rematerialise (its custom VJP already recomputes the scores)."
        )
    return cfg, _remats(cfg, remat)


def analytic_plan(cfg: Problem, remat: Remat | None, block_size: int | None) -> Plan:
    """The first candidate the model predicts fits, or a ValueError saying what would."""
    for r in _remats(cfg, remat):
        why = uncalibrated(_problem(cfg, _tiles(cfg)[0], r, cfg.num_devices))
        if why is not None:
            raise ValueError(
                f"No analytic plan: {why}. Plan with `target=` (a TPU slice or GPU count) "
                "to ask the target's compiler instead."
            )
    found = _search(cfg, remat, block_size)
    if found is None:
        raise ValueError(_no_fit_message(cfg, remat, block_size))
    return found
