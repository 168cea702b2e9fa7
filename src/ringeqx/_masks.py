"""Attention masks as pytrees: an elementwise rule and a conservative block rule."""

import abc
import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from ._layout._tokens import BlockSummary, TokenInfo
from ._util._numbers import as_int, shown


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
        return jnp.zeros(_shape(q, k), bool)

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
        return _reads(self)

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


def _shape(q: BlockSummary, k: BlockSummary) -> tuple[int, ...]:
    return jnp.broadcast_shapes(q.pos_min.shape, k.pos_min.shape)


class Full(AbstractMask):
    """Every query attends to every (valid) key."""

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return jnp.ones(jnp.broadcast_shapes(q.positions.shape, k.positions.shape), bool)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return jnp.ones(_shape(q, k), bool)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return jnp.ones(_shape(q, k), bool)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class Causal(AbstractMask):
    """A query attends to keys at the same or earlier original positions."""

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return q.positions >= k.positions

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return q.pos_max >= k.pos_min

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return q.pos_min >= k.pos_max

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return 0

    def check(self, seq_len: int) -> None:
        pass


class Document(AbstractMask):
    """A query attends only to keys of its own segment (packed documents).

    Segment ids come from `ring_attention(..., segment_ids=...)` or from the layout.
    """

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return q.segments == k.segments

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return (q.seg_min <= k.seg_max) & (k.seg_min <= q.seg_max)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        one = (q.seg_min == q.seg_max) & (k.seg_min == k.seg_max)
        return one & (q.seg_min == k.seg_min)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class SlidingWindow(AbstractMask):
    r"""Local attention: each query sees the `window` most recent keys (itself included).

    Causal (the default): $0 \le q - k < \text{window}$. Two-sided:
    $|q - k| < \text{window}$, for encoders. Positions are original positions, so the
    window is exact under every strategy; with contiguous layouts (`Uniform`)
    the ring also stops early: shards of capacity $C$ need
    $\lceil (\text{window} - 1) / C \rceil + 1$ ring steps per direction instead of one per
    device, which cuts both compute and communication.

    **Arguments:**

    - `window`: static window length, an integer >= 1 (1 = each token sees itself).
    - `two_sided`: static; also see the `window - 1` following keys.

    `SlidingWindow(w)` is `jax.nn.dot_product_attention(..., is_causal=True,
    local_window_size=(w - 1, 0))`; two-sided it is `local_window_size=(w - 1, w - 1)`.

    ??? cite "Longformer"

        ```bibtex
        @article{beltagy2020longformer,
          title={Longformer: The Long-Document Transformer},
          author={Beltagy, Iz and Peters, Matthew E. and Cohan, Arman},
          journal={arXiv:2004.05150},
          year={2020}
        }
        ```
    """

    window: int = eqx.field(static=True, converter=as_int)
    two_sided: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        w = self.window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"SlidingWindow `window` must be an integer >= 1; got {shown(w)}.")

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        d = q.positions - k.positions
        low = 1 - self.window if self.two_sided else 0
        return (d >= low) & (d < self.window)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        # q - k ranges over [q.pos_min - k.pos_max, q.pos_max - k.pos_min]; does that
        # interval meet the window's?
        low = 1 - self.window if self.two_sided else 0
        return (q.pos_max - k.pos_min >= low) & (q.pos_min - k.pos_max < self.window)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        # Does the whole interval of q - k lie inside the window's?
        low = 1 - self.window if self.two_sided else 0
        return (q.pos_min - k.pos_max >= low) & (q.pos_max - k.pos_min < self.window)

    def max_distance(self) -> int | None:
        return self.window - 1

    def max_lookahead(self) -> int | None:
        return self.window - 1 if self.two_sided else 0

    def check(self, seq_len: int) -> None:
        pass


