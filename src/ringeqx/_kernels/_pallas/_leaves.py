"""The mask and the score modifier as a Pallas kernel's operands: their array leaves,
how a kernel body rebuilds them from its refs (`MaskReader`), and their block specs."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from ..._masks._base import DENSE, MASKED, AbstractMask, TileLocal
from ..._score_mods import AbstractScoreMod


def kernel_leaves(tree: Any) -> tuple[list[Array], Callable[[Sequence[Array]], Any]]:
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
        values, self._rebuild = kernel_leaves(local.mask)
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
    values, rebuild = kernel_leaves(per_head)
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

