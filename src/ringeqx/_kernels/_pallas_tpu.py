"""`PallasTpuKernel`: flash attention as Pallas (Mosaic TPU) kernels, forward and
backward."""

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from .._layout._tokens import TokenInfo
from .._masks._base import DENSE, MASKED
from .._util._numbers import as_int
from . import _pallas_common as common, _pallas_tiles as tiles
from ._base import AbstractAttentionKernel, Scores


_DTYPES = ("bfloat16", "float32")
# A vreg is 8 sublanes x 128 lanes: the last two dims of a block are multiples of these.
_LANES = 128
_SUBLANES = 8


def _head_dim_ok(d: int) -> bool:
    return d == 64 or (d > 0 and d % _LANES == 0)


_HEAD_DIMS = "64 or a multiple of 128"


def kv_index_map(groups: int, num_q: int, num_kv: int):
    """Index map of K, V and key records in the forward and dQ grids `(batch, head,
    query tile, key tile)`: key tile `j`, or for a skipped tile the block already
    resident (`fetch`, from `resident_blocks`), so that it is not copied again."""

    def index_map(b, h, i, j, run_ref, fetch_ref):
        return b, h // groups, fetch_ref[(b * num_q + i) * num_kv + j], 0

    return index_map


def q_index_map(groups: int, num_q: int, num_kv: int, first: int = 0):
    """Index map of Q, dO, lse and delta in the dK/dV grid `(batch, kv head, key tile,
    query head in the group, query tile)`: query tile `i` of head `j * groups + gi`, or
    for a skipped tile the block already resident; counted from query tile `first`
    (a call over some of the queries, `_QuerySplit`)."""

    def index_map(b, j, t, gi, i, run_ref, fetch_ref):
        block = fetch_ref[(b * num_kv + t) * num_q + i]
        return b, j * groups + gi, _shifted(block, first), 0

    return index_map


def _shifted(tile, first: int):
    """Query tile `tile` of a call whose first is `first` (0 but for the later calls
    over some of the queries, `_QuerySplit`)."""
    return tile + first if first else tile


def tile_plan(table: Int[Array, "batch rows steps *stride"]) -> tuple[Array, Array]:
    """`(table, fetch)` flattened to int32 for SMEM (scalar prefetch): whether each grid
    step computes and its per-tile mask operands (`tiles.tile_mask`; a table without a
    `stride` axis holds the run flags only), and which block it fetches along the
    sequential axis."""
    table = table.reshape(table.shape[:3] + (-1,))
    return table.reshape(-1), tiles.resident_blocks(table[..., 0]).reshape(-1)


def _q_records(info: TokenInfo, length: int) -> Array:
    """`[batch, 4, length, 128]`: query records broadcast along lanes, so that a tile
    `[block_q, 128]` loads as a column (the layout of JAX's TPU flash attention)."""
    rec = tiles.records(info, length)
    return jnp.broadcast_to(rec[..., None], rec.shape + (_LANES,))


def _k_records(info: TokenInfo, length: int) -> Array:
    """`[batch, 4, 8, length]`: key records broadcast along sublanes."""
    rec = tiles.records(info, length)
    return jnp.broadcast_to(rec[:, :, None], rec.shape[:2] + (_SUBLANES, length))


def _q_info(ref) -> TokenInfo:
    return tiles.token_info([ref[f, :, :1] for f in range(4)])


def _k_info(ref, cols=slice(None)) -> TokenInfo:
    return tiles.token_info([ref[f, :1, cols] for f in range(4)])


def _lanes(x: Array) -> Array:
    """`[..., 1]` -> `[..., 128]`: per-row statistics (lse, delta, the running max and
    sum) broadcast along lanes."""
    return jnp.broadcast_to(x, x.shape[:-1] + (_LANES,))


