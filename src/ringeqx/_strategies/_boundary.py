"""Shard edges snapped to special-token positions."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int

from .._layout._layout import Layout, layout_from_order
from .._layout._tokens import Runs
from .._util._numbers import as_int
from ._base import AbstractShardingStrategy
from ._placement import balanced_cuts, is_traced, order_from_pieces, snap_cuts
from ._uniform import check_num_shards


@jax.jit(static_argnums=(1, 2))
def _boundary_cuts(
    positions: Int[Array, " breaks"], seq_len: int, num_shards: int
) -> Int[Array, " cuts"]:
    ends = jnp.array([seq_len], jnp.int32)
    allowed = jnp.concatenate([jnp.zeros((1,), jnp.int32), positions, ends])
    ideal = jnp.asarray(balanced_cuts(seq_len, num_shards))
    return snap_cuts(ideal, allowed, split_longer_than=math.ceil(seq_len / num_shards))


@eqx.filter_jit
def _boundary_layout(
    positions: Int[Array, " breaks"],
    seq_len: int,
    num_shards: int,
    capacity: int,
    check: bool,
    segment_ids,
    span_ids,
) -> Layout:
    cuts = _boundary_cuts(positions, seq_len, num_shards)
    sizes = cuts[1:] - cuts[:-1]
    order = order_from_pieces(cuts[:-1, None], sizes[:, None], capacity)
    if check:
        diffs = positions[1:] - positions[:-1]
        bad = jnp.any(positions < 0) | jnp.any(positions > seq_len) | jnp.any(diffs < 0)
        order = eqx.error_if(
            order,
            bad,
            f"Boundary `positions` must be sorted and lie in [0, seq_len={seq_len}].",
        )
        order = eqx.error_if(
            order,
            jnp.any(sizes > capacity),
            f"Boundary `capacity`={capacity} is too small for the tokens: a snapped "
            "shard holds more.",
        )
    # Shards are consecutive runs in order, but the layout is not `contiguous=True`:
    # shards may hold fewer than `capacity` tokens, which the ring's early stop for
    # bounded masks does not allow for. Each is one run, wherever the cuts are.
    return layout_from_order(
        order,
        seq_len,
        segment_ids=segment_ids,
        span_ids=span_ids,
        runs=Runs((0,), capacity),
    )


class Boundary(AbstractShardingStrategy):
    """Contiguous shards whose edges snap to special-token positions.

    Each edge of the even split (`k * seq_len / P`) moves to the nearest break in
    `positions` (sentence, paragraph or document breaks), so a span between two breaks
    is never split across devices, unless it is longer than an even shard
    (`ceil(seq_len / P)` tokens): then the edge stays where it was and the span is cut.
    Shards are padded to a common `capacity`.

    A break at `p` means "a shard may start at token `p`": pass the index of a
    beginning-of-document token, or `index + 1` of an end-of-sentence token.

    **Arguments:**

    - `positions`: `int[breaks]`, sorted break positions in `[0, seq_len]`. An array
        leaf: new positions (of the same count) do not recompile. To keep the count fixed
        under `jit`, pad with `seq_len` (repeated breaks are allowed).
    - `capacity`: slots per shard (static). Default: the smallest that fits, which needs
        concrete positions; under `jit` with traced positions, pass it.

    **Example:**

    ```python
    strategy = ringeqx.Boundary(jnp.array([900, 2100, 3000, 4300, 5100, 6000, 7200]))
    layout = strategy.layout(8192, num_shards=8)
    ```
    """

    positions: Int[Array, " breaks"]
    capacity: int | None = eqx.field(static=True)

    def __init__(self, positions: ArrayLike, capacity: int | None = None):
        self.positions = jnp.asarray(positions)
        self.capacity = as_int(capacity)

    def __check_init__(self):
        pos = self.positions
        if pos.ndim != 1 or not jnp.issubdtype(pos.dtype, jnp.integer):
            raise ValueError(
                "Boundary `positions` must be a 1-d integer array; got shape "
                f"{pos.shape} and dtype {pos.dtype}."
            )
        if not is_traced(pos):
            p = np.asarray(pos)
            if np.any(np.diff(p) < 0):
                raise ValueError(f"Boundary `positions` must be sorted; got {p.tolist()}.")
            if np.any(p < 0):
                raise ValueError(f"Boundary `positions` must be >= 0; got {p.tolist()}.")
        cap = self.capacity
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(f"Boundary `capacity` must be an integer >= 1 or None; got {cap!r}.")

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        seq_len, num_shards = check_num_shards(seq_len, num_shards, segment_ids, span_ids)
        # Concrete positions (even closed over by an outer jit) allow trace-time checks
        # and the smallest capacity; traced ones are checked when the program runs.
        traced = is_traced(self.positions)
        if traced and self.capacity is None:
            raise ValueError(
                "Boundary with traced `positions` (under jit) needs a static "
                "`capacity`: pass Boundary(positions, capacity=...)."
            )
        if not traced:
            p = np.asarray(self.positions)
            if np.any(p > seq_len):
                raise ValueError(
                    f"Boundary `positions` must lie in [0, seq_len={seq_len}]; got {p.tolist()}."
                )
            with jax.ensure_compile_time_eval():
                cuts = _boundary_cuts(jnp.asarray(p, jnp.int32), seq_len, num_shards)
            sizes = np.diff(np.asarray(cuts))
            if self.capacity is not None and sizes.max() > self.capacity:
                raise ValueError(
                    f"Boundary `capacity`={self.capacity} is too small for the tokens: the "
                    f"snapped shards hold {sizes.tolist()} tokens."
                )
        capacity = max(int(sizes.max()), 1) if self.capacity is None else self.capacity
        pos = self.positions.astype(jnp.int32)
        return _boundary_layout(pos, seq_len, num_shards, capacity, traced, segment_ids, span_ids)
