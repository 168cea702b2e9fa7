"""Masks: exact under every strategy, conservative block rules, early stop, tile skipping.

Compiling a ring (forward and backward) costs seconds on CPU, so the default run covers
the matrix masks x strategies x devices with a rotation (every mask on every device count
on `Uniform`, every strategy with composite masks that use every rule);
`RINGEQX_FULL_MATRIX=1` runs every mask under every strategy on 1, 3, 4 and 8 devices.
"""

import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL_MASKS,
    KERNELS,
    STRATEGIES,
    CausalSameDocument,
    OnlyWithinSpans,
    assert_close,
    block_pattern,
    mesh,
    packed_segments,
    qkv,
    ring_loop_trips,
    span_ids,
)
from hypothesis import given, settings, strategies as st
from jaxtyping import Array, Bool

import ringeqx as rx
from ringeqx._ring._steps import analytic_window


HEADS, KV_HEADS, HEAD_DIM = 3, 1, 5
SEQ = 37
DEVICES = [1, 3, 4, 8]
FULL = os.environ.get("RINGEQX_FULL_MATRIX") == "1"
KERNEL = KERNELS[0][1]


def _composites(seq_len: int) -> list[tuple[str, rx.AbstractMask]]:
    """Between them, every elementwise and block rule, `&` and `|`."""
    return [
        ("window_doc_or_spans", (rx.SlidingWindow(7) & rx.Document()) | rx.BidirectionalSpans()),
        (
            "sparse_causal_or_prefix",
            (rx.BlockSparse(block_pattern(seq_len, 4), 4) & rx.Causal()) | rx.PrefixLM(6),
        ),
        ("two_sided_window", rx.SlidingWindow(5, two_sided=True)),
    ]


def _check_masks(strategy, devices: int, masks, *, seq_len: int = SEQ, key: int = 0):
    """Ring attention under `strategy` on `devices` devices for every mask in one compiled
    program; values and q/k/v gradients must match the dense reference (computed in the
    original order and moved to layout order)."""
    seg = packed_segments(seq_len, [5, 11, 7])
    spans = span_ids(seq_len)
    layout = strategy.layout(seq_len, devices, segment_ids=seg, span_ids=spans)
    q, k, v = qkv(jax.random.key(key), (), seq_len, HEADS, KV_HEADS, HEAD_DIM)
    ct = jax.random.normal(jax.random.key(key + 1), q.shape)
    m = mesh(devices)

    def ring(q, k, v, ct):
        results = []
        for _, mask in masks:

            def f(q, k, v, mask=mask):
                return rx.ring_attention(
                    q, k, v, mask=mask, layout=layout, order="layout", mesh=m, kernel=KERNEL
                )

            out, vjp = jax.vjp(f, q, k, v)
            results.append((out, vjp(ct)))
        return results

    sharded = [layout.shard(x) for x in (q, k, v, ct)]
    got = jax.jit(ring)(*sharded)
    for (name, mask), (out, grads) in zip(masks, got):

        def ref(q, k, v, mask=mask):
            return rx.reference_attention(q, k, v, mask=mask, segment_ids=seg, span_ids=spans)

        ref_out, vjp = jax.vjp(ref, q, k, v)
        ref_grads = vjp(ct)
        try:
            assert_close(out, layout.shard(ref_out))
            for g, r in zip(grads, ref_grads):
                assert_close(g, layout.shard(r))
        except AssertionError as e:
            raise AssertionError(f"mask {name!r} on {devices} devices") from e


_POSITION_MASKS = len(ALL_MASKS) - 3  # the MASKS entries, run on every device count by test_ring


# By default: the masks that read span ids or depend on the length on 3 and 8 devices
# (tests/test_ring.py runs the position masks on 1, 2, 3, 4 and 8), and each other
# strategy with one composite mask on one device count. RINGEQX_FULL_MATRIX=1 runs every
# mask under every strategy on every device count (about 14 minutes on 2 cores).
@pytest.mark.parametrize("devices", DEVICES if FULL else (3, 8))
def test_every_mask_on_uniform(devices):
    names = ALL_MASKS if FULL else ALL_MASKS[_POSITION_MASKS:]
    _check_masks(rx.Uniform(), devices, [(name, factory(SEQ)) for name, factory in names])


_OTHER_STRATEGIES = [i for i, (name, _) in enumerate(STRATEGIES) if FULL or name != "uniform"]


@pytest.mark.parametrize(
    "index", _OTHER_STRATEGIES, ids=[STRATEGIES[i][0] for i in _OTHER_STRATEGIES]
)
def test_every_strategy(index):
    name, factory = STRATEGIES[index]
    if FULL:
        masks = [(n, f(SEQ)) for n, f in ALL_MASKS] + _composites(SEQ)
        for devices in DEVICES:
            _check_masks(factory(SEQ), devices, masks)
    else:
        # A rotation: one of the composites (which use every rule between them) on 3, 4
        # or 8 devices; the two-sided window only matters on contiguous layouts.
        composite = _composites(SEQ)[index % 2]
        _check_masks(factory(SEQ), DEVICES[1 + index % 3], [composite], key=index)


def test_sliding_windows_match_dot_product_attention():
    w = 9
    q, k, v = qkv(jax.random.key(4), (2,), 64, HEADS, 3, 8)
    ct = jax.random.normal(jax.random.key(5), q.shape)
    m = mesh(8)

    def grads(f):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(ct)

    @jax.jit
    def ring():
        return [
            grads(
                lambda q, k, v, two_sided=two_sided: rx.ring_attention(
                    q, k, v, mask=rx.SlidingWindow(w, two_sided=two_sided), mesh=m, kernel=KERNEL
                )
            )
            for two_sided in (False, True)
        ]

    @jax.jit
    def dpa():
        return [
            grads(
                lambda q, k, v, window=window, causal=causal: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, local_window_size=window
                )
            )
            for window, causal in (((w - 1, 0), True), ((w - 1, w - 1), False))
        ]

    for (out, g), (ref, r) in zip(ring(), dpa()):
        assert_close(out, ref)
        for a, b in zip(g, r):
            assert_close(a, b)


# --- early stop -------------------------------------------------------------------------


def test_early_stop_runs_and_sends_only_the_steps_that_matter():
    # P = 8 shards of capacity C = 8; a causal window W = 11 needs ceil(10 / 8) + 1 = 3
    # steps (<= ceil(W / C) + 1), a two-sided W = 6 one step each way: 3. Counted in the
    # compiled program, forward and backward, with values and gradients checked.
    p, seq = 8, 64
    layout = rx.Uniform().layout(seq, p)
    m = mesh(p)
    q, k, v = qkv(jax.random.key(6), (), seq, HEADS, KV_HEADS, HEAD_DIM)
    ct = jax.random.normal(jax.random.key(7), q.shape)

    def program(mask):
        def f(q, k, v):
            return rx.ring_attention(q, k, v, mask=mask, mesh=m, kernel=KERNEL)

        def both(q, k, v, ct):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(ct)

        return jax.jit(both).lower(q, k, v, ct).compile()

    assert rx.num_ring_steps(rx.Causal(), layout) == p
    _, causal_bytes, causal_trips = rx.tools.permute_stats(program(rx.Causal()).as_text())
    assert sorted(causal_trips) == sorted(ring_loop_trips(p))
    for mask in (rx.SlidingWindow(11), rx.SlidingWindow(6, two_sided=True)):
        steps = rx.num_ring_steps(mask, layout)
        behind = math.ceil(mask.window / layout.capacity)
        assert steps == 3 and steps <= behind + 1 + (behind if mask.two_sided else 0)
        compiled = program(mask)
        _, nbytes, trips = rx.tools.permute_stats(compiled.as_text())
        assert sorted(trips) == sorted(ring_loop_trips(steps))
        # K/V (+ records) per hop, and dK/dV in the backward: traffic scales with steps.
        assert nbytes < causal_bytes * (steps + 1) / p

        out, grads = compiled(q, k, v, ct)
        ref, vjp = jax.vjp(lambda q, k, v: rx.reference_attention(q, k, v, mask=mask), q, k, v)
        assert_close(out, ref)
        for g, r in zip(grads, vjp(ct)):
            assert_close(g, r)


class _ClaimsCausal(rx.AbstractMask):
    """A two-sided window that wrongly claims to look only backwards."""

    window: int = eqx.field(static=True)

    def allows(self, q: rx.TokenInfo, k: rx.TokenInfo) -> Bool[Array, "..."]:
        return abs(q.positions - k.positions) < self.window

    def may_attend(self, q: rx.BlockSummary, k: rx.BlockSummary) -> Bool[Array, "*blocks"]:
        return (q.pos_max - k.pos_min > -self.window) & (q.pos_min - k.pos_max < self.window)

    def max_distance(self) -> int | None:
        return self.window - 1

    def max_lookahead(self) -> int | None:
        return 0

    def check(self, seq_len: int) -> None:
        pass


def test_early_stop_never_silently_drops_keys_ahead():
    # A ring that only ran backwards would miss the keys of the next shard. With a mask
    # that lies about looking ahead, the ring notices (the block rule on the shards it
    # would skip, checked while tracing when the layout is concrete) and raises instead
    # of returning a wrong answer.
    m = mesh(4)
    q, k, v = qkv(jax.random.key(8), (), 24, HEADS, KV_HEADS, HEAD_DIM)
    liar = _ClaimsCausal(4)
    # Its bounds alone would stop after 2 steps (all a traced layout has to go on); the
    # block rule on the concrete layout asks for one step ahead too.
    assert analytic_window(liar, rx.Uniform().layout(24, 4)) == (0, 2)
    assert rx.num_ring_steps(liar, rx.Uniform().layout(24, 4)) == 3
    with pytest.raises(ValueError, match="a shard it skips may attend: either the mask's"):
        rx.ring_attention(q, k, v, mask=liar, mesh=m, kernel=KERNEL)
    # The honest mask runs one step ahead as well (exactness: the early-stop test above
    # and the two-sided entries of MASKS).
    assert rx.num_ring_steps(rx.SlidingWindow(4, two_sided=True), rx.Uniform().layout(24, 4)) == 3


def test_early_stop_guard_catches_short_contiguous_shards():
    # Contiguous shards of capacity 4 whose middle ones are short: shard 0 and shard 3
    # are closer than the capacity suggests, so stopping after 2 steps would be wrong.
    order = jnp.array([[0, 1, 2, 3], [4, -1, -1, -1], [5, -1, -1, -1], [6, 7, 8, 9]])
    layout = rx.layout_from_order(order, 10, contiguous=True)
    mask = rx.SlidingWindow(4)
    # The bounds say 2 steps; the block rule on these shards says all 4 (position 3 of
    # shard 0 is 3 from position 6 of shard 3). A traced run would trust the bounds.
    assert analytic_window(mask, layout)[1] == 2 and rx.num_ring_steps(mask, layout) == 4
    q, k, v = (layout.shard(x) for x in qkv(jax.random.key(9), (), 10, HEADS, KV_HEADS, 4))
    with pytest.raises(ValueError, match="stop the ring after 2 of 4 steps"):
        rx.ring_attention(
            q, k, v, mask=mask, layout=layout, order="layout", mesh=mesh(4), kernel=KERNEL
        )


@pytest.mark.parametrize("seq_len, shards", [(64, 8), (37, 8), (30, 3), (16, 4)])
@pytest.mark.parametrize("window", [1, 2, 4, 5, 9, 17])
@pytest.mark.parametrize("two_sided", [False, True])
def test_num_ring_steps_is_exact_on_uniform(seq_len, shards, window, two_sided):
    # Brute force: the shard offsets of attending pairs. The early-stopped ring must cover
    # them all (correct) and use no more steps than they span (no off-by-one waste).
    layout = rx.Uniform().layout(seq_len, shards)
    cap = layout.capacity
    pos = np.arange(seq_len)
    d = pos[:, None] - pos[None, :]
    ok = (d < window) & (d > -window if two_sided else d >= 0)
    offsets = (pos[:, None] // cap - pos[None, :] // cap)[ok]
    needed = offsets.max() - offsets.min() + 1
    steps = rx.num_ring_steps(rx.SlidingWindow(window, two_sided=two_sided), layout)
    assert steps >= min(needed, shards)
    # Tight whenever the shards between are full (here: unless the sequence is short).
    if seq_len >= shards * cap:
        assert steps == min(needed, shards)


def test_bounds_of_combinators():
    w, w2 = rx.SlidingWindow(8), rx.SlidingWindow(5, two_sided=True)
    assert (w.max_distance(), w.max_lookahead()) == (7, 0)
    assert (w2.max_distance(), w2.max_lookahead()) == (4, 4)
    assert ((w & rx.Document()).max_distance(), (w & rx.Document()).max_lookahead()) == (7, 0)
    assert ((w2 & rx.Causal()).max_distance(), (w2 & rx.Causal()).max_lookahead()) == (4, 0)
    assert ((w | w2).max_distance(), (w | w2).max_lookahead()) == (7, 4)
    assert ((w | rx.Causal()).max_distance(), (w | rx.Causal()).max_lookahead()) == (None, 0)
    assert (w | rx.PrefixLM(3)).max_lookahead() is None
    layout = rx.Uniform().layout(64, 8)
    assert rx.num_ring_steps(w2 & rx.Causal(), layout) == 2
    assert rx.num_ring_steps(w2, layout) == 3
    assert rx.num_ring_steps(w | rx.Causal(), layout) == 8
    # Non-contiguous layouts never stop early on the bounds alone (traced), but the block
    # rule on a concrete Zigzag layout (chunks of 4: chunk c on shard c or 15 - c) finds
    # the window's keys at most two chunks, so two shards, away either way: 5 steps.
    zigzag = rx.Zigzag().layout(64, 8)
    assert analytic_window(w, zigzag) == (0, 8)
    assert rx.num_ring_steps(w, zigzag) == 5


# --- block rules --------------------------------------------------------------------


def _property_masks():
    n, bs = 40, 3  # positions in [0, 40), BlockSparse over ceil(40 / 3) = 14 blocks

    def sparse(seed):
        rng = np.random.default_rng(seed)
        return rx.BlockSparse(jnp.asarray(rng.random((14, 14)) < 0.15), bs)

    leaf = st.one_of(
        st.just(rx.Full()),
        st.just(rx.Causal()),
        st.just(rx.Document()),
        st.just(rx.BidirectionalSpans()),
        st.builds(rx.SlidingWindow, st.integers(1, 12), st.booleans()),
        st.builds(rx.PrefixLM, st.integers(-2, n + 2)),
        st.builds(sparse, st.integers(0, 2**16)),
    )
    tree = st.recursive(
        leaf,
        lambda inner: st.tuples(inner, inner, st.booleans()).map(
            lambda t: t[0] & t[1] if t[2] else t[0] | t[1]
        ),
        max_leaves=3,
    )
    return tree, n


_MASK_TREES, _N = _property_masks()


@settings(max_examples=120, deadline=None)
@given(mask=_MASK_TREES, seed=st.integers(0, 2**31 - 1))
def test_block_rule_is_never_wrong(mask, seed):
    # 64 random pairs of blocks (random positions, segments, spans, padding) per example,
    # checked at once through the stacked-summary form of the block rule: wherever the
    # elementwise rule has a true pair of valid tokens, the block rule must say True.
    rng = np.random.default_rng(seed)
    pairs, bq, bk = 64, 5, 4

    def block(size):
        start = rng.integers(0, _N, (pairs, 1))
        spread = rng.integers(1, 12, (pairs, 1))
        pos = np.clip(start + rng.integers(0, spread, (pairs, size)), 0, _N - 1)
        seg = rng.integers(0, 4, (pairs, size))
        span = rng.integers(-1, 3, (pairs, size))
        valid = rng.random((pairs, size)) < 0.8
        return rx.TokenInfo(*(jnp.asarray(x) for x in (pos, seg, span, valid)))

    qi, ki = block(bq), block(bk)
    q, k = qi.expand(2), ki.expand(1)
    exact = jnp.any(mask.allows(q, k) & q.valid & k.valid, axis=(1, 2))
    qs, ks = rx.BlockSummary.of(qi, axis=1), rx.BlockSummary.of(ki, axis=1)
    rule = mask.may_attend(qs, ks)
    assert rule.shape == (pairs,)
    missed = np.asarray(exact & ~rule)
    assert not missed.any(), f"block rule says no for attending blocks {np.flatnonzero(missed)}"
    # The other direction: where `must_attend` says every pair attends, every pair of
    # tokens in the blocks' ranges does (valid or not: the kernels add validity).
    every = jnp.all(mask.allows(q, k) | ~(q.valid & k.valid), axis=(1, 2))
    must = mask.must_attend(qs, ks)
    assert must.shape == (pairs,)
    wrong = np.asarray(must & ~every)
    assert not wrong.any(), f"must_attend says yes for blocks {np.flatnonzero(wrong)}"


def test_block_rules_are_tight_where_they_can_be():
    # Conservative must not mean useless: on plain ranges these rules are exact.
    def summary(lo, hi, seg=(0, 0), span=(-1, -1)):
        i = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
        return rx.BlockSummary(
            i(lo), i(hi), i(seg[0]), i(seg[1]), i(span[0]), i(span[1]), jnp.array(True)
        )

    w = rx.SlidingWindow(4)
    assert w.may_attend(summary(10, 12), summary(7, 9))  # 10 - 7 = 3 < 4
    assert not w.may_attend(summary(10, 12), summary(3, 6))  # 10 - 6 = 4
    assert not w.may_attend(summary(10, 12), summary(13, 15))  # keys ahead
    assert rx.SlidingWindow(4, two_sided=True).may_attend(summary(10, 12), summary(15, 15))
    spans = rx.BidirectionalSpans()
    assert spans.may_attend(summary(0, 3, span=(-1, 2)), summary(5, 9, span=(2, 4)))
    assert not spans.may_attend(summary(0, 3, span=(-1, 1)), summary(5, 9, span=(2, 4)))
    sparse = rx.BlockSparse(jnp.eye(4, dtype=bool), 10)
    assert sparse.may_attend(summary(5, 15), summary(12, 30))  # rectangle holds (1, 1)
    assert not sparse.may_attend(summary(0, 9), summary(12, 30))
    prefix = rx.PrefixLM(5)
    assert prefix.may_attend(summary(0, 2), summary(4, 8))
    assert not prefix.may_attend(summary(0, 2), summary(5, 8))
    # must_attend: True exactly where every pair of the ranges attends.
    assert rx.Full().must_attend(summary(0, 9), summary(20, 30))
    assert rx.Causal().must_attend(summary(10, 12), summary(3, 10))
    assert not rx.Causal().must_attend(summary(10, 12), summary(3, 11))
    assert w.must_attend(summary(10, 12), summary(9, 9))  # 12 - 9 = 3 < 4
    assert not w.must_attend(summary(10, 12), summary(8, 9))  # 12 - 8 = 4
    assert rx.Document().must_attend(summary(0, 3, seg=(2, 2)), summary(5, 9, seg=(2, 2)))
    assert not rx.Document().must_attend(summary(0, 3, seg=(2, 2)), summary(5, 9, seg=(2, 3)))
    assert spans.must_attend(summary(0, 3, span=(1, 1)), summary(5, 9, span=(1, 1)))
    assert not spans.must_attend(summary(0, 3, span=(-1, -1)), summary(5, 9, span=(-1, -1)))
    assert sparse.must_attend(summary(10, 19), summary(12, 15))  # inside block (1, 1)
    assert not sparse.must_attend(summary(5, 15), summary(12, 30))
    assert prefix.must_attend(summary(0, 2), summary(3, 4))
    assert not prefix.must_attend(summary(0, 2), summary(4, 5))
    assert (rx.Causal() & w).must_attend(summary(10, 12), summary(9, 10))
    assert (rx.Causal() | rx.Document()).must_attend(summary(0, 3), summary(5, 9))


def test_packed_documents_skip_cross_document_tiles():
    # Causal + document on packed documents: the tiles the schedule runs are exactly the
    # tiles with at least one attending pair (no cross-document tile is computed).
    seq, shards, bq, bk = 70, 4, 6, 4
    lengths = [9, 4, 17, 3, 12, 25]
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths), jnp.int32)
    layout = rx.Uniform().layout(seq, shards, segment_ids=seg)
    mask = rx.Causal() & rx.Document()
    sched = rx.tools.schedule(layout, mask, kernel=rx.XlaKernel(bq, bk))

    cap = layout.capacity
    pos = np.asarray(layout.positions)
    segs, valid = np.asarray(layout.segments), np.asarray(layout.valid)
    useful = 0
    for i in range(shards):
        for j in range(shards):
            for a in range(0, cap, bq):
                for b in range(0, cap, bk):
                    qp, qs, qv = pos[i, a : a + bq], segs[i, a : a + bq], valid[i, a : a + bq]
                    kp, ks, kv = pos[j, b : b + bk], segs[j, b : b + bk], valid[j, b : b + bk]
                    ok = (qp[:, None] >= kp) & (qs[:, None] == ks) & qv[:, None] & kv
                    useful += int(ok.any())
    assert int(sched.total_tiles) == useful
    causal = rx.tools.schedule(layout, rx.Causal(), kernel=rx.XlaKernel(bq, bk))
    assert int(causal.total_tiles) > useful


def test_window_schedule_has_only_the_steps_that_run():
    layout = rx.Uniform().layout(64, 8)
    mask = rx.SlidingWindow(11)
    sched = rx.tools.schedule(layout, mask, kernel=rx.XlaKernel(4, 4))
    assert sched.tiles_run.shape == (rx.num_ring_steps(mask, layout), 8) == (3, 8)


# --- user masks, leaves and errors ----------------------------------------------------


class DilatedWindow(rx.AbstractMask):
    """A user mask: causal, within `window`, every `dilation`-th key."""

    window: int = eqx.field(static=True)
    dilation: int = eqx.field(static=True)

    def allows(self, q: rx.TokenInfo, k: rx.TokenInfo) -> Bool[Array, "..."]:
        d = q.positions - k.positions
        return (d >= 0) & (d < self.window) & (d % self.dilation == 0)

    def may_attend(self, q: rx.BlockSummary, k: rx.BlockSummary) -> Bool[Array, "*blocks"]:
        # The window's rule; ignoring the dilation keeps it conservative.
        return (q.pos_max - k.pos_min >= 0) & (q.pos_min - k.pos_max < self.window)

    def max_distance(self) -> int | None:
        return self.window - 1

    def max_lookahead(self) -> int | None:
        return 0

    def check(self, seq_len: int) -> None:
        pass


def test_user_mask_with_early_stop():
    mask = DilatedWindow(12, 3)
    # It reads positions only, so it runs without segment or span ids.
    assert mask.reads() == {"positions"}
    q, k, v = qkv(jax.random.key(10), (2,), 48, HEADS, KV_HEADS, HEAD_DIM)
    assert rx.num_ring_steps(mask, rx.Uniform().layout(48, 8)) == 3
    ct = jax.random.normal(jax.random.key(11), q.shape)

    def grads(f):
        return jax.jit(lambda q, k, v: (lambda o, vjp: (o, vjp(ct)))(*jax.vjp(f, q, k, v)))

    out, g = grads(
        lambda q, k, v: rx.ring_attention(q, k, v, mask=mask, mesh=mesh(8), kernel=KERNEL)
    )(q, k, v)
    ref, rg = grads(lambda q, k, v: rx.reference_attention(q, k, v, mask=mask))(q, k, v)
    assert_close(out, ref)
    for a, b in zip(g, rg):
        assert_close(a, b)


def test_what_a_mask_reads_comes_from_its_rule():
    pos, seg, span = "positions", "segments", "spans"
    expected = [
        (rx.Full(), set()),
        (rx.Causal(), {pos}),
        (rx.Document(), {seg}),
        (rx.SlidingWindow(3, two_sided=True), {pos}),
        (rx.PrefixLM(jnp.int32(4)), {pos}),
        (rx.BidirectionalSpans(), {pos, span}),
        (rx.BlockSparse(block_pattern(SEQ, 4), 4), {pos}),
        (rx.Causal() & rx.Document(), {pos, seg}),
        (rx.Full() | rx.BidirectionalSpans(), {pos, span}),
        (CausalSameDocument(), {pos, seg}),
        (OnlyWithinSpans(), {span}),
        (OnlyWithinSpans() & DilatedWindow(4, 2), {pos, span}),
    ]
    for mask, reads in expected:
        assert mask.reads() == reads, mask

    # Also while tracing, with the mask's arrays traced.
    def traced(n):
        assert (rx.PrefixLM(n) & rx.Document()).reads() == {pos, seg}
        return n

    jax.jit(traced)(jnp.int32(3))


def test_user_mask_reading_segments_is_exact_with_ids():
    q, k, v = qkv(jax.random.key(15), (), 12, HEADS, KV_HEADS, HEAD_DIM)
    seg = packed_segments(12, (5, 7))
    mask = CausalSameDocument()
    out = rx.ring_attention(q, k, v, mask=mask, segment_ids=seg, mesh=mesh(3), kernel=KERNEL)
    assert_close(out, rx.reference_attention(q, k, v, mask=mask, segment_ids=seg))
    # The same answer as the built-in rule it spells out, which the -1 ids of a missing
    # `segment_ids` would not give (they would make it plain causal).
    built_in = rx.reference_attention(q, k, v, mask=rx.Causal() & rx.Document(), segment_ids=seg)
    assert_close(out, built_in)
    assert not np.allclose(out, rx.reference_attention(q, k, v, mask=rx.Causal()))


def test_new_mask_arrays_do_not_recompile():
    m = mesh(4)
    q, k, v = qkv(jax.random.key(12), (), 20, HEADS, KV_HEADS, HEAD_DIM)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def f(mask, q, k, v):
        return rx.ring_attention(q, k, v, mask=mask, mesh=m, kernel=KERNEL)

    for seed, prefix in [(0, 3), (1, 11)]:
        rng = np.random.default_rng(seed)
        sparse = rx.BlockSparse(jnp.asarray(rng.random((4, 4)) < 0.5) | jnp.eye(4, dtype=bool), 5)
        mask = sparse | rx.PrefixLM(jnp.asarray(prefix, jnp.int32))
        assert_close(f(mask, q, k, v), rx.reference_attention(q, k, v, mask=mask))


def test_window_must_be_positive():
    with pytest.raises(ValueError, match=r"SlidingWindow `window` must be an integer >= 1; got 0"):
        rx.SlidingWindow(0)
    with pytest.raises(ValueError, match=r"got -3"):
        rx.SlidingWindow(-3, two_sided=True)


def test_block_sparse_errors():
    q, k, v = qkv(jax.random.key(13), (), 21, HEADS, KV_HEADS, HEAD_DIM)
    bad = rx.BlockSparse(jnp.ones((5, 5), bool), 4)  # 21 tokens / 4 -> 6 blocks
    msg = (
        r"`block_mask` must have shape .* = \(6, 6\) for seq_len=21 and block_size=4; "
        r"got shape \(5, 5\)"
    )
    with pytest.raises(ValueError, match=msg):
        rx.ring_attention(q, k, v, mask=bad & rx.Causal(), mesh=mesh(3))
    with pytest.raises(ValueError, match=msg):
        rx.reference_attention(q, k, v, mask=rx.Causal() | bad)
    layout = rx.Uniform().layout(21, 3)
    with pytest.raises(ValueError, match=msg):
        rx.ring_attention(
            *(layout.shard(x) for x in (q, k, v)),
            mask=bad,
            layout=layout,
            order="layout",
            mesh=mesh(3),
        )
    # Under the test suite's jaxtyping hook the field annotation `Bool[Array, "q_blocks
    # k_blocks"]` answers first; without it, `__check_init__` says the same in words.
    with pytest.raises((TypeError, ValueError), match=r"block_mask"):
        rx.BlockSparse(jnp.ones((6,), bool), 4)
    with pytest.raises(TypeError, match=r"block_mask"):
        rx.BlockSparse(jnp.ones((6, 6), jnp.int32), 4)
    with pytest.raises(ValueError, match=r"`block_size` must be an integer >= 1; got 0"):
        rx.BlockSparse(jnp.ones((6, 6), bool), 0)


def test_span_ids_are_required_and_placed_like_segment_ids():
    q, k, v = qkv(jax.random.key(14), (), 12, HEADS, KV_HEADS, HEAD_DIM)
    spans = rx.BidirectionalSpans() & rx.SlidingWindow(6, two_sided=True)
    msg = r"This mask reads span ids: pass `span_ids=` or a `layout=`"
    with pytest.raises(ValueError, match=msg):
        rx.ring_attention(q, k, v, mask=spans, mesh=mesh(2))
    with pytest.raises(ValueError, match=msg):
        rx.reference_attention(q, k, v, mask=spans)
    ids = span_ids(12)
    layout = rx.Uniform().layout(12, 2, span_ids=ids)
    with pytest.raises(ValueError, match=r"Pass `span_ids` to the strategy that builds the layout"):
        rx.ring_attention(q, k, v, mask=spans, layout=layout, span_ids=ids, mesh=mesh(2))
    q2, k2, v2 = (jnp.stack([x, x]) for x in (q, k, v))
    msg = r"`span_ids` must have shape \[\*batch, seq\] = \(2, 12\) or \[seq\]; got shape \(1, 12\)"
    with pytest.raises(ValueError, match=msg):
        rx.ring_attention(q2, k2, v2, mask=spans, span_ids=ids[None], mesh=mesh(2))


def test_reads_follows_calls_and_is_conservative_elsewhere():
    # What a mask reads comes from a liveness pass over the traced rule (public
    # jax.extend.core API, no private JAX): records only a dead branch touches are not
    # read, a `jax.jit` inside the rule is followed, and an effect keeps its inputs.
    from ringeqx._masks._reads import _dependence

    rec = [jax.ShapeDtypeStruct((3,), jnp.int32)] * 3
    tree = jax.tree.structure(None)

    def dead(_, a, b, c):
        unused = b * 2  # computed, never returned
        del unused
        return a + 1

    def nested(_, a, b, c):
        return jax.jit(lambda x, y: x * 2)(a, b) + jax.jit(lambda z: z)(c)

    def effect(_, a, b, c):
        jax.debug.callback(lambda x: None, b)
        return a

    assert _dependence(dead, tree, (), rec) == [True, False, False]
    assert _dependence(nested, tree, (), rec) == [True, False, True]
    assert _dependence(effect, tree, (), rec) == [True, True, False]
