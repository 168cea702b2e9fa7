"""What the Triton and Mosaic kernels do alike around their `pallas_call`s: the sizes of
a call, the mask and modifier as kernel operands, padding the inputs to whole tiles and
trimming the outputs back. The tile maths inside the kernels is in `_tiles.py`."""

import functools
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from ..._layout._tokens import TokenInfo
from ..._masks._base import AbstractMask, TileLocal
from ..._score_mods import AbstractScoreMod
from . import _leaves as leaves, _tables as tables, _tiles as tiles


class Tiling(NamedTuple):
    """Static sizes of one kernel call; the sequences are padded to whole tiles."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int
    kv_len: int
    block_q: int
    block_kv: int

    @property
    def groups(self) -> int:
        """Query heads per key/value head (GQA)."""
        return self.heads // self.kv_heads

    @property
    def q_padded(self) -> int:
        return tiles.round_up(self.q_len, self.block_q)

    @property
    def kv_padded(self) -> int:
        return tiles.round_up(self.kv_len, self.block_kv)

    @property
    def num_q(self) -> int:
        return self.q_padded // self.block_q

    @property
    def num_kv(self) -> int:
        return self.kv_padded // self.block_kv


def tiling(q: Array, k: Array, block_q: int, block_kv: int) -> Tiling:
    """The sizes of a call on `q [batch, heads, q_len, d]` and `k [batch, kv_heads,
    kv_len, d]` with the tiles the kernel chose for these lengths."""
    batch, heads, q_len, head_dim = q.shape
    return Tiling(batch, heads, k.shape[1], head_dim, q_len, k.shape[2], block_q, block_kv)


class Operands(NamedTuple):
    """The mask and the score modifier as kernel inputs (`leaves.mask_operands`,
    `leaves.head_operands`), and the keyword arguments every kernel body takes to
    rebuild them."""

    mask_leaves: list[Array]
    mod_leaves: list[Array]
    kernel_args: dict[str, Any]

    @property
    def leaves(self) -> tuple[Array, ...]:
        return (*self.mask_leaves, *self.mod_leaves)


def operands(
    table: Array,
    local: TileLocal,
    score_mod: AbstractScoreMod | None,
    heads: int,
    scale: float,
) -> Operands:
    """The operands of a call whose `(table, local)` come from `tile_mask`: in the
    kernels, `rebuild_mask(mask_refs, table_ref, tile)` gives the mask for a pair of
    tiles and `rebuild_mask.runs(table_ref, tile)` whether it runs."""
    mask_leaves, rebuild_mask = leaves.mask_operands(local, table.shape[-1])
    mod_leaves, rebuild_mod = leaves.head_operands(score_mod, heads)
    kernel_args = dict(
        rebuild_mask=rebuild_mask,
        rebuild_mod=rebuild_mod,
        num_mask=len(mask_leaves),
        scale=scale,
    )
    return Operands(mask_leaves, mod_leaves, kernel_args)


def tile_mask(
    t: Tiling,
    mask: AbstractMask,
    q_info: TokenInfo,
    kv_info: TokenInfo,
    compute: int | None = None,
) -> tuple[Array, TileLocal]:
    """`tables.tile_mask` for the tiles of `t`: `table [batch, q_tiles, kv_tiles,
    stride]` (which pairs run, their per-tile mask operands, and with `compute` the
    branches of their key chunks) and the tile-local mask."""
    return tables.tile_mask(*_tile_args(t, mask, q_info, kv_info), compute)


def _tile_args(t: Tiling, mask: AbstractMask, q_info: TokenInfo, kv_info: TokenInfo):
    return mask, q_info, kv_info, t.q_padded, t.block_q, t.kv_padded, t.block_kv


def runtime_check(
    tilings: Sequence[Tiling], mask: AbstractMask, q_info: TokenInfo, kv_info: TokenInfo
) -> tuple[Array, str] | None:
    """`AbstractAttentionKernel.runtime_check` of a kernel whose calls run on
    `tilings`: the run-time checks of their `tile_mask`s, as one flag."""
    checks = [
        (t, tables.inexact_tiles(*_tile_args(t, mask, q_info, kv_info)))
        for t in tilings
    ]
    checks = [(t, flag) for t, flag in checks if flag is not None]
    if not checks:
        return None
    flag = functools.reduce(jnp.logical_or, [flag for _, flag in checks])
    t = checks[0][0]
    return flag, tables.inexact_message(mask, t.block_q, t.block_kv)


def pad_qkv(t: Tiling, q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
    return (
        tiles.pad_axis(q, 2, t.q_padded),
        tiles.pad_axis(k, 2, t.kv_padded),
        tiles.pad_axis(v, 2, t.kv_padded),
    )


def pad_rows(
    t: Tiling, q: Array, d_out: Array, lse: Array, delta: Array
) -> tuple[Array, Array, Array]:
    """The backward's query-side inputs besides `q`, padded to whole query tiles: `dO`
    in `q`'s dtype, `lse` and `delta`. A row that attended to nothing has lse -inf; the
    kernels take 0 there (see `tiles.tile_grads`)."""
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return (
        tiles.pad_axis(d_out.astype(q.dtype), 2, t.q_padded),
        tiles.pad_axis(lse, 2, t.q_padded),
        tiles.pad_axis(delta, 2, t.q_padded),
    )


def trim_grads(
    t: Tiling, dq: Array, dk: Array, dv: Array
) -> tuple[Array, Array, Array]:
    """The gradients without the padding rows."""
    return dq[:, :, : t.q_len], dk[:, :, : t.kv_len], dv[:, :, : t.kv_len]


# Matmuls of one (query, key) pair of rows per kernel: the forward's QK^T and PV; dQ
# recomputes QK^T and takes dO V^T and dS K; dK/dV recomputes QK^T and dO V^T and takes
# P^T dO and dS^T Q (so a backward of two kernels is 7 matmuls, 14 * pairs * d FLOPs); a
# fused backward computes QK^T and dO V^T once (5 matmuls).
_MATMULS = {"forward": 2, "dq": 3, "dkv": 4, "backward": 5}


def cost_estimate(
    t: Tiling, kind: Literal["forward", "dq", "dkv", "backward"], arrays: Any
) -> pl.CostEstimate:
    """What one call of a kernel costs, for XLA's scheduler (without it a custom call
    is free, and the scheduler has nothing to hide a ring hop behind): the matmul FLOPs
    of every (query, key) pair of the padded call, one `exp` per pair, and the bytes of
    its array inputs `arrays` (anything with `.shape` and `.dtype`), each read once
    (outputs and re-reads of K/V tiles are left out). Tiles the mask skips are counted:
    the estimate is the dense work, an upper bound that a static number cannot improve
    on (which tiles run is data)."""
    pairs = t.batch * t.heads * t.q_padded * t.kv_padded
    nbytes = sum(
        math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(arrays)
    )
    return pl.CostEstimate(
        flops=2 * _MATMULS[kind] * pairs * t.head_dim,
        transcendentals=pairs,
        bytes_accessed=int(nbytes),
    )


def first_order(kernel: str, step, *args):
    """`step(*args)`, a Pallas kernel's forward or backward pass: the ring's custom VJP
    differentiates it once, and differentiating it again (`jax.grad` of `jax.grad`,
    `jax.hessian`) raises an error that says what works, instead of an empty
    `NotImplementedError` from inside Pallas (`pallas_call` has no derivative; issue 45)."""
    dynamic, static = eqx.partition(args, eqx.is_array)

    @jax.custom_jvp
    def run(dynamic):
        return step(*eqx.combine(dynamic, static))

    @run.defjvp
    def _second_derivative(primals, tangents):
        raise NotImplementedError(
            f"Second derivatives through {kernel} are not supported: its forward and "
            "backward passes are Pallas kernels, which have no derivatives. First derivatives "
            "(jax.grad, jax.vjp) work with every kernel; for second derivatives "
            "(jax.grad of jax.grad, jax.hessian) pass kernel=ringeqx.XlaKernel() "
            '(or kernel="xla").'
        )

    return run(dynamic)
