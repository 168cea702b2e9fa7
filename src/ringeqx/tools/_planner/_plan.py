"""The `Plan` that `ringeqx.tools.plan` returns: tile sizes, rematerialisation and a
sharding strategy chosen so that ring attention (or a `RingTransformerLM` training step)
fits a per-device memory budget; the model, kernel and layout it describes."""

from typing import Literal, NamedTuple

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from ..._kernels._xla import XlaKernel
from ..._masks._base import AbstractMask
from ..._strategies._base import AbstractShardingStrategy
from ..._strategies._uniform import Uniform
from ..._strategies._work_balanced import WorkBalanced
from ..._strategies._zigzag import Zigzag
from ...nn import AttentionOptions, Precision, RingTransformerLM
from ._model import (
    CATEGORIES,
    MemoryBreakdown,
    family,
)
from ._problem import Problem, Remat


_MIB = 2**20


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
    - `mlp`, `norm_bias`, `precision`: the LM's blocks (`"gelu"` or `"swiglu"`, the
        norms' bias) and its [`ringeqx.nn.Precision`][], as
        [`ringeqx.nn.RingTransformerLM`][] takes them; `rope_theta` its attention's
        (None: `AttentionOptions`' default), from a `config`.
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
    mlp: str = eqx.field(static=True, default="gelu")
    norm_bias: bool = eqx.field(static=True, default=True)
    precision: Precision = eqx.field(static=True, default_factory=Precision)
    rope_theta: float | None = eqx.field(static=True, default=None)

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
        its sizes, MLP, norms and precision, its mask, the kernel `plan.kernel()` names,
        the planned remat as `checkpoint`, and `scan_layers` as planned.

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
        rope = {} if self.rope_theta is None else {"rope_theta": self.rope_theta}
        attention = AttentionOptions(
            mask=self.mask, kernel=self.kernel(), head_dim=self.head_dim, **rope
        )
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
            mlp=self.mlp,  # pyright: ignore[reportArgumentType]
            norm_bias=self.norm_bias,
            precision=self.precision,
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
            "mlp": self.mlp if self.kind == "lm" else None,
            "norm_bias": self.norm_bias if self.kind == "lm" else None,
            "precision": precision_name(self.precision) if self.kind == "lm" else None,
            "rope_theta": self.rope_theta,
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


def precision_name(precision: Precision) -> str:
    """`"float32"`, `"mixed"`, or the three dtypes (parameters/compute/output)."""
    dtypes = (precision.param_dtype, precision.compute_dtype, precision.output_dtype)
    for name, policy in (("float32", Precision()), ("mixed", Precision.mixed())):
        if dtypes == (policy.param_dtype, policy.compute_dtype, policy.output_dtype):
            return name
    return "/".join(d.name for d in dtypes)


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
