"""`KVCache`: keys and values of a sequence sharded over the ring, with their token records."""

import math

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from ._layout import Layout
from ._mesh import place
from ._tokens import TokenInfo


_BIG = jnp.iinfo(jnp.int32).max


class KVCache(eqx.Module):
    """Keys and values of every layer, sharded over the ring axis, for decoding.

    The cache has `num_shards * capacity` slots in *layout order*: slot `c` of device `s`
    is `s * capacity + c`, the same convention as [`ringeqx.Layout`][], so its slot axis
    is what the ring's mesh axis shards. Each slot carries the token records the ring
    uses ([`ringeqx.TokenInfo`][]: original position, segment, span, validity), so every
    mask (causal, document, sliding window, ...) and score modifier reads the cache
    exactly as it reads a ring shard, whatever strategy placed the prompt.

    Made by [`ringeqx.nn.RingTransformerLM.prefill`][] (the prompt, in the layout the
    ring used) and advanced by [`ringeqx.nn.RingTransformerLM.decode`][]. The token at
    position `n` goes to device `n % num_shards` (round robin, as serving engines do,
    so no device fills first), into that device's first free slot; when the device has
    none and every layer's mask looks back at most `max_distance()` tokens (sliding
    windows), the device's oldest token is evicted once no future query can see it.

    **Fields:**

    - `keys`, `values`: one array per layer, heads-major
        `[kv_heads, num_shards * capacity, head_dim]` (rotary embeddings applied).
    - `records`: the [`ringeqx.TokenInfo`][] of every slot, `[num_shards * capacity]`;
        small, so every device keeps all of them (no collective to find a free slot).
    - `length`: the position of the next token (the tokens so far).
    - `segment`: the segment (document) id new tokens belong to: the prompt's last.
    - `overflow`: True once a token found no slot (its key and value were dropped, so
        later steps are no longer exact). Checking it is the caller's choice, outside
        the decode loop ([`ringeqx.generate`][] raises), so the compiled step has no host
        callback and no extra collective.
    - `num_shards`: static, the devices on the ring.
    """

    keys: tuple[Float[Array, "kv_heads slots head_dim"], ...]
    values: tuple[Float[Array, "kv_heads slots head_dim"], ...]
    records: TokenInfo
    length: Int[Array, ""]
    segment: Int[Array, ""]
    overflow: Bool[Array, ""]
    num_shards: int = eqx.field(static=True)

    def __check_init__(self):
        slots = self.records.positions.shape[-1]
        if slots % self.num_shards != 0:
            raise ValueError(
                f"KVCache `records` must have num_shards * capacity slots; got {slots} "
                f"slots for num_shards={self.num_shards}."
            )
        if len(self.keys) != len(self.values):
            raise ValueError(
                f"KVCache needs one `values` array per `keys` array; got {len(self.keys)} "
                f"and {len(self.values)}."
            )

    @property
    def capacity(self) -> int:
        """Slots per device."""
        return self.records.positions.shape[-1] // self.num_shards

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def query(self) -> TokenInfo:
        """The records of the next token (scalars): position `length`, the cache's
        segment, no span, valid."""
        return TokenInfo(self.length, self.segment, jnp.full((), -1, jnp.int32), jnp.ones((), bool))

    def next_slot(self, max_distance: int | None) -> tuple[Int[Array, ""], Bool[Array, ""]]:
        """The slot of the next token, and whether it may go there (if not, the token
        must be dropped: write it at slot -1, which no device holds).

        Device `length % num_shards`; there its first free slot, else (with a static
        `max_distance`, the largest of every layer's mask) its oldest token, which may be
        evicted when `length - position > max_distance`: no query from now on sees it.
        """
        p, c = self.num_shards, self.capacity
        device = self.length % p
        rows = (jnp.arange(p, dtype=jnp.int32) == device)[:, None]
        valid = self.records.valid.reshape(p, c)
        positions = self.records.positions.reshape(p, c)
        free = (rows & ~valid).reshape(-1)
        has_free = jnp.any(free)
        held = jnp.where(rows & valid, positions, _BIG).reshape(-1)
        oldest = jnp.argmin(held).astype(jnp.int32)
        slot = jnp.where(has_free, jnp.argmax(free).astype(jnp.int32), oldest)
        if max_distance is None:
            return slot, has_free
        return slot, has_free | (self.length - jnp.min(held) > max_distance)

    def write_records(self, slot: Int[Array, ""]) -> TokenInfo:
        """The records with the next token's written at `slot` (elementwise, so it needs
        no collective whatever the records' sharding)."""
        here = jnp.arange(self.records.positions.shape[-1], dtype=jnp.int32) == slot
        new = self.query()
        return TokenInfo(
            *(
                jnp.where(here, getattr(new, f), getattr(self.records, f))
                for f in ("positions", "segments", "spans", "valid")
            )
        )


