"""`check_mask`: a randomised test of every rule of a mask that the ring and the kernels
act on (the block rules `may_attend` and `must_attend`, the bounds `max_distance` and
`max_lookahead`), against the mask's elementwise `allows`."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from .._layout._layout import Layout
from .._layout._tokens import BlockSummary, TokenInfo
from ._base import AbstractMask, block_rule, dense_rule


def _random_ids(key, seq_len: int, given, spans: bool) -> Array:
    """The given ids, or random runs (documents; spans with gaps of -1)."""
    if given is not None:
        return jnp.asarray(given, jnp.int32).reshape(seq_len)
    k1, k2 = jax.random.split(key)
    ids = jnp.cumsum(jax.random.bernoulli(k1, 0.2, (seq_len,))).astype(jnp.int32)
    if spans:
        ids = jnp.where(jax.random.bernoulli(k2, 0.5, (seq_len,)), ids, -1)
    return ids


def _blocks(key, seq_len: int, block: int, segments, spans, shuffle: bool) -> TokenInfo:
    """Tokens in a random order (or in order), cut into blocks `[blocks, block]`."""
    order = jax.random.permutation(key, seq_len) if shuffle else jnp.arange(seq_len)
    order = order.astype(jnp.int32)
    num = -(-seq_len // block)
    pad = num * block - seq_len

    def tile(x, fill):
        return jnp.pad(x, (0, pad), constant_values=fill).reshape(num, block)

    return TokenInfo(
        tile(order, 0),
        tile(segments[order], 0),
        tile(spans[order], -1),
        tile(jnp.ones(seq_len, bool), False),
    )


def _violations(mask: AbstractMask, info: TokenInfo):
    """Token pairs that break a rule of the mask, `[rules, qb, kb, q, k]` (`_RULES`)."""
    return _violations_between(mask, info, info)


def _layout_blocks(layout: Layout, block: int) -> list[tuple[Callable, TokenInfo]]:
    """The blocks the ring and the kernels judge by the block rule, for each example of
    `layout`: its shards `[shards, capacity]` (the ring skips whole steps) and tiles of
    `block` slots inside each shard `[shards * tiles, block]` (the kernels skip tiles),
    each with a function that names block `i`."""
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[-2:]), layout)
    info = TokenInfo(flat.positions, flat.segments, flat.spans, flat.valid)
    capacity = layout.capacity
    num = -(-capacity // block)

    def tiles(x, fill):
        x = jnp.pad(x, ((0, 0), (0, num * block - capacity)), constant_values=fill)
        return x.reshape(-1, block)

    out = []
    for example in range(info.positions.shape[0]):
        one = jax.tree.map(lambda x: x[example], info)
        fills = (0, -1, -1, False)
        fields = (one.positions, one.segments, one.spans, one.valid)
        tiled = TokenInfo(*(tiles(x, f) for x, f in zip(fields, fills)))
        where = f" of example {example}" if layout.batch_shape else ""
        out.append((lambda i, w=where: f"shard {i}{w}", one))
        tile = f"({block} slots) of shard"
        out.append((lambda i, w=where, t=tile: f"tile {i % num} {t} {i // num}{w}", tiled))
    return out


@eqx.filter_jit
def _block_pairs(mask: AbstractMask, q: TokenInfo, k: TokenInfo):
    """Which `[rules, qb, kb]` block pairs break a rule, for one row of query blocks."""
    return jnp.any(_violations_between(mask, q, k), axis=(-2, -1))


# The rules the ring and the kernels act on, in the order `check_mask` reports them; each
# gives the message's claim and what a wrong rule does.
_RULES = ("may_attend", "must_attend", "max_distance", "max_lookahead")


def _violations_between(mask: AbstractMask, q: TokenInfo, k: TokenInfo):
    """As `_violations`, for query blocks `q` against key blocks `k`: pairs the mask
    allows in block pairs its block rule skips; pairs it refuses in block pairs its
    dense rule runs unmasked (every token of both valid); allowed pairs further back than
    `max_distance()` or further ahead than `max_lookahead()`."""
    qi = jax.tree.map(lambda x: x[:, None, :, None], q)
    ki = jax.tree.map(lambda x: x[None, :, None, :], k)
    both = qi.valid & ki.valid
    allows = mask.allows(qi, ki)
    allowed = allows & both
    qs = jax.tree.map(lambda x: x[:, None], BlockSummary.of(q, axis=-1))
    ks = jax.tree.map(lambda x: x[None, :], BlockSummary.of(k, axis=-1))
    blocks = allowed.shape[:2]
    may = jnp.broadcast_to(block_rule(mask, qs, ks), blocks)
    q_all = jnp.all(q.valid, axis=-1)[:, None]
    k_all = jnp.all(k.valid, axis=-1)[None, :]
    dense = jnp.broadcast_to(dense_rule(mask, qs, ks, q_all, k_all), blocks)
    gap = qi.positions - ki.positions
    behind, ahead = mask.max_distance(), mask.max_lookahead()
    none = jnp.zeros_like(allowed)
    return jnp.stack(
        [
            allowed & ~may[..., None, None],
            both & ~allows & dense[..., None, None],
            none if behind is None else allowed & (gap > behind),
            none if ahead is None else allowed & (-gap > ahead),
        ]
    )


def _broken(mask: AbstractMask, rule: int, where: str, q_pos: int, k_pos: int) -> str:
    """The message for a pair of positions that breaks `_RULES[rule]`; `where` names the
    two blocks."""
    name = type(mask).__name__
    pair = f"query position {q_pos} attend key position {k_pos}"
    match _RULES[rule]:
        case "may_attend":
            return (
                f"{name}.may_attend is not conservative{where}: it says False for the two "
                f"blocks, but `allows` lets {pair}. may_attend must be True whenever any "
                "pair of the two blocks may attend; ring_attention would drop these pairs."
            )
        case "must_attend":
            return (
                f"{name}.must_attend is too permissive{where}: it says True for the two "
                f"blocks (every pair attends), but `allows` refuses {pair}. must_attend "
                "may be True only when every pair of the two blocks attends; the kernels "
                "run such tiles without the mask and would let these pairs attend."
            )
        case "max_distance":
            return (
                f"{name}.max_distance() is {mask.max_distance()}, but `allows` lets "
                f"{pair} ({q_pos - k_pos} back){where}. It must bound every attending "
                "pair, or return None; ring_attention would skip the steps holding such "
                "keys."
            )
        case _:
            return (
                f"{name}.max_lookahead() is {mask.max_lookahead()}, but `allows` lets "
                f"{pair} ({k_pos - q_pos} ahead){where}. It must bound every attending "
                "pair, or return None; ring_attention would skip the steps holding such "
                "keys."
            )


def _check_on_layout(mask: AbstractMask, layout: Layout, block: int) -> None:
    """`check_mask` on the blocks of an actual layout (no randomness): every pair of
    shards and every pair of tiles, one query block at a time (memory: a shard's
    capacity x seq_len booleans)."""
    for name, info in _layout_blocks(layout, block):
        for qb in range(info.positions.shape[0]):
            q = jax.tree.map(lambda x: x[qb : qb + 1], info)
            bad = np.asarray(_block_pairs(mask, q, info))[:, 0]
            if not bad.any():
                continue
            rule, kb = (int(i) for i in np.argwhere(bad)[0])
            k = jax.tree.map(lambda x: x[kb : kb + 1], info)
            pairs = np.asarray(_violations_between(mask, q, k))[rule, 0, 0]
            qt, kt = (int(i) for i in np.argwhere(pairs)[0])
            where = f" on this layout, for the queries of {name(qb)} and the keys of {name(kb)}"
            positions = np.asarray(info.positions)
            raise ValueError(_broken(mask, rule, where, positions[qb, qt], positions[kb, kt]))


def _check_layout_arg(layout, seq_len: int, segment_ids, span_ids) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"`layout` must be a ringeqx.Layout; got {type(layout).__name__}.")
    if layout.seq_len != seq_len:
        raise ValueError(f"`layout` was built for seq_len {layout.seq_len}; got seq_len {seq_len}.")
    if segment_ids is not None or span_ids is not None:
        raise ValueError(
            "Pass `segment_ids`/`span_ids` to the strategy that builds the layout, not "
            "to check_mask together with `layout=` (the layout carries its own ids)."
        )


def check_mask(
    mask: AbstractMask,
    seq_len: int,
    *,
    block: int = 4,
    samples: int = 8,
    key: PRNGKeyArray | None = None,
    segment_ids: Int[Array, " seq"] | None = None,
    span_ids: Int[Array, " seq"] | None = None,
    layout: Layout | None = None,
) -> None:
    """Check every rule of a mask that the ring and the kernels act on, on random layouts.

    Every kernel and the ring skip a block of keys when `may_attend` says no pair of
    the two blocks attends; a block rule that says False where `allows` has a True
    element silently drops those pairs from the softmax. The kernels run a pair of
    tiles without the elementwise mask where `must_attend` says every pair attends; one
    that says True where `allows` has a False element lets those pairs attend. The ring
    skips the steps beyond `max_distance()` and `max_lookahead()`. `check_mask` cuts the
    sequence into blocks of `block` tokens, in order and in random token orders (as
    sharding strategies do), with random documents and spans (or the given ids), and
    raises when any block pair or token pair breaks one of these rules. Run it in the
    tests of your own masks.

    **Arguments:**

    - `mask`: the mask to check.
    - `seq_len`: length of the sequence.
    - `block`: block length in tokens.
    - `samples`: number of random layouts (the first is in order).
    - `key`: PRNG key (default `jax.random.key(0)`).
    - `segment_ids`, `span_ids`: ids `[seq_len]` to use instead of random ones.
    - `layout`: a debug option: check the mask on this actual [`ringeqx.Layout`][]
        (its positions, documents and spans; every example of a batched layout) instead
        of random ones: every pair of its shards (the blocks the ring skips) and every
        pair of its tiles of `block` slots inside shards (the blocks a kernel skips; pass
        the kernel's tile size to mirror it exactly). Deterministic; `samples`, `key`
        and the ids are not used (the layout carries its own ids).

    **Raises:** `ValueError` naming the mask, the rule and a counterexample: the block
    pair, and a query and key position the rule gets wrong.

    **Example:**

    ```python
    ringeqx.check_mask(MyMask(), 64)
    layout = ringeqx.Zigzag().layout(64, 4, segment_ids=seg)
    ringeqx.check_mask(MyMask(), 64, layout=layout, block=8)  # the layout you will use
    ```
    """
    if not isinstance(mask, AbstractMask):
        raise TypeError(f"`mask` must be an AbstractMask instance; got {mask!r}.")
    mask.check(seq_len)
    if layout is not None:
        _check_layout_arg(layout, seq_len, segment_ids, span_ids)
        _check_on_layout(mask, layout, block)
        return
    key = jax.random.key(0) if key is None else key
    for sample in range(samples):
        key, k_seg, k_span, k_order = jax.random.split(key, 4)
        segments = _random_ids(k_seg, seq_len, segment_ids, spans=False)
        spans = _random_ids(k_span, seq_len, span_ids, spans=True)
        info = _blocks(k_order, seq_len, block, segments, spans, shuffle=sample > 0)
        bad = np.asarray(_violations(mask, info))
        if bad.any():
            rule, qb, kb, qt, kt = (int(i) for i in np.argwhere(bad)[0])
            positions = np.asarray(info.positions)
            where = (
                f", for query block {qb} and key block {kb} (sample {sample}, blocks of "
                f"{block} tokens)"
            )
            raise ValueError(_broken(mask, rule, where, positions[qb, qt], positions[kb, kt]))