def _widen(x: Array, n: int) -> Array:
    """`[bq, 128]` per-row statistics (every lane equal) as `[bq, n]`: whole vregs
    tiled along lanes (splash attention's way), which costs no broadcast of a column;
    for `n` under 128 (head_dim 64) the first `n` lanes."""
    return jnp.tile(x, (1, n // _LANES)) if n % _LANES == 0 else x[:, :n]


def _prescaled(q_ref, scale: float) -> Array:
    """The query tile times the softmax scale, in its own dtype (splash attention's
    pre-scaled q): the logits then need no multiply over the `[bq, bk]` score tile, a
    VPU pass per tile, but one over the `[bq, d]` queries. The forward and the backward
    round the same way, so the backward's recomputed logits are the forward's."""
    return (q_ref[...].astype(jnp.float32) * scale).astype(q_ref.dtype)


def _when_runs(rebuild_mask: tiles.MaskReader, run_ref, tile, body: Callable[[bool], None]):
    """Run `body(dense)` where the tile table says tile `tile` runs: `body(False)` with
    the elementwise mask, `body(True)` where every pair attends (splash attention's
    full blocks; `XlaKernel`'s dense branch). A dense tile then costs no mask, no
    select and no non-finite guard over its `[block_q, block_kv]` scores."""
    pl.when(rebuild_mask.masked(run_ref, tile))(lambda: body(False))
    pl.when(rebuild_mask.dense(run_ref, tile))(lambda: body(True))


def _when_runs_in_pieces(rebuild_mask, run_ref, tile, k_ref, compute: int, body) -> None:
    """`body(dense, cols)` over the key tile in `k_ref`, `compute` key columns at a time
    (splash attention's `block_kv_compute`): the tile is copied in one DMA, and computed
    on in smaller pieces, whose score tiles and their siblings are that much smaller.
    A dense tile runs its pieces in one branch, unrolled, so that the scheduler overlaps
    one piece's softmax with the next one's matmuls (a branch a piece cost a v5e 12% at
    full attention); on a masked tile each piece takes its own branch from the table
    (`MaskReader.chunk`), so a wide tile on a mask's edge computes only the pieces where
    someone attends, and masks only those where not all do. Wide tiles then cost fewer
    grid steps (each about a microsecond on a v5e, whatever it computes) and no more
    work than narrow ones."""
    chunks = k_ref.shape[0] // compute
    if chunks == 1:
        _when_runs(rebuild_mask, run_ref, tile, lambda dense: body(dense, slice(None)))
        return
    pieces = [pl.ds(c * compute, compute) for c in range(chunks)]

    @pl.when(rebuild_mask.dense(run_ref, tile))
    def _():
        for cols in pieces:
            body(True, cols)

    @pl.when(rebuild_mask.masked(run_ref, tile))
    def _():
        for c, cols in enumerate(pieces):
            branch = rebuild_mask.chunk(run_ref, tile, c)
            pl.when(branch == MASKED)(lambda cols=cols: body(False, cols))
            pl.when(branch == DENSE)(lambda cols=cols: body(True, cols))


def _forward_kernel(
    run_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    num_q: int,
    num_kv: int,
    block_kv_compute: int,
):
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask:-6]
    o_ref, lse_ref, m_ref, total_ref, acc_ref, q_scaled_ref = refs[-6:]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    tile = (b * num_q + i) * num_kv + j
    mask, mod = rebuild_mask(mask_refs, run_ref, tile), rebuild_mod(mod_refs)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        q_scaled_ref[...] = _prescaled(q_ref, scale)

    def update(dense: bool, cols):
        qi, ki = _q_info(q_rec_ref), _k_info(k_rec_ref, cols)
        s, _ = tiles.logits(q_scaled_ref[...], k_ref[cols, :], qi, ki, mod, 1.0)
        # The running max and sum stay `[bq, 128]` along lanes (`_widen`).
        acc = tiles.Softmax(m_ref[...], total_ref[...], acc_ref[...])
        if dense:
            acc = acc.update(s, None, v_ref[cols, :], widen=_widen)
        else:
            s, v = tiles.nan_columns(s, v_ref[cols, :])
            acc = acc.update(s, tiles.allowed(mask, qi, ki), v, widen=_widen)
        m_ref[...] = acc.m
        total_ref[...] = acc.total
        acc_ref[...] = acc.acc

    _when_runs_in_pieces(rebuild_mask, run_ref, tile, k_ref, block_kv_compute, update)

    @pl.when(j == num_kv - 1)
    def _finish():
        out, lse = tiles.Softmax(m_ref[:, :1], total_ref[:, :1], acc_ref[...]).finish()
        o_ref[...] = out
        lse_ref[...] = _lanes(lse)


def _backward_kernel(
    run_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    num_q: int,
    num_kv: int,
    groups: int,
    block_kv_compute: int,
    carried: bool = False,
):
    """dQ, dK and dV in one pass over the tile pairs (a fused backward): each pair's
    probabilities and logit gradients are computed once, where a dQ kernel and a dK/dV
    kernel would each recompute QK^T and dO V^T (5 matmuls a pair instead of 7).

    The grid is `(batch, kv head, key tile, query head in the group, query tile)`: a
    key tile's dK and dV accumulate in VMEM over the query tiles of every head of its
    group; every query tile's dQ accumulates in a VMEM scratch of the call's rows
    (`_QuerySplit` bounds them) over the key tiles, and is written at the last one,
    into an output of the call's rows alone: a dQ output aliased across calls, beside
    dK and dV carried, made libtpu fail ("Can't deep copy instruction") or never finish
    compiling inside the ring's `cond`."""
    # With `carried`, dK and dV so far (`_QuerySplit`) come in before the outputs and
    # the accumulators start from them.
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask : len(refs) - 6 - 2 * carried]
    dk_ref, dv_ref, dq_ref, dq_acc, dk_acc, dv_acc = refs[-6:]
    b, t, i = pl.program_id(0), pl.program_id(2), pl.program_id(4)
    g = pl.program_id(3)
    tile = (b * num_kv + t) * num_q + i
    mask, mod = rebuild_mask(mask_refs, run_ref, tile), rebuild_mod(mod_refs)
    block_q = q_ref.shape[0]
    rows = pl.ds(pl.multiple_of((g * num_q + i) * block_q, block_q), block_q)

    @pl.when((g == 0) & (i == 0))
    def _init_kv():
        if carried:
            dk_acc[...], dv_acc[...] = refs[-8][...], refs[-7][...]
        else:
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    # Whether or not the first key tile runs for these queries, their dQ starts here.
    @pl.when(t == 0)
    def _init_q():
        dq_acc[rows, :] = jnp.zeros((block_q, dq_acc.shape[1]), jnp.float32)

    def grads(dense: bool, cols):
        qi, ki = _q_info(q_rec_ref), _k_info(k_rec_ref, cols)
        q, k, d_out = _prescaled(q_ref, scale), k_ref[cols, :], do_ref[...]
        lse, delta = (_widen(r[...], k.shape[0]) for r in (lse_ref, delta_ref))
        p, ds, k_finite = tiles.tile_grads(
            q, k, v_ref[cols, :], d_out, lse, delta, qi, ki, None if dense else mask, mod, 1.0
        )
        ds_low = ds.astype(q.dtype)
        dv_acc[cols, :] += tiles.matmul_tn(p.astype(d_out.dtype), d_out)
        dk_acc[cols, :] += tiles.matmul_tn(ds_low, q)
        dq_acc[rows, :] += tiles.matmul(ds_low, k_finite)

    _when_runs_in_pieces(rebuild_mask, run_ref, tile, k_ref, block_kv_compute, grads)

    @pl.when(t == num_kv - 1)
    def _finish_q():
        dq_ref[...] = dq_acc[rows, :] * scale

    @pl.when((g == groups - 1) & (i == num_q - 1))
    def _finish_kv():
        dk_ref[...] = dk_acc[...]
        dv_ref[...] = dv_acc[...]


