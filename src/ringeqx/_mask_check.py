"""`check_mask`: a randomised test that a mask's block rule is conservative."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from ._layout import Layout
from ._masks import AbstractMask, block_rule
from ._tokens import BlockSummary, TokenInfo


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
    """Token pairs the mask allows in block pairs its block rule skips: `[qb, kb, q, k]`."""
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
    """Which `[qb, kb]` block pairs break the block rule, for one row of query blocks."""
    return jnp.any(_violations_between(mask, q, k), axis=(-2, -1))


def _violations_between(mask: AbstractMask, q: TokenInfo, k: TokenInfo):
    """As `_violations`, for query blocks `q` against key blocks `k`."""
    qi = jax.tree.map(lambda x: x[:, None, :, None], q)
    ki = jax.tree.map(lambda x: x[None, :, None, :], k)
    allowed = mask.allows(qi, ki) & qi.valid & ki.valid
    qs = jax.tree.map(lambda x: x[:, None], BlockSummary.of(q, axis=-1))
    ks = jax.tree.map(lambda x: x[None, :], BlockSummary.of(k, axis=-1))
    may = jnp.broadcast_to(block_rule(mask, qs, ks), allowed.shape[:2])
    return allowed & ~may[..., None, None]


def _check_on_layout(mask: AbstractMask, layout: Layout, block: int) -> None:
    """`check_mask` on the blocks of an actual layout (no randomness): every pair of
    shards and every pair of tiles, one query block at a time (memory: a shard's
    capacity x seq_len booleans)."""
    for name, info in _layout_blocks(layout, block):
        for qb in range(info.positions.shape[0]):
            q = jax.tree.map(lambda x: x[qb : qb + 1], info)
            bad = np.asarray(_block_pairs(mask, q, info))[0]
            if not bad.any():
                continue
            kb = int(np.argmax(bad))
            k = jax.tree.map(lambda x: x[kb : kb + 1], info)
            pairs = np.asarray(_violations_between(mask, q, k))[0, 0]
            qt, kt = (int(i) for i in np.argwhere(pairs)[0])
            raise ValueError(
                f"{type(mask).__name__}.may_attend is not conservative on this layout: it "
                f"says False for the queries of {name(qb)} and the keys of {name(kb)}, "
                f"but `allows` lets query position {int(info.positions[qb, qt])} attend "
                f"key position {int(info.positions[kb, kt])}. may_attend must be True "
                "whenever any pair of the two blocks may attend; ring_attention would "
                "drop these pairs."
            )


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
    """Check that a mask's block rule is conservative, on random layouts.

    Every kernel and the ring skip a block of keys when `may_attend` says no pair of
    the two blocks attends; a block rule that says False where `allows` has a True
    element silently drops those pairs from the softmax. `check_mask` cuts the
    sequence into blocks of `block` tokens, in order and in random token orders (as
    sharding strategies do), with random documents and spans (or the given ids), and
    raises when any block pair breaks the rule. Run it in the tests of your own masks.

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

    **Raises:** `ValueError` naming the mask and a counterexample: the block pair, and a
    query and key position the mask allows.

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
            qb, kb, qt, kt = (int(i) for i in np.argwhere(bad)[0])
            positions = np.asarray(info.positions)
            raise ValueError(
                f"{type(mask).__name__}.may_attend is not conservative: it says False "
                f"for query block {qb} and key block {kb} (sample {sample}, blocks of "
                f"{block} tokens), but `allows` lets query position {positions[qb, qt]} "
                f"attend key position {positions[kb, kt]}. may_attend must be True "
                "whenever any pair of the two blocks may attend."
            )
