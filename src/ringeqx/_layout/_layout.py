"""The `Layout`: where every token of a sharded sequence lives."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Shaped

from .._util._numbers import check_int32, is_int
from ._tokens import Runs, TokenInfo


class Layout(eqx.Module):
    """A placement of `seq_len` tokens on `num_shards` shards of `capacity` slots each.

    Slot `c` of shard `s` holds the original token `positions[s, c]`, with its segment id
    and span id, unless `valid[s, c]` is False (a padding slot: shards have one common
    capacity because SPMD programs need equal shapes). Activations in *layout order* are
    arrays whose sequence axis has `num_shards * capacity` entries, shard after shard; that
    axis is what the ring shards over its mesh axis.

    Masks only look at positions, segments and spans, so attention is exact for any
    layout: a strategy changes speed, never the answer.

    **Fields:**

    - `positions`: `int32[*batch, shards, capacity]`, original token index per slot (any
        value in padding slots).
    - `segments`: `int32[*batch, shards, capacity]`, segment (document) id per slot.
    - `spans`: `int32[*batch, shards, capacity]`, span id per slot, -1 for none.
    - `valid`: `bool[*batch, shards, capacity]`, False for padding.
    - `seq_len`: static, the length of the original sequence.
    - `contiguous`: static, True when every shard holds one run of consecutive positions
        and shard `s + 1` continues where shard `s` ended, with no short shard in the middle
        (Uniform; not Boundary, whose shards may be short). Masks with a bounded
        `max_distance` then need fewer ring steps.
    - `in_order`: static, True when slot `i` of the layout-order axis holds token `i` and
        the padding is all at the end ([`ringeqx.contiguous_layout`][], `Uniform`): then
        `shard`/`unshard` pad and slice instead of gathering, and sequence-sharded arrays
        keep their sharding.
    - `runs`: static, a [`ringeqx.Runs`][] of period `capacity`: where each shard's runs
        of consecutive positions start, the same in every shard (and every example), or
        None when that is not known at trace time. A `contiguous` layout is one run per
        shard without it. The Pallas kernels read it from `token_info()` to run
        `BlockSparse` without a run-time check.

    A layout with leading batch axes (made from batched segment ids) describes each example
    separately.
    """

    positions: Int[Array, "*batch shards capacity"]
    segments: Int[Array, "*batch shards capacity"]
    spans: Int[Array, "*batch shards capacity"]
    valid: Bool[Array, "*batch shards capacity"]
    seq_len: int = eqx.field(static=True)
    contiguous: bool = eqx.field(static=True, default=False)
    in_order: bool = eqx.field(static=True, default=False)
    runs: Runs | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        shape = self.positions.shape
        if len(shape) < 2:
            raise ValueError(
                "Layout arrays must be [*batch, shards, capacity]; got positions of shape "
                f"{shape}."
            )
        for name in ("segments", "spans", "valid"):
            got = getattr(self, name).shape
            if got != shape:
                raise ValueError(
                    f"Layout.{name} must have the shape of positions {shape}; got {got}."
                )
        if self.runs is not None and self.runs.period != shape[-1]:
            raise ValueError(
                f"Layout `runs` must describe a shard: period = capacity = {shape[-1]}; "
                f"got period {self.runs.period}."
            )

    @property
    def num_shards(self) -> int:
        return self.positions.shape[-2]

    @property
    def capacity(self) -> int:
        return self.positions.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.positions.shape[:-2]

    @property
    def sharded_len(self) -> int:
        """Length of the sequence axis in layout order: `num_shards * capacity`."""
        return self.num_shards * self.capacity

    def token_info(self) -> TokenInfo:
        """Per-slot records in layout order, `[*batch, shards * capacity]`, with the
        layout's `runs` (one run per shard for a `contiguous` layout)."""
        flat = self.batch_shape + (self.sharded_len,)
        runs = self.runs
        if runs is None and self.contiguous:
            runs = Runs((0,), self.capacity)
        return TokenInfo(
            self.positions.reshape(flat),
            self.segments.reshape(flat),
            self.spans.reshape(flat),
            self.valid.reshape(flat),
            runs,
        )

    def _seq_axis(self, x, length: int, axis: int | None, method: str) -> int:
        """The sequence axis of `x`: `axis`, or the first axis after the layout's batch
        axes whose length is `length`."""
        nb = len(self.batch_shape)
        if x.shape[:nb] != self.batch_shape:
            raise ValueError(
                f"Layout.{method}: the layout has batch shape {self.batch_shape}, so the "
                f"array must start with it; got shape {x.shape}."
            )
        if axis is None:
            found = [a for a in range(nb, x.ndim) if x.shape[a] == length]
            if not found:
                raise ValueError(
                    f"Layout.{method} expected an array with an axis of length {length} "
                    f"after the layout's batch axes {self.batch_shape}; got shape {x.shape}."
                )
            return found[0]
        axis = axis % x.ndim if -x.ndim <= axis < x.ndim else axis
        if not nb <= axis < x.ndim or x.shape[axis] != length:
            raise ValueError(
                f"Layout.{method}: `axis`={axis} must be an axis of length {length} after "
                f"the layout's batch axes {self.batch_shape}; got shape {x.shape}."
            )
        return axis

    def _per_example(self, fn, x, axis: int):
        """Run `fn(layout, x, axis)` with the layout's batch axes mapped by `jax.vmap`."""
        for _ in self.batch_shape:
            fn = jax.vmap(fn, in_axes=(0, 0, None))
        nb = len(self.batch_shape)
        return fn(self, x, axis - nb)

    def shard(
        self, x: Shaped[Array, "..."], *, axis: int | None = None
    ) -> Shaped[Array, "..."]:
        """Move arrays from original order to layout order; padding slots get zeros.

        A layout in the original order (`in_order`: [`ringeqx.contiguous_layout`][],
        `Uniform`) only pads the end of the sequence axis, so a sequence-sharded `x` stays
        sharded and no device gathers the sequence. Other layouts gather.

        **Arguments:**

        - `x`: `[*batch, seq_len, *rest]`; it starts with the layout's batch shape when the
            layout is batched, and may have further leading batch axes otherwise.
        - `axis`: the sequence axis (default: the first axis after the layout's batch
            axes whose length is `seq_len`; give it when a batch axis has that length too).

        **Returns:** `x` with the sequence axis in layout order (`num_shards * capacity`).
        """
        axis = self._seq_axis(x, self.seq_len, axis, "shard")
        if self.in_order:
            pad = [(0, 0)] * x.ndim
            pad[axis] = (0, self.sharded_len - self.seq_len)
            return jnp.pad(x, pad)

        def one(layout, x, axis):
            idx = jnp.clip(layout.positions.reshape(-1), 0, layout.seq_len - 1)
            keep = layout.valid.reshape((-1,) + (1,) * (x.ndim - axis - 1))
            return jnp.where(keep, jnp.take(x, idx, axis=axis), jnp.zeros((), x.dtype))

        return self._per_example(one, x, axis)

    def unshard(
        self, y: Shaped[Array, "..."], *, axis: int | None = None
    ) -> Shaped[Array, "..."]:
        """Move arrays from layout order back to original order (drops padding).

        The inverse of [`ringeqx.Layout.shard`][], with the same batching and `axis`
        rules; a layout in the original order only slices the padding off the end.
        """
        axis = self._seq_axis(y, self.sharded_len, axis, "unshard")
        if self.in_order:
            return jax.lax.slice_in_dim(y, 0, self.seq_len, axis=axis)

        def one(layout, y, axis):
            # Gather through the inverse permutation (slot of each original token): the
            # scatter runs on small int arrays only, and the gather's transpose is cheap.
            idx = jnp.where(
                layout.valid.reshape(-1), layout.positions.reshape(-1), layout.seq_len
            )
            slots = jnp.arange(layout.sharded_len, dtype=jnp.int32)
            inverse = jnp.zeros(layout.seq_len, jnp.int32).at[idx].set(slots, mode="drop")
            return jnp.take(y, inverse, axis=axis)

        return self._per_example(one, y, axis)


