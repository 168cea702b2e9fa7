"""Masks on ids: `Document` (segments, packed documents) and `BidirectionalSpans`
(spans: image or audio clips inside causal text)."""

from jaxtyping import Array, Bool

from .._layout._tokens import BlockSummary, TokenInfo
from ._base import AbstractMask


class Document(AbstractMask):
    """A query attends only to keys of its own segment (packed documents).

    Segment ids come from `ring_attention(..., segment_ids=...)` or from the layout.
    """

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return q.segments == k.segments

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return (q.seg_min <= k.seg_max) & (k.seg_min <= q.seg_max)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        one = (q.seg_min == q.seg_max) & (k.seg_min == k.seg_max)
        return one & (q.seg_min == k.seg_min)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class BidirectionalSpans(AbstractMask):
    """Causal text with bidirectional spans (image, audio clips).

    A query sees every earlier key, and every key of its own span: tokens with one span
    id `>= 0` attend to each other fully. Span ids come from
    `ring_attention(..., span_ids=...)` or from the layout (`-1` = not in a span).
    """

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        same = (q.spans == k.spans) & (q.spans >= 0)
        return (q.positions >= k.positions) | same

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        # A shared span id s >= 0 lies in both ranges, so both maxima are >= 0.
        overlap = (q.span_min <= k.span_max) & (k.span_min <= q.span_max)
        spans = overlap & (q.span_max >= 0) & (k.span_max >= 0)
        return (q.pos_max >= k.pos_min) | spans

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        one = (q.span_min == q.span_max) & (k.span_min == k.span_max)
        same = one & (q.span_min == k.span_min) & (q.span_min >= 0)
        return (q.pos_min >= k.pos_max) | same

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass
