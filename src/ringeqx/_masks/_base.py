"""The mask contract: `AbstractMask` (an elementwise rule and a conservative block
rule), what a kernel makes of it inside a tile, the rules every part shares
(`block_rule`, `dense_rule`, `tile_branch`) and the algebra (`And`, `Or`)."""

import abc
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from .._layout._tokens import BlockSummary, TokenInfo
from ._reads import reads


class AbstractMask(eqx.Module):
    """Which query-key pairs may attend.

    A mask is defined on token records ([`ringeqx.TokenInfo`][]: original position,
    segment id, span id), never on slots, so it is exact under every sharding strategy.
    Padding is handled by the ring itself; masks never see it.

    Subclass it to write your own mask: implement the five abstract methods below
    (and, optionally, `must_attend`, which lets kernels run fully visible tiles unmasked). Combine
    masks with `a & b` and `a | b`. What a mask reads (`reads`) is not declared: it is read
    off the rule itself, so `ring_attention` asks for `segment_ids` or `span_ids` exactly
    when your rule uses them.

    **Example:**

    ```python
    class EvenKeys(ringeqx.AbstractMask):
        # Causal, and only keys at even positions.
        def allows(self, q, k):
            return (q.positions >= k.positions) & (k.positions % 2 == 0)

        def may_attend(self, q, k):
            return q.pos_max >= k.pos_min   # ignoring the parity is conservative

        def max_distance(self):
            return None

        def max_lookahead(self):
            return 0

        def check(self, seq_len):
            pass   # nothing about this mask depends on the sequence length
    ```
    """

    @abc.abstractmethod
    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        """Elementwise rule: may query `q` attend to key `k`?

        `q` and `k` hold broadcastable arrays (typically `[..., q_len, 1]` and
        `[..., 1, k_len]`); the result has their broadcast shape.
        """

    @abc.abstractmethod
    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        """Block rule: may *any* query of block `q` attend to *any* key of block `k`?

        It must be conservative: whenever `allows` is True for some pair of valid tokens in
        the two blocks, this returns True. A False lets the ring skip a step and the kernel
        skip a tile. The summaries may hold stacks of blocks (broadcastable leading axes):
        write the rule with elementwise `jnp` operations and it answers for every pair of
        blocks at once. Blocks without valid tokens are ruled out by the caller.
        """

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        """Block rule: does *every* query of block `q` attend to *every* key of block `k`?

        The other direction of `may_attend`: True only when `allows` is True for every
        pair of tokens within the two blocks' ranges. Kernels run such tiles without the
        elementwise mask (the caller also requires every token of both blocks to be
        valid). Optional: the default, False everywhere, is always correct and only
        forgoes that fast path.
        """
        return jnp.zeros(blocks_shape(q, k), bool)

    @abc.abstractmethod
    def max_distance(self) -> int | None:
        """A static bound on how far back a query looks, or None.

        For every attending pair, `q_position - k_position <= max_distance()`. With a
        contiguous layout the ring then runs only the steps that can still matter.
        """

    @abc.abstractmethod
    def max_lookahead(self) -> int | None:
        """A static bound on how far ahead a query looks, or None.

        For every attending pair, `k_position - q_position <= max_lookahead()`: 0 for causal
        masks, `window - 1` for a two-sided window, None when keys anywhere ahead may be
        seen. Together with `max_distance` it decides which ring steps run.
        """

    @abc.abstractmethod
    def check(self, seq_len: int) -> None:
        """Trace-time check of the mask against the original sequence length.

        Raise a `ValueError` naming the offending field when the mask cannot serve a
        sequence of `seq_len` tokens (a block map of the wrong size); a mask that fits
        every length does nothing (`pass`). `ring_attention` and `reference_attention`
        call it once the sequence length is known.
        """

    def tile_local(
        self, q: BlockSummary, k: BlockSummary, block_q: int, block_kv: int
    ) -> "TileLocal":
        """The mask as a Pallas kernel evaluates it inside one tile.

        `q` and `k` summarise the kernel's query and key tiles (`block_q` and
        `block_kv` tokens each), stacked along broadcastable leading `*tiles` axes.
        A rule that looks a table up per token pair (`BlockSparse`'s block map) is a
        gather, which neither Triton nor Mosaic lowers; here, outside the kernel, the
        mask may instead read the few entries each tile can touch and hand them to the
        kernel as per-tile scalars, which the kernel reads for the tile it runs (from
        SMEM on a TPU).

        Where the layout bounds how far apart a tile's positions are
        ([`ringeqx.BlockSummary`][]'s static `extent`: a tile inside one run of
        consecutive positions spans at most its own size), return `exact=True` as a
        Python bool: the kernel then emits no run-time check (`BlockSparse` does).

        Not needed for masks without tables: the default is the mask itself, with no
        per-tile operands, exact everywhere. `And` and `Or` combine their parts'.

        **Returns:** a [`ringeqx.TileLocal`][]: a mask whose `allows` agrees with this
        mask's on every pair of tokens of one pair of tiles (where `exact` is True),
        which of its array leaves are per tile, and where it is exact.
        """
        del q, k, block_q, block_kv
        return TileLocal(self, (False,) * len(_arrays(self)), True)

    def reads(self) -> frozenset[str]:
        """Which token records the mask reads: a subset of `{"positions", "segments",
        "spans", "valid"}`.

        Not implemented by subclasses, and not to be overridden: the answer is read off the
        mask's own rules. `allows` and `may_attend` are traced on abstract records
        (`jax.make_jaxpr`), and a record counts when an output depends on it (dead-code
        elimination of the traced program). So a user mask cannot get it wrong, and `And` /
        `Or` read what their parts read. `ring_attention` uses it to ask for `segment_ids`
        and `span_ids` exactly when the mask needs them.
        """
        return reads(self)

    def __and__(self, other: "AbstractMask") -> "And":
        return And(self, other)

    def __or__(self, other: "AbstractMask") -> "Or":
        return Or(self, other)


