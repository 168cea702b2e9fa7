"""The tile maths and the input plumbing that both Pallas kernels share.

A Pallas program sees one `[block_q, head_dim]` tile of one query head and walks the key
tiles. Everything here acts on values already loaded from refs, so the Triton kernel
(`_pallas_gpu.py`) and the Mosaic kernel (`_pallas_tpu.py`) differ only in how they lay
out the grid, load tiles and keep their accumulators. The dense reference for all of it
is `XlaKernel` (`_xla.py`), which the contract tests compare against. Padding, token
record tiling and the online softmax, which `XlaKernel` and `schedule` share, live in
`_tiling.py` (no Pallas import) and are re-exported here.
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array, Bool, Int

from .._layout._tokens import BlockSummary, TokenInfo
from .._masks._base import DENSE, MASKED, AbstractMask, TileLocal, tile_branch
from .._score_mods import AbstractScoreMod
from ._tiling import (
    RECORD_FIELDS as RECORD_FIELDS,
    Softmax as Softmax,
    matmul as matmul,
    pad_axis as pad_axis,
    pad_info,
    tile_info,
)


# `(((1,), (1,)), ((), ()))`: contract the last axes of both, i.e. `a @ b.T`.
_NT = (((1,), (1,)), ((), ()))
# `a.T @ b`.
_TN = (((0,), (0,)), ((), ()))


def round_up(x: int, multiple: int) -> int:
    return multiple * math.ceil(x / multiple)


def records(info: TokenInfo, length: int) -> Int[Array, "batch 4 length"]:
    """Stack a `[batch, len]` TokenInfo into one int32 array `[batch, 4, length]`,
    padded with invalid slots (one kernel input instead of four)."""
    padded = pad_info(info, length)
    rows = [getattr(padded, name).astype(jnp.int32) for name in RECORD_FIELDS]
    return jnp.stack(rows, axis=1)


def token_info(rows: Sequence[Array]) -> TokenInfo:
    """Rebuild a TokenInfo from four loaded record rows (any common shape)."""
    positions, segments, spans, valid = rows
    return TokenInfo(positions, segments, spans, valid != 0)


# An identity on one kernel input whose *lowering* checks the platform. Which platform a
# program is for is only known when it is lowered (`jax.export` lowers for "cuda" or "tpu"
# on a CPU-only machine; `jit` lowers for the default backend), so a check at trace time
# (`jax.default_backend()`) would refuse programs that are never meant to run here.
_platform_check_p = jax.extend.core.Primitive("ringeqx_platform_check")


@functools.cache
def _platform_check_jit(**params):
    return jax.jit(functools.partial(_platform_check_p.bind, **params))


# Applied eagerly, it still lowers (for the default backend), so the check runs there too.
_platform_check_p.def_impl(lambda x, **params: _platform_check_jit(**params)(x))
_platform_check_p.def_abstract_eval(lambda x, **_: x)
ad.deflinear2(_platform_check_p, lambda ct, x, **_: [ct])
batching.defvectorized(_platform_check_p)


def _platform_check_lowering(ctx, x, *, kernel_name, platforms, device, compiler):
    lowering = tuple(ctx.module_context.platforms)
    wrong = [p for p in lowering if p not in platforms]
    if wrong:
        raise ValueError(
            f"{kernel_name}(interpret=False) compiles with {compiler} and needs a "
            f"{device}; this program is being lowered for platform {wrong[0]!r}. Pass "
            "interpret=True to run it in the Pallas interpreter, or use XlaKernel."
        )
    return [x]


mlir.register_lowering(_platform_check_p, _platform_check_lowering)


def platform_check(
    x: Array, kernel_name: str, platforms: tuple[str, ...], device: str, compiler: str
) -> Array:
    """`x`, unchanged; lowering it for a platform outside `platforms` (the JAX platform
    names the kernel compiles for) is a clear error naming the kernel and `device`."""
    return _platform_check_p.bind(
        x,
        kernel_name=kernel_name,
        platforms=platforms,
        device=device,
        compiler=compiler,
    )


def check_inputs(
    kernel_name: str,
    q: Array,
    k: Array,
    v: Array,
    dtypes: tuple[str, ...],
    head_dim_ok: Callable[[int], bool],
    head_dim_rule: str,
) -> None:
    """Trace-time checks of what a Pallas kernel can run on its device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in dtypes:
            raise TypeError(
                f"{kernel_name} does not support dtype {jnp.dtype(x.dtype).name} for "
                f"`{name}`; supported dtypes: {', '.join(dtypes)}."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{kernel_name} needs q, k and v of one dtype; got {q.dtype}, {k.dtype} "
            f"and {v.dtype}."
        )
    head_dim = q.shape[-1]
    if not head_dim_ok(head_dim):
        raise ValueError(
            f"head_dim={head_dim} is not supported by {kernel_name}, which needs "
            f"{head_dim_rule}."
        )


