"""Attention masks as pytrees: an elementwise rule and a conservative block rule."""

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool

from ._tokens import BlockSummary, TokenInfo


class AbstractMask(eqx.Module):
    """Which query-key pairs may attend.

    A mask is defined on token records ([`ringeqx.TokenInfo`][]: original position,
    segment id, span id), never on slots, so it is exact under every sharding strategy.
    Padding is handled by the ring itself; masks never see it.

    Subclass it to write your own mask: implement the three methods below. Combine masks
    with `a & b` and `a | b`.
    """

    @abc.abstractmethod
    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        """Elementwise rule: may query `q` attend to key `k`?

        `q` and `k` hold broadcastable arrays (typically `[..., q_len, 1]` and
        `[..., 1, k_len]`); the result has their broadcast shape.
        """

    @abc.abstractmethod
    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, ""]:
        """Block rule: may *any* query of block `q` attend to *any* key of block `k`?

        It must be conservative: whenever `allows` is True for some pair of valid tokens in
        the two blocks, this returns True. A False lets the ring skip a step and the kernel
        skip a tile.
        """

    @abc.abstractmethod
    def max_distance(self) -> int | None:
        """A static bound on `q_position - k_position` for attending pairs, or None.

        With a contiguous layout, a bound lets the ring stop after the steps that can
        still matter.
        """

    def __and__(self, other: "AbstractMask") -> "And":
        return And(self, other)

    def __or__(self, other: "AbstractMask") -> "Or":
        return Or(self, other)


class Full(AbstractMask):
    """Every query attends to every (valid) key."""

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return jnp.ones(jnp.broadcast_shapes(q.positions.shape, k.positions.shape), bool)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, ""]:
        return jnp.array(True)

    def max_distance(self) -> int | None:
        return None


class Causal(AbstractMask):
    """A query attends to keys at the same or earlier original positions."""

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return q.positions >= k.positions

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, ""]:
        return q.pos_max >= k.pos_min

    def max_distance(self) -> int | None:
        return None


class Document(AbstractMask):
    """A query attends only to keys of its own segment (packed documents).

    Segment ids come from `ring_attention(..., segment_ids=...)` or from the layout.
    """

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return q.segments == k.segments

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, ""]:
        return (q.seg_min <= k.seg_max) & (k.seg_min <= q.seg_max)

    def max_distance(self) -> int | None:
        return None


def _min_bound(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


class And(AbstractMask):
    """Both masks allow the pair."""

    left: AbstractMask
    right: AbstractMask

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return self.left.allows(q, k) & self.right.allows(q, k)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, ""]:
        return self.left.may_attend(q, k) & self.right.may_attend(q, k)

    def max_distance(self) -> int | None:
        return _min_bound(self.left.max_distance(), self.right.max_distance())


class Or(AbstractMask):
    """Either mask allows the pair."""

    left: AbstractMask
    right: AbstractMask

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return self.left.allows(q, k) | self.right.allows(q, k)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, ""]:
        return self.left.may_attend(q, k) | self.right.may_attend(q, k)

    def max_distance(self) -> int | None:
        left, right = self.left.max_distance(), self.right.max_distance()
        if left is None or right is None:
            return None
        return max(left, right)


def mask_needs_segments(mask: AbstractMask) -> bool:
    """Whether a mask reads segment ids (so callers must supply them)."""
    match mask:
        case Document():
            return True
        case And() | Or():
            return mask_needs_segments(mask.left) or mask_needs_segments(mask.right)
        case _:
            return False
