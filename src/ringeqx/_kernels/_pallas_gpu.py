"""`PallasGpuKernel`: flash attention as Pallas (Triton) kernels, forward and
backward."""

import functools
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float

from .._layout._tokens import TokenInfo
from .._util._numbers import as_int
from . import _pallas_common as common, _pallas_tiles as tiles
from ._base import AbstractAttentionKernel, Scores


_DTYPES = ("float16", "bfloat16", "float32")

Kind = Literal["forward", "dq", "dkv"]


class _Launch(NamedTuple):
    """The tiles and Triton launch parameters of one kernel call."""

    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int


def _kinds(
    forward: _Launch, dq: _Launch, dkv: _Launch
) -> "MappingProxyType[Kind, _Launch]":
    return MappingProxyType({"forward": forward, "dq": dq, "dkv": dkv})


_L = _Launch
# The default `(block_q, block_kv, num_warps, num_stages)` per (bits of the dtype,
# head_dim) and kernel, read from ptxas on what XLA compiles for A100 (sm_80) and H100
# (sm_90) (`aot/test_gpu_matrix.py`; the sweep is in benchmarks/LOG.md). For 16 bits:
# the largest tiles with which no kernel spills on either, under the heaviest mask and
# modifier (`Causal() & Document()` with ALiBi, GQA 4:1 and 1:1) and eight other
# mask/modifier pairs; between equal areas, the one with registers to spare (at head_dim
# 256 the forward's 64 x 16 uses all 255 on A100 and spills 4 bytes in float16 under
# `SlidingWindow` with `Softcap`; 32 x 32 uses 182 at most). Eight warps throughout:
# with four most of these tiles spill or use all 255 registers, sixteen cap a thread at
# 128 and spill; ptxas reports the same registers and spills for 1, 2 and 3 stages. In
# dK/dV `block_kv` is the tile a program holds (two float32 accumulators of it) and
# `block_q` the one it loops over; A100 spills there with key tiles above 32 at head_dim
# 64. Head dims below 64 take 64's row.
_TUNED = MappingProxyType(
    {
        (16, 64): _kinds(_L(128, 32, 8, 2), _L(128, 32, 8, 2), _L(64, 32, 8, 2)),
        (16, 128): _kinds(_L(64, 64, 8, 2), _L(64, 32, 8, 2), _L(32, 64, 8, 2)),
        (16, 256): _kinds(_L(32, 32, 8, 2), _L(32, 32, 8, 2), _L(16, 32, 8, 2)),
        # float32: the tiles that spill least of those tried. dK/dV still spills: up to
        # 3.3 KB at head_dim 256 (every tile tried spills there; 32 x 16 spills 500
        # bytes under the heavy mask but 10 KB under plain Causal), and up to 108 bytes
        # at 64 and 128.
        (32, 64): _kinds(_L(64, 32, 8, 2), _L(32, 64, 8, 2), _L(64, 32, 8, 2)),
        (32, 128): _kinds(_L(64, 32, 8, 2), _L(32, 64, 8, 2), _L(32, 32, 8, 2)),
        (32, 256): _kinds(_L(32, 32, 8, 2), _L(32, 32, 8, 2), _L(16, 16, 8, 2)),
    }
)
# Tiles for `tune_block_sizes` to try: the tuned ones.
_CANDIDATES = sorted(
    {(x.block_q, x.block_kv) for kinds in _TUNED.values() for x in kinds.values()}
)


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def _head_dim_ok(d: int) -> bool:
    return _power_of_two(d) and 16 <= d <= 256


_HEAD_DIMS = "a power of two from 16 to 256"


def _block(block: int, length: int) -> int:
    """The tile actually used: `block`, or the smallest power of two (>= 16, Triton's
    smallest matmul) covering a shorter sequence."""
    return min(block, max(16, 1 << (length - 1).bit_length()))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# Each record row is loaded from its ref on its own: slicing a loaded `[4, block]` value
# would be a `slice`, which Triton's lowering does not have.
def _q_info(ref, rows=slice(None)) -> TokenInfo:
    return tiles.token_info([ref[f, rows][:, None] for f in range(4)])


def _k_info(ref, cols=slice(None)) -> TokenInfo:
    return tiles.token_info([ref[f, cols][None, :] for f in range(4)])


