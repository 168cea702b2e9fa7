"""Per-token records (`TokenInfo`), their block summaries (`BlockSummary`), and what a
layout knows statically about the positions along them (`Runs`).

Every mask is a function of these records, which is what lets any placement of tokens on
the ring give the exact answer: a strategy moves tokens, their records move with them.
"""

import functools
import math
from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from .._util._numbers import as_int


# Segment and span ids of padding never match a real id; -1 in spans means "no span".
_BIG = jnp.iinfo(jnp.int32).max
_SMALL = jnp.iinfo(jnp.int32).min


def _starts(starts: Sequence[int]) -> Sequence[int]:
    # A range stays a range: Striped's and WorkBalanced's starts are every `stripe`
    # slots, and a static field is hashed and compared on every trace.
    return starts if isinstance(starts, range) else tuple(int(s) for s in starts)


class Runs(eqx.Module):
    """What a layout knows statically about the positions along a token axis: where
    runs of consecutive positions start.

    The axis is cut into periods of `period` slots (a shard's capacity). In every
    period, a run starts at each slot offset in `starts` and lasts until the next one
    (or the period's end): a valid slot `x` of the run that starts at offset `r` holds
    the run's first position plus `x - r`. Padding slots (invalid) may be anywhere and
    hold anything. With `stride`, the run starting at `starts[j + 1]` begins `stride`
    positions after the one at `starts[j]` (Striped: `num_shards * stripe`); without,
    runs are anywhere relative to each other (Zigzag's two chunks), and periods always
    are (they are different shards).

    It is a static fact that values cannot change (`Uniform` and `Boundary`: one run
    per shard, wherever the cuts are), so the Pallas kernels can use it at trace time:
    a tile of consecutive slots inside one run holds positions at most a tile apart,
    which is what `BlockSparse`'s per-tile window needs (`AbstractMask.tile_local`,
    `BlockSummary.extent`), so no run-time check of it is emitted.

    **Fields:**

    - `starts`: the slot offsets in a period where runs start (a tuple or a `range`),
        increasing, the first 0.
    - `period`: slots per period.
    - `stride`: positions from the start of a run to the start of the next in the same
        period, or None.
    """

    starts: Sequence[int] = eqx.field(static=True, converter=_starts)
    period: int = eqx.field(static=True, converter=as_int)
    stride: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        period, starts, stride = self.period, self.starts, self.stride
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"Runs `period` must be an integer >= 1; got {period!r}.")
        if isinstance(starts, range):
            ok = len(starts) > 0 and starts.start == 0 and starts.step > 0
            ok = ok and starts[-1] < period
        else:
            ok = len(starts) > 0 and starts[0] == 0 and starts[-1] < period
            ok = ok and all(a < b for a, b in zip(starts, starts[1:]))
        if not ok:
            raise ValueError(
                "Runs `starts` must be increasing slot offsets in [0, period="
                f"{period}) starting with 0; got {starts!r}."
            )
        if stride is not None and (not isinstance(stride, int) or stride < 1):
            raise ValueError(f"Runs `stride` must be None or an integer >= 1; got {stride!r}.")

    def tile_extent(self, length: int, block: int) -> int | None:
        """A static bound on the valid positions of any tile of `block` consecutive
        slots (tiles from slot 0) of an axis of `length` slots: every tile's lie within
        that many consecutive positions (`pos_max - pos_min < extent`).

        None when the runs do not bound it: a tile holds slots of two runs that are
        anywhere relative to each other, or `length` is not a whole number of periods
        (the records are not the axis these runs describe: a piece of it).
        """
        if length % self.period:
            return None
        return _tile_extent(self, length, block)

    def halves(self) -> "Runs":
        """The runs of an axis whose periods are each two half-periods taken from any
        periods of this one (`RingConfig(balance="zigzag")` trades half-shards): every
        start of either half, in both halves, and a start at the middle."""
        half = self.period // 2
        assert 2 * half == self.period, "halves of an odd period"
        own = sorted({0} | {s % half for s in self.starts})
        return Runs(tuple(own) + tuple(half + s for s in own), self.period)


