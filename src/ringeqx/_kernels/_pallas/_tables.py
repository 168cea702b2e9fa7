"""The tile tables of a Pallas call: which pairs of tiles run, masked or dense, with the
mask's per-tile operands; which tiles a traced mask cannot bound; the block each skipped
step keeps resident."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from ..._layout._tokens import BlockSummary, TokenInfo
from ..._masks._base import AbstractMask, TileLocal, tile_branch
from .._tiling import tile_info
from ._leaves import kernel_leaves


def tile_mask(
    mask: AbstractMask,
    q_info: TokenInfo,
    kv_info: TokenInfo,
    q_len: int,
    block_q: int,
    kv_len: int,
    block_kv: int,
    compute: int | None = None,
) -> tuple[Int[Array, "batch q_tiles kv_tiles stride"], TileLocal]:
    """The tile table and the tile-local mask of a kernel call.

    `table[b, i, j]` holds `stride` (a power of two) int32 entries: the `tile_branch`
    of query tile `i` and key tile `j` (0 where the kernels skip the pair, 1 where it
    may have an attending pair, 2 where every pair of it attends and a kernel may leave
    the elementwise mask out), then the per-tile operands of `mask.tile_local` for
    query tile `i` and key tile `j`. Both come from the tiles' summaries of the actual
    records, so they hold for any layout. They are computed here, outside the kernels,
    for every pair at once, so that a block rule may use anything XLA can run
    (`BlockSparse` sums its block map with `cumsum`), and the kernels only read a few
    integers per tile. With `compute` (key columns a kernel computes at a time, dividing
    `block_kv`), each pair also holds the branches of its `block_kv // compute` key
    chunks, after its per-tile operands (`MaskReader.chunk`).

    Whether the tile-local form is exact (a tile's positions no further apart than the
    window of the mask a kernel gets per tile) is decided when traced wherever the
    records say where their runs of consecutive positions start (`TokenInfo.runs`, from
    the layout: `Runs.tile_extent` bounds every tile's extent, `BlockSummary.extent`):
    exact, and no check is emitted (Uniform, Boundary, Zigzag and Striped whose runs
    the tiles do not straddle, or Striped's stripes within a window of a few words); or
    a `ValueError` now, naming the mask, the tiles, the runs and tiles that fit. Only
    records without that fact (a hand-built TokenInfo, the ring's K/V halves with
    `bidirectional=True`, a Zigzag tile straddling its two chunks) are checked at run
    time: `eqx.error_if` makes the table an error rather than a wrong answer (in a ring,
    the ring makes the same check first on every device together, through
    `AbstractAttentionKernel.runtime_check`, so that no device waits alone). That is a
    host callback, which XLA compiles for real GPUs and TPUs but which a compile-only
    GPU (the CUDA plugin without a driver) cannot lower: give such programs their runs.
    """
    branch, local = _tiles(mask, q_info, kv_info, q_len, block_q, kv_len, block_kv)
    shape = branch.shape
    values, _ = kernel_leaves(local.mask)
    per_tile = [x for x, tile in zip(values, local.per_tile) if tile]
    for x in per_tile:
        if x.shape != shape:
            raise ValueError(
                f"{type(mask).__name__}.tile_local must give per-tile operands of the "
                f"tiles' shape {shape}; got shape {x.shape}."
            )
    entries = [branch, *per_tile]
    if compute is not None and compute < block_kv:
        # Each key chunk's own branch (`MaskReader.chunk`): a kernel that copies wide
        # key tiles and computes them `compute` columns at a time skips the chunks
        # nobody attends in, and leaves the mask out of those where all do.
        chunks, _ = _tiles(mask, q_info, kv_info, q_len, block_q, kv_len, compute, False)
        per = block_kv // compute
        entries += list(jnp.moveaxis(chunks.reshape(shape + (per,)), -1, 0))
    stride = 1 << (len(entries) - 1).bit_length()
    entries += [jnp.zeros(shape, jnp.int32)] * (stride - len(entries))
    table = jnp.stack(entries, axis=-1)
    if local.exact is not True:
        table = eqx.error_if(
            table, _inexact(branch, local), inexact_message(mask, block_q, block_kv)
        )
    return table, local


def inexact_tiles(
    mask: AbstractMask,
    q_info: TokenInfo,
    kv_info: TokenInfo,
    q_len: int,
    block_q: int,
    kv_len: int,
    block_kv: int,
) -> Bool[Array, ""] | None:
    """Whether some tile pair that [`tile_mask`][] runs holds positions its tile-local
    mask cannot answer exactly (the run-time check `tile_mask` makes), or None where
    that is decided when traced (exact; an inexact layout is refused then)."""
    branch, local = _tiles(mask, q_info, kv_info, q_len, block_q, kv_len, block_kv)
    return None if local.exact is True else _inexact(branch, local)


def inexact_message(mask: AbstractMask, block_q: int, block_kv: int) -> str:
    """The error of the run-time check of `tile_mask` / `inexact_tiles`."""
    return (
        f"{type(mask).__name__} cannot run exactly in a Pallas kernel with "
        f"{block_q}x{block_kv} tiles here: a query or key tile holds positions "
        "further apart than the part of the mask the kernel gets per tile (a "
        "BlockSparse map: the blocks a run of consecutive positions meets). The "
        "layout places far-apart positions in one tile (a tile straddles two runs "
        "of consecutive positions); use a layout whose runs are multiples of the "
        "tiles (Uniform, Zigzag with a length divisible by 2 x devices x tiles), a "
        "larger block_size, or XlaKernel."
    )


def _inexact(branch: Array, local: TileLocal) -> Bool[Array, ""]:
    """Whether a pair of tiles that runs (`branch` not 0) is not exact."""
    return jnp.any((branch != 0) & ~jnp.asarray(local.exact))


def _tiles(mask, q_info, kv_info, q_len, block_q, kv_len, block_kv, refuse=True):
    """The `tile_branch` of every pair of tiles (on the tiles' summaries) and the mask's
    tile-local form; refused when traced where that form is known to be inexact (unless
    not `refuse`: the branches of a tile's chunks, whose tile is checked)."""
    q_extent, kv_extent = _extent(q_info, block_q), _extent(kv_info, block_kv)
    qs, ks, q_full, k_full = _tile_summaries(
        q_info, kv_info, q_len, block_q, kv_len, block_kv, q_extent, kv_extent
    )
    shape = jnp.broadcast_shapes(q_full.shape, k_full.shape)
    q_full, k_full = (jnp.broadcast_to(x, shape) for x in (q_full, k_full))
    branch = tile_branch(mask, qs, ks, q_full, k_full)
    local = mask.tile_local(qs, ks, block_q, block_kv)
    if local.exact is False and refuse:
        fits = _fitting_tiles(mask, q_info, kv_info, block_q, block_kv)
        raise ValueError(
            f"{type(mask).__name__} cannot run exactly in a Pallas kernel with "
            f"{block_q}x{block_kv} tiles on this layout: its query tiles hold positions "
            f"up to {q_extent} apart and its key tiles up to {kv_extent} (query runs "
            f"{q_info.runs}, key runs {kv_info.runs}), more than the part of the mask a "
            "kernel gets per tile covers (a BlockSparse map: a window of a few words). "
            f"{fits}Use smaller tiles, a layout whose runs of consecutive positions are "
            "multiples of the tiles (Striped with a longer stripe; Uniform, Zigzag), a "
            "larger block_size, or XlaKernel."
        )
    return branch, local


def _extent(info: TokenInfo, block: int) -> int | None:
    """The static bound on the position extent of every `block`-slot tile of `info`'s
    last axis that its runs give (`Runs.tile_extent`), or None."""
    if info.runs is None:
        return None
    return info.runs.tile_extent(info.positions.shape[-1], block)


def _fitting_tiles(mask, q_info, kv_info, block_q: int, block_kv: int) -> str:
    """A sentence naming the largest smaller tiles (powers of two from 8, halving
    each side) on which `mask.tile_local` is not refused, or "" if none is."""
    one = jnp.zeros((), jnp.int32)
    best = None
    for bq in _halvings(block_q):
        for bk in _halvings(block_kv):
            qs = BlockSummary(*[one] * 6, jnp.ones((), bool), _extent(q_info, bq))
            ks = BlockSummary(*[one] * 6, jnp.ones((), bool), _extent(kv_info, bk))
            exact = eqx.filter_eval_shape(
                lambda m, a, b: m.tile_local(a, b, bq, bk).exact, mask, qs, ks
            )
            if exact is not False and (best is None or bq * bk > best[0] * best[1]):
                best = (bq, bk)
    if best is None:
        return ""
    return f"Tiles of {best[0]}x{best[1]} fit, if the kernel takes them. "


def _halvings(block: int) -> list[int]:
    out = [block]
    while out[-1] % 2 == 0 and out[-1] > 8:
        out.append(out[-1] // 2)
    return out


def _tile_summaries(q_info, kv_info, q_len, block_q, kv_len, block_kv, q_extent, kv_extent):
    """Summaries of every query tile `[batch, q_tiles, 1]` and key tile
    `[batch, 1, kv_tiles]`, with the extents the records' runs bound, and whether
    every token of each tile is valid (same shapes)."""

    def summaries(info, length, block, extent):
        tiled = tile_info(info, length // block, block, axis=1)
        return BlockSummary.of(tiled, axis=2, extent=extent), jnp.all(tiled.valid, axis=2)

    (qs, q_full), (ks, k_full) = (
        summaries(q_info, q_len, block_q, q_extent),
        summaries(kv_info, kv_len, block_kv, kv_extent),
    )
    qs, q_full = jax.tree.map(lambda x: x[:, :, None], (qs, q_full))
    ks, k_full = jax.tree.map(lambda x: x[:, None, :], (ks, k_full))
    return qs, ks, q_full, k_full


def resident_blocks(run: Int[Array, "*rows steps"]) -> Int[Array, "*rows steps"]:
    """Which block each step of a sequential sweep should fetch, given which steps run.

    A step that runs fetches its own block; a skipped step fetches the block already
    resident (the last one that ran, or before any ran the first that will), so the
    pipeline sees an unchanged block index and copies nothing (splash attention's trick).
    """
    steps = jnp.arange(run.shape[-1], dtype=jnp.int32)
    ran = jax.lax.cummax(jnp.where(run != 0, steps, -1), axis=run.ndim - 1)
    first = jnp.argmax(run != 0, axis=-1, keepdims=True).astype(jnp.int32)
    return jnp.where(ran >= 0, ran, first)

