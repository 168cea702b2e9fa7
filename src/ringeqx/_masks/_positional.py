"""Masks on positions alone: `Full`, `Causal`, `SlidingWindow` and `PrefixLM`."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from .._layout._tokens import BlockSummary, TokenInfo
from .._util._numbers import as_int, shown
from ._base import AbstractMask, blocks_shape


class Full(AbstractMask):
    """Every query attends to every (valid) key."""

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return jnp.ones(jnp.broadcast_shapes(q.positions.shape, k.positions.shape), bool)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return jnp.ones(blocks_shape(q, k), bool)

    def must_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return jnp.ones(blocks_shape(q, k), bool)

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
