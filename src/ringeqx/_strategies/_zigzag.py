"""Zigzag shards: each device holds one chunk from the head and one from the tail."""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._layout._layout import Layout, layout_from_order
from .._layout._tokens import Runs
from ._base import AbstractShardingStrategy
from ._placement import balanced_cuts, order_from_pieces, zigzag_pieces
from ._uniform import check_num_shards


@eqx.filter_jit
def _zigzag_layout(seq_len: int, num_shards: int, segment_ids, span_ids) -> Layout:
    cuts = balanced_cuts(seq_len, 2 * num_shards)
    starts, lengths = zigzag_pieces(jnp.asarray(cuts))
    capacity = 2 * math.ceil(seq_len / (2 * num_shards))
    order = order_from_pieces(starts, lengths, capacity)
    # Each shard's tail chunk starts right after its head chunk, whose length (static:
    # the cuts are) differs by at most one between shards; on one shard the two chunks
    # are one run.
    heads = np.diff(cuts)[:num_shards] if num_shards > 1 else []
    runs = Runs(sorted({0} | {int(n) for n in heads if 0 < n < capacity}), capacity)
    return layout_from_order(
        order, seq_len, segment_ids=segment_ids, span_ids=span_ids, runs=runs
    )


class Zigzag(AbstractShardingStrategy):
    r"""Cut the sequence into `2P` chunks; device `i` holds chunk `i` and chunk `2P - 1 - i`.

    Under a causal mask every device then does the same work at every ring step: a
    device pairs an early chunk (little to attend to) with a late one (a lot), and at each
    step its two query chunks see exactly two full key chunks' worth of keys. Chunk
    lengths differ by at most one token, so any `seq_len` works; shards are padded to
    `2 * ceil(seq_len / 2P)` slots.

    **Example:**

    ```python
    layout = ringeqx.Zigzag().layout(seq_len=8192, num_shards=8)
    ringeqx.tools.schedule(layout, ringeqx.Causal()).imbalance  # 1.0
    ```

    ??? cite "Zigzag ring attention (as in Megatron-LM context parallelism)"

        ```bibtex
        @misc{zhu2024ringflashattention,
          title={ring-flash-attention},
          author={Zhu, Zilin},
          howpublished={\url{https://github.com/zhuzilin/ring-flash-attention}},
          year={2024}
        }
        ```
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
        return _zigzag_layout(seq_len, num_shards, segment_ids, span_ids)
