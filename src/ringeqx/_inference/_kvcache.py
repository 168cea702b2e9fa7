"""`KVCache`: keys and values of a sequence sharded over the ring, with their token records."""

import math

import equinox as eqx
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from .._layout._layout import Layout
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._ring._mesh import place


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
    - `overflow`: True once a decode step was not exact: a token found no slot (its key
        and value were dropped), or a layer's mask let an earlier token see it (a mask
        a cache cannot serve), or (found at run time) the step's token id was outside
        the vocabulary or `length` had been edited. [`ringeqx.nn.RingTransformerLM.decode`][]
        raises instead by default; with `on_overflow="flag"` it only sets this flag, for
        callers that check it once after their loop ([`ringeqx.generate`][] does, and
        raises), so the compiled step has no host callback. A flagged cache stays
        flagged: no later step is exact, so decoding it with the default
        `on_overflow="error"` raises.
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
        # A cache built by hand: every shape and dtype decoding relies on. Trailing axes
        # only, so that a batch of caches (out of `jax.vmap`) passes too.
        p = self.num_shards
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ValueError(f"KVCache `num_shards` must be an integer >= 1; got {p!r}.")
        r = self.records
        shape = jnp.shape(r.positions)
        for name in ("segments", "spans", "valid"):
            got = jnp.shape(getattr(r, name))
            if got != shape:
                raise ValueError(
                    f"KVCache `records.{name}` must have the shape of `records.positions` "
                    f"{shape}; got {got}."
                )
        dtypes = {"positions": jnp.int32, "segments": jnp.int32, "spans": jnp.int32}
        for name, dtype in {**dtypes, "valid": jnp.bool_}.items():
            got = jnp.result_type(getattr(r, name))
            if got != dtype:
                raise TypeError(
                    f"KVCache `records.{name}` must have dtype {jnp.dtype(dtype).name}; "
                    f"got {got}."
                )
        slots = shape[-1] if shape else 0
        if not shape or slots % p != 0:
            raise ValueError(
                f"KVCache `records` must have num_shards * capacity slots; got {slots} "
                f"slots for num_shards={p}."
            )
        if len(self.keys) != len(self.values):
            raise ValueError(
                f"KVCache needs one `values` array per `keys` array; got {len(self.keys)} "
                f"and {len(self.values)}."
            )
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            got = jnp.shape(k)
            if len(got) < 3 or got[-2] != slots:
                raise ValueError(
                    f"KVCache `keys[{i}]` must have shape [kv_heads, slots={slots}, "
                    f"head_dim] (one slot per record); got shape {got}."
                )
            if jnp.shape(v) != got:
                raise ValueError(
                    f"KVCache `values[{i}]` must have the shape of `keys[{i}]` {got}; got "
                    f"{jnp.shape(v)}."
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
        return new_token(self.length, self.segment)

    def length_fits(self) -> Bool[Array, ""]:
        """Whether `length` is what prefill and decode leave: one past the position of
        the latest token held, or, once `overflow` is set (dropped tokens hold no slot),
        at least that. Anything else (a `length` edited back, forward or below 0) would
        give the next token a position that repeats or skips one."""
        held = jnp.where(self.records.valid, self.records.positions, -1)
        after = jnp.max(held, axis=-1, initial=-1) + 1
        return jnp.where(self.overflow, self.length >= after, self.length == after)

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


def prefill_cache(
    layout: Layout,
    keys: tuple[Array, ...],
    values: tuple[Array, ...],
    max_new_tokens: int,
    mesh,
    axis_name: str,
) -> KVCache:
    """The `KVCache` of the prompt in `layout` (one example: an unbatched layout), from
    each layer's heads-major keys and values in layout order, with room for
    `max_new_tokens` more, spread round robin (`ceil(max_new_tokens / num_shards)` free
    slots per device). Its keys and values are sharded over the ring axis `axis_name` of
    `mesh` (their slot axis), its records whole on every device."""
    p = layout.num_shards
    capacity = layout.capacity + math.ceil(max_new_tokens / p)
    info = layout.token_info()

    def grow(x, axis, fill):
        return _grow(x, axis, p, capacity, fill)

    records = TokenInfo(
        grow(info.positions, 0, 0),
        grow(info.segments, 0, -1),
        grow(info.spans, 0, -1),
        grow(info.valid, 0, False),
    )
    keys, values = place(
        (tuple(grow(k, 1, 0) for k in keys), tuple(grow(v, 1, 0) for v in values)),
        mesh,
        PartitionSpec(None, axis_name),
    )
    return KVCache(
        keys=keys,
        values=values,
        records=replicated(records, mesh),
        length=jnp.asarray(layout.seq_len, jnp.int32),
        segment=last_segment(info, layout.seq_len),
        overflow=jnp.zeros((), bool),
        num_shards=p,
    )


def sees_ahead(mask: AbstractMask, records: TokenInfo, new: TokenInfo) -> Bool[Array, "*slots"]:
    """Which earlier tokens of `records` the mask lets attend to the later token `new`
    (scalar records): their cached keys and values would need recomputing, which no
    KV cache does."""
    return mask.allows(records, new) & records.valid & (records.positions < new.positions)


def last_segment(info: TokenInfo, seq_len: int) -> Int[Array, ""]:
    """The segment of the token at position `seq_len - 1`: the one new tokens continue."""
    last = info.valid & (info.positions == seq_len - 1)
    return jnp.max(jnp.where(last, info.segments, jnp.iinfo(jnp.int32).min)).astype(jnp.int32)


def new_token(position, segment) -> TokenInfo:
    """The records of a generated token (scalars): at `position`, in `segment`, in no
    span, valid."""
    return TokenInfo(
        jnp.asarray(position, jnp.int32),
        segment,
        jnp.full((), -1, jnp.int32),
        jnp.ones((), bool),
    )
