"""`jax.nn.dot_product_attention`'s keyword names, translated to ring attention's terms.

`ring_attention(q, k, v, is_causal=True, local_window_size=..., query_seq_lengths=...,
key_value_seq_lengths=..., bias=...)` means what the same call to
`jax.nn.dot_product_attention` means. Each name becomes a mask or a score modifier (rules on
token records, which the ring can shard), combined with the caller's own by `&`. What has no
ring meaning (a dense `[q, k]` mask or bias, `implementation=`) is refused with the reason
and what to use instead.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._layout._tokens import BlockSummary, TokenInfo
from .._masks._base import AbstractMask
from .._masks._positional import Causal, SlidingWindow
from .._score_mods import AbstractScoreMod, Chain, lift
from .._util._numbers import is_int


class _Window(AbstractMask):
    """`jax.nn.dot_product_attention`'s `local_window_size=(left, right)`: query `i` sees
    keys `j` with `i - left <= j <= i + right` (`SlidingWindow` covers `right` in
    `{0, left}`)."""

    left: int = eqx.field(static=True)
    right: int = eqx.field(static=True)

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        d = q.positions - k.positions
        return (d >= -self.right) & (d <= self.left)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        return (q.pos_max - k.pos_min >= -self.right) & (q.pos_min - k.pos_max <= self.left)

    def max_distance(self) -> int | None:
        return self.left

    def max_lookahead(self) -> int | None:
        return self.right

    def check(self, seq_len: int) -> None:
        pass


class _SeqLengths(AbstractMask):
    """Padding given as per-example lengths, carried in one id record (`"segments"` or
    `"spans"`): bit 1 set where the token is a valid query, bit 0 where it is a valid key.

    The lengths travel as ids because the records are the only per-example data that the
    ring shards with the batch; a mask's own arrays are replicated and cannot know which
    examples a device holds.
    """

    record: str = eqx.field(static=True)

    def allows(self, q: TokenInfo, k: TokenInfo) -> Bool[Array, "..."]:
        return (getattr(q, self.record) >= 2) & (getattr(k, self.record) % 2 == 1)

    def may_attend(self, q: BlockSummary, k: BlockSummary) -> Bool[Array, "*blocks"]:
        top = "seg_max" if self.record == "segments" else "span_max"
        return (getattr(q, top) >= 2) & (getattr(k, top) >= 1)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class _KeyBias(AbstractScoreMod):
    """A bias per key position (and optionally per head), broadcast over the queries:
    `s[h, i, j] += bias[h, j]` (`bias` of `[1, seq]` serves every head)."""

    bias: Float[Array, "bias_heads seq"]

    def __call__(
        self,
        scores: Float[Array, "*batch heads q k"],
        q: TokenInfo,
        k: TokenInfo,
    ) -> Float[Array, "*batch heads q k"]:
        # k.positions is [*b, 1, 1, k]: gather along the keys, then put the bias's heads
        # on the heads axis. Padding slots may hold any position: clipped (they are
        # masked after the modifier).
        pos = k.positions[..., 0, :, :]
        b = jnp.take(self.bias.astype(scores.dtype), pos, axis=1, mode="clip")
        return scores + lift(jnp.moveaxis(b, 0, -3), scores.ndim)

    def for_head(self, head: Int[Array, ""]) -> "_KeyBias":
        if self.bias.shape[0] == 1:
            return self
        return _KeyBias(jax.lax.dynamic_slice_in_dim(self.bias, head, 1))

    def for_heads(self, first: Int[ArrayLike, ""], count: int) -> "_KeyBias":
        if self.bias.shape[0] == 1:
            return self
        return _KeyBias(jax.lax.dynamic_slice_in_dim(self.bias, first, count))

    def check(self, heads: int) -> None:
        pass


_DENSE_WHY = (
    "cannot be ring-sharded: no device ever holds a [q, k] block of the whole sequence "
    "(each keeps its queries and sees each key/value block once, as it passes), so an "
    "array over all query-key pairs would be gathered whole on every device, O(seq^2) "
    "memory: the cost ring attention exists to avoid. Write the pattern as a rule on token "
    "positions instead: a mask (`ringeqx.Causal()`, `SlidingWindow(w)`, `Document()` with "
    "`segment_ids=`, `BlockSparse(block_mask, block_size)`, or your own `AbstractMask`, "
    "combined with `&` / `|`) or a score modifier (`ringeqx.ALiBi`, `Softcap`, or your "
    "own `AbstractScoreMod`); padding is `query_seq_lengths=` / `key_value_seq_lengths=`."
)


def _refuse(implementation, mask) -> None:
    if implementation is not None:
        raise ValueError(
            "`implementation=` picks a backend of jax.nn.dot_product_attention ('xla', "
            "'cudnn'); ring_attention's per-device kernel is chosen by `kernel=` ('auto', "
            "'xla', 'pallas_gpu', 'pallas_tpu' or a kernel object) and `device_type=` "
            f"('auto', 'cpu', 'gpu', 'tpu'). Got implementation={implementation!r}."
        )
    if isinstance(mask, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"`mask` got a {np.dtype(mask.dtype)} array of shape {tuple(mask.shape)}: a "
            f"dense mask array (jax.nn.dot_product_attention's [batch, heads, q, k]) "
            f"{_DENSE_WHY}"
        )


def _window_mask(is_causal: bool, local_window_size) -> AbstractMask | None:
    """`is_causal` and `local_window_size` as one mask, exactly as jax.nn.dot_product_attention
    reads them (an int `w` is the pair `(w, w)`)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"`is_causal` must be a Python bool; got {is_causal!r}.")
    if local_window_size is None:
        return Causal() if is_causal else None
    pair = (local_window_size,) * 2 if is_int(local_window_size) else local_window_size
    if not (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(is_int(x) and x >= 0 for x in pair)
    ):
        raise ValueError(
            "`local_window_size` must be an integer >= 0 or a pair (left, right) of "
            f"integers >= 0 (the query's own position is always in its window); got "
            f"{local_window_size!r}."
        )
    left, right = int(pair[0]), 0 if is_causal else int(pair[1])
    if right == 0:
        return SlidingWindow(left + 1)
    if left == right:
        return SlidingWindow(left + 1, two_sided=True)
    return _Window(left, right)


def _bias_mod(
    bias, batch_shape, seq: int, heads: int, sinks: bool = False
) -> AbstractScoreMod | None:
    """A bias that broadcasts over the queries, as a score modifier; None when it is
    constant along the keys and there are no `sinks` (softmax ignores it then; with
    sinks it shifts the keys against them, so it is kept)."""
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    shape = (1,) * (4 - bias.ndim) + bias.shape
    batch = int(np.prod(batch_shape))
    want = ((1, batch), (1, heads), (1, seq), (1, seq))
    if bias.ndim > 4 or any(s not in ok for s, ok in zip(shape, want)):
        raise ValueError(
            "`bias` must broadcast to [batch, heads, q, k] = "
            f"{(batch, heads, seq, seq)}; got shape {bias.shape}."
        )
    b, h, t, s = shape
    if s == 1 and not sinks:
        # Constant along the keys: it shifts every logit of a row alike, and softmax is
        # invariant to that (its gradient is zero too), so the exact answer ignores it.
        return None
    if s == 1 and (t != 1 or b != 1):
        raise ValueError(
            f"`bias` of shape {bias.shape} is constant along the keys, which softmax "
            "ignores, but not beside `sinks=`: it shifts every key against the sinks, "
            "and per query or per example that cannot be ring-sharded. Shift the "
            "sinks instead (`sinks - bias`, per head) or pass a bias of shape "
            "[1, heads or 1, 1, 1]."
        )
    if t != 1:
        raise ValueError(
            f"`bias` of shape {bias.shape} varies over queries and keys: it {_DENSE_WHY}"
        )
    if b != 1:
        raise ValueError(
            f"`bias` of shape {bias.shape} is per example and per key: padding is "
            "`key_value_seq_lengths=` (exact, and sharded with the batch); any other "
            "per-example bias needs a score modifier that computes it from token records."
        )
    return _KeyBias(jnp.broadcast_to(bias.reshape(h, s), (h, seq)).astype(jnp.float32))