def _run_table(table: Array) -> Array:
    """The tile table `[batch, rows, steps, stride]` (`tiles.tile_mask`) padded along
    steps to a power of two (Triton's block shapes), the padding not run, and flattened
    to `[batch, rows, steps * stride]` (a row per program)."""
    table = tiles.pad_axis(table, 2, _pow2(table.shape[2]))
    return table.reshape(table.shape[:2] + (-1,))


def _forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    q_rec_ref,
    k_rec_ref,
    run_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    block_kv: int,
    num_kv: int,
):
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask:-2]
    o_ref, lse_ref = refs[-2:]
    score_mod = rebuild_mod(mod_refs)
    q = q_ref[...]
    qi = _q_info(q_rec_ref)

    def body(j, acc):
        kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        ki = _k_info(k_rec_ref, kv)

        def update(acc):
            mask = rebuild_mask(mask_refs, run_ref, j)
            s, _ = tiles.logits(q, k_ref[kv, :], qi, ki, score_mod, scale)
            s, v = tiles.nan_columns(s, v_ref[kv, :])
            return acc.update(s, tiles.allowed(mask, qi, ki), v)

        return jax.lax.cond(rebuild_mask.runs(run_ref, j), update, lambda acc: acc, acc)

    init = tiles.Softmax.init(q.shape[0], q.shape[1])
    out, lse = jax.lax.fori_loop(0, num_kv, body, init).finish()
    o_ref[...] = out
    lse_ref[...] = lse[:, 0]


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    run_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    block_kv: int,
    num_kv: int,
):
    mask_refs, mod_refs, dq_ref = refs[:num_mask], refs[num_mask:-1], refs[-1]
    score_mod = rebuild_mod(mod_refs)
    q, d_out = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    qi = _q_info(q_rec_ref)

    def body(j, dq):
        kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        ki = _k_info(k_rec_ref, kv)

        def grads(dq):
            mask = rebuild_mask(mask_refs, run_ref, j)
            k = k_ref[kv, :]
            _, ds, k_finite = tiles.tile_grads(
                q, k, v_ref[kv, :], d_out, lse, delta, qi, ki, mask, score_mod, scale
            )
            return dq + tiles.matmul(ds.astype(k.dtype), k_finite)

        return jax.lax.cond(rebuild_mask.runs(run_ref, j), grads, lambda dq: dq, dq)

    dq_ref[...] = jax.lax.fori_loop(0, num_kv, body, jnp.zeros(q.shape, jnp.float32))


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    run_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    block_q: int,
    num_q: int,
    groups: int,
):
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask:-2]
    dk_ref, dv_ref = refs[-2:]
    k, v = k_ref[...], v_ref[...]
    ki = _k_info(k_rec_ref)

    def body(t, carry):
        # One loop over (query head of this kv head's group, query tile).
        # lax's div/rem of nonnegative ints: jnp's floor division lowers to a `rem`
        # of mixed int and bool operands, which Triton's lowering rejects.
        g, i = jax.lax.div(t, num_q), jax.lax.rem(t, num_q)
        qb = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        qi = _q_info(q_rec_ref, qb)

        def grads(carry):
            dk, dv = carry
            # The refs hold the modifier rows of this kv head's `groups` query heads.
            mod = rebuild_mod(mod_refs, g)
            mask = rebuild_mask(mask_refs, run_ref, i)
            q, d_out = q_ref[g, qb, :], do_ref[g, qb, :]
            lse, delta = lse_ref[g, qb][:, None], delta_ref[g, qb][:, None]
            p, ds, _ = tiles.tile_grads(
                q, k, v, d_out, lse, delta, qi, ki, mask, mod, scale
            )
            dv = dv + tiles.matmul_tn(p.astype(d_out.dtype), d_out)
            dk = dk + tiles.matmul_tn(ds.astype(q.dtype), q)
            return dk, dv

        return jax.lax.cond(rebuild_mask.runs(run_ref, i), grads, lambda c: c, carry)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, groups * num_q, body, (zero, zero))
    dk_ref[...] = dk
    dv_ref[...] = dv


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
        *tiles.whole_array_specs(ops.mask_leaves),
        *tiles.head_specs(ops.mod_leaves, lambda b, h, i: h),
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
        *tiles.whole_array_specs(ops.mask_leaves),
        *tiles.head_specs(ops.mod_leaves, lambda b, j, s: j, rows=groups),
    ]