def replicated(records: TokenInfo, mesh) -> TokenInfo:
    """`records` kept whole on every device. XLA would otherwise shard them like the
    cache they describe, and then finding the next slot would gather them every step."""
    return place(records, mesh, PartitionSpec())


def _grow(x: Array, axis: int, num_shards: int, capacity: int, fill) -> Array:
    """`x` with its layout-order `axis` of `num_shards * c` slots grown to `num_shards *
    capacity` (the new slots at the end of each shard, filled with `fill`)."""
    shape = x.shape
    c = shape[axis] // num_shards
    x = x.reshape(shape[:axis] + (num_shards, c) + shape[axis + 1 :])
    pad = [(0, 0)] * x.ndim
    pad[axis + 1] = (0, capacity - c)
    x = jnp.pad(x, pad, constant_values=fill)
    return x.reshape(shape[:axis] + (num_shards * capacity,) + shape[axis + 1 :])


def cache_capacity(layout: Layout, max_new_tokens: int) -> int:
    """Slots per device for the prompt in `layout` and `max_new_tokens` more, spread
    round robin (at most `ceil(max_new_tokens / num_shards)` per device)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be an integer >= 0; got {max_new_tokens!r}.")
    return layout.capacity + math.ceil(max_new_tokens / layout.num_shards)


def prefill_cache(
    layout: Layout,
    keys: tuple[Array, ...],
    values: tuple[Array, ...],
    capacity: int,
) -> KVCache:
    """A `KVCache` of the prompt in `layout` (one example: an unbatched layout), from
    each layer's heads-major keys and values in layout order, with `capacity` slots per
    device."""
    p = layout.num_shards
    info = layout.token_info()

    def grow(x, axis, fill):
        return _grow(x, axis, p, capacity, fill)

    records = TokenInfo(
        grow(info.positions, 0, 0),
        grow(info.segments, 0, -1),
        grow(info.spans, 0, -1),
        grow(info.valid, 0, False),
    )
    last = info.valid & (info.positions == layout.seq_len - 1)
    segment = jnp.max(jnp.where(last, info.segments, jnp.iinfo(jnp.int32).min))
    return KVCache(
        keys=tuple(grow(k, 1, 0) for k in keys),
        values=tuple(grow(v, 1, 0) for v in values),
        records=records,
        length=jnp.asarray(layout.seq_len, jnp.int32),
        segment=segment.astype(jnp.int32),
        overflow=jnp.zeros((), bool),
        num_shards=p,
    )


def place_cache(cache: KVCache, mesh, axis_name: str) -> KVCache:
    """The cache's keys and values sharded over the ring axis (their slot axis) and its
    records whole on every device."""
    kv = place((cache.keys, cache.values), mesh, PartitionSpec(None, axis_name))
    records = replicated(cache.records, mesh)
    return eqx.tree_at(lambda c: (c.keys, c.values, c.records), cache, (*kv, records))
