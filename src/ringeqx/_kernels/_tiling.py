"""Tiling maths shared by every kernel and by `schedule`: padding, token-record tiles and
the online-softmax update; and the tile loop's pieces that `XlaKernel` and the score
modifier's gradient pass (`_score_mod_grads.py`) share: tile sizes and slices, per-tile
records and the branch a tile takes, and the mask and the modifier on one tile.

Nothing here imports Pallas: `XlaKernel` and `schedule` use it as they are, and
`_pallas/_tiles.py` re-exports it for the Pallas kernels.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .._layout._tokens import BlockSummary, TokenInfo
from .._masks._base import AbstractMask, tile_branch
from .._score_mods import AbstractScoreMod


# Row order of the int32 token records that the Pallas kernels receive, and the value a
# padding slot gets in each (an invalid token of no segment and no span).
RECORD_FIELDS = ("positions", "segments", "spans", "valid")
RECORD_FILL = (0, -1, -1, 0)

# `a @ b`: contract the last axis of `a` with the first of `b`.
_NN = (((1,), (0,)), ((), ()))


def pad_axis(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    """`x` padded at the end of `axis` to `size` with `value`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_info(info: TokenInfo, length: int) -> TokenInfo:
    """Records padded along their last axis to `length`, padding slots invalid."""
    return TokenInfo(
        *(
            pad_axis(getattr(info, name), -1, length, fill)
            for name, fill in zip(RECORD_FIELDS, RECORD_FILL)
        )
    )


def tile_info(info: TokenInfo, num: int, block: int, axis: int) -> TokenInfo:
    """`[*lead, len]` records -> `num` tiles of `block` tokens, padding slots invalid,
    with the tile axis moved to `axis` (`[*lead, num, block]` before the move)."""

    def tile(x):
        x = x.reshape(x.shape[:-1] + (num, block))
        return jnp.moveaxis(x, -2, axis)

    return jax.tree.map(tile, pad_info(info, num * block))


def matmul(a: Array, b: Array) -> Array:
    """`a @ b` in float32."""
    return jax.lax.dot_general(a, b, _NN, preferred_element_type=jnp.float32)


class Softmax(eqx.Module):
    """Online softmax state of a query tile: running max `m` and running sum `total`
    (both `[..., bq, 1]`, or `[bq, 128]` along lanes in the Mosaic kernel: `update`'s
    `widen`), and the unnormalised output `acc` (`[..., bq, d]`), all float32."""

    m: Array
    total: Array
    acc: Array

    @staticmethod
    def init(block_q: int, head_dim: int) -> "Softmax":
        zero = jnp.zeros((block_q, 1), jnp.float32)
        return Softmax(
            zero - jnp.inf, zero, jnp.zeros((block_q, head_dim), jnp.float32)
        )

    def update(
        self,
        s: Array,
        ok: Array | None,
        v: Array,
        pv: Callable[[Array, Array], Array] = matmul,
        widen: Callable[[Array, int], Array] | None = None,
    ) -> "Softmax":
        """Fold in a tile of logits `s` (`[..., bq, bk]`; `ok` marks attending pairs,
        None where all do) and values `v`; `pv(p, v)` gives the float32 `[..., bq, d]`
        product (`p @ v` for one head). With `widen`, `m` and `total` are kept as they
        come (a TPU kernel's `[bq, 128]`, every lane equal) and `widen(x, n)` gives
        them `n` columns wide (tiled vregs instead of a broadcast column)."""
        if ok is not None:
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(self.m, jnp.max(s, axis=-1, keepdims=True))
        # Rows that have seen nothing keep m = -inf; exponentiate against 0 instead.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        wide = widen or (lambda x, _: x)
        p = jnp.exp(s - wide(m_safe, s.shape[-1]))
        alpha = jnp.exp(self.m - m_safe)
        total = self.total * alpha + jnp.sum(p, axis=-1, keepdims=True)
        acc = self.acc * wide(alpha, self.acc.shape[-1]) + pv(p.astype(v.dtype), v)
        return Softmax(m_new, total, acc)

    def finish(self) -> tuple[Array, Array]:
        """`(out [..., bq, d], lse [..., bq, 1])`; rows that saw nothing give 0 and
        -inf."""
        seen = self.total > 0
        total = jnp.where(seen, self.total, 1.0)
        return self.acc / total, jnp.where(seen, self.m + jnp.log(total), -jnp.inf)


def pair_mask(
    mask: AbstractMask, qi: TokenInfo, ki: TokenInfo, keys_first: bool = False
) -> Bool[Array, "b q k"]:
    """Which pairs of a `[b, bq]` x `[b, bk]` tile attend (padding never does):
    `[b, bq, bk]`, or `[b, bk, bq]` with `keys_first`."""
    q, k = (qi.expand(1), ki.expand(2)) if keys_first else (qi.expand(2), ki.expand(1))
    return mask.allows(q, k) & q.valid & k.valid


def modify(score_mod: AbstractScoreMod, s: Array, qi: TokenInfo, ki: TokenInfo) -> Array:
    """`score_mod` on logits `[b, kv_heads, groups, bq, bk]` (its own `[heads, q, k]`
    orientation)."""
    b, kh, g, bq, bk = s.shape
    out = score_mod(
        s.reshape(b, kh * g, bq, bk),
        jax.tree.map(lambda x: x[:, None, :, None], qi),
        jax.tree.map(lambda x: x[:, None, None, :], ki),
    )
    return out.reshape(s.shape)


def tile_sizes(block: int, length: int) -> tuple[int, int]:
    size = min(block, length)
    return size, math.ceil(length / size)


def grouped(x: Array, kv_heads: int, length: int) -> Array:
    """`[b, heads, len, *rest]` -> `[b, kv_heads, groups, length, *rest]`, padded to
    `length`: a reshape, no copy unless padding is needed."""
    b, h = x.shape[:2]
    x = pad_axis(x, 2, length)
    return x.reshape((b, kv_heads, h // kv_heads) + x.shape[2:])


def take_tile(x: Array, index, block: int, axis: int) -> Array:
    """Tile `index` (traced) of `block` tokens along `axis`: a slice, not a copy of `x`."""
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis)


def tile_loop(num: int, body, init):
    """`lax.fori_loop(0, num, body, init)`, or the body itself for one tile (no loop, so
    no loop-carried copies of whole buffers)."""
    if num == 1:
        return body(0, init)
    return jax.lax.fori_loop(0, num, body, init)


def pick(tree, index):
    """Entry `index` of stacked per-tile records."""
    return jax.tree.map(lambda x: x[index], tree)


class Tiles(NamedTuple):
    """Per-tile token records `[num, batch, block]`, their summaries, and whether every
    token of a tile is valid `[num]`."""

    info: TokenInfo
    summary: BlockSummary
    full: Array


def info_tiles(info: TokenInfo, num: int, block: int) -> Tiles:
    """`[batch, len]` records -> `[num, batch, block]` tiles and their summaries."""
    tiles = tile_info(info, num, block, axis=0)
    return Tiles(tiles, BlockSummary.of(tiles, axis=(1, 2)), jnp.all(tiles.valid, axis=(1, 2)))


def which_branch(mask: AbstractMask, q: Tiles, k: Tiles, i, j):
    """The branch tile `(i, j)` takes (`tile_branch`): 0 skipped, 1 masked, 2 dense."""
    return tile_branch(mask, pick(q.summary, i), pick(k.summary, j), q.full[i], k.full[j])