def _backward_inputs(
    t: common.Tiling, q, k, v, d_out, lse, delta, q_info: TokenInfo, kv_info: TokenInfo
) -> tuple[Array, ...]:
    """The backward kernels' inputs `(Q, K, V, dO, lse, delta, Q records, K records)`,
    padded to the tiles of `t`."""
    qp, kp, vp = common.pad_qkv(t, q, k, v)
    dop, lse_p, delta_p = common.pad_rows(t, q, d_out, lse, delta)
    q_rec = tiles.records(q_info, t.q_padded)
    k_rec = tiles.records(kv_info, t.kv_padded)
    return qp, kp, vp, dop, lse_p, delta_p, q_rec, k_rec


def _forward_call(
    t: common.Tiling, ops: common.Operands, inputs, params, interpret: bool
) -> tuple[Array, Array]:
    """`(out [b, h, lq, d], lse [b, h, lq])` of the padded inputs `(Q, K, V, Q records,
    K records, skip table)`."""
    kernel = functools.partial(
        _forward_kernel, **ops.kernel_args, block_kv=t.block_kv, num_kv=t.num_kv
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


def _dq_call(
    t: common.Tiling, ops: common.Operands, inputs, params, interpret: bool
) -> Array:
    """dQ `[b, h, lq, d]` of the padded backward inputs `(Q, K, V, dO, lse, delta, Q
    records, K records, skip table)`, on the forward's grid."""
    kernel = functools.partial(
        _dq_kernel, **ops.kernel_args, block_kv=t.block_kv, num_kv=t.num_kv
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


def _dkv_call(
    t: common.Tiling, ops: common.Operands, inputs, params, interpret: bool
) -> tuple[Array, Array]:
    """`(dK, dV)`, each `[b, kv_heads, lk, d]`, of the padded backward inputs (as for
    `_dq_call`, the skip table transposed): one program per key tile, looping over the
    query tiles of its group's query heads."""
    kernel = functools.partial(
        _dkv_kernel,
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


class PallasGpuKernel(AbstractAttentionKernel):
    """Flash attention written in Pallas for GPUs (Triton).

    The forward runs one program per (batch, query head, query tile) and loops over the
    key tiles, keeping the running max, sum and output in registers. The backward is the
    usual split: a dK/dV kernel with one program per (batch, key/value head, key tile)
    that loops over the query tiles of every query head in its GQA group (so K/V heads
    are never copied and dK/dV need no reduction afterwards), and a dQ kernel shaped
    like the forward. All three read the token records of their tiles, apply the mask's
    elementwise rule and the score modifier on the loaded values, and skip tiles that
    the mask's block rule rules out (a table of which tile pairs run, computed before
    the kernels). Per-head modifier parameters (ALiBi slopes) reach each program through
    its block spec.

    `BlockSparse` (alone or combined) runs from per-tile windows of its map, read from
    each program's row of the tile table (`AbstractMask.tile_local`); a layout that
    puts positions too far apart in one tile for that window is a run-time error,
    never a wrong answer. Other masks that look a table up per token pair (a `gather`)
    are refused when traced. On a machine without a GPU the kernel still traces, so a
    program can be exported for `"cuda"` with `jax.export`; lowering it for any other
    platform is an error that names the platform.

    **Tiles.** A Triton program keeps its tiles in registers, and one that does not fit
    spills them to local memory (through L1/L2). By default (fields left None)
    each kernel takes its tiles and warps from a table by dtype and head_dim, measured
    with `ptxas` on what XLA compiles for A100 (sm_80) and H100 (sm_90)
    (`aot/test_gpu_matrix.py`): for bfloat16 and float16 the largest tiles tried with
    which no kernel spills a register on either, under the heaviest mask and modifier
    (`Causal() & Document()` with ALiBi, GQA 4:1 and 1:1) and eight other pairs, with
    registers to spare where two tiles tie. `block_q x block_kv`, all with 8 warps and
    2 stages:

    | dtype | head_dim | forward | dQ | dK/dV |
    |---|---|---|---|---|
    | 16-bit | <= 64 | 128 x 32 | 128 x 32 | 64 x 32 |
    | 16-bit | 128 | 64 x 64 | 64 x 32 | 32 x 64 |
    | 16-bit | 256 | 32 x 32 | 32 x 32 | 16 x 32 |
    | float32 | <= 64 | 64 x 32 | 32 x 64 | 64 x 32 |
    | float32 | 128 | 64 x 32 | 32 x 64 | 32 x 32 |
    | float32 | 256 | 32 x 32 | 32 x 32 | 16 x 16 |

    float32 takes the tiles that spill least of those tried; its dK/dV still spills,
    up to 3.3 KB at head_dim 256 (with every tile tried) and 108 bytes below.

    The dK/dV program holds its key tile (`block_kv`, with two float32 accumulators of
    it) and loops over query tiles; the forward and dQ programs hold a query tile. A
    field that is set is used for all three kernels, the others still come from the
    table: `PallasGpuKernel(block_q=64, block_kv=64)` keeps the table's warps.
    `launch(kind, dtype, head_dim)` says what a kernel will use.

    **Arguments:**

    - `block_q`, `block_kv`: tile sizes (static), powers of two >= 16, or None (the
        table). Sequences are padded to whole tiles, the padding masked; a tile longer
        than a sequence shrinks to it.
    - `num_warps`, `num_stages`: Triton launch parameters, or None (the table).
    - `interpret`: run in the Pallas interpreter (any backend; for tests on the CPU).

    Supports float16, bfloat16 and float32 and head_dim a power of two from 16 to 256,
    on a GPU or with `interpret=True`.

    ??? cite "Flash Attention 2"

        ```bibtex
        @article{dao2023flashattention2,
          title={FlashAttention-2: Faster Attention with Better Parallelism and Work
                 Partitioning},
          author={Dao, Tri},
          journal={arXiv:2307.08691},
          year={2023}
        }
        ```
    """

    # None is the tuned table; the base declares `int`, which these widen.
    block_q: int | None = eqx.field(static=True, default=None, converter=as_int)  # pyright: ignore
    block_kv: int | None = eqx.field(static=True, default=None, converter=as_int)  # pyright: ignore
    num_warps: int | None = eqx.field(static=True, default=None, converter=as_int)
    num_stages: int | None = eqx.field(static=True, default=None, converter=as_int)
    interpret: bool = eqx.field(static=True, default=False)

    def tile_candidates(self) -> list[tuple[int, int]]:
        # A Triton program holds its score tile in registers: small tiles (the tuned
        # ones, see `_TUNED`).
        return list(_CANDIDATES)

    def tiles(self, dtype: Any, head_dim: int) -> tuple[int, int]:
        return self.launch("forward", dtype, head_dim)[:2]

    def __check_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or value < 16 or not _power_of_two(value):
                raise ValueError(
                    f"PallasGpuKernel `{name}` must be a power of two >= 16 (Triton "
                    f"tiles); got {value!r}."
                )

    def unsupported_head_dim(self, head_dim: int) -> str | None:
        """None where the kernel takes heads `head_dim` wide; else a description of the
        head dims it does take, for a planner to refuse before it plans."""
        return None if _head_dim_ok(head_dim) else _HEAD_DIMS

    def unsupported_dtype(self, dtype: str) -> str | None:
        """None where the kernel takes q/k/v of `dtype` (a name); else the dtypes it
        takes, for a planner to refuse before it compiles."""
        return None if dtype in _DTYPES else ", ".join(_DTYPES)

    def devices(self) -> frozenset[str]:
        return frozenset({"cpu", "gpu", "tpu"} if self.interpret else {"gpu"})

    def _check(self, q, k, v, mask, score_mod) -> Array:
        """Trace-time checks; returns `q` behind the lowering-time platform check."""
        tiles.check_inputs(
            "PallasGpuKernel",
            q,
            k,
            v,
            _DTYPES,
            _head_dim_ok,
            _HEAD_DIMS,
        )
        if self.interpret:
            return q
        tiles.check_lowerable(mask, score_mod, "PallasGpuKernel", "GPU", "Triton")
        return tiles.platform_check(
            q, "PallasGpuKernel", ("cuda", "rocm"), "GPU", "Triton"
        )

    def launch(self, kind: Kind, dtype: Any, head_dim: int) -> tuple[int, int, int, int]:
        """`(block_q, block_kv, num_warps, num_stages)` of the `kind` kernel
        (`"forward"`, `"dq"` or `"dkv"`) on inputs of `dtype` and `head_dim`: this
        kernel's fields, each None taken from the tuned table (tiles then shrink to a
        shorter sequence). `dtype` is float16, bfloat16 or float32."""
        bits = 8 * jnp.dtype(dtype).itemsize
        # Head dims below 64 hold less per thread than 64 does: its tiles fit them too.
        tuned = _TUNED[bits, max(head_dim, 64)][kind]
        mine = (self.block_q, self.block_kv, self.num_warps, self.num_stages)
        block_q, block_kv, warps, stages = (
            t if m is None else m for m, t in zip(mine, tuned)
        )
        return block_q, block_kv, warps, stages

    def _launch(self, kind: Kind, q: Array, k: Array) -> tuple[common.Tiling, Any]:
        """The tiling (tiles shrunk to short sequences) and the Triton parameters of
        the `kind` kernel on `q` and `k`."""
        block_q, block_kv, warps, stages = self.launch(kind, q.dtype, q.shape[-1])
        t = common.tiling(
            q, k, _block(block_q, q.shape[2]), _block(block_kv, k.shape[2])
        )
        return t, plgpu.CompilerParams(num_warps=warps, num_stages=stages)

    def runtime_check(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
        *,
        backward: bool,
    ) -> tuple[Bool[Array, ""], str] | None:
        kinds: tuple[Kind, ...] = ("dq", "dkv") if backward else ("forward",)
        tilings = [self._launch(kind, q, k)[0] for kind in kinds]
        return common.runtime_check(tilings, scores.mask, q_info, kv_info)

    def forward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"], Float[Array, "batch heads q_len"]
    ]:
        args = (q, k, v, q_info, kv_info, scores)
        return common.first_order("PallasGpuKernel", self._forward, *args)

    def _forward(self, q, k, v, q_info, kv_info, scores):
        mask, score_mod, scale = scores.mask, scores.score_mod, scores.scale
        q = self._check(q, k, v, mask, score_mod)
        with jax.named_scope("ringeqx_pallas_gpu_forward"):
            t, params = self._launch("forward", q, k)
            table, local = common.tile_mask(t, mask, q_info, kv_info)
            ops = common.operands(table, local, score_mod, t.heads, scale)
            run = _run_table(table)
            inputs = (
                *common.pad_qkv(t, q, k, v),
                tiles.records(q_info, t.q_padded),
                tiles.records(kv_info, t.kv_padded),
                run,
            )
            out, lse = _forward_call(t, ops, inputs, params, self.interpret)
            return out[:, :, : t.q_len], lse[:, :, : t.q_len]

    def backward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        lse: Float[Array, "batch heads q_len"],
        delta: Float[Array, "batch heads q_len"],
        d_out: Float[Array, "batch heads q_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
    ]:
        args = (q, k, v, lse, delta, d_out, q_info, kv_info, scores)
        return common.first_order("PallasGpuKernel", self._backward, *args)

    def _backward(self, q, k, v, lse, delta, d_out, q_info, kv_info, scores):
        mask, score_mod, scale = scores.mask, scores.score_mod, scores.scale
        q = self._check(q, k, v, mask, score_mod)
        with jax.named_scope("ringeqx_pallas_gpu_backward"):
            # dQ and dK/dV each run on their own tiles (the dK/dV program holds two
            # accumulators of its key tile), so each pads the inputs to its tiles and
            # reads its own tile table.
            t, params = self._launch("dq", q, k)
            table, local = common.tile_mask(t, mask, q_info, kv_info)
            ops = common.operands(table, local, score_mod, t.heads, scale)
            inputs = _backward_inputs(t, q, k, v, d_out, lse, delta, q_info, kv_info)
            dq = _dq_call(t, ops, (*inputs, _run_table(table)), params, self.interpret)
            t, params = self._launch("dkv", q, k)
            table, local = common.tile_mask(t, mask, q_info, kv_info)
            ops = common.operands(table, local, score_mod, t.heads, scale)
            inputs = _backward_inputs(t, q, k, v, d_out, lse, delta, q_info, kv_info)
            run = _run_table(jnp.swapaxes(table, 1, 2))
            dk, dv = _dkv_call(t, ops, (*inputs, run), params, self.interpret)
            return common.trim_grads(t, dq, dk, dv)