class TileLocal(NamedTuple):
    """What [`ringeqx.AbstractMask.tile_local`][] returns.

    **Fields:**

    - `mask`: the mask a kernel evaluates inside a tile. Its array leaves are either
        whole arrays (handed to every program) or per-tile operands: `int32` or `bool`
        arrays of exactly the tiles' broadcast shape `*tiles`, of which a kernel gives
        each tile its own entry (a scalar).
    - `per_tile`: one flag per array leaf of `mask` (in `jax.tree.leaves` order of its
        arrays): True for a per-tile operand.
    - `exact`: where `mask` agrees with the original mask on every pair of tokens of
        the two tiles: `True` (a Python bool: everywhere, known when traced, so the
        kernel emits no check), `False` (nowhere it can promise: the kernel refuses when
        traced, with an error that names the mask, the tiles and the layout's runs), or
        `bool[*tiles]`, which the kernel checks at run time (`eqx.error_if`, a host
        callback) before it runs a tile where it is False. It never answers inexactly.
    """

    mask: "AbstractMask"
    per_tile: tuple[bool, ...]
    exact: Bool[ArrayLike, "*tiles"]


def _arrays(tree) -> list:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def block_rule(
    mask: AbstractMask, q: BlockSummary, k: BlockSummary
) -> Bool[Array, "*blocks"]:
    """True where a block of queries may attend to a block of keys: both hold a valid
    token and the mask's own block rule allows it.

    The one definition of "this tile runs", shared by the ring's step skipping, the
    schedule, and every kernel's tile skipping, so that the schedule counts exactly
    what the kernels run."""
    return q.any_valid & k.any_valid & mask.may_attend(q, k)


def dense_rule(
    mask: AbstractMask,
    q: BlockSummary,
    k: BlockSummary,
    q_all_valid: Bool[Array, "*blocks"],
    k_all_valid: Bool[Array, "*blocks"],
) -> Bool[Array, "*blocks"]:
    """True where every pair of a block of queries and a block of keys attends: every
    token of both is valid and the mask's `must_attend` says so. Kernels run such tiles
    without the elementwise mask."""
    return q_all_valid & k_all_valid & mask.must_attend(q, k)


