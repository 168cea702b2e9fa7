"""`check_mask`: a randomised test that a mask's block rule is conservative."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

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
    qi = jax.tree.map(lambda x: x[:, None, :, None], info)
    ki = jax.tree.map(lambda x: x[None, :, None, :], info)
    allowed = mask.allows(qi, ki) & qi.valid & ki.valid
    summary = BlockSummary.of(info, axis=-1)
    qs = jax.tree.map(lambda x: x[:, None], summary)
    ks = jax.tree.map(lambda x: x[None, :], summary)
    may = jnp.broadcast_to(block_rule(mask, qs, ks), allowed.shape[:2])
    return allowed & ~may[..., None, None]


def check_mask(
    mask: AbstractMask,
    seq_len: int,
    *,
    block: int = 4,
    samples: int = 8,
    key: PRNGKeyArray | None = None,
    segment_ids: Int[Array, " seq"] | None = None,
    span_ids: Int[Array, " seq"] | None = None,
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

    **Raises:** `ValueError` naming the mask and a counterexample: the block pair, and a
    query and key position the mask allows.

    **Example:**

    ```python
    ringeqx.check_mask(MyMask(), 64)
    ```
    """
    if not isinstance(mask, AbstractMask):
        raise TypeError(f"`mask` must be an AbstractMask instance; got {mask!r}.")
    mask.check(seq_len)
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
