"""`PallasTpuKernel`'s `pallas_call`s: the grids' index maps and block specs, the tile
tables in SMEM, the VMEM each call asks for, and the split of the queries into calls
whose tables fit in SMEM."""

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Int

from ..._layout._tokens import TokenInfo
from .._pallas import _common as common, _leaves as leaves, _tables as tables, _tiles as tiles
from ._bodies import LANES, SUBLANES, backward_kernel, forward_kernel


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
    (a call over some of the queries, `QuerySplit`)."""

    def index_map(b, j, t, gi, i, run_ref, fetch_ref):
        block = fetch_ref[(b * num_kv + t) * num_q + i]
        return b, j * groups + gi, _shifted(block, first), 0

    return index_map


def _shifted(tile, first: int):
    """Query tile `tile` of a call whose first is `first` (0 but for the later calls
    over some of the queries, `QuerySplit`)."""
    return tile + first if first else tile


def tile_plan(table: Int[Array, "batch rows steps *stride"]) -> tuple[Array, Array]:
    """`(table, fetch)` flattened to int32 for SMEM (scalar prefetch): whether each grid
    step computes and its per-tile mask operands (`tables.tile_mask`; a table without a
    `stride` axis holds the run flags only), and which block it fetches along the
    sequential axis."""
    table = table.reshape(table.shape[:3] + (-1,))
    return table.reshape(-1), tables.resident_blocks(table[..., 0]).reshape(-1)


def q_records(info: TokenInfo, length: int) -> Array:
    """`[batch, 4, length, 128]`: query records broadcast along lanes, so that a tile
    `[block_q, 128]` loads as a column (the layout of JAX's TPU flash attention)."""
    rec = tiles.records(info, length)
    return jnp.broadcast_to(rec[..., None], rec.shape + (LANES,))


def k_records(info: TokenInfo, length: int) -> Array:
    """`[batch, 4, 8, length]`: key records broadcast along sublanes."""
    rec = tiles.records(info, length)
    return jnp.broadcast_to(rec[:, :, None], rec.shape[:2] + (SUBLANES, length))



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
    `[bq, 128]` (`lanes`)."""
    q_side = pl.BlockSpec((None, None, t.block_q, t.head_dim), maps.q)
    kv_side = pl.BlockSpec((None, None, t.block_kv, t.head_dim), maps.kv)
    rows = pl.BlockSpec((None, None, t.block_q, LANES), maps.q)
    grads = [q_side, rows, rows] if backward else []
    return [
        q_side,
        kv_side,
        kv_side,
        *grads,
        pl.BlockSpec((None, 4, t.block_q, LANES), maps.q_rec),
        pl.BlockSpec((None, 4, SUBLANES, t.block_kv), maps.k_rec),
        *leaves.whole_array_specs(ops.mask_leaves),
        *leaves.head_specs(ops.mod_leaves, maps.head),
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
    With `carried`, dK and dV also come in (a dK/dV call after others, `QuerySplit`):
    two more float32 blocks, double-buffered, counted whole (512 x 1024 tiles at
    head_dim 128 under `Document` took 16.42 MiB, past the default limit). The fused
    backward's dQ accumulator, `dq_rows` float32 rows of the call (`dq_row_tiles`), and its
    output block are counted whole too. The score tiles are `compute` key columns wide
    (`block_kv_compute`; the whole tile by default)."""
    bq, bk, d = t.block_q, t.block_kv, t.head_dim
    blocks = 2 * 2 * itemsize * d * (bq + bk)
    rows = 2 * 2 * 4 * bq * LANES
    records = 2 * 4 * 4 * (bq * LANES + SUBLANES * bk)
    # The forward accumulates its `[bq, d]` output (and keeps its scaled queries).
    accumulators = max(24 * bk * d, 12 * bq * d) if backward else 12 * bq * d
    carried_blocks = 2 * 2 * 4 * bk * d * carried
    dq = (4 * dq_rows * d + 2 * 4 * bq * d) if dq_rows else 0
    scores = 16 * bq * (compute or bk)
    body = int(0.9 * (scores + blocks + rows + records + accumulators))
    return body + carried_blocks + dq


# VMEM the fused backward's dQ accumulator may take: the call's query rows of every head
# of a group, float32. Longer shards run as several calls (`QuerySplit`).
_DQ_VMEM = 16 * 2**20


def dq_row_tiles(t: common.Tiling) -> int:
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
    default_kernel: Callable[[], Any] | None = None,
) -> int | None:
    """The scoped VMEM limit a call asks Mosaic for: its default (None) where the tiles
    fit it, else `_LARGE_SCOPED_VMEM`; tiles that would need more are an error (Mosaic
    refuses them only when compiling, with a message about the kernel's internals),
    which names what the default tiles need (`default_kernel`: `PallasTpuKernel`, passed
    in because its module imports this one)."""
    itemsize = inputs[0].dtype.itemsize
    need = _scoped_vmem(t, itemsize, carried, dq_rows, compute, backward)
    # A quarter's margin: the fused backward's float32 kernel at head_dim 64 (512 x 1024
    # tiles) was estimated at 14.6 MiB and took 16.99 MiB on v5p.
    if interpret or need <= 0.75 * _DEFAULT_SCOPED_VMEM:
        return None
    if need > _MAX_SCOPED_VMEM:
        default = default_kernel()
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
    long. A call over some of them (`QuerySplit`) writes into the outputs of the calls
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


class Call(NamedTuple):
    """One `pallas_call` of a kernel (`kind`) on tiles `t`: its two tables (`tile_plan`),
    prefetched into SMEM; its array inputs and the mask's and modifier's operands; the
    `_Part` of the queries it covers; the kernel's class, for `_vmem_limit`'s error."""

    t: common.Tiling
    kind: Literal["forward", "backward"]
    plan: tuple[Array, Array]
    inputs: tuple[Array, ...]
    ops: common.Operands
    part: _Part
    interpret: bool
    block_kv_compute: int
    default_kernel: Callable[[], Any]

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
            self.default_kernel,
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


def forward_call(c: Call) -> tuple[Array, Array]:
    """`(out [b, h, lq, d], lse [b, h, lq, 128])` of the padded inputs `(Q, K, V, Q
    records, K records)`, the queries `c.part` covers written."""
    t = c.t
    maps = _query_grid_maps(t, c.part.first)
    bq, d = t.block_q, t.head_dim
    rows = (t.batch, t.heads, c.part.length)
    kernel = functools.partial(
        forward_kernel,
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
            pl.BlockSpec((None, None, bq, LANES), maps.q),
        ],
        scratch=[
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, d), jnp.float32),
            pltpu.VMEM((bq, d), c.inputs[0].dtype),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(rows + (d,), jnp.float32),
            jax.ShapeDtypeStruct(rows + (LANES,), jnp.float32),
        ],
    )


def backward_call(c: Call) -> tuple[Array, Array, Array]:
    """`(dK, dV [b, kv_heads, lk, d], dQ [b, h, rows, d])` of the padded backward inputs
    (`backward_kernel`): each key tile's dK and dV accumulated over the queries
    `c.part` covers of every query head in its group, from the dK and dV of the calls
    before (`c.part.into`) if any; dQ of those queries' rows."""
    t = c.t
    maps = _key_grid_maps(t, c.part.first)
    kernel = functools.partial(
        backward_kernel,
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


class QuerySplit(NamedTuple):
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
    def of(cls, t: common.Tiling, stride: int, most: int | None = None) -> "QuerySplit":
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