def check_id_array(name: str, ids, seq_len: int) -> Array:
    check_int32(name, ids)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"`{name}` must be an integer array; got dtype {ids.dtype}.")
    if ids.ndim < 1 or ids.shape[-1] != seq_len:
        raise ValueError(
            f"`{name}` must have shape [*batch, seq_len={seq_len}]; got shape {ids.shape}."
        )
    return ids.astype(jnp.int32)


def _check_all_ids(segment_ids, span_ids, seq_len: int):
    """Checked segment and span ids (or None) and the batch shape they broadcast to."""
    batch = ()
    if segment_ids is not None:
        segment_ids = check_id_array("segment_ids", segment_ids, seq_len)
        batch = segment_ids.shape[:-1]
    if span_ids is not None:
        span_ids = check_id_array("span_ids", span_ids, seq_len)
        batch = jnp.broadcast_shapes(batch, span_ids.shape[:-1])
    return segment_ids, span_ids, batch


def layout_from_order(
    order: Int[Array, "*#batch shards capacity"],
    seq_len: int,
    *,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
    contiguous: bool = False,
    runs: Runs | None = None,
) -> Layout:
    """Build a `Layout` from the original index held by each slot (`-1` = padding).

    This is the one constructor every strategy uses: a strategy only decides `order`.

    **Arguments:**

    - `order`: for each shard and slot, the original token index or -1 for padding.
    - `seq_len`: length of the original sequence.
    - `segment_ids`, `span_ids`: optional per-token ids in original order; batched ids
        give a batched layout.
    - `contiguous`: whether shards hold consecutive runs in shard order.
    - `runs`: where runs of consecutive positions start in every shard, when the
        strategy knows it statically (see [`ringeqx.Runs`][]): a claim about every value
        `order` may take, which the Pallas kernels trust.
    """
    order = jnp.asarray(order, jnp.int32)
    valid = order >= 0
    pos = jnp.where(valid, order, 0)
    segment_ids, span_ids, batch = _check_all_ids(segment_ids, span_ids, seq_len)
    batch = jnp.broadcast_shapes(batch, order.shape[:-2])
    shape = batch + order.shape[-2:]

    def take(ids, fill):
        if ids is None:
            return jnp.full(shape, fill, jnp.int32)
        ids = jnp.broadcast_to(ids, batch + (seq_len,))
        g = jnp.take_along_axis(
            ids, jnp.broadcast_to(pos, shape).reshape(batch + (-1,)), axis=-1
        ).reshape(shape)
        return jnp.where(jnp.broadcast_to(valid, shape), g, fill)

    return Layout(
        positions=jnp.broadcast_to(pos, shape),
        segments=take(segment_ids, -1),
        spans=take(span_ids, -1),
        valid=jnp.broadcast_to(valid, shape),
        seq_len=seq_len,
        contiguous=contiguous,
        runs=runs,
    )