class _Maps(NamedTuple):
    """Index maps of one grid: Q-side blocks (Q, dO, lse, delta), K/V blocks, the token
    records of both, and the query head whose modifier row a program gets."""

    q: Callable
    kv: Callable
    q_rec: Callable
    k_rec: Callable
    head: Callable


def _query_grid_maps(t: common.Tiling, first: int = 0) -> _Maps:
    """Maps of the forward and dQ grids `(batch, head, query tile, key tile)`, the
    query side's counted from query tile `first` (`_shifted`)."""
    kv_map = kv_index_map(t.groups, t.num_q, t.num_kv)

    def q_map(b, h, i, j, *_):
        return b, h, _shifted(i, first), 0

    def q_rec_map(b, h, i, j, *_):
        return b, 0, _shifted(i, first), 0

    def k_rec_map(b, h, i, j, *prefetch):
        return b, 0, 0, kv_map(b, h, i, j, *prefetch)[2]

    def head_map(b, h, i, j, *_):
        return h

    return _Maps(q_map, kv_map, q_rec_map, k_rec_map, head_map)


def _key_grid_maps(t: common.Tiling, first: int = 0) -> _Maps:
    """Maps of the dK/dV grid `(batch, kv head, key tile, query head in the group,
    query tile)`; `first` as in `_query_grid_maps`."""
    groups = t.groups
    q_map = q_index_map(groups, t.num_q, t.num_kv, first)

    def k_map(b, j, s, gi, i, *_):
        return b, j, s, 0

    def q_rec_map(b, j, s, gi, i, *prefetch):
        return b, 0, q_map(b, j, s, gi, i, *prefetch)[2], 0

    def k_rec_map(b, j, s, gi, i, *_):
        return b, 0, 0, s

    def head_map(b, j, s, gi, i, *_):
        return j * groups + gi

    return _Maps(q_map, k_map, q_rec_map, k_rec_map, head_map)


def _dq_out_map(t: common.Tiling) -> Callable:
    """Index map of dQ (the call's rows) in the backward's grid: query tile `i` of head
    `j * groups + gi` at the last key tile, where the kernel writes it; before that the
    block the last key tile starts with, so that the pipeline writes nothing back until
    it is whole."""
    groups, last = t.groups, t.num_kv - 1

    def index_map(b, j, s, gi, i, *_):
        at_last = s == last
        head = j * groups + jnp.where(at_last, gi, 0)
        return b, head, jnp.where(at_last, i, 0), 0

    return index_map


def _in_specs(
    t: common.Tiling, maps: _Maps, ops: common.Operands, backward: bool
) -> list[Any]:
    """Block specs of the inputs `(Q, K, V[, dO, lse, delta], Q records, K records,
    *mask leaves, *modifier leaves)`; the backward's per-row lse and delta are
    `[bq, 128]` (`_lanes`)."""
    q_side = pl.BlockSpec((None, None, t.block_q, t.head_dim), maps.q)
    kv_side = pl.BlockSpec((None, None, t.block_kv, t.head_dim), maps.kv)
    rows = pl.BlockSpec((None, None, t.block_q, _LANES), maps.q)
    grads = [q_side, rows, rows] if backward else []
    return [
        q_side,
        kv_side,
        kv_side,
        *grads,
        pl.BlockSpec((None, 4, t.block_q, _LANES), maps.q_rec),
        pl.BlockSpec((None, 4, _SUBLANES, t.block_kv), maps.k_rec),
        *tiles.whole_array_specs(ops.mask_leaves),
        *tiles.head_specs(ops.mod_leaves, maps.head),
    ]


