"""`PallasGpuKernel`'s `pallas_call`s: the grids' block specs, the padded inputs and the
tile table a program reads its row of."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from ..._layout._tokens import TokenInfo
from .._pallas import _common as common, _leaves as leaves, _tiles as tiles
from ._bodies import dkv_kernel, dq_kernel, forward_kernel


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()



def run_table(table: Array) -> Array:
    """The tile table `[batch, rows, steps, stride]` (`tables.tile_mask`) padded along
    steps to a power of two (Triton's block shapes), the padding not run, and flattened
    to `[batch, rows, steps * stride]` (a row per program)."""
    table = tiles.pad_axis(table, 2, _pow2(table.shape[2]))
    return table.reshape(table.shape[:2] + (-1,))



def _query_grid_specs(
    t: common.Tiling, ops: common.Operands, steps: int, backward: bool
) -> list[Any]:
    """Block specs of the forward and dQ grids `(batch, head, query tile)`, for the inputs
    `(Q, K, V[, dO, lse, delta], Q records, K records, skip table, *mask leaves,
    *modifier leaves)`: a program gets its query tile, every key and value of its kv
    head (it loops over their tiles) and its query tile's row of the skip table (`steps`
    long)."""
    d, groups = t.head_dim, t.groups
    q_side = pl.BlockSpec((None, None, t.block_q, d), lambda b, h, i: (b, h, i, 0))
    kv_side = pl.BlockSpec(
        (None, None, t.kv_padded, d), lambda b, h, i: (b, h // groups, 0, 0)
    )
    rows = pl.BlockSpec((None, None, t.block_q), lambda b, h, i: (b, h, i))
    grads = [q_side, rows, rows] if backward else []
    return [
        q_side,
        kv_side,
        kv_side,
        *grads,
        pl.BlockSpec((None, 4, t.block_q), lambda b, h, i: (b, 0, i)),
        pl.BlockSpec((None, 4, t.kv_padded), lambda b, h, i: (b, 0, 0)),
        pl.BlockSpec((None, None, steps), lambda b, h, i: (b, i, 0)),
        *leaves.whole_array_specs(ops.mask_leaves),
        *leaves.head_specs(ops.mod_leaves, lambda b, h, i: h),
    ]


def _key_grid_specs(t: common.Tiling, ops: common.Operands, steps: int) -> list[Any]:
    """Block specs of the dK/dV grid `(batch, kv head, key tile)`, inputs as in
    `_query_grid_specs`: a program gets its key tile, and every query tile of the query
    heads of kv head `j`, which are `j * groups, ..., j * groups + groups - 1`: one
    block."""
    d, groups = t.head_dim, t.groups
    q_side = pl.BlockSpec((None, groups, t.q_padded, d), lambda b, j, s: (b, j, 0, 0))
    kv_side = pl.BlockSpec((None, None, t.block_kv, d), lambda b, j, s: (b, j, s, 0))
    rows = pl.BlockSpec((None, groups, t.q_padded), lambda b, j, s: (b, j, 0))
    return [
        q_side,
        kv_side,
        kv_side,
        q_side,
        rows,
        rows,
        pl.BlockSpec((None, 4, t.q_padded), lambda b, j, s: (b, 0, 0)),
        pl.BlockSpec((None, 4, t.block_kv), lambda b, j, s: (b, 0, s)),
        pl.BlockSpec((None, None, steps), lambda b, j, s: (b, s, 0)),
        *leaves.whole_array_specs(ops.mask_leaves),
        *leaves.head_specs(ops.mod_leaves, lambda b, j, s: j, rows=groups),
    ]


def backward_inputs(
    t: common.Tiling, q, k, v, d_out, lse, delta, q_info: TokenInfo, kv_info: TokenInfo
) -> tuple[Array, ...]:
    """The backward kernels' inputs `(Q, K, V, dO, lse, delta, Q records, K records)`,
    padded to the tiles of `t`."""
    qp, kp, vp = common.pad_qkv(t, q, k, v)
    dop, lse_p, delta_p = common.pad_rows(t, q, d_out, lse, delta)
    q_rec = tiles.records(q_info, t.q_padded)
    k_rec = tiles.records(kv_info, t.kv_padded)
    return qp, kp, vp, dop, lse_p, delta_p, q_rec, k_rec


def forward_call(
    t: common.Tiling, ops: common.Operands, inputs, params, interpret: bool
) -> tuple[Array, Array]:
    """`(out [b, h, lq, d], lse [b, h, lq])` of the padded inputs `(Q, K, V, Q records,
    K records, skip table)`."""
    kernel = functools.partial(
        forward_kernel, **ops.kernel_args, block_kv=t.block_kv, num_kv=t.num_kv
    )
    shape = (t.batch, t.heads, t.q_padded)
    return pl.pallas_call(
        kernel,
        grid=(t.batch, t.heads, t.num_q),
        in_specs=_query_grid_specs(t, ops, inputs[-1].shape[2], backward=False),
        out_specs=[
            pl.BlockSpec(
                (None, None, t.block_q, t.head_dim), lambda b, h, i: (b, h, i, 0)
            ),
            pl.BlockSpec((None, None, t.block_q), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*shape, t.head_dim), jnp.float32),
            jax.ShapeDtypeStruct(shape, jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="ringeqx_gpu_flash_forward",
        cost_estimate=common.cost_estimate(t, "forward", inputs),
    )(*inputs, *ops.leaves)


def dq_call(
    t: common.Tiling, ops: common.Operands, inputs, params, interpret: bool
) -> Array:
    """dQ `[b, h, lq, d]` of the padded backward inputs `(Q, K, V, dO, lse, delta, Q
    records, K records, skip table)`, on the forward's grid."""
    kernel = functools.partial(
        dq_kernel, **ops.kernel_args, block_kv=t.block_kv, num_kv=t.num_kv
    )
    block = (None, None, t.block_q, t.head_dim)
    return pl.pallas_call(
        kernel,
        grid=(t.batch, t.heads, t.num_q),
        in_specs=_query_grid_specs(t, ops, inputs[-1].shape[2], backward=True),
        out_specs=pl.BlockSpec(block, lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(
            (t.batch, t.heads, t.q_padded, t.head_dim), jnp.float32
        ),
        compiler_params=params,
        interpret=interpret,
        name="ringeqx_gpu_flash_backward_dq",
        cost_estimate=common.cost_estimate(t, "dq", inputs),
    )(*inputs, *ops.leaves)


def dkv_call(
    t: common.Tiling, ops: common.Operands, inputs, params, interpret: bool
) -> tuple[Array, Array]:
    """`(dK, dV)`, each `[b, kv_heads, lk, d]`, of the padded backward inputs (as for
    `dq_call`, the skip table transposed): one program per key tile, looping over the
    query tiles of its group's query heads."""
    kernel = functools.partial(
        dkv_kernel,
        **ops.kernel_args,
        block_q=t.block_q,
        num_q=t.num_q,
        groups=t.groups,
    )
    block = pl.BlockSpec(
        (None, None, t.block_kv, t.head_dim), lambda b, j, s: (b, j, s, 0)
    )
    shape = (t.batch, t.kv_heads, t.kv_padded, t.head_dim)
    return pl.pallas_call(
        kernel,
        grid=(t.batch, t.kv_heads, t.num_kv),
        in_specs=_key_grid_specs(t, ops, inputs[-1].shape[2]),
        out_specs=[block, block],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="ringeqx_gpu_flash_backward_dkv",
        cost_estimate=common.cost_estimate(t, "dkv", inputs),
    )(*inputs, *ops.leaves)

