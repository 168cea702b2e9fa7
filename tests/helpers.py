"""Shared test fixtures: one list each of every strategy, mask, score modifier and kernel.

A new strategy, mask, modifier or kernel is tested by every contract test once it is
added to its list here.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

import ringeqx as rx


def mesh(*shape: int, names=("sequence",), explicit: bool = False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


# (name, factory(seq_len) -> strategy). Factories take the length so that strategies with
# array leaves (boundary positions) can make valid ones.
STRATEGIES = [
    ("uniform", lambda seq_len: rx.Uniform()),
    ("zigzag", lambda seq_len: rx.Zigzag()),
    ("striped", lambda seq_len: rx.Striped()),
    ("striped3", lambda seq_len: rx.Striped(stripe=3)),
    # Breaks every 4-9 tokens over the first ~60%, then a long gap that must be cut.
    (
        "boundary",
        lambda seq_len: rx.Boundary(np.cumsum(np.resize([5, 9, 4, 7, 6], seq_len // 10))),
    ),
    ("work_balanced", lambda seq_len: rx.WorkBalanced(chunk=2, iterations=100)),
    ("modality_aware", lambda seq_len: rx.ModalityAware()),
    ("modality_aware_contiguous", lambda seq_len: rx.ModalityAware(zigzag=False)),
]

# (name, mask): masks that read positions and segment ids only, any sequence length.
MASKS = [
    ("full", rx.Full()),
    ("causal", rx.Causal()),
    ("document", rx.Document()),
    ("causal_document", rx.Causal() & rx.Document()),
    ("sliding_window", rx.SlidingWindow(6)),
    ("sliding_window_two_sided", rx.SlidingWindow(5, two_sided=True)),
    ("window_document", rx.SlidingWindow(9) & rx.Document()),
    ("prefix_lm", rx.PrefixLM(7)),
]


def block_pattern(seq_len: int, block_size: int) -> jax.Array:
    """A fixed, irregular block map for `BlockSparse` (diagonal always on)."""
    n = -(-seq_len // block_size)
    i, j = np.indices((n, n))
    return jnp.asarray(((i * 3 + j * 5) % 7 < 3) | (i == j))


def span_ids(seq_len: int) -> jax.Array:
    """Span ids (-1 = none) with spans of 6 and 9 tokens and a one-token span; the
    second starts at 40% of the sequence so it crosses shard edges."""
    ids = np.full(seq_len, -1)
    ids[2:8] = 0
    start = (2 * seq_len) // 5
    ids[start : start + 9] = 1
    ids[seq_len - 3] = 2
    return jnp.asarray(ids, jnp.int32)


# (name, factory(seq_len) -> mask): every mask, including those that read span ids or
# whose arrays depend on the sequence length. Contract tests call them with
# `segment_ids=packed_segments(...)` and `span_ids=span_ids(seq_len)`.
ALL_MASKS = [(name, lambda seq_len, m=m: m) for name, m in MASKS] + [
    ("bidirectional_spans", lambda seq_len: rx.BidirectionalSpans()),
    ("block_sparse", lambda seq_len: rx.BlockSparse(block_pattern(seq_len, 4), 4)),
    (
        "block_sparse_causal_or_spans",
        lambda seq_len: (rx.BlockSparse(block_pattern(seq_len, 5), 5) & rx.Causal())
        | rx.BidirectionalSpans(),
    ),
]

class CausalSameDocument(rx.AbstractMask):
    """A user mask that reads segment ids (no built-in class matches it)."""

    def allows(self, q: rx.TokenInfo, k: rx.TokenInfo) -> jax.Array:
        return (q.segments == k.segments) & (q.positions >= k.positions)

    def may_attend(self, q: rx.BlockSummary, k: rx.BlockSummary) -> jax.Array:
        return (q.seg_min <= k.seg_max) & (k.seg_min <= q.seg_max) & (q.pos_max >= k.pos_min)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return 0

    def check(self, seq_len: int) -> None:
        pass


class OnlyWithinSpans(rx.AbstractMask):
    """A user mask that reads span ids: tokens of one span see each other, no others."""

    def allows(self, q: rx.TokenInfo, k: rx.TokenInfo) -> jax.Array:
        return (q.spans == k.spans) & (q.spans >= 0)

    def may_attend(self, q: rx.BlockSummary, k: rx.BlockSummary) -> jax.Array:
        overlap = (q.span_min <= k.span_max) & (k.span_min <= q.span_max)
        return overlap & (q.span_max >= 0) & (k.span_max >= 0)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


# (name, factory(heads) -> score modifier or None)
SCORE_MODS = [
    ("none", lambda heads: None),
    ("softcap", lambda heads: rx.Softcap(1.5)),
    ("alibi", lambda heads: rx.ALiBi(0.3 * 0.5 ** jnp.arange(heads, dtype=jnp.float32))),
    (
        "alibi_softcap",
        lambda heads: rx.Chain(
            rx.ALiBi(jnp.linspace(0.05, 0.4, heads, dtype=jnp.float32)), rx.Softcap(2.0)
        ),
    ),
]

# (name, factory(heads) -> attention-sink logits `float32[heads]` or None), passed as
# `sinks=`.
SINKS = [
    ("none", lambda heads: None),
    ("sinks", lambda heads: jnp.linspace(-1.0, 1.5, heads, dtype=jnp.float32)),
]

# (name, kernel) with small blocks so that tiling, padding and skipping are exercised.
KERNELS = [
    ("xla", rx.XlaKernel(block_q=8, block_kv=4)),
    # Pallas kernels in the interpreter, with the smallest tiles their devices accept
    # (Triton: powers of two >= 16; Mosaic: multiples of 8 x 128).
    ("pallas_gpu", rx.PallasGpuKernel(block_q=16, block_kv=16, interpret=True)),
    ("pallas_tpu", rx.PallasTpuKernel(
        block_q=16, block_kv=128, block_kv_compute=None, backward_block_kv=None, interpret=True
    )),
]


def qkv(key, batch, seq, heads, kv_heads, head_dim, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, batch + (seq, heads, head_dim), dtype)
    k = jax.random.normal(kk, batch + (seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, batch + (seq, kv_heads, head_dim), dtype)
    return q, k, v


def packed_segments(seq_len: int, lengths) -> jax.Array:
    """Segment ids for documents of the given lengths, repeated to fill seq_len."""
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    ids = np.resize(ids, seq_len) if len(ids) < seq_len else ids[:seq_len]
    return jnp.asarray(ids, jnp.int32)


def value_and_grads(fn, q, k, v):
    """Output and the vjp of a fixed random cotangent w.r.t. q, k, v, as one compiled
    program (compiling dominates the suite's time, so one compile instead of two)."""
    shape = jax.eval_shape(fn, q, k, v)
    ct = jax.random.normal(jax.random.key(123), shape.shape, jnp.float32).astype(shape.dtype)

    @jax.jit
    def run(q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(ct)

    return run(q, k, v, ct)


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol
    )


def ring_loop_trips(steps: int) -> list[int]:
    """The trip counts of one ring call's permute loops in a compiled forward + backward,
    for a ring of `steps` steps: the forward loops over `steps - 1` hops, the backward
    over `steps - 2` (its first step, before any dK/dV travel, and its last, which sends
    no K/V, run outside the loop); XLA unrolls a loop of one trip."""
    return [n for n in (steps - 1, steps - 2) if n > 1]
