"""The analytic plan: the memory model's prediction for each candidate (remat, tiles),
searched cheapest in compute first, and what would fit when nothing does."""

import jax
import jax.numpy as jnp

from ..._kernels._select import default_kernel
from ..._masks._base import AbstractMask
from ..._masks._positional import Full
from ..._ring._steps import ring_window
from ..._strategies._base import AbstractShardingStrategy
from ..._strategies._zigzag import Zigzag
from ._model import (
    LMShapes,
    MemoryBreakdown,
    Shapes,
    family,
    headroom,
    predict_attention,
    predict_lm,
    uncalibrated,
)
from ._plan import Plan, make_plan, suggest_strategy
from ._problem import Problem, Remat, remats


_MIB = 2**20


def kernel_tiles(cfg: "Problem") -> tuple[int, int]:
    """The forward tiles of the kernel `kernel="auto"` picks on the profile's devices
    (on an accelerator its Pallas kernel: its defaults on a TPU, its tuned table on a
    GPU, for the problem's dtype and head_dim), asked of the kernel; a ValueError where
    that kernel does not take the problem's head_dim or dtype."""
    kernel = default_kernel(family(cfg.device))
    expected = kernel.unsupported_head_dim(cfg.head_dim)
    if expected is not None:
        lm = " (the LM's `dim` / `heads`)" if cfg.kind == "lm" else ""
        raise ValueError(
            f"`head_dim`={cfg.head_dim}{lm} is not a width {type(kernel).__name__}, the "
            f"kernel of {cfg.device!r} devices, takes: expected {expected}."
        )
    expected = kernel.unsupported_dtype(cfg.dtype)
    if expected is not None:
        # Found only when the target's compile traced the kernel (a TypeError that the
        # CLI printed as a traceback; issue 45).
        raise ValueError(
            f"`dtype`={cfg.dtype} is not a dtype {type(kernel).__name__}, the kernel of "
            f"{cfg.device!r} devices, takes: expected one of {expected}."
        )
    return kernel.tiles(cfg.dtype, cfg.head_dim)


def _tiles(cfg: "Problem") -> tuple[int, ...]:
    """Square tiles to try, preferred first: on the CPU the XLA kernel's default (as
    fast as larger ones there, see docs/design.md), then two halvings, which only save
    memory. On an accelerator the Pallas kernel's own tiles: they live in on-chip memory,
    so smaller ones would save no HBM."""
    block = kernel_tiles(cfg)[0]
    return (block, block // 2, block // 4) if family(cfg.device) == "cpu" else (block,)


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


def _model_shapes(cfg: Problem, block: int, remat: Remat, num_devices: int) -> Shapes | LMShapes:
    shapes = _shapes(cfg, block, num_devices)
    if cfg.kind == "attention":
        return shapes
    # On an accelerator the parameters and Adam state are sharded over every chip.
    chips = 1 if shapes.family == "cpu" else cfg.batch_devices * num_devices
    precision = cfg.precision
    return LMShapes(
        shapes, cfg.vocab_size, cfg.dim, cfg.num_layers, cfg.hidden, remat, chips,
        cfg.scan_layers, mlp=cfg.mlp, norm_bias=cfg.norm_bias,
        param_bytes=precision.param_dtype.itemsize,
        compute_bytes=precision.compute_dtype.itemsize,
        output_bytes=precision.output_dtype.itemsize,
    )  # fmt: skip


def predict(cfg: Problem, block: int, remat: Remat, num_devices: int) -> MemoryBreakdown:
    problem = _model_shapes(cfg, block, remat, num_devices)
    if isinstance(problem, LMShapes):
        return predict_lm(problem)
    return predict_attention(problem)


def plan_problem(p: Plan) -> Shapes | LMShapes:
    """The per-device sizes the model predicts `p` from (for calibration)."""
    cfg = Problem(*(getattr(p, name) for name in Problem._fields))
    return _model_shapes(cfg, p.block_q, p.remat, p.num_devices)


def _search(cfg: Problem, remat: Remat | None, block: int | None) -> Plan | None:
    """The first (remat, tile) that fits, cheapest in compute first: no remat with
    smaller tiles before remat."""
    blocks = _tiles(cfg) if block is None else (block,)
    # On an accelerator `_tiles` is the kernel's own pair, whose block_kv may differ.
    tiles = None if family(cfg.device) == "cpu" or block is not None else kernel_tiles(cfg)
    for r in remats(cfg, remat):
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
    r = remats(cfg, remat)[-1]
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


def analytic_plan(cfg: Problem, remat: Remat | None, block_size: int | None) -> Plan:
    """The first candidate the model predicts fits, or a ValueError saying what would."""
    for r in remats(cfg, remat):
        why = uncalibrated(_model_shapes(cfg, _tiles(cfg)[0], r, cfg.num_devices))
        if why is not None:
            raise ValueError(
                f"No analytic plan: {why}. Plan with `target=` (a TPU slice or GPU count) "
                "to ask the target's compiler instead."
            )
    found = _search(cfg, remat, block_size)
    if found is None:
        raise ValueError(_no_fit_message(cfg, remat, block_size))
    return found