@functools.lru_cache(maxsize=256)
def _tile_extent(runs: Runs, length: int, block: int) -> int | None:
    # Model positions over the slots that tiles can tell apart: tile contents repeat
    # every lcm(period, block) slots (relative to their first position), and a last,
    # shorter tile holds a subset of a whole tile's slots.
    n = min(length, math.lcm(runs.period, block))
    starts = np.asarray(runs.starts, np.int64)
    slot = np.arange(n, dtype=np.int64)
    offset = slot % runs.period
    run = np.searchsorted(starts, offset, side="right") - 1
    position = offset - starts[run]
    # Slots whose positions are known relative to each other share a group.
    if runs.stride is None:
        group = (slot // runs.period) * len(starts) + run
    else:
        group = slot // runs.period
        position = position + run * runs.stride
    tiles = -(-n // block)
    pad = tiles * block - n
    group = np.pad(group, (0, pad), mode="edge").reshape(tiles, block)
    position = np.pad(position, (0, pad), mode="edge").reshape(tiles, block)
    if np.any(group != group[:, :1]):
        return None
    return int(np.max(position.max(axis=1) - position.min(axis=1))) + 1



class TokenInfo(eqx.Module):
    """Where each token of a block came from.

    All four arrays share one shape (any shape: `[tokens]`, `[batch, tokens]`, or
    broadcastable views such as `[..., tokens, 1]` when a mask compares queries with keys).

    **Fields:**

    - `positions`: the token's index in the original (unsharded) sequence.
    - `segments`: its segment (document) id.
    - `spans`: its span id (an image, an audio clip: tokens that attend bidirectionally),
        or -1 for none.
    - `valid`: False for padding slots.
    - `runs`: static, optional: a [`ringeqx.Runs`][] the layout vouches for along the
        last axis ([`ringeqx.Layout.token_info`][] sets it). The Pallas kernels trust it
        to skip `BlockSparse`'s run-time exactness check, so it is a claim about these
        arrays as they are: an operation that reorders slots along the last axis
        without changing its length must drop it (`TokenInfo(*arrays)` has none). One
        that changes the length cannot go wrong: the claim is then not a whole number
        of periods and is ignored (the ring's K/V pieces).
    """

    positions: Int[Array, "*shape"]
    segments: Int[Array, "*shape"]
    spans: Int[Array, "*shape"]
    valid: Bool[Array, "*shape"]
    runs: Runs | None = eqx.field(static=True, default=None)

    def summary(self) -> "BlockSummary":
        """Summarise the whole block (every axis) for conservative block rules."""
        return BlockSummary.of(self)

    def expand(self, axis: int) -> "TokenInfo":
        """Insert a length-1 axis into every array (to broadcast queries against keys)."""
        return TokenInfo(
            jnp.expand_dims(self.positions, axis),
            jnp.expand_dims(self.segments, axis),
            jnp.expand_dims(self.spans, axis),
            jnp.expand_dims(self.valid, axis),
        )


class BlockSummary(eqx.Module):
    """Ranges of positions, segments and spans over the valid tokens of a block.

    Block rules of masks use it to answer "may any pair in these two blocks attend?"
    without looking at single tokens. Fields are scalars for one block; kernels stack the
    summaries of all their tiles along leading `blocks` axes. Ranges are over valid tokens
    only; a block without any valid token has `any_valid=False` and empty ranges
    (min > max).

    `extent` is static: a bound on how far apart the valid positions of each block
    are (`pos_max - pos_min < extent` in every block of the stack), known at trace time
    from the layout (`Runs.tile_extent`), or None. The Pallas kernels set it on their
    tiles' summaries for `AbstractMask.tile_local`.
    """

    pos_min: Int[Array, "*blocks"]
    pos_max: Int[Array, "*blocks"]
    seg_min: Int[Array, "*blocks"]
    seg_max: Int[Array, "*blocks"]
    span_min: Int[Array, "*blocks"]
    span_max: Int[Array, "*blocks"]
    any_valid: Bool[Array, "*blocks"]
    extent: int | None = eqx.field(static=True, default=None)

    @staticmethod
    def of(
        info: TokenInfo,
        axis: int | tuple[int, ...] | None = None,
        extent: int | None = None,
    ) -> "BlockSummary":
        """Summarise `info` over `axis` (all axes by default); `extent` as above."""
        v = info.valid

        def lo(x):
            return jnp.min(jnp.where(v, x, _BIG), axis=axis)

        def hi(x):
            return jnp.max(jnp.where(v, x, _SMALL), axis=axis)

        return BlockSummary(
            lo(info.positions),
            hi(info.positions),
            lo(info.segments),
            hi(info.segments),
            lo(info.spans),
            hi(info.spans),
            jnp.any(v, axis=axis),
            extent,
        )
