"""Contiguous shards."""

from jaxtyping import Array, Int

from .._layout._layout import Layout, contiguous_layout
from .._util._numbers import check_int32, is_int, shown
from ._base import AbstractShardingStrategy


def check_num_shards(
    seq_len: int, num_shards: int, segment_ids=None, span_ids=None
) -> tuple[int, int]:
    """Checks of a strategy's `layout` arguments, before its (jitted) construction traces
    the ids and their values can no longer be checked; returns `(seq_len, num_shards)`
    as Python ints (NumPy integers are accepted, booleans are not)."""
    if not is_int(num_shards) or num_shards < 1:
        raise ValueError(f"`num_shards` must be an integer >= 1; got {shown(num_shards)}.")
    if not is_int(seq_len) or seq_len < 1:
        raise ValueError(f"`seq_len` must be an integer >= 1; got {shown(seq_len)}.")
    check_int32("segment_ids", segment_ids)
    check_int32("span_ids", span_ids)
    return int(seq_len), int(num_shards)


class Uniform(AbstractShardingStrategy):
    """Contiguous, equal shards: shard `s` holds tokens `[s * C, (s + 1) * C)`.

    A length not divisible by the shard count is padded at the end to the common
    capacity `C = ceil(seq_len / num_shards)`; the padding is masked out.

    Under a causal mask the work is unbalanced (the last shard attends to everything,
    the first to itself): see `Zigzag` and `Striped` for balanced alternatives.
    """

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        seq_len, num_shards = check_num_shards(seq_len, num_shards, segment_ids, span_ids)
        return contiguous_layout(
            seq_len, num_shards, segment_ids=segment_ids, span_ids=span_ids
        )
