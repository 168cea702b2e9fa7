"""Shards balanced by attention work, for packed documents."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._layout._layout import Layout, check_id_array, layout_from_order
from .._layout._tokens import Runs
from .._util._numbers import as_int, shown
from ._base import AbstractShardingStrategy
from ._placement import runs
from ._uniform import check_num_shards


def _chunk_pairs(segment_ids: Int[Array, " seq"], chunk: int) -> Float[Array, "chunks chunks"]:
    """`pairs[a, b]`: query-key pairs of chunk `a` (queries) and chunk `b` (keys) that a
    causal + document mask allows, documents being runs of equal ids."""
    n = segment_ids.shape[0]
    num = math.ceil(n / chunk)
    _, start, length = runs(segment_ids)
    pad = num * chunk - n
    # Padding tokens get an empty document [0, 0): they pair with nothing.
    start = jnp.pad(start, (0, pad))
    end = jnp.pad(start[:n] + length, (0, pad))
    t = jnp.arange(num * chunk, dtype=jnp.int32)
    b0 = jnp.arange(num, dtype=jnp.int32) * chunk
    b1 = jnp.minimum(b0 + chunk, n)

    def row(xs):
        s, e, q = xs  # one query chunk: [chunk] each
        hi = jnp.minimum(jnp.minimum(e[:, None], b1[None, :]), q[:, None] + 1)
        lo = jnp.maximum(s[:, None], b0[None, :])
        return jnp.sum(jnp.maximum(hi - lo, 0), axis=0, dtype=jnp.int32).astype(jnp.float32)

    shape = (num, chunk)
    return jax.lax.map(row, (start.reshape(shape), end.reshape(shape), t.reshape(shape)))


def _load(pairs, dev, num_shards: int, rows, cols, weights):
    """`[steps, shards]` work of the given (query chunk, key chunk) entries: the pair
    (a, b) runs on device dev[a] at ring step dev[a] - dev[b] (mod P)."""
    step = (dev[rows] - dev[cols]) % num_shards
    out = jnp.zeros((num_shards, num_shards), jnp.float32)
    return out.at[step, dev[rows]].add(pairs[rows, cols] * weights)


def _assign(
    segment_ids: Int[Array, " seq"], num_shards: int, chunk: int, iterations: int
) -> Int[Array, " chunks"]:
    """The device of every chunk (see `WorkBalanced`)."""
    pairs = _chunk_pairs(segment_ids, chunk)
    num = pairs.shape[0]
    idx = jnp.arange(num, dtype=jnp.int32)
    r = idx % (2 * num_shards)
    dev = jnp.where(r < num_shards, r, 2 * num_shards - 1 - r)  # start: snake order
    rows, cols = jnp.meshgrid(idx, idx, indexing="ij")
    load = _load(pairs, dev, num_shards, rows.reshape(-1), cols.reshape(-1), 1.0)

    def touched(dev, x, y):
        # Every entry in rows x, y or columns x, y, each once.
        other = ((idx != x) & (idx != y)).astype(jnp.float32)
        r = jnp.concatenate([jnp.full((num,), x), jnp.full((num,), y), idx, idx])
        c = jnp.concatenate([idx, idx, jnp.full((num,), x), jnp.full((num,), y)])
        w = jnp.concatenate([jnp.ones((2 * num,), jnp.float32), other, other])
        return _load(pairs, dev, num_shards, r, c, w)

    def body(i, carry):
        dev, load = carry
        x, y = jax.random.randint(
            jax.random.fold_in(jax.random.key(0), i), (2,), 0, num, dtype=jnp.int32
        )
        swapped = dev.at[x].set(dev[y]).at[y].set(dev[x])
        new = load - touched(dev, x, y) + touched(swapped, x, y)
        # Keep the swap if the critical path (sum over steps of the busiest device)
        # shrinks, or stays and the loads get more even (sum of squares): the second
        # test moves the search across the plateaus of the first.
        crit, crit_new = jnp.sum(jnp.max(load, axis=1)), jnp.sum(jnp.max(new, axis=1))
        tol = 1e-6 * crit
        flatter = jnp.sum(new * new) <= jnp.sum(load * load)
        better = (crit_new < crit - tol) | ((crit_new <= crit + tol) & flatter)
        return jnp.where(better, swapped, dev), jnp.where(better, new, load)

    dev, _ = jax.lax.fori_loop(0, iterations, body, (dev, load))
    return dev


def _order(dev: Int[Array, " chunks"], num_shards: int, chunk: int, seq_len: int):
    """Chunks of each device in original order, then their tokens."""
    num = dev.shape[0]
    per = math.ceil(num / num_shards)
    ranked = jnp.argsort(dev * num + jnp.arange(num), stable=True)  # device-major
    counts = jnp.bincount(dev, length=num_shards)
    first = jnp.cumsum(counts) - counts
    slot = jnp.arange(num) - first[dev[ranked]]
    table = jnp.full((num_shards, per), -1, jnp.int32)
    table = table.at[dev[ranked], slot].set(ranked.astype(jnp.int32), mode="drop")
    token = table[:, :, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, None, :]
    ok = (table[:, :, None] >= 0) & (token < seq_len)
    return jnp.where(ok, token, -1).reshape(num_shards, per * chunk)


@eqx.filter_jit
def _work_balanced_layout(
    seq_len: int, num_shards: int, chunk: int, iterations: int, segment_ids, span_ids
) -> Layout:
    if segment_ids is None:
        seg = jnp.zeros((seq_len,), jnp.int32)
    else:
        seg = check_id_array("segment_ids", segment_ids, seq_len)
    batch = seg.shape[:-1]

    def order(s):
        dev = _assign(s, num_shards, chunk, iterations)
        return _order(dev, num_shards, chunk, seq_len)

    orders = jax.vmap(order)(seg.reshape((-1, seq_len)))
    orders = orders.reshape(batch + orders.shape[-2:])
    # Every chunk fills its own `chunk` slots, whichever device it went to.
    capacity = orders.shape[-1]
    runs = Runs(range(0, capacity, chunk), capacity)
    return layout_from_order(
        orders, seq_len, segment_ids=segment_ids, span_ids=span_ids, runs=runs
    )


class WorkBalanced(AbstractShardingStrategy):
    r"""Place packed documents so that every device does the same attention work at every
    ring step, under causal + document masks ("dynamic sharding by content density").

    The sequence is cut into chunks of `chunk` consecutive tokens; each device gets
    `ceil(num_chunks / P)` of them, in original order. Chunk `a` of device `d(a)` and chunk
    `b` meet at ring step `d(a) - d(b) mod P`, where they cost

    $$w_{ab} = \#\{(q, k) : q \in a,\ k \in b,\ k \le q,\ \text{doc}(k) = \text{doc}(q)\}$$

    unmasked pairs. The placement minimises the critical path
    $\sum_s \max_i \text{work}_{s,i}$: it starts from chunks dealt in zigzag (snake)
    order `0, 1, ..., P-1, P-1, ..., 0, 0, 1, ...` (a many-round zigzag: it spreads every
    document over the devices) and then tries `iterations` random swaps of two chunks
    (from a fixed seed), keeping a swap when it shortens the critical path, or keeps it
    and makes the loads more even. Any document lengths work; nothing
    needs to divide anything.

    Chunks keep tiles dense: with `chunk` equal to the kernel's block size, every kernel
    tile is one chunk against one chunk, so the kernel runs the same tiles in total as
    with contiguous shards (`Uniform`), only spread evenly over devices and steps.
    (Placing single tokens or whole documents balances pairs too, but puts many documents
    in each tile, so that the block rule skips far fewer tiles: we measured 3-4x more
    tiles on long-tailed packs.)

    Documents are the runs of equal `segment_ids` (an id repeated later is a new
    document for the cost; the `Document` mask still treats equal ids as one). Without
    segment ids the sequence is one document. Segment ids are traced: new ones do not
    recompile, and batched ids give a batched layout (one placement per example).

    **Arguments:**

    - `chunk`: tokens per chunk (static); use the kernel's block size.
    - `iterations`: swaps tried (static). Each costs `O(num_chunks)`.

    **Example:**

    ```python
    strategy = ringeqx.WorkBalanced(chunk=128)
    layout = strategy.layout(8192, 8, segment_ids=segment_ids)
    ringeqx.tools.schedule(layout, ringeqx.Causal() & ringeqx.Document()).imbalance
    ```
    """

    chunk: int = eqx.field(static=True, default=128, converter=as_int)
    iterations: int = eqx.field(static=True, default=8000, converter=as_int)

    def __check_init__(self):
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(
                f"WorkBalanced `chunk` must be an integer >= 1; got {shown(self.chunk)}."
            )
        its = self.iterations
        if not isinstance(its, int) or its < 0:
            raise ValueError(f"WorkBalanced `iterations` must be an integer >= 0; got {its!r}.")

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        seq_len, num_shards = check_num_shards(seq_len, num_shards, segment_ids, span_ids)
        return _work_balanced_layout(
            seq_len, num_shards, self.chunk, self.iterations, segment_ids, span_ids
        )