# Mosaic's scoped VMEM limit by default on v5e and v5p (v6e's is 32 MiB); what a call
# whose tiles need more asks for instead (v5e, v5p and v6e compile such calls:
# `aot/test_tpu_matrix.py`); and the largest need (estimated) that is given it.
_DEFAULT_SCOPED_VMEM = 16 * 2**20
_LARGE_SCOPED_VMEM = 64 * 2**20
_MAX_SCOPED_VMEM = 56 * 2**20


def _scoped_vmem(
    t: common.Tiling,
    itemsize: int,
    carried: bool = False,
    dq_rows: int = 0,
    compute: int | None = None,
    backward: bool = True,
) -> int:
    """Bytes of VMEM the kernel (the backward, or with `backward` False the forward)
    holds for tiles `t`, from above.

    The sum of the float32 score tile and its three siblings of the backward (P, dP,
    dS); the Q, dO, K and V blocks, double-buffered; the rows (lse, delta) and the
    tokens' records across lanes; dK and dV accumulated in float32 (or dQ, whichever is
    larger); nine tenths of it, since Mosaic does not hold all of it at once: libtpu's
    figures are 75-97% of what this returns (v5e and v5p: 23.5 MiB for 1024 x 1024 tiles
    at head_dim 128, 17.2-17.7 MiB for 512 x 1024 at 256, 19.0-19.4 for 512 x 2048).
    With `carried`, dK and dV also come in (a dK/dV call after others, `_QuerySplit`):
    two more float32 blocks, double-buffered, counted whole (512 x 1024 tiles at
    head_dim 128 under `Document` took 16.42 MiB, past the default limit). The fused
    backward's dQ accumulator, `dq_rows` float32 rows of the call (`_dq_row_tiles`), and its
    output block are counted whole too. The score tiles are `compute` key columns wide
    (`block_kv_compute`; the whole tile by default)."""
    bq, bk, d = t.block_q, t.block_kv, t.head_dim
    blocks = 2 * 2 * itemsize * d * (bq + bk)
    rows = 2 * 2 * 4 * bq * _LANES
    records = 2 * 4 * 4 * (bq * _LANES + _SUBLANES * bk)
    # The forward accumulates its `[bq, d]` output (and keeps its scaled queries).
    accumulators = max(24 * bk * d, 12 * bq * d) if backward else 12 * bq * d
    carried_blocks = 2 * 2 * 4 * bk * d * carried
    dq = (4 * dq_rows * d + 2 * 4 * bq * d) if dq_rows else 0
    scores = 16 * bq * (compute or bk)
    body = int(0.9 * (scores + blocks + rows + records + accumulators))
    return body + carried_blocks + dq


# VMEM the fused backward's dQ accumulator may take: the call's query rows of every head
# of a group, float32. Longer shards run as several calls (`_QuerySplit`).
_DQ_VMEM = 16 * 2**20