def _length_ids(q_shape, q_lens, kv_lens) -> Int[Array, "*batch seq"]:
    batch_shape, seq = q_shape[:-3], q_shape[-3]
    pos = jnp.arange(seq, dtype=jnp.int32).reshape((1,) * len(batch_shape) + (seq,))
    ids = []
    for name, lens in (("query_seq_lengths", q_lens), ("key_value_seq_lengths", kv_lens)):
        if lens is None:
            ids.append(jnp.ones(batch_shape + (seq,), jnp.int32))
            continue
        lens = jnp.asarray(lens)
        if lens.shape != batch_shape or not jnp.issubdtype(lens.dtype, jnp.integer):
            raise ValueError(
                f"`{name}` must be integers of shape [*batch] = {batch_shape} (one length "
                f"per example); got {lens.dtype} of shape {lens.shape}."
            )
        ids.append((pos < lens.astype(jnp.int32)[..., None]).astype(jnp.int32))
    return 2 * ids[0] + ids[1]


def _length_record(mask, segment_ids, span_ids, layout) -> str:
    """The id record that can carry the lengths: one that nothing else uses."""
    if layout is not None:
        raise ValueError(
            "`query_seq_lengths` / `key_value_seq_lengths` index the original order, "
            "which `layout=` does not have: give the strategy padding ids instead (e.g. "
            "segment ids with padding as a segment of its own) or call without a layout."
        )
    reads = mask.reads() if isinstance(mask, AbstractMask) else frozenset()
    if segment_ids is None and "segments" not in reads:
        return "segments"
    if span_ids is None and "spans" not in reads:
        return "spans"
    raise ValueError(
        "`query_seq_lengths` / `key_value_seq_lengths` travel round the ring as segment "
        "or span ids, and both are in use here (by `segment_ids=`/`span_ids=` or by the "
        "mask): mark the padding in your own ids instead (a segment of its own)."
    )


def translate(q, mask, score_mod, segment_ids, span_ids, layout, compat: dict, sinks=None):
    """`ring_attention`'s `mask, score_mod, segment_ids, span_ids` once the
    `jax.nn.dot_product_attention` names in `compat` are added to them (with `&` for
    masks; a bias runs before the caller's `score_mod`; `sinks`, the call's, keep a bias
    constant along the keys that softmax alone would ignore)."""
    _refuse(compat["implementation"], mask)
    q_shape = q.shape  # a JAX array: the front door converts q/k/v first
    new = _window_mask(compat["is_causal"], compat["local_window_size"])
    q_lens, kv_lens = compat["query_seq_lengths"], compat["key_value_seq_lengths"]
    if q_lens is not None or kv_lens is not None:
        record = _length_record(mask, segment_ids, span_ids, layout)
        ids = _length_ids(q_shape, q_lens, kv_lens)
        if record == "segments":
            segment_ids = ids
        else:
            span_ids = ids
        lengths = _SeqLengths(record)
        new = lengths if new is None else new & lengths
    if new is not None and (mask is None or isinstance(mask, AbstractMask)):
        mask = new if mask is None else mask & new
    if len(q_shape) >= 3:
        # A bias is indexed by the keys' original positions: as long as the sequence
        # (with a layout, its `seq_len`, whatever the order and padding of q).
        seq = q_shape[-3] if layout is None else layout.seq_len
        bias = _bias_mod(
            compat["bias"], q_shape[:-3], seq, q_shape[-2], sinks=sinks is not None
        )
        if bias is not None:
            score_mod = bias if score_mod is None else Chain(bias, score_mod)
    return mask, score_mod, segment_ids, span_ids