def _kernel_leaves(tree: Any) -> tuple[list[Array], Callable[[Sequence[Array]], Any]]:
    """Split a pytree into array leaves (booleans as int32: Triton and Mosaic load no
    boolean refs) and a function that rebuilds it from loaded leaves."""
    dynamic, static = eqx.partition(tree, eqx.is_array)
    values, treedef = jax.tree.flatten(dynamic)
    dtypes = [jnp.asarray(x).dtype for x in values]
    leaves = [
        jnp.asarray(x, jnp.int32 if d == jnp.bool_ else d) for x, d in zip(values, dtypes)
    ]

    def rebuild(loaded: Sequence[Array]) -> Any:
        loaded = [x.astype(d) for x, d in zip(loaded, dtypes)]
        return eqx.combine(jax.tree.unflatten(treedef, loaded), static)

    return leaves, rebuild


class MaskReader:
    """How a kernel body gets back the tile-local mask (`AbstractMask.tile_local`):
    its whole-array leaves from their refs, its per-tile operands from the tile table.

    The table (`tile_mask`) holds `stride` int32 entries per pair of tiles: whether the
    pair runs, then the pair's per-tile operands. A kernel passes the ref of the table
    (or of its row) and the pair's index in it."""

    def __init__(self, local: TileLocal, stride: int):
        values, self._rebuild = _kernel_leaves(local.mask)
        self._shapes = [x.shape for x in values]
        self._per_tile = local.per_tile
        self.stride = stride
        # Where the pair's chunk branches start (`tile_mask`'s `compute`).
        self._chunks_at = 1 + sum(1 for tile in local.per_tile if tile)
        # Whole leaves, at least 1-D (Triton and Mosaic load no 0-d refs).
        self.leaves = [
            jnp.atleast_1d(x) for x, tile in zip(values, local.per_tile) if not tile
        ]

    def runs(self, table_ref: Any, tile: Any) -> Array:
        """Whether the pair of tiles `tile` runs."""
        return table_ref[tile * self.stride] != 0

    def masked(self, table_ref: Any, tile: Any) -> Array:
        """Whether the pair of tiles `tile` runs with the elementwise mask."""
        return table_ref[tile * self.stride] == MASKED

    def dense(self, table_ref: Any, tile: Any) -> Array:
        """Whether the pair of tiles `tile` runs and every pair of its tokens attends."""
        return table_ref[tile * self.stride] == DENSE

    def chunk(self, table_ref: Any, tile: Any, c: int) -> Array:
        """The branch (0, `MASKED` or `DENSE`) of key chunk `c` of the pair of tiles
        `tile`, in a table made with chunks (`tile_mask`'s `compute`)."""
        return table_ref[tile * self.stride + self._chunks_at + c]

    def __call__(self, refs: Sequence[Any], table_ref: Any, tile: Any) -> AbstractMask:
        """The mask for the pair of tiles `tile`, from the whole leaves' `refs`."""
        whole, n, loaded = iter(refs), 0, []
        for shape, per_tile in zip(self._shapes, self._per_tile):
            if per_tile:
                n += 1
                loaded.append(table_ref[tile * self.stride + n])
            else:
                loaded.append(next(whole)[...].reshape(shape))
        return self._rebuild(loaded)