def contiguous_layout(
    seq_len: int,
    num_shards: int,
    *,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
) -> Layout:
    """Contiguous, equal shards in the original order: shard `s` holds tokens
    `[s * C, (s + 1) * C)` with `C = ceil(seq_len / num_shards)`, padding at the end.

    Built by padding and reshaping only (no gather), so per-token ids that are sharded
    over the sequence stay sharded. This is the layout `ring_attention` uses without
    `layout=`, and the one `Uniform` returns.

    **Arguments:**

    - `seq_len`: length of the original sequence.
    - `num_shards`: devices on the ring.
    - `segment_ids`, `span_ids`: optional per-token ids `[*batch, seq_len]`; batched ids
        give a batched layout.

    **Returns:** a [`ringeqx.Layout`][] with `contiguous=True` and `in_order=True`.
    """
    if not is_int(num_shards) or num_shards < 1:
        raise ValueError(f"`num_shards` must be an integer >= 1; got {num_shards!r}.")
    if not is_int(seq_len) or seq_len < 1:
        raise ValueError(f"`seq_len` must be an integer >= 1; got {seq_len!r}.")
    seq_len, num_shards = int(seq_len), int(num_shards)
    capacity = math.ceil(seq_len / num_shards)
    total = num_shards * capacity
    segment_ids, span_ids, batch = _check_all_ids(segment_ids, span_ids, seq_len)
    shape = batch + (num_shards, capacity)

    def slots(ids):
        if ids is None:
            return jnp.full(shape, -1, jnp.int32)
        ids = jnp.broadcast_to(ids, batch + (seq_len,))
        pad = [(0, 0)] * len(batch) + [(0, total - seq_len)]
        return jnp.pad(ids, pad, constant_values=-1).reshape(shape)

    idx = jnp.arange(total, dtype=jnp.int32).reshape(num_shards, capacity)
    return Layout(
        positions=jnp.broadcast_to(jnp.where(idx < seq_len, idx, 0), shape),
        segments=slots(segment_ids),
        spans=slots(span_ids),
        valid=jnp.broadcast_to(idx < seq_len, shape),
        seq_len=seq_len,
        contiguous=True,
        in_order=True,
        runs=Runs((0,), capacity),
    )
