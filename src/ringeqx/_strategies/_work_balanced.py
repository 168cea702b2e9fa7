"""Shards balanced by attention work, for packed documents."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._layout import Layout, _check_ids, layout_from_order
from ._base import AbstractShardingStrategy
from ._placement import ceil_to, order_from_devices, runs
from ._uniform import check_num_shards


def _devices(
    segment_ids: Int[Array, " seq"], num_shards: int, chunk: int, capacity: int
) -> Int[Array, " seq"]:
    """The device of every token (see `WorkBalanced`)."""
    n = segment_ids.shape[0]
    p2 = 2 * num_shards
    run, start, length = runs(segment_ids)
    t = jnp.arange(n, dtype=jnp.int32)
    long = length >= p2 * chunk
    # Long documents: zigzag inside the document, over all devices.
    piece = ((t - start) * p2) // jnp.maximum(length, 1)
    zigzag = jnp.where(piece < num_shards, piece, p2 - 1 - piece)

    # Short documents stay whole; longest-processing-time-first greedy on their work
    # (causal: L (L + 1) / 2 pairs), among the devices that still have room.
    doc_len = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), run, num_segments=n)
    short = (doc_len > 0) & (doc_len < p2 * chunk)
    size = jnp.where(short, doc_len, 0)
    lf = size.astype(jnp.float32)
    cost = lf * (lf + 1.0) / 2.0
    by_cost = jnp.argsort(-cost, stable=True)
    tokens0 = jax.ops.segment_sum(
        long.astype(jnp.int32), jnp.where(long, zigzag, 0), num_segments=num_shards
    )

    def place(carry, doc):
        work, tokens = carry
        fits = tokens + size[doc] <= capacity
        best = jnp.argmin(jnp.where(fits, work, jnp.inf))
        dev = jnp.where(jnp.any(fits), best, jnp.argmin(tokens)).astype(jnp.int32)
        work = work.at[dev].add(cost[doc])
        tokens = tokens.at[dev].add(size[doc])
        return (work, tokens), dev

    init = (jnp.zeros((num_shards,), jnp.float32), tokens0)
    _, dev_sorted = jax.lax.scan(place, init, by_cost)
    doc_dev = jnp.zeros((n,), jnp.int32).at[by_cost].set(dev_sorted)
    return jnp.where(long, zigzag, doc_dev[run])


@eqx.filter_jit
def _work_balanced_layout(
    seq_len: int, num_shards: int, chunk: int, capacity: int, segment_ids, span_ids
) -> Layout:
    if segment_ids is None:
        seg = jnp.zeros((seq_len,), jnp.int32)
    else:
        seg = _check_ids("segment_ids", segment_ids, seq_len)
    batch = seg.shape[:-1]

    def order(s):
        dev = _devices(s, num_shards, chunk, capacity)
        return order_from_devices(dev, num_shards, capacity)

    orders = jax.vmap(order)(seg.reshape((-1, seq_len)))
    orders = orders.reshape(batch + (num_shards, capacity))
    return layout_from_order(orders, seq_len, segment_ids=segment_ids, span_ids=span_ids)


class WorkBalanced(AbstractShardingStrategy):
    r"""Place packed documents so that every device does the same attention work at
    every ring step, under causal + document masks ("dynamic sharding by content density").

    The work of a document of `L` tokens is its `L (L + 1) / 2` unmasked query-key pairs.
    Two kinds of documents are placed differently:

    - a *long* document (`L >= 2 P chunk`) is cut into `2P` near-equal pieces, and device
      `i` gets pieces `i` and `2P - 1 - i` (zigzag inside the document). Its work is then
      the same on every device at every ring step.
    - a *short* document stays whole on one device, so all its work happens at ring step
      0. Short documents are placed by a greedy (largest work first, each to the device
      with the least work so far among those with room), which evens out step 0.

    Tokens keep their original order inside a shard. Any document lengths work; nothing
    needs to divide anything. If the greedy leaves a shard over `capacity`, its last
    tokens spill into free slots elsewhere (still exact, slightly less balanced).

    Segment ids are the runs of equal ids in `segment_ids` (an id repeated later starts a
    new run here; the `Document` mask still treats equal ids as one document). Without
    `segment_ids` the sequence is one document. They are traced: new segment ids do not
    recompile, and batched ids give a batched layout.

    **Arguments:**

    - `chunk`: the smallest piece worth cutting a document into (static). Pieces of a long
        document have at least `chunk` tokens; smaller values balance better, larger ones
        keep more of each tile inside one document.
    - `capacity`: slots per shard (static). Default: `ceil(seq_len / P)` rounded up to a
        multiple of `chunk`, plus one `chunk` of slack for the greedy.

    **Example:**

    ```python
    strategy = ringeqx.WorkBalanced(chunk=16)
    layout = strategy.layout(8192, 8, segment_ids=segment_ids)
    ringeqx.schedule(layout, ringeqx.Causal() & ringeqx.Document()).imbalance
    ```
    """

    chunk: int = eqx.field(static=True, default=16)
    capacity: int | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"WorkBalanced `chunk` must be an integer >= 1; got {self.chunk!r}.")
        cap = self.capacity
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"WorkBalanced `capacity` must be an integer >= 1 or None; got {cap!r}."
            )

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        check_num_shards(seq_len, num_shards)
        if self.capacity is None:
            capacity = ceil_to(math.ceil(seq_len / num_shards), self.chunk) + self.chunk
        else:
            capacity = self.capacity
            if num_shards * capacity < seq_len:
                raise ValueError(
                    f"WorkBalanced `capacity`={capacity} is too small for the tokens: "
                    f"{num_shards} shards x {capacity} slots < seq_len={seq_len}."
                )
        return _work_balanced_layout(
            seq_len, num_shards, self.chunk, capacity, segment_ids, span_ids
        )