def mask_operands(local: TileLocal, stride: int) -> tuple[list[Array], MaskReader]:
    """The whole-array leaves of a tile-local mask (a prefix length) as whole-array
    kernel inputs: a kernel body may not close over traced arrays. Its per-tile
    operands travel in the tile table (`tile_mask`).

    **Returns:** `(leaves, rebuild)`: the kernel inputs, and the `MaskReader` that
    gives back the mask inside the kernel.
    """
    reader = MaskReader(local, stride)
    return reader.leaves, reader


def head_operands(
    score_mod: AbstractScoreMod | None, heads: int
) -> tuple[list[Array], Callable[..., AbstractScoreMod | None]]:
    """The score modifier of every query head, as kernel inputs with a leading heads axis.

    `score_mod.for_head` runs here, outside the kernel, for all heads at once (`vmap`):
    each leaf becomes `[heads, 1, 1, *shape]`, and a block spec hands a program its own
    head's row. The kernel then never slices per-head parameters (ALiBi slopes) by a
    traced head index, which neither Triton nor Mosaic lowers (`dynamic_slice`).

    **Returns:** `(leaves, rebuild)`: the kernel inputs, and a function of their refs,
    `rebuild(refs, group=None)`, that gives back the one-head modifier; with `group`,
    each ref holds the rows of several heads and row `group` is used.
    """
    if score_mod is None:
        return [], lambda refs, group=None: None
    per_head = jax.vmap(score_mod.for_head)(jnp.arange(heads, dtype=jnp.int32))
    values, rebuild = _kernel_leaves(per_head)
    shapes = [x.shape[1:] for x in values]
    # Two unit axes after heads: Mosaic wants a block's last two dims whole.
    leaves = [x.reshape((heads, 1, 1) + x.shape[1:]) for x in values]

    def from_refs(refs: Sequence[Any], group=None) -> AbstractScoreMod:
        rows = [r[...] if group is None else r[group] for r in refs]
        return rebuild([x.reshape(s) for x, s in zip(rows, shapes)])

    return leaves, from_refs


def whole_array_specs(leaves: Sequence[Array]) -> list[Any]:
    """Block specs that hand each leaf to every program whole."""
    return [pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in leaves]


def head_specs(
    leaves: Sequence[Array], head: Callable[..., Any], rows: int | None = None
) -> list[Any]:
    """Block specs that hand a program the rows of `head_operands` leaves for head
    `head(*grid_indices)` (one row, squeezed), or `rows` consecutive rows from block
    `head(...)` on."""
    return [
        pl.BlockSpec(
            (rows, *x.shape[1:]),
            lambda *idx, n=x.ndim: (head(*idx),) + (0,) * (n - 1),
        )
        for x in leaves
    ]


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
    values, _ = _kernel_leaves(local.mask)
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


