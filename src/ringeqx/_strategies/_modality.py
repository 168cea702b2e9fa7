"""Shards that never split a span (an image, an audio clip)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._layout._layout import Layout, check_id_array, layout_from_order
from .._layout._tokens import Runs
from .._util._numbers import as_int
from ._base import AbstractShardingStrategy
from ._placement import (
    balanced_cuts,
    is_traced,
    order_from_pieces,
    runs,
    snap_cuts,
    zigzag_pieces,
)
from ._uniform import check_num_shards


@jax.jit(static_argnums=(1, 2))
def _pieces(
    spans: Int[Array, "batch seq"], num_pieces: int, zigzag: bool
) -> tuple[
    Int[Array, "batch shards pieces"], Int[Array, "batch shards pieces"], Int[Array, " batch"]
]:
    """Starts and lengths of each shard's pieces, and the longest span, per example."""

    def one(spans):
        n = spans.shape[0]
        t = jnp.arange(n + 1, dtype=jnp.int32)
        inside = (spans[1:] >= 0) & (spans[1:] == spans[:-1])
        # A cut before token t is allowed unless t continues the span of token t - 1.
        edge = jnp.ones((1,), bool)
        allowed = jnp.concatenate([edge, ~inside, edge])
        allowed = jnp.sort(jnp.where(allowed, t, n))
        ideal = jnp.asarray(balanced_cuts(n, num_pieces))
        cuts = snap_cuts(ideal, allowed, split_longer_than=None)
        if zigzag:
            starts, lengths = zigzag_pieces(cuts)
        else:
            starts, lengths = cuts[:-1, None], (cuts[1:] - cuts[:-1])[:, None]
        _, _, run_len = runs(spans)
        longest = jnp.max(jnp.where(spans >= 0, run_len, 0))
        return starts, lengths, longest

    return jax.vmap(one)(spans)


def _flat_spans(span_ids, seq_len: int) -> Int[Array, "batch seq"]:
    if span_ids is None:
        return jnp.full((1, seq_len), -1, jnp.int32)
    return check_id_array("span_ids", span_ids, seq_len).reshape(-1, seq_len)


@eqx.filter_jit
def _modality_layout(
    spans: Int[Array, "batch seq"],
    num_shards: int,
    zigzag: bool,
    capacity: int,
    check: bool,
    segment_ids,
    span_ids,
) -> Layout:
    seq_len = spans.shape[-1]
    num_pieces = 2 * num_shards if zigzag else num_shards
    starts, lengths, longest = _pieces(spans, num_pieces, zigzag)
    orders = jax.vmap(lambda s, n: order_from_pieces(s, n, capacity))(starts, lengths)
    if check:
        orders = eqx.error_if(
            orders,
            jnp.any(longest > capacity),
            f"A span is longer than ModalityAware `capacity`={capacity}; spans are never split.",
        )
        orders = eqx.error_if(
            orders,
            jnp.any(jnp.sum(lengths, axis=-1) > capacity),
            f"ModalityAware `capacity`={capacity} is too small for the tokens.",
        )
    batch = () if span_ids is None else jnp.shape(span_ids)[:-1]
    orders = orders.reshape(batch + (num_shards, capacity))
    # One run per shard without zigzag; with it the tail piece starts wherever the cuts
    # (traced: they follow the spans) put the head piece's end.
    runs = None if zigzag else Runs((0,), capacity)
    return layout_from_order(
        orders, seq_len, segment_ids=segment_ids, span_ids=span_ids, runs=runs
    )


class ModalityAware(AbstractShardingStrategy):
    """Keep every span (an image's tokens, an audio clip) whole on one device; text fills
    around them.

    The sequence is cut into even pieces (`2P` pieces in zigzag order, for causal
    balance, or `P` contiguous ones), then every cut that falls inside a span moves to the
    nearer end of that span. A span is a run of equal, non-negative `span_ids` (-1 for
    text). Inside a span, attention can be bidirectional (a span mask) without any
    communication beyond the ring's.

    **Arguments:**

    - `capacity`: slots per shard (static). Default: the smallest that fits, which needs
        concrete `span_ids`; with traced span ids (under `jit`), pass it. A span longer
        than the capacity is an error.
    - `zigzag`: place pieces `i` and `2P - 1 - i` on device `i` (default), balancing
        causal attention like [`ringeqx.Zigzag`][]; False gives contiguous shards.

    **Example:**

    ```python
    span_ids = jnp.full(4096, -1).at[1000:1576].set(0)  # one image of 576 tokens
    layout = ringeqx.ModalityAware().layout(4096, 8, span_ids=span_ids)
    ```
    """

    capacity: int | None = eqx.field(static=True, default=None, converter=as_int)
    zigzag: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        cap = self.capacity
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"ModalityAware `capacity` must be an integer >= 1 or None; got {cap!r}."
            )

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        seq_len, num_shards = check_num_shards(seq_len, num_shards, segment_ids, span_ids)
        # Concrete span ids (even closed over by an outer jit) allow trace-time checks and
        # the smallest capacity; traced ones are checked when the program runs.
        traced = is_traced(span_ids)
        if traced and self.capacity is None:
            raise ValueError(
                "ModalityAware with traced `span_ids` (under jit) needs a static "
                "`capacity`: pass ModalityAware(capacity=...)."
            )
        if not traced:
            num_pieces = 2 * num_shards if self.zigzag else num_shards
            with jax.ensure_compile_time_eval():
                spans = _flat_spans(span_ids, seq_len)
                _, lengths, longest = _pieces(spans, num_pieces, self.zigzag)
            sizes = np.asarray(lengths).sum(axis=-1)
            capacity = max(int(sizes.max()), 1) if self.capacity is None else self.capacity
            span = int(np.max(np.asarray(longest)))
            if span > capacity:
                raise ValueError(
                    f"A span of {span} tokens is longer than ModalityAware `capacity`="
                    f"{capacity}; spans are never split."
                )
            if sizes.max() > capacity:
                raise ValueError(
                    f"ModalityAware `capacity`={capacity} is too small for the tokens: "
                    f"the shards hold {sizes.tolist()} tokens."
                )
        else:
            capacity = self.capacity
        spans = _flat_spans(span_ids, seq_len)
        return _modality_layout(
            spans, num_shards, self.zigzag, capacity, traced, segment_ids, span_ids
        )