# What a kernel does with a pair of tiles (`tile_branch`).
SKIPPED, MASKED, DENSE = 0, 1, 2


def tile_branch(
    mask: AbstractMask,
    q: BlockSummary,
    k: BlockSummary,
    q_all_valid: Bool[Array, "*blocks"],
    k_all_valid: Bool[Array, "*blocks"],
) -> Int[Array, "*blocks"]:
    """What a kernel does with a pair of tiles: `SKIPPED` where `block_rule` rules it
    out, `DENSE` where `dense_rule` says every pair attends (no elementwise mask),
    `MASKED` otherwise. XlaKernel branches on it; the Pallas kernels read it from their
    tile table."""
    run = block_rule(mask, q, k)
    dense = run & dense_rule(mask, q, k, q_all_valid, k_all_valid)
    return run.astype(jnp.int32) + dense.astype(jnp.int32)


def blocks_shape(q: BlockSummary, k: BlockSummary) -> tuple[int, ...]:
    """The broadcast shape of two stacks of block summaries: a block rule's answer's."""
    return jnp.broadcast_shapes(q.pos_min.shape, k.pos_min.shape)


def _combine_local(
    cls, left: AbstractMask, right: AbstractMask, q, k, block_q: int, block_kv: int
) -> TileLocal:
    a = left.tile_local(q, k, block_q, block_kv)
    b = right.tile_local(q, k, block_q, block_kv)
    # The array leaves of `cls(l, r)` are those of `l`, then those of `r`. Exact where
    # both are; a static answer stays static.
    if a.exact is False or b.exact is False:
        exact = False
    elif a.exact is True or b.exact is True:
        exact = b.exact if a.exact is True else a.exact
    else:
        exact = a.exact & b.exact
    return TileLocal(cls(a.mask, b.mask), a.per_tile + b.per_tile, exact)


def _min_bound(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _max_bound(a: int | None, b: int | None) -> int | None:
    if a is None or b is None:
        return None
    return max(a, b)


class And(AbstractMask):
    """Both masks allow the pair (`left & right`)."""

    left: AbstractMask
    right: AbstractMask

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return self.left.allows(q, k) & self.right.allows(q, k)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return self.left.may_attend(q, k) & self.right.may_attend(q, k)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return self.left.must_attend(q, k) & self.right.must_attend(q, k)

    def tile_local(
        self, q: BlockSummary, k: BlockSummary, block_q: int, block_kv: int
    ) -> TileLocal:
        return _combine_local(And, self.left, self.right, q, k, block_q, block_kv)

    def max_distance(self) -> int | None:
        return _min_bound(self.left.max_distance(), self.right.max_distance())

    def max_lookahead(self) -> int | None:
        return _min_bound(self.left.max_lookahead(), self.right.max_lookahead())

    def check(self, seq_len: int) -> None:
        self.left.check(seq_len)
        self.right.check(seq_len)


class Or(AbstractMask):
    """Either mask allows the pair (`left | right`)."""

    left: AbstractMask
    right: AbstractMask

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return self.left.allows(q, k) | self.right.allows(q, k)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return self.left.may_attend(q, k) | self.right.may_attend(q, k)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return self.left.must_attend(q, k) | self.right.must_attend(q, k)

    def tile_local(
        self, q: BlockSummary, k: BlockSummary, block_q: int, block_kv: int
    ) -> TileLocal:
        return _combine_local(Or, self.left, self.right, q, k, block_q, block_kv)

    def max_distance(self) -> int | None:
        return _max_bound(self.left.max_distance(), self.right.max_distance())

    def max_lookahead(self) -> int | None:
        return _max_bound(self.left.max_lookahead(), self.right.max_lookahead())

    def check(self, seq_len: int) -> None:
        self.left.check(seq_len)
        self.right.check(seq_len)
