"""The `Layout`: where every token of a sharded sequence lives."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Shaped

from ._tokens import TokenInfo


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

    A layout with leading batch axes (made from batched segment ids) describes each example
    separately.
    """

    positions: Int[Array, "*batch shards capacity"]
    segments: Int[Array, "*batch shards capacity"]
    spans: Int[Array, "*batch shards capacity"]
    valid: Bool[Array, "*batch shards capacity"]
    seq_len: int = eqx.field(static=True)
    contiguous: bool = eqx.field(static=True, default=False)

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
        """Per-slot records in layout order, `[*batch, shards * capacity]`."""
        flat = self.batch_shape + (self.sharded_len,)
        return TokenInfo(
            self.positions.reshape(flat),
            self.segments.reshape(flat),
            self.spans.reshape(flat),
            self.valid.reshape(flat),
        )

    def shard(self, x: Shaped[Array, " seq *rest"]) -> Shaped[Array, " sharded *rest"]:
        """Move one example from original order to layout order; padding slots get zeros.

        **Arguments:**

        - `x`: an array whose leading axis is the original sequence (`seq_len`).

        **Returns:** the array in layout order, leading axis `num_shards * capacity`.
        Use `jax.vmap` for batches (over the layout too if it is batched).
        """
        if self.batch_shape:
            raise ValueError(
                "Layout.shard handles one example; this layout has batch shape "
                f"{self.batch_shape}: use jax.vmap over the layout and the array."
            )
        if x.ndim < 1 or x.shape[0] != self.seq_len:
            raise ValueError(
                f"Layout.shard expected an array with leading axis seq_len={self.seq_len}; "
                f"got shape {x.shape}."
            )
        idx = jnp.clip(self.positions.reshape(-1), 0, self.seq_len - 1)
        gathered = x[idx]
        keep = self.valid.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, gathered, jnp.zeros((), x.dtype))

    def unshard(self, y: Shaped[Array, " sharded *rest"]) -> Shaped[Array, " seq *rest"]:
        """Move one example from layout order back to original order (drops padding)."""
        if self.batch_shape:
            raise ValueError(
                "Layout.unshard handles one example; this layout has batch shape "
                f"{self.batch_shape}: use jax.vmap over the layout and the array."
            )
        if y.ndim < 1 or y.shape[0] != self.sharded_len:
            raise ValueError(
                "Layout.unshard expected an array with leading axis "
                f"num_shards * capacity={self.sharded_len}; got shape {y.shape}."
            )
        # Gather through the inverse permutation (slot of each original token): the
        # scatter runs on small int arrays only, and the gather's transpose is cheap.
        idx = jnp.where(self.valid.reshape(-1), self.positions.reshape(-1), self.seq_len)
        slots = jnp.arange(self.sharded_len, dtype=jnp.int32)
        inverse = jnp.zeros(self.seq_len, jnp.int32).at[idx].set(slots, mode="drop")
        return y[inverse]


def _check_ids(name: str, ids, seq_len: int) -> Array:
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"`{name}` must be an integer array; got dtype {ids.dtype}.")
    if ids.ndim < 1 or ids.shape[-1] != seq_len:
        raise ValueError(
            f"`{name}` must have shape [*batch, seq_len={seq_len}]; got shape {ids.shape}."
        )
    return ids.astype(jnp.int32)


def layout_from_order(
    order: Int[Array, "*#batch shards capacity"],
    seq_len: int,
    *,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
    contiguous: bool = False,
) -> Layout:
    """Build a `Layout` from the original index held by each slot (`-1` = padding).

    This is the one constructor every strategy uses: a strategy only decides `order`.

    **Arguments:**

    - `order`: for each shard and slot, the original token index or -1 for padding.
    - `seq_len`: length of the original sequence.
    - `segment_ids`, `span_ids`: optional per-token ids in original order; batched ids
        give a batched layout.
    - `contiguous`: whether shards hold consecutive runs in shard order.
    """
    order = jnp.asarray(order, jnp.int32)
    valid = order >= 0
    pos = jnp.where(valid, order, 0)
    batch = ()
    if segment_ids is not None:
        segment_ids = _check_ids("segment_ids", segment_ids, seq_len)
        batch = segment_ids.shape[:-1]
    if span_ids is not None:
        span_ids = _check_ids("span_ids", span_ids, seq_len)
        batch = jnp.broadcast_shapes(batch, span_ids.shape[:-1])
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
    )