def _dq_row_tiles(t: common.Tiling) -> int:
    """How many query tiles one fused backward call accumulates dQ for (at least 1)."""
    return max(1, _DQ_VMEM // (4 * t.groups * t.block_q * t.head_dim))


def _vmem_limit(
    t: common.Tiling,
    inputs,
    interpret: bool,
    carried: bool = False,
    dq_rows: int = 0,
    compute: int | None = None,
    backward: bool = True,
) -> int | None:
    """The scoped VMEM limit a call asks Mosaic for: its default (None) where the tiles
    fit it, else `_LARGE_SCOPED_VMEM`; tiles that would need more are an error (Mosaic
    refuses them only when compiling, with a message about the kernel's internals)."""
    itemsize = inputs[0].dtype.itemsize
    need = _scoped_vmem(t, itemsize, carried, dq_rows, compute, backward)
    # A quarter's margin: the fused backward's float32 kernel at head_dim 64 (512 x 1024
    # tiles) was estimated at 14.6 MiB and took 16.99 MiB on v5p.
    if interpret or need <= 0.75 * _DEFAULT_SCOPED_VMEM:
        return None
    if need > _MAX_SCOPED_VMEM:
        default = PallasTpuKernel()
        block_kv, usual_compute = default._key_tiles(backward)
        default_tiles = t._replace(block_q=default.block_q, block_kv=block_kv)
        usual = _scoped_vmem(default_tiles, itemsize, compute=usual_compute, backward=backward)
        kind = "backward" if backward else "forward"
        raise ValueError(
            f"PallasTpuKernel {kind} tiles `block_q`={t.block_q} x {t.block_kv} keys "
            f"(computed {compute or t.block_kv} at a time) at head_dim {t.head_dim} need "
            f"about {need / 2**20:.1f} MiB of VMEM; expected at most "
            f"{_MAX_SCOPED_VMEM // 2**20} MiB: choose smaller tiles (the default "
            f"{default.block_q} x {block_kv} computed {usual_compute} at a time needs "
            f"{usual / 2**20:.1f} MiB here)."
        )
    return _LARGE_SCOPED_VMEM


class _Part(NamedTuple):
    """Which queries a call covers: from query tile `first` of outputs `length` queries
    long. A call over some of them (`_QuerySplit`) writes into the outputs of the calls
    before it, `into` (none for the first), which its outputs alias."""

    first: int
    length: int
    into: tuple[Array, ...] = ()


# The kernels' names, and the grid axes (last) each accumulates over.
_KERNELS = {"forward": ("forward", 1), "backward": ("backward", 3)}


def _without_refs(kernel, start: int, count: int):
    """`kernel`, called without the `count` refs from `start` on."""

    def body(*refs):
        return kernel(*refs[:start], *refs[start + count :])

    return body


class _Call(NamedTuple):
    """One `pallas_call` of a kernel (`kind`) on tiles `t`: its two tables (`tile_plan`),
    prefetched into SMEM; its array inputs and the mask's and modifier's operands; the
    `_Part` of the queries it covers."""

    t: common.Tiling
    kind: Literal["forward", "backward"]
    plan: tuple[Array, Array]
    inputs: tuple[Array, ...]
    ops: common.Operands
    part: _Part
    interpret: bool
    block_kv_compute: int

    def __call__(
        self, kernel, grid, in_specs, out_specs, scratch, out_shape, into_spec=None, dq_rows=0
    ):
        """Run `kernel`, the last grid axes of its kind sequential ("arbitrary",
        accumulating into scratch). Its outputs alias `part.into`, which follow the
        other inputs: read through `into_spec` blocks where given (dK and dV carried),
        else left in HBM and hidden from the kernel, which writes them through its
        outputs. `dq_rows`: the fused backward's dQ accumulator rows (VMEM)."""
        name, sequential = _KERNELS[self.kind]
        into, inputs, ops = self.part.into, self.inputs, self.ops
        start = 2 + len(inputs) + len(ops.leaves)
        if into and into_spec is None:
            kernel = _without_refs(kernel, start, len(into))
        spec = into_spec or pl.BlockSpec(memory_space=pl.ANY)
        carried = bool(into) and into_spec is not None
        semantics = ("parallel",) * (len(grid) - sequential) + ("arbitrary",) * sequential
        vmem = _vmem_limit(
            self.t,
            inputs,
            self.interpret,
            carried,
            dq_rows,
            self.block_kv_compute,
            self.kind == "backward",
        )
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=grid,
                in_specs=in_specs + [spec] * len(into),
                out_specs=out_specs,
                scratch_shapes=scratch,
            ),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=semantics, vmem_limit_bytes=vmem
            ),
            interpret=self.interpret,
            name=f"ringeqx_tpu_flash_{name}",
            cost_estimate=common.cost_estimate(self.t, self.kind, inputs),
            input_output_aliases={start + n: n for n in range(len(into))},
        )(*self.plan, *inputs, *ops.leaves, *into)


def _forward_call(c: _Call) -> tuple[Array, Array]:
    """`(out [b, h, lq, d], lse [b, h, lq, 128])` of the padded inputs `(Q, K, V, Q
    records, K records)`, the queries `c.part` covers written."""
    t = c.t
    maps = _query_grid_maps(t, c.part.first)
    bq, d = t.block_q, t.head_dim
    rows = (t.batch, t.heads, c.part.length)
    kernel = functools.partial(
        _forward_kernel,
        **c.ops.kernel_args,
        num_q=t.num_q,
        num_kv=t.num_kv,
        block_kv_compute=c.block_kv_compute,
    )
    return c(
        kernel,
        grid=(t.batch, t.heads, t.num_q, t.num_kv),
        in_specs=_in_specs(t, maps, c.ops, backward=False),
        out_specs=[
            pl.BlockSpec((None, None, bq, d), maps.q),
            pl.BlockSpec((None, None, bq, _LANES), maps.q),
        ],
        scratch=[
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, _LANES), jnp.float32),
            pltpu.VMEM((bq, d), jnp.float32),
            pltpu.VMEM((bq, d), c.inputs[0].dtype),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(rows + (d,), jnp.float32),
            jax.ShapeDtypeStruct(rows + (_LANES,), jnp.float32),
        ],
    )


def _backward_call(c: _Call) -> tuple[Array, Array, Array]:
    """`(dK, dV [b, kv_heads, lk, d], dQ [b, h, rows, d])` of the padded backward inputs
    (`_backward_kernel`): each key tile's dK and dV accumulated over the queries
    `c.part` covers of every query head in its group, from the dK and dV of the calls
    before (`c.part.into`) if any; dQ of those queries' rows."""
    t = c.t
    maps = _key_grid_maps(t, c.part.first)
    kernel = functools.partial(
        _backward_kernel,
        **c.ops.kernel_args,
        num_q=t.num_q,
        num_kv=t.num_kv,
        groups=t.groups,
        block_kv_compute=c.block_kv_compute,
        carried=bool(c.part.into),
    )
    block = pl.BlockSpec((None, None, t.block_kv, t.head_dim), maps.kv)
    dq_block = pl.BlockSpec((None, None, t.block_q, t.head_dim), _dq_out_map(t))
    dq_rows = t.groups * t.q_padded
    kv_shape = (t.batch, t.kv_heads, t.kv_padded, t.head_dim)
    return c(
        kernel,
        grid=(t.batch, t.kv_heads, t.num_kv, t.groups, t.num_q),
        in_specs=_in_specs(t, maps, c.ops, backward=True),
        out_specs=[block, block, dq_block],
        scratch=[
            pltpu.VMEM((dq_rows, t.head_dim), jnp.float32),
            pltpu.VMEM((t.block_kv, t.head_dim), jnp.float32),
            pltpu.VMEM((t.block_kv, t.head_dim), jnp.float32),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(kv_shape, jnp.float32),
            jax.ShapeDtypeStruct(kv_shape, jnp.float32),
            jax.ShapeDtypeStruct((t.batch, t.heads, t.q_padded, t.head_dim), jnp.float32),
        ],
        into_spec=block,
        dq_rows=dq_rows,
    )