# Primitives that neither Triton's nor Mosaic's lowering has for tile values.
_UNLOWERABLE = ("gather", "cumsum", "cummax", "cumprod", "cumlogsumexp", "sort")


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def check_lowerable(
    mask: AbstractMask,
    score_mod: AbstractScoreMod | None,
    kernel_name: str,
    device: str,
    compiler: str,
) -> None:
    """Trace-time check that the mask's elementwise rule and the modifier, as a kernel
    evaluates them on a tile, use no primitive that `compiler` cannot lower.

    The rule traced is the mask's tile-local form (`AbstractMask.tile_local`), as a
    kernel gets it: a mask that looks a table up per token pair (a `gather`) lowers
    only if its `tile_local` hands the kernel per-tile entries instead, as
    `BlockSparse` does. Tracing the rule once on a small tile finds that here, with a
    message that names the feature, instead of deep inside the lowering.
    """
    qi = token_info([jnp.zeros((8, 1), jnp.int32)] * 4)
    ki = token_info([jnp.zeros((1, 128), jnp.int32)] * 4)
    one_tile = BlockSummary(*[jnp.zeros((), jnp.int32)] * 6, jnp.ones((), bool))
    # Abstract leaves: the tile-local form's own table lookups run outside kernels.
    local = eqx.filter_eval_shape(lambda m: m.tile_local(one_tile, one_tile, 8, 128).mask, mask)
    abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    leaves, rest = eqx.partition(local, abstract)

    def mask_rule(leaves):
        return allowed(eqx.combine(leaves, rest), qi, ki)

    parts = [("mask", type(mask).__name__, lambda: jax.make_jaxpr(mask_rule)(leaves))]
    if score_mod is not None:
        one = jax.vmap(score_mod.for_head)(jnp.arange(1, dtype=jnp.int32))
        one = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, one)
        q, k = jnp.zeros((8, 64), jnp.float32), jnp.zeros((128, 64), jnp.float32)
        parts.append(
            (
                "score_mod",
                type(score_mod).__name__,
                lambda: jax.make_jaxpr(lambda: logits(q, k, qi, ki, one, 1.0)[0])(),
            )
        )
    for what, name, fn in parts:
        used = _primitives(fn().jaxpr)
        bad = sorted(used.intersection(_UNLOWERABLE))
        if bad:
            raise ValueError(
                f"{kernel_name}(interpret=False) cannot run {what} {name} on a "
                f"{device}: evaluated on a tile it uses {', '.join(bad)}, which "
                f"{compiler} cannot lower (a table looked up per token pair is a "
                "gather: give the mask a `tile_local` that hands the kernel the "
                "entries each tile needs, as BlockSparse does). Use XlaKernel "
                f"(kernel='xla'), which runs {name} on every device, or interpret=True."
            )


def allowed(mask: AbstractMask, qi: TokenInfo, ki: TokenInfo) -> Array:
    """`[bq, bk]`: pairs of a query tile (`[bq, 1]` records) and a key tile (`[1, bk]`)
    that attend; padding never does."""
    return mask.allows(qi, ki) & qi.valid & ki.valid


def logits(
    q: Array,
    k: Array,
    qi: TokenInfo,
    ki: TokenInfo,
    score_mod: AbstractScoreMod | None,
    scale: float,
) -> tuple[Array, Callable[[Array], Array]]:
    """Scaled, modified float32 logits `[bq, bk]` of one head, and the vjp of the
    modifier (identity without one). `score_mod` is already restricted to this head."""
    s = _scaled(jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32), scale)
    if score_mod is None:
        return s, lambda ds: ds

    def mod(s):
        # The modifier's contract: scores `[*batch, heads, q, k]`, records
        # `[*batch, 1, q, 1]` and `[*batch, 1, 1, k]`; here batch and heads are 1.
        # The scores are reshaped, not indexed with `None`: the transpose of a reshape is a
        # reshape, where that of `s[None, None]` is a sum over two axes, which Triton's
        # lowering in JAX 0.12 cannot do under an explicit mesh (it keeps the 4-d
        # sharding on the 3-d partial sum).
        q4 = jax.tree.map(lambda x: x[None, None], qi)
        k4 = jax.tree.map(lambda x: x[None, None], ki)
        out = score_mod(s.reshape((1, 1) + s.shape), q4, k4)
        if out.shape != (1, 1) + s.shape:
            raise ValueError(
                f"score_mod {type(score_mod).__name__}.for_head(h) must give scores "
                f"of the one-head tile's shape {(1, 1) + s.shape}; got {out.shape}."
            )
        return out.reshape(s.shape)

    s, vjp = jax.vjp(mod, s)
    return s, lambda ds: vjp(ds)[0]


