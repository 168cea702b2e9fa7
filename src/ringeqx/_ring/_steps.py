"""How many ring steps run: the rule the ring follows and the schedule counts.

It sits below both the ring (`_algorithm`) and `tools/_schedule`, so that the schedule
reads the ring's own rule without importing the ring.
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool

from .._layout._layout import Layout
from .._layout._tokens import BlockSummary, TokenInfo
from .._masks._base import AbstractMask, block_rule


def analytic_window(mask: AbstractMask, layout: Layout) -> tuple[int, int]:
    """`(num_ahead, num_steps)` from the mask's static bounds alone (`max_distance`,
    `max_lookahead`) on a contiguous layout with full inner shards; the full ring
    `(0, num_shards)` otherwise. Needs no array values, so it also serves traced layouts."""
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


def _shards(layout: Layout) -> TokenInfo:
    """Per-slot records `[batch, shards, capacity]` (batch 1 for unbatched layouts)."""
    info = TokenInfo(layout.positions, layout.segments, layout.spans, layout.valid)
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[-2:]), info)


# Block-rule evaluations (batch x blocks x blocks) allowed for `shard_pairs`: it picks
# the finest sub-blocks within this budget (a few MB of scalars, once per trace).
_PAIR_BUDGET = 1 << 22


def shard_pairs(mask: AbstractMask, layout: Layout) -> Bool[Array, "shards shards"]:
    """`[i, j]`: True where a query of shard `i` may attend to a key of shard `j` in some
    example, by the block rule on sub-blocks of the shards (as fine as `_PAIR_BUDGET`
    allows: a shard holding two distant chunks, as Zigzag's, is not judged by one range
    over both). Conservative, as the block rule is."""
    info = _shards(layout)
    batch, p, cap = info.positions.shape
    per_shard = max(1, math.isqrt(_PAIR_BUDGET // batch) // p)
    block = math.ceil(cap / min(cap, per_shard))
    num = math.ceil(cap / block)
    pad = num * block - cap

    def tiles(x, fill):
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=fill)
        return x.reshape(batch, p * num, block)

    info = TokenInfo(
        *(tiles(x, 0) for x in (info.positions, info.segments, info.spans)),
        tiles(info.valid, False),
    )
    summ = BlockSummary.of(info, axis=2)  # [batch, shards * num]
    q = jax.tree.map(lambda x: x[:, :, None], summ)
    k = jax.tree.map(lambda x: x[:, None, :], summ)
    rule = block_rule(mask, q, k).reshape(batch, p, num, p, num)
    return jnp.any(rule, axis=(0, 2, 4))


def _concrete(tree) -> bool:
    """Every leaf holds values now (no tracer, no shape-only struct)."""
    return all(
        isinstance(x, (np.ndarray, np.generic, int, float, bool))
        or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
        for x in jax.tree.leaves(tree)
    )


@contextlib.contextmanager
def _now():
    """Evaluate on concrete values now, outside any mesh context: inside `ring_attention`
    an abstract mesh may be set (lowering for another platform), under which even eager
    ops would need a lowering platform."""
    with jax.ensure_compile_time_eval():
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            yield


def needed_offsets(mask: AbstractMask, layout: Layout) -> np.ndarray | None:
    """`bool[shards]`: entry `d` is True where some device `i` needs the shard `i - d`
    (mod the shard count), always for `d = 0`; None when the layout or the mask is traced
    (their values are unknown until the program runs)."""
    if not _concrete((mask, layout)):
        return None
    with _now():
        pairs = shard_pairs(mask, layout)
    if isinstance(pairs, jax.core.Tracer):
        return None
    pairs = np.asarray(pairs)
    p = layout.num_shards
    d = (np.arange(p)[:, None] - np.arange(p)[None, :]) % p
    needed = np.zeros(p, bool)
    needed[d[pairs]] = True
    needed[0] = True
    return needed


def smallest_window(needed: np.ndarray) -> tuple[int, int]:
    """The shortest circular run of offsets covering every needed one, as `(num_ahead,
    num_steps)`: the offsets `-num_ahead, ..., num_steps - 1 - num_ahead` (mod `p`).
    Ties go to the smallest `num_ahead`; the full ring is `(0, p)`."""
    p = len(needed)
    offsets = np.flatnonzero(needed)
    best = (p, 0)  # (num_steps, num_ahead)
    for k, low in enumerate(offsets):
        # Start at `low` and run upward (circularly) to the offset just before it.
        length = (offsets[k - 1] - low) % p + 1
        best = min(best, (int(length), int(-low % p)))
    num_steps, num_ahead = best
    return (0, p) if num_steps >= p else (num_ahead, num_steps)


def ring_window(mask: AbstractMask, layout: Layout) -> tuple[int, int]:
    """`(num_ahead, num_steps)`: the ring starts `num_ahead` shards ahead and runs
    `num_steps` steps, so device `i` meets the shards `i + num_ahead, ..., i + num_ahead -
    num_steps + 1` (mod the shard count).

    With a concrete layout and mask (values known at trace time), the window is the
    smallest that holds every shard offset the block rule on whole shards allows, for any
    layout: exact by construction, since the block rule is conservative. Traced, it is
    the analytic one (`analytic_window`: bounded masks on contiguous layouts)."""
    needed = needed_offsets(mask, layout)
    if needed is None:
        return analytic_window(mask, layout)
    return smallest_window(needed)


def num_ring_steps(mask: AbstractMask, layout: Layout) -> int:
    """How many ring steps run: one per shard offset that some device needs, over the
    smallest circular run of offsets that holds them all (its own shard included).

    With a concrete `layout` (and mask), the offsets are those the mask's block rule
    allows on whole shards, for any layout: packed documents shorter than a shard need
    few steps, a causal window `W` over contiguous shards of capacity `C`
    `ceil((W - 1) / C) + 1` (a two-sided one `2 ceil((W - 1) / C) + 1`), a causal mask
    all of them. With a traced layout (inside `jax.jit`, as an argument) only the mask's
    static bounds count (`max_distance` behind and `max_lookahead` ahead, on a contiguous
    layout); otherwise every step runs."""
    return ring_window(mask, layout)[1]


def early_stop_error(mask: AbstractMask, layout: Layout) -> Bool[Array, ""]:
    """True where the analytic window (`analytic_window`) misses a shard pair that
    may still attend.

    The analytic window assumes honest bounds and full inner shards; a wrong
    `max_distance`/`max_lookahead`, or a contiguous layout with short shards (padding in
    the middle), breaks it, and a traced run of the same mask and layout would then be
    silently wrong. The block rule on sub-blocks of the shards (`shard_pairs`) catches
    it."""
    num_ahead, num_steps = analytic_window(mask, layout)
    p = layout.num_shards
    i = jnp.arange(p)[:, None]
    j = jnp.arange(p)[None, :]
    # Device i meets shard j at step (i + num_ahead - j) mod p.
    met = (i + num_ahead - j) % p < num_steps
    if not _concrete((mask, layout)):
        return jnp.any(~met & shard_pairs(mask, layout))
    with _now():
        return jnp.any(~met & shard_pairs(mask, layout))