# SMEM the two tile tables of one call (`tile_plan`) may take. libtpu gives a kernel
# 1 MiB of SMEM on v5e, v5p and v6e, and refuses a call whose tables fill it ("Ran out of
# memory in memory space smem"): with the default 512 x 1024 tiles, at 256K tokens a
# shard (two tables of 512 x 256 int32 entries each). Half of it keeps shards up to
# about 180K tokens (batch 1, `Causal`) in one call, as before.
_TABLE_SMEM = 512 * 1024


class _QuerySplit(NamedTuple):
    """How a kernel's calls split the query tiles so that each call's tile tables fit
    in SMEM: `calls` calls over `rows` query tiles each (the last over the rest) of
    `whole`, the tiling of all of them. The tables grow with query tiles x key tiles,
    so a long shard takes more calls, each with tables of at most the same size. The
    calls read the whole inputs and write into the whole outputs, each at its own query
    tiles, so nothing is copied or padded."""

    whole: common.Tiling
    rows: int
    calls: int

    @classmethod
    def of(cls, t: common.Tiling, stride: int, most: int | None = None) -> "_QuerySplit":
        """The split of tiles `t` whose tile table holds `stride` entries a pair, into
        calls over at most `most` query tiles each (None: as many as SMEM holds)."""
        per_row = 4 * (stride + 1) * t.batch * t.num_kv  # both tables' int32 entries
        rows = _TABLE_SMEM // per_row
        if most is not None and rows > 0:
            rows = min(rows, most)
        if rows >= t.num_q:
            return cls(t, t.num_q, 1)
        if rows == 0:
            raise ValueError(
                f"PallasTpuKernel: one row of tiles' tables takes {per_row} bytes of SMEM "
                f"(batch {t.batch} x {t.num_kv} key tiles of {t.block_kv} x {stride + 1} "
                f"int32 entries); expected at most {_TABLE_SMEM}: use fewer examples a "
                f"device or a larger `block_kv`."
            )
        calls = -(-t.num_q // rows)
        return cls(t, -(-t.num_q // calls), calls)  # as even as whole tiles allow

    def run(self, table: Array, call):
        """`call(tiling, table, part)` (the call's tiling, table and `_Part`) once per
        chunk of query tiles, each call writing into the outputs of the one before.
        The calls are unrolled: a loop's carry would take a layout of its own, and
        libtpu copied the outputs in and out of it (4.8 GB more at 192K tokens a
        shard)."""
        t = self.whole
        if self.calls == 1:
            return call(t, table, _Part(0, t.q_padded))
        outputs = ()
        for first in range(0, t.num_q, self.rows):
            rows = min(self.rows, t.num_q - first)
            tc = t._replace(q_len=rows * t.block_q)
            part = _Part(first, t.q_padded, tuple(outputs))
            outputs = call(tc, table[:, first : first + rows], part)
        return outputs


def _key_tile(block_kv: int, compute: int | None, length: int) -> int:
    """The key tile for `length` keys: as few tiles as `block_kv` allows, each as short
    as whole pieces of `compute` columns (or of 128, for a tile of one piece) make it,
    so that a sequence just past a tile is not padded by a whole wide tile (5000 keys
    in tiles of 4096 computed 1024 at a time: two tiles of 3072, not of 4096)."""
    tiles_needed = -(-length // block_kv)
    per_tile = -(-length // tiles_needed)
    unit = compute if compute is not None and per_tile > compute else _LANES
    return min(block_kv, tiles.round_up(per_tile, unit))


class PallasTpuKernel(AbstractAttentionKernel):
    """Flash attention written in Pallas for TPUs (Mosaic).

    The grid runs over (batch, query head, query tile, key tile), the key tiles
    innermost and sequential, with the running max, sum and output accumulator in VMEM
    scratch. A table of which tile pairs run (the mask's block rule, computed before
    the kernel) is prefetched into SMEM, so the skip test of a tile is one scalar load;
    and the index maps of a skipped tile point at the K/V block already in VMEM (in the
    backward, the Q-side block), so a skipped tile costs no copy (splash attention's
    trick). Per-head modifier parameters (ALiBi slopes) reach each program through its
    block spec. The backward is one fused kernel over
    (batch, kv head, key tile, query head of the group, query tile): each pair of tiles'
    probabilities and logit gradients are computed once for dQ, dK and dV (5 matmuls a
    pair, where separate dQ and dK/dV kernels take 7); dK and dV accumulate over the
    last two axes (GQA without copying K/V heads), dQ in VMEM over the key tiles, for
    as many query rows as `_DQ_VMEM` holds a call (longer shards run as several calls,
    dK and dV carried). Token records travel broadcast to full vregs (queries along lanes, keys
    along sublanes), as in JAX's own TPU flash attention.

    **Arguments:**

    - `block_q`: query tile (static), a multiple of 8.
    - `block_kv`: key tile (static), a multiple of 128.
    - `interpret`: run in the Pallas interpreter (any backend; for tests on the CPU).
    - `block_kv_compute`: key columns computed at a time within a `block_kv` tile
      (static; a multiple of 128 dividing `block_kv`), or None (or at least `block_kv`)
      for the whole tile: the tile is copied in one DMA, its scores computed in smaller
      pieces, each piece on its own branch of the tile table (skipped where nobody
      attends, unmasked where all do), so a wide tile costs fewer grid steps and no
      more work.
    - `backward_block_kv`, `backward_block_kv_compute`: the same for the fused
      backward (static); `backward_block_kv=None` runs it on the forward's tiles (both
      of them). Its float32 dK and dV accumulators and four score-sized tiles make
      other tiles best there.

    Tiles (as shrunk to the sequence) whose kernels need more than Mosaic's default
    scoped VMEM (16 MiB on v5e and v5p), such as the defaults, ask Mosaic for 64 MiB;
    tiles that would need more than 56 MiB are an error when traced. At head_dims past
    128 the key tiles copied hold no more elements than the defaults' at 128 (head_dim
    256: 2048 keys forward, 1024 backward; a v5e ran 4096 there 1.5x slower).

    Supports bfloat16 and float32 and head_dim 64 or a multiple of 128, on a TPU or with
    `interpret=True`. Sequences are padded to whole tiles, the padding masked. The tile
    tables grow with query tiles x key tiles; where a shard's would overflow SMEM (1 MiB,
    about 240K tokens a shard with the default tiles), each kernel runs as several calls
    over runs of query tiles, each writing its rows of the same outputs (dK and dV
    accumulated across them), so a shard's length is bounded by HBM alone.
    `BlockSparse` (alone or combined) runs from per-tile windows of its map, prefetched
    into SMEM with the tile table (`AbstractMask.tile_local`), exact when traced where
    the records' runs (`TokenInfo.runs`, from the layout) bound every tile; elsewhere
    a tile whose window is inexact is a run-time error, never a wrong answer. Other
    masks that look a table up per token pair (a `gather`) are refused when traced. On
    a machine without a TPU the kernel still traces, so a program can be exported for
    `"tpu"` with `jax.export`; lowering it for any other platform is an error that
    names the platform.

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

    # The defaults are a v5e chip's best (benchmarks/LOG.md, issue 43): wide key
    # tiles, few grid steps; the backward's narrower, for its float32 dK/dV.
    block_q: int = eqx.field(static=True, default=1024, converter=as_int)
    block_kv: int = eqx.field(static=True, default=4096, converter=as_int)
    interpret: bool = eqx.field(static=True, default=False)
    block_kv_compute: int | None = eqx.field(static=True, default=1024)
    backward_block_kv: int | None = eqx.field(static=True, default=2048)
    backward_block_kv_compute: int | None = eqx.field(static=True, default=512)

    def tile_candidates(self) -> list[tuple[int, int]]:
        return [(256, 512), (512, 512), (512, 1024), (1024, 1024)]

    def __check_init__(self):
        for name, multiple in (("block_q", _SUBLANES), ("block_kv", _LANES)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < multiple or value % multiple != 0:
                raise ValueError(
                    f"PallasTpuKernel `{name}` must be a positive multiple of "
                    f"{multiple} (TPU vreg tiles); got {value!r}."
                )
        backward = self.backward_block_kv
        if backward is not None and (
            not isinstance(backward, int) or backward < _LANES or backward % _LANES != 0
        ):
            raise ValueError(
                f"PallasTpuKernel `backward_block_kv` must be None or a positive multiple "
                f"of {_LANES} (TPU vreg tiles); got {backward!r}."
            )
        for name, tile in (
            ("block_kv_compute", "block_kv"),
            ("backward_block_kv_compute", "backward_block_kv"),
        ):
            compute, block_kv = getattr(self, name), getattr(self, tile)
            if block_kv is None:  # the backward runs on the forward's tiles
                continue
            # At least the tile: the tile is computed whole.
            if compute is not None and (
                not isinstance(compute, int)
                or compute < _LANES
                or compute % _LANES != 0
                or (compute < block_kv and block_kv % compute != 0)
            ):
                raise ValueError(
                    f"PallasTpuKernel `{name}` must be None or a positive multiple of "
                    f"{_LANES} that divides `{tile}`={block_kv} (or is at least it); got "
                    f"{compute!r}."
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
        return frozenset({"cpu", "gpu", "tpu"} if self.interpret else {"tpu"})

    def _check(self, q, k, v, mask, score_mod) -> Array:
        """Trace-time checks; returns `q` behind the lowering-time platform check."""
        tiles.check_inputs(
            "PallasTpuKernel", q, k, v, _DTYPES, _head_dim_ok, _HEAD_DIMS
        )
        if self.interpret:
            return q
        tiles.check_lowerable(mask, score_mod, "PallasTpuKernel", "TPU", "Mosaic")
        return tiles.platform_check(q, "PallasTpuKernel", ("tpu",), "TPU", "Mosaic")

    def _key_tiles(self, backward: bool) -> tuple[int, int | None]:
        """`(block_kv, block_kv_compute)` of the forward or the backward."""
        if backward and self.backward_block_kv is not None:
            return self.backward_block_kv, self.backward_block_kv_compute
        return self.block_kv, self.block_kv_compute

    def _key_tile_cap(self, head_dim: int, backward: bool) -> int:
        """The widest key tile the kernel copies at `head_dim`: the default's width at
        head_dim 128 (4096 keys forward, 2048 backward), in elements. At head_dim 256 a
        v5e ran the forward's 4096 keys 1.5x slower than 2048 (the copies of K and V
        no longer hide behind the matmuls)."""
        widest = PallasTpuKernel()._key_tiles(backward)[0] * 128 // head_dim
        return max(_LANES, widest // _LANES * _LANES)

    def _compute(self, t: common.Tiling, backward: bool = False) -> int:
        """The key columns computed at a time in a tile of `t` (`block_kv_compute`, at
        most the tile as shrunk to the sequence)."""
        compute = self._key_tiles(backward)[1]
        if compute is None or compute >= t.block_kv or t.block_kv % compute != 0:
            return t.block_kv
        return compute

    def _tiling(self, q: Array, k: Array, backward: bool = False) -> common.Tiling:
        q_len, kv_len = q.shape[2], k.shape[2]
        block_q = min(self.block_q, tiles.round_up(q_len, _SUBLANES))
        block_kv, compute = self._key_tiles(backward)
        cap = self._key_tile_cap(q.shape[3], backward)
        if compute is not None and compute < block_kv:
            cap = max(compute, cap // compute * compute)  # whole pieces
        block_kv = min(block_kv, cap)
        return common.tiling(q, k, block_q, _key_tile(block_kv, compute, kv_len))

    def _table(self, t: common.Tiling, scores: Scores, q_info, kv_info, backward: bool):
        """The tile table of tiles `t` (with its key chunks' branches) and the operands."""
        compute = self._compute(t, backward)
        table, local = common.tile_mask(
            t, scores.mask, q_info, kv_info, compute if compute < t.block_kv else None
        )
        ops = common.operands(table, local, scores.score_mod, t.heads, scores.scale)
        return table, ops

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
        tilings = [self._tiling(q, k)] + ([self._tiling(q, k, True)] if backward else [])
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
        return common.first_order("PallasTpuKernel", self._forward, *args)

    def _forward(self, q, k, v, q_info, kv_info, scores):
        q = self._check(q, k, v, scores.mask, scores.score_mod)
        with jax.named_scope("ringeqx_pallas_tpu_forward"):
            t = self._tiling(q, k)
            table, ops = self._table(t, scores, q_info, kv_info, backward=False)
            split = _QuerySplit.of(t, table.shape[-1])
            qp, kp, vp = common.pad_qkv(t, q, k, v)
            inputs = (
                qp,
                kp,
                vp,
                _q_records(q_info, t.q_padded),
                _k_records(kv_info, t.kv_padded),
            )

            def call(tc, table_c, part):
                c = _Call(
                    tc, "forward", tile_plan(table_c), inputs, ops, part, self.interpret,
                    self._compute(t),
                )
                return _forward_call(c)

            out, lse = split.run(table, call)
            return out[:, :, : t.q_len], lse[:, :, : t.q_len, 0]

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
        return common.first_order("PallasTpuKernel", self._backward, *args)

    def _backward(self, q, k, v, lse, delta, d_out, q_info, kv_info, scores):
        q = self._check(q, k, v, scores.mask, scores.score_mod)
        with jax.named_scope("ringeqx_pallas_tpu_backward"):
            t = self._tiling(q, k, backward=True)
            table, ops = self._table(t, scores, q_info, kv_info, backward=True)
            split = _QuerySplit.of(t, table.shape[-1], _dq_row_tiles(t))
            qp, kp, vp = common.pad_qkv(t, q, k, v)
            dop, lse_p, delta_p = common.pad_rows(t, q, d_out, lse, delta)
            inputs = (
                qp,
                kp,
                vp,
                dop,
                _lanes(lse_p[..., None]),
                _lanes(delta_p[..., None]),
                _q_records(q_info, t.q_padded),
                _k_records(kv_info, t.kv_padded),
            )
            dq_parts = []

            def call(tc, table_c, part):
                # dK/dV add to dK and dV so far; dQ is this call's rows.
                plan = tile_plan(jnp.swapaxes(table_c, 1, 2))
                dk, dv, dq = _backward_call(
                    _Call(tc, "backward", plan, inputs, ops, part, self.interpret,
                          self._compute(t, backward=True))
                )
                dq_parts.append(dq)
                return dk, dv

            dk, dv = split.run(table, call)
            dq = dq_parts[0] if len(dq_parts) == 1 else jnp.concatenate(dq_parts, axis=2)
            return common.trim_grads(t, dq, dk, dv)