# Rows of ones that `nan_columns` multiplies by: 16, Triton's smallest matmul side (and
# a multiple of Mosaic's sublanes for every dtype).
_ROWS = 16


def nan_columns(s: Array, x: Array) -> tuple[Array, Array]:
    """For a tile of logits `s` (`[bq, bk]`) and a key-side tile `x` (`[bk, d]`, K or
    V): `s` with NaN in the columns whose row of `x` is not finite, and `x` with its
    non-finite values zeroed.

    Masked pairs then contribute exactly nothing: the mask replaces their logits (or
    zeroes their probabilities), and 0 x a zeroed value is 0, where 0 x NaN was NaN.
    A query row that does attend a non-finite key or value row still gets NaN, through
    its logits, as in `XlaKernel` and dense attention. The cost: one add on the score
    tile, a select on `x` and a `[16, d] @ x.T` matmul per key tile.

    The row flags reach the columns of `s` (lanes) through that small matmul with ones
    and a max over its rows (sublanes): a reduction over `d` would leave them along
    sublanes, and moving them to lanes is a transpose, which the kernels avoid.
    """
    # In float32 (Mosaic's is_finite takes float32 only), cast back after the select.
    x32 = x.astype(jnp.float32)
    finite = jnp.isfinite(x32)
    ones = jnp.ones((_ROWS, x.shape[-1]), jnp.float32)
    bad = jnp.where(finite, 0.0, 1.0)
    counts = jax.lax.dot_general(ones, bad, _NT, preferred_element_type=jnp.float32)
    nan = jnp.where(jnp.max(counts, axis=0, keepdims=True) > 0, jnp.nan, 0.0)
    return s + nan, jnp.where(finite, x32, 0.0).astype(x.dtype)


def tile_grads(
    q: Array,
    k: Array,
    v: Array,
    d_out: Array,
    lse: Array,
    delta: Array,
    qi: TokenInfo,
    ki: TokenInfo,
    mask: AbstractMask | None,
    score_mod: AbstractScoreMod | None,
    scale: float,
) -> tuple[Array, Array, Array]:
    """Probabilities `p` (from the global lse, `[bq, 1]` or as wide as the tile, with
    -inf replaced by 0; `delta` likewise) and the logit gradients `ds` of one tile,
    both `[bq, bk]` float32 (Flash Attention 2),
    and `k` with its non-finite values zeroed (`nan_columns`), for dQ = dS K: masked
    pairs contribute exactly nothing to any of them. `mask=None` is a dense tile (every
    pair attends, `MaskReader.dense`): no elementwise mask, and `k` as it is, as in
    `XlaKernel`'s dense branch."""
    s, mod_vjp = logits(q, k, qi, ki, score_mod, scale)
    if mask is None:  # a dense tile: a non-finite K or V row reaches every row as is
        p = jnp.exp(s - lse)
        dp = jax.lax.dot_general(d_out, v, _NT, preferred_element_type=jnp.float32)
        return p, _scaled(mod_vjp(p * (dp - delta)), scale), k
    s, k_finite = nan_columns(s, k)
    ok = allowed(mask, qi, ki)
    p = jnp.where(ok, jnp.exp(s - lse), 0.0)
    dp = jax.lax.dot_general(d_out, v, _NT, preferred_element_type=jnp.float32)
    # A non-finite value row makes its column of dP non-finite: masked pairs drop it.
    dp = jnp.where(ok, dp, 0.0)
    ds = _scaled(mod_vjp(p * (dp - delta)), scale)
    return p, ds, k_finite


def _scaled(x: Array, scale: float) -> Array:
    """`x * scale`, no multiply for 1 (a kernel that feeds pre-scaled queries)."""
    return x if scale == 1.0 else x * scale


def matmul_tn(a: Array, b: Array) -> Array:
    """`a.T @ b` in float32 (dK, dV from a tile of probabilities or logit gradients)."""
    return jax.lax.dot_general(a, b, _TN, preferred_element_type=jnp.float32)
