"""The abstract sharding strategy."""

import abc
import warnings

import equinox as eqx
from jaxtyping import Array, Int

from .._kernels._base import AbstractAttentionKernel
from .._kernels._select import KernelName
from .._layout._layout import Layout
from .._masks._base import AbstractMask


class AbstractShardingStrategy(eqx.Module):
    """Decides which shard holds each token, and in what order.

    A strategy only produces a [`ringeqx.Layout`][]; masks read positions and segment ids
    from it, so every strategy gives the exact answer and differs only in speed. Array
    fields of a strategy are pytree leaves: new values do not recompile.

    Subclass it to write your own strategy (see the README): implement `layout`, and build
    the result with [`ringeqx.layout_from_order`][].
    """

    @abc.abstractmethod
    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        """Place `seq_len` tokens on `num_shards` shards.

        **Arguments:**

        - `seq_len`: length of the original sequence.
        - `num_shards`: number of devices on the ring.
        - `segment_ids`: optional document id per token (`[*batch, seq_len]`); a batched
            array gives a batched layout.
        - `span_ids`: optional span id per token (-1 for none): spans that must stay whole.

        **Returns:** a `Layout` with `num_shards` shards.
        """

    def schedule(
        self,
        layout: Layout,
        mask: AbstractMask,
        *,
        kernel: KernelName | AbstractAttentionKernel = "auto",
    ):
        """Deprecated: [`ringeqx.tools.schedule`][]`(layout, mask, kernel=kernel)`, which
        this alias warns and calls; it goes in the next release (a strategy produces
        layouts only, and a schedule is a tool)."""
        warnings.warn(
            "`strategy.schedule(layout, mask)` is deprecated: use "
            "`ringeqx.tools.schedule(layout, mask)`.",
            DeprecationWarning,
            stacklevel=2,
        )
        # The core's one import of a tool, inside the deprecated alias and named in
        # tests/test_architecture.py; both go with the alias.
        from ..tools._schedule import schedule

        return schedule(layout, mask, kernel=kernel)
