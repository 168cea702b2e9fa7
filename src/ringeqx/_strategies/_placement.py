"""Building blocks shared by the strategies: pieces of consecutive tokens, snapped cuts, runs.

Every function here is plain `jax.numpy` with static shapes, so strategies whose placement
depends on array leaves (boundary positions, segment ids, span ids) trace once and serve
every value.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


def is_traced(x) -> bool:
    """Whether `x` is a tracer (its values are unknown until run time)."""
    return isinstance(x, jax.core.Tracer)


def balanced_cuts(seq_len: int, num_pieces: int) -> np.ndarray:
    """`num_pieces + 1` cut points splitting `[0, seq_len)` into pieces whose lengths
    differ by at most one."""
    return (np.arange(num_pieces + 1, dtype=np.int64) * seq_len // num_pieces).astype(np.int32)


def zigzag_pieces(
    cuts: Int[Array, " pieces_plus_one"],
) -> tuple[Int[Array, "shards 2"], Int[Array, "shards 2"]]:
    """Starts and lengths of the two pieces of each shard when piece `i` and piece
    `2P - 1 - i` go to shard `i` (`cuts` holds `2P + 1` cut points)."""
    num_pieces = cuts.shape[0] - 1
    if num_pieces % 2:
        raise ValueError(f"zigzag needs an even number of pieces; got {num_pieces}.")
    starts, ends = cuts[:-1], cuts[1:]
    half = num_pieces // 2
    head = jnp.arange(half)
    tail = num_pieces - 1 - head
    s = jnp.stack([starts[head], starts[tail]], axis=-1)
    e = jnp.stack([ends[head], ends[tail]], axis=-1)
    return s, e - s


def order_from_pieces(
    starts: Int[Array, "shards pieces"],
    lengths: Int[Array, "shards pieces"],
    capacity: int,
) -> Int[Array, "shards capacity"]:
    """The `order` of a layout whose shards each hold a few runs of consecutive tokens.

    Shard `s` holds run `starts[s, p] + [0, lengths[s, p])` for each `p`, in that order,
    then padding (-1) up to `capacity`. Runs longer than the capacity are cut off: check
    the sizes before calling this.
    """
    ends = jnp.cumsum(lengths, axis=-1)
    begins = ends - lengths
    slot = jnp.arange(capacity, dtype=jnp.int32)
    piece = jnp.sum(slot[None, :, None] >= ends[:, None, :], axis=-1, dtype=jnp.int32)
    num_pieces = lengths.shape[-1]
    p = jnp.minimum(piece, num_pieces - 1)
    start = jnp.take_along_axis(starts, p, axis=-1)
    begin = jnp.take_along_axis(begins, p, axis=-1)
    return jnp.where(piece < num_pieces, start + slot[None, :] - begin, -1).astype(jnp.int32)


def snap_cuts(
    ideal: Int[Array, " cuts"],
    allowed: Int[Array, " allowed"],
    split_longer_than: int | None,
) -> Int[Array, " cuts"]:
    """Move each ideal cut point to the nearest allowed one.

    `allowed` is sorted and contains 0 and `seq_len`, so the first and last cuts stay
    where they are and the result is non-decreasing (the nearest of two fixed neighbours is
    monotone in the ideal point). If the gap between the two allowed neighbours of an
    ideal cut is longer than `split_longer_than`, the cut stays where it is: that span is
    split. Ties go to the later cut.
    """
    last = allowed.shape[0] - 1
    hi_idx = jnp.searchsorted(allowed, ideal, side="left")
    hi = allowed[jnp.clip(hi_idx, 0, last)]
    lo = allowed[jnp.clip(hi_idx - 1, 0, last)]
    lo = jnp.where(hi == ideal, hi, lo)
    nearest = jnp.where(ideal - lo < hi - ideal, lo, hi)
    if split_longer_than is None:
        return nearest
    return jnp.where(hi - lo > split_longer_than, ideal, nearest)


def runs(
    ids: Int[Array, " seq"],
) -> tuple[Int[Array, " seq"], Int[Array, " seq"], Int[Array, " seq"]]:
    """Maximal runs of equal ids: per token, its run index, the run's first index and
    the run's length."""
    n = ids.shape[0]
    t = jnp.arange(n, dtype=jnp.int32)
    new = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
    run = jnp.cumsum(new, dtype=jnp.int32) - 1
    start = jax.lax.cummax(jnp.where(new, t, 0))
    length = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), run, num_segments=n)
    return run, start, length[run]