class PrefixLM(AbstractMask):
    """Causal, except that the first `prefix_len` tokens all see each other.

    The prefix (a prompt, an image) is attended bidirectionally; the rest is causal.
    `prefix_len` is an array leaf, so one compiled program serves every prefix length.
    For a different prefix per example, give span ids (0 on each prefix, -1 elsewhere)
    and use [`ringeqx.BidirectionalSpans`][].

    **Arguments:**

    - `prefix_len`: number of leading tokens in the bidirectional prefix (an int or an
        int32 scalar array; <= 0 gives a causal mask).
    """

    prefix_len: Int[ArrayLike, ""]

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        n = self.prefix_len
        return (q.positions >= k.positions) | ((q.positions < n) & (k.positions < n))

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        n = self.prefix_len
        return (q.pos_max >= k.pos_min) | ((q.pos_min < n) & (k.pos_min < n))

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        n = self.prefix_len
        return (q.pos_min >= k.pos_max) | ((q.pos_max < n) & (k.pos_max < n))

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class BidirectionalSpans(AbstractMask):
    """Causal text with bidirectional spans (image, audio clips).

    A query sees every earlier key, and every key of its own span: tokens with one span
    id `>= 0` attend to each other fully. Span ids come from
    `ring_attention(..., span_ids=...)` or from the layout (`-1` = not in a span).
    """

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        same = (q.spans == k.spans) & (q.spans >= 0)
        return (q.positions >= k.positions) | same

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        # A shared span id s >= 0 lies in both ranges, so both maxima are >= 0.
        overlap = (q.span_min <= k.span_max) & (k.span_min <= q.span_max)
        spans = overlap & (q.span_max >= 0) & (k.span_max >= 0)
        return (q.pos_max >= k.pos_min) | spans

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        one = (q.span_min == q.span_max) & (k.span_min == k.span_max)
        same = one & (q.span_min == k.span_min) & (q.span_min >= 0)
        return (q.pos_min >= k.pos_max) | same

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class BlockSparse(AbstractMask):
    """An explicit boolean map over blocks of the original sequence.

    Query `i` may attend to key `j` iff `block_mask[i // block_size, j // block_size]`.
    Combine it with `Causal()` (`BlockSparse(...) & Causal()`) for causal block-sparse
    patterns. The map is an array leaf: new values do not recompile. Its block rule asks
    whether any entry is True in the rectangle of the map that the two blocks' position
    ranges cover (a summed-area table, so it is cheap for any ranges).

    In the Pallas kernels each pair of tiles gets the window of the map its positions
    can meet (`tile_local`), sized when traced from the layout's
    [`ringeqx.Runs`][]: with the ring's default layout, `Uniform`, `Zigzag` whose chunks
    are whole tiles and `Striped` (whose window grows with its spread, up to a few
    words), no run-time check is emitted, so the ring compiles for any GPU or TPU
    target. Records that do not bound a tile keep a run-time check; a spread too wide
    for a window is refused when traced. Never a wrong answer.

    **Arguments:**

    - `block_mask`: `bool[q_blocks, k_blocks]`, both `ceil(seq_len / block_size)` (checked
        when the sequence length is known, by `ring_attention` and
        `reference_attention`).
    - `block_size`: static block length in tokens, an integer >= 1.
    """

    block_mask: Bool[Array, "q_blocks k_blocks"]
    block_size: int = eqx.field(static=True, converter=as_int)

    def __check_init__(self):
        bs = self.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise ValueError(f"BlockSparse `block_size` must be an integer >= 1; got {shown(bs)}.")
        shape, dtype = jnp.shape(self.block_mask), jnp.result_type(self.block_mask)
        if dtype != jnp.bool_:
            raise TypeError(f"BlockSparse `block_mask` must be a bool array; got dtype {dtype}.")
        if len(shape) != 2:
            raise ValueError(
                f"BlockSparse `block_mask` must be 2-D [q_blocks, k_blocks]; got shape {shape}."
            )

    def _block(self, positions, axis: int):
        return jnp.clip(positions // self.block_size, 0, self.block_mask.shape[axis] - 1)

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return self.block_mask[self._block(q.positions, 0), self._block(k.positions, 1)]

    def _rectangle(self, q: BlockSummary, k: BlockSummary):
        """`(True entries, all entries)` of the map's rectangle that the blocks' position
        ranges cover (a summed-area table, so cheap for any ranges)."""
        table = jnp.cumsum(jnp.cumsum(self.block_mask.astype(jnp.int32), 0), 1)
        table = jnp.pad(table, ((1, 0), (1, 0)))
        q_lo, q_hi = self._block(q.pos_min, 0), self._block(q.pos_max, 0) + 1
        k_lo, k_hi = self._block(k.pos_min, 1), self._block(k.pos_max, 1) + 1
        count = table[q_hi, k_hi] - table[q_lo, k_hi] - table[q_hi, k_lo] + table[q_lo, k_lo]
        return count, (q_hi - q_lo) * (k_hi - k_lo)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        nonempty = (q.pos_min <= q.pos_max) & (k.pos_min <= k.pos_max)
        return nonempty & (self._rectangle(q, k)[0] > 0)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        nonempty = (q.pos_min <= q.pos_max) & (k.pos_min <= k.pos_max)
        count, area = self._rectangle(q, k)
        return nonempty & (count == area)

    def _window(self, s: BlockSummary, axis: int, block: int) -> tuple[int, int, bool]:
        """The map blocks a tile's window spans (from the tile's known extent, else its
        token count), the window a tile of one run needs, and whether every tile fits
        its window statically (a known extent, or a window as large as the map)."""
        n = self.block_mask.shape[axis]

        def blocks(span: int) -> int:
            # `span` consecutive positions meet at most this many map blocks.
            return min(n, -(-(span - 1) // self.block_size) + 1)

        one_run = blocks(block)
        if s.extent is None:
            return one_run, one_run, one_run == n
        return blocks(s.extent), one_run, True

    def tile_local(
        self, q: BlockSummary, k: BlockSummary, block_q: int, block_kv: int
    ) -> "TileLocal":
        # A tile's valid positions meet at most `window` map blocks: from its extent
        # when the layout bounds it (`BlockSummary.extent`: then it fits, no check), else
        # as if it held one run of consecutive positions (checked). Each pair of tiles
        # gets that window of the map, from its first blocks on, packed into int32
        # words, which the kernel indexes by shifts: no gather.
        wq, q_run, q_static = self._window(q, 0, block_q)
        wk, k_run, k_static = self._window(k, 1, block_kv)
        if _words(wq, wk) > max(_MAX_WORDS, _words(q_run, k_run)):
            # Positions spread too far in a tile for a window of a few words (Striped
            # with a short stripe over many shards): refused when traced, never checked
            # at run time against windows that would not fit.
            wq, wk, q_static, k_static, refuse = q_run, k_run, True, True, True
        else:
            refuse = False
        shape = _shape(q, k)

        def first(s: BlockSummary, axis: int, window: int):
            lo, hi = self._block(s.pos_min, axis), self._block(s.pos_max, axis)
            start = jnp.clip(lo, 0, self.block_mask.shape[axis] - window)
            # Empty tiles have lo > hi and are exact; others must fit in the window.
            return jnp.broadcast_to(start, shape), jnp.broadcast_to(hi - start < window, shape)

        q_first, q_fits = first(q, 0, wq)
        k_first, k_fits = first(k, 1, wk)
        lead = (1,) * len(shape)
        rows = q_first[..., None, None] + jnp.arange(wq).reshape(lead + (wq, 1))
        cols = k_first[..., None, None] + jnp.arange(wk).reshape(lead + (1, wk))
        bits = self.block_mask[rows, cols].reshape(shape + (wq * wk,))
        num_words = _words(wq, wk)
        bits = jnp.pad(bits, [(0, 0)] * len(shape) + [(0, 32 * num_words - wq * wk)])
        bits = bits.reshape(shape + (num_words, 32)).astype(jnp.uint32)
        shifts = jnp.arange(32, dtype=jnp.uint32).reshape(lead + (1, 32))
        words = jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)
        words = jax.lax.bitcast_convert_type(words, jnp.int32)
        local = _BlockWindow(
            q_first * self.block_size,
            k_first * self.block_size,
            tuple(words[..., w] for w in range(num_words)),
            self.block_size,
            (wq, wk),
        )
        if refuse:
            exact = False
        else:
            exact = (True if q_static else q_fits) & (True if k_static else k_fits)
        return TileLocal(local, (True,) * (2 + num_words), exact)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        n = math.ceil(seq_len / self.block_size)
        if self.block_mask.shape != (n, n):
            raise ValueError(
                "BlockSparse `block_mask` must have shape (ceil(seq_len / block_size),) "
                f"* 2 = {(n, n)} for seq_len={seq_len} and block_size="
                f"{self.block_size}; got shape {self.block_mask.shape}."
            )


# Words of the map a tile's window may grow to beyond what tiles of one run need: each
# word costs the kernel a select per pair of tokens.
_MAX_WORDS = 8


def _words(rows: int, cols: int) -> int:
    return -(-(rows * cols) // 32)


class _BlockWindow(AbstractMask):
    """`BlockSparse` inside one pair of kernel tiles (`BlockSparse.tile_local`): the
    `window = (rows, cols)` entries of the map from block `q_start // block_size`,
    `k_start // block_size` on, bit `row * cols + col` of the packed `words`.

    A token's block within the window is counted with compares against the window's
    block edges (no integer division, which Triton's lowering of floor division
    rejects), clipped to the window as `BlockSparse` clips positions to its map."""

    q_start: Int[Array, "*tiles"]
    k_start: Int[Array, "*tiles"]
    words: tuple[Int[Array, "*tiles"], ...]
    block_size: int = eqx.field(static=True)
    window: tuple[int, int] = eqx.field(static=True)

    def _offset(self, positions, start, window: int):
        count = jnp.zeros(positions.shape, jnp.int32)
        for a in range(1, window):
            count = count + (positions >= start + a * self.block_size).astype(jnp.int32)
        return count

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        rows, cols = self.window
        bit = self._offset(q.positions, self.q_start, rows) * cols + self._offset(
            k.positions, self.k_start, cols
        )
        word = jnp.broadcast_to(self.words[0], bit.shape)
        for w in range(1, len(self.words)):
            word = jnp.where(bit >= 32 * w, self.words[w], word)
        shift = jnp.bitwise_and(bit, 31)
        return jnp.bitwise_and(jax.lax.shift_right_logical(word, shift), 1) != 0

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return jnp.ones(_shape(q, k), bool)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


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


_SUMMARY_READS = {
    "pos_min": "positions",
    "pos_max": "positions",
    "seg_min": "segments",
    "seg_max": "segments",
    "span_min": "spans",
    "span_max": "spans",
    "any_valid": "valid",
}


def _used_inputs(jaxpr: jex.Jaxpr, used_outputs: list[bool]) -> list[bool]:
    """Which inputs of `jaxpr` the used outputs depend on: a backward liveness pass over
    its equations (public `jax.extend.core` API). A call of another jaxpr with the same
    arity (`jit`, `closed_call`) is followed inside; any other equation with a used
    output, or with effects, uses all its inputs (conservative: a record may be
    reported read that is not, never the other way round)."""
    live = {v for v, u in zip(jaxpr.outvars, used_outputs) if u and not isinstance(v, jex.Literal)}
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not (any(outs) or eqn.effects):
            continue
        inner = eqn.params.get("jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        if (
            isinstance(inner, jex.Jaxpr)
            and not inner.constvars
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
            and not eqn.effects
        ):
            ins = _used_inputs(inner, outs)
        else:
            ins = [True] * len(eqn.invars)
        live |= {v for v, u in zip(eqn.invars, ins) if u and not isinstance(v, jex.Literal)}
    return [v in live for v in jaxpr.invars]


def _dependence(fn, treedef, leaves: tuple, records: list) -> list[bool]:
    """Whether the output of `fn(mask, *records)` depends on each record array, for the
    mask of structure `treedef` whose array leaves are given as `ShapeDtypeStruct`s."""
    is_abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

    def traced(arrays, *record_arrays):
        it = iter(arrays)
        mask = [next(it) if a else x for x, a in zip(leaves, is_abstract)]
        return fn(jax.tree.unflatten(treedef, mask), *record_arrays)

    abstract = [x for x, a in zip(leaves, is_abstract) if a]
    jaxpr = jax.make_jaxpr(traced)(abstract, *records).jaxpr
    used = _used_inputs(jaxpr, [True] * len(jaxpr.outvars))
    return used[len(used) - len(records) :]


@functools.lru_cache(maxsize=256)
def _reads_of(treedef, leaves: tuple) -> frozenset[str]:
    i32 = jnp.int32
    # Token records shaped like the kernels' `[batch, q, 1]` against `[batch, 1, k]`.
    tokens = [jax.ShapeDtypeStruct((1, 2, 1), i32)] * 3 + [
        jax.ShapeDtypeStruct((1, 2, 1), jnp.bool_)
    ]
    tokens += [jax.ShapeDtypeStruct((1, 1, 3), x.dtype) for x in tokens]

    def allows(mask, *arrays):
        return mask.allows(TokenInfo(*arrays[:4]), TokenInfo(*arrays[4:]))

    names = ("positions", "segments", "spans", "valid") * 2
    used = _dependence(allows, treedef, leaves, tokens)
    reads = {name for name, u in zip(names, used) if u}

    summary = [jax.ShapeDtypeStruct((), i32)] * 6 + [jax.ShapeDtypeStruct((), jnp.bool_)]

    def may_attend(mask, *arrays):
        return mask.may_attend(BlockSummary(*arrays[:7]), BlockSummary(*arrays[7:]))

    names = tuple(_SUMMARY_READS.values()) * 2
    used = _dependence(may_attend, treedef, leaves, summary * 2)
    reads |= {name for name, u in zip(names, used) if u}
    return frozenset(reads)


def _reads(mask: AbstractMask) -> frozenset[str]:
    # The answer depends on the mask's structure and the shapes of its arrays, not on
    # their values: cached on those, so ring calls pay the tracing once per kind of mask.
    leaves, treedef = jax.tree.flatten(mask)
    leaves = tuple(
        jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if eqx.is_array(x) else x
        for x in leaves
    )
    try:
        hash((treedef, leaves))
    except TypeError:  # an unhashable static field or leaf: trace it, uncached
        return _reads_of.__wrapped__(treedef, leaves)
    return _reads_of(treedef, leaves)


def check_ids(mask: AbstractMask, segment_ids, span_ids, layout) -> None:
    """Raise when the mask reads segment or span ids that neither the ids nor a layout
    give (the records would then hold -1 everywhere and the answer be silently wrong)."""
    if layout is not None:
        return
    reads = mask.reads()
    name = type(mask).__name__
    if segment_ids is None and "segments" in reads:
        raise ValueError(
            "This mask reads segment ids: pass `segment_ids=` or a `layout=` (the rule "
            f"of {name} reads `segments`; got neither)."
        )
    if span_ids is None and "spans" in reads:
        raise ValueError(
            "This mask reads span ids: pass `span_ids=` or a `layout=` (the rule of "
            f"{name} reads `spans`; got neither)."
        )
