"""Per-token records (`TokenInfo`) and their block summaries (`BlockSummary`).

Every mask is a function of these records, which is what lets any placement of tokens on
the ring give the exact answer: a strategy moves tokens, their records move with them.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


# Segment and span ids of padding never match a real id; -1 in spans means "no span".
_BIG = jnp.iinfo(jnp.int32).max
_SMALL = jnp.iinfo(jnp.int32).min


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
    """

    positions: Int[Array, "*shape"]
    segments: Int[Array, "*shape"]
    spans: Int[Array, "*shape"]
    valid: Bool[Array, "*shape"]

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
    """

    pos_min: Int[Array, "*blocks"]
    pos_max: Int[Array, "*blocks"]
    seg_min: Int[Array, "*blocks"]
    seg_max: Int[Array, "*blocks"]
    span_min: Int[Array, "*blocks"]
    span_max: Int[Array, "*blocks"]
    any_valid: Bool[Array, "*blocks"]

    @staticmethod
    def of(info: TokenInfo, axis: int | tuple[int, ...] | None = None) -> "BlockSummary":
        """Summarise `info` over `axis` (all axes by default)."""
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
        )
