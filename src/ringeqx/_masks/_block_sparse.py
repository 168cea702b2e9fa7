"""`BlockSparse`: an explicit boolean map over blocks of the sequence, and the window of
it that a Pallas kernel reads inside one pair of tiles."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._layout._tokens import BlockSummary, TokenInfo
from .._util._numbers import as_int, shown
from ._base import AbstractMask, TileLocal, blocks_shape


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
        shape = blocks_shape(q, k)

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
        return jnp.ones(blocks_shape(q, k), bool)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass
