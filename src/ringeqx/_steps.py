"""How many ring steps run: the rule the ring follows and the schedule counts.

It sits below both `_ring` and `_schedule`, so that the schedule reads the ring's own
rule without importing the ring.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ._layout import Layout
from ._masks import AbstractMask, block_rule
from ._tokens import BlockSummary, TokenInfo


def ring_window(mask: AbstractMask, layout: Layout) -> tuple[int, int]:
    """`(num_ahead, num_steps)`: the ring starts `num_ahead` shards ahead and runs
    `num_steps` steps, so device `i` meets the shards `i + num_ahead, ..., i + num_ahead -
    num_steps + 1` (mod the shard count)."""
    p = layout.num_shards
    behind, ahead = mask.max_distance(), mask.max_lookahead()
    if behind is None or ahead is None or not layout.contiguous:
        return 0, p

    # In a contiguous layout whose shards between two others are full (capacity C), a
    # query of shard i and a key of shard i - s are at least (s - 1) * C + 1 apart for
    # s >= 1; pairs within `bound` need s <= ceil(bound / C). The same holds ahead.
    def reach(bound: int) -> int:
        return math.ceil(max(bound, 0) / layout.capacity)

    num_ahead = reach(ahead)
    num_steps = reach(behind) + num_ahead + 1
    if num_steps >= p:
        return 0, p
    return num_ahead, num_steps


def num_ring_steps(mask: AbstractMask, layout: Layout) -> int:
    """How many ring steps run: all of them, unless the mask bounds the distance between
    attending positions (`max_distance` behind and `max_lookahead` ahead) and the layout
    is contiguous. A causal window `W` over shards of capacity `C` needs
    `ceil((W - 1) / C) + 1` steps; a two-sided one `2 ceil((W - 1) / C) + 1`."""
    return ring_window(mask, layout)[1]


def _shards(layout: Layout) -> TokenInfo:
    """Per-slot records `[batch, shards, capacity]` (batch 1 for unbatched layouts)."""
    info = TokenInfo(layout.positions, layout.segments, layout.spans, layout.valid)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[-2:]), info)


def early_stop_error(mask: AbstractMask, layout: Layout) -> Bool[Array, ""]:
    """True where a shard pair that the early-stopped ring never meets may still attend.

    `ring_window` assumes full inner shards; a contiguous layout with short shards
    (padding in the middle) could break that, and then the answer would be silently
    wrong. The block rule on whole shards catches it, at the cost of a few scalars."""
    num_ahead, num_steps = ring_window(mask, layout)
    p = layout.num_shards
    summ = BlockSummary.of(_shards(layout), axis=(0, 2))
    q = jax.tree.map(lambda x: x[:, None], summ)
    k = jax.tree.map(lambda x: x[None, :], summ)
    i = jnp.arange(p)[:, None]
    j = jnp.arange(p)[None, :]
    # Device i meets shard j at step (i + num_ahead - j) mod p.
    met = (i + num_ahead - j) % p < num_steps
    return jnp.any(~met & block_rule(mask, q, k))
