"""Sharding strategies: the layout contract, exactness through the ring, balance, errors."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from helpers import STRATEGIES, assert_close, mesh, packed_segments, qkv
from jaxtyping import Array, Int

import ringeqx as rx


matplotlib.use("Agg")

SEQ = 43  # not divisible by 2, 3, 4, 6, 8 or 16
SEG = packed_segments(SEQ, [5, 11, 7, 13])
# Two spans (an "image" of 6 tokens, a "clip" of 4) in text.
SPANS = jnp.full((SEQ,), -1, jnp.int32).at[9:15].set(0).at[30:34].set(1)
IDS = [s[0] for s in STRATEGIES]
MASKS = [
    ("causal", rx.Causal()),
    ("document", rx.Document()),
    ("causal_document", rx.Causal() & rx.Document()),
]


class EdgesAt(rx.AbstractShardingStrategy):
    """A user strategy, registered nowhere: shard edges at the given special tokens.

    Shard 0 ends at `edges[0]`, shard 1 at `edges[1]`, ...; the shards after the last
    edge split the rest of the sequence evenly.
    """

    edges: tuple[int, ...] = eqx.field(static=True)

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> rx.Layout:
        rest = num_shards - len(self.edges)
        tail = self.edges[-1] + (np.arange(1, rest + 1) * (seq_len - self.edges[-1])) // rest
        cuts = np.array([0, *self.edges, *tail])
        sizes = np.diff(cuts)
        slot = np.arange(sizes.max())
        order = np.where(slot < sizes[:, None], cuts[:-1, None] + slot, -1)
        return rx.layout_from_order(
            jnp.asarray(order), seq_len, segment_ids=segment_ids, span_ids=span_ids
        )


def _tokens(layout: rx.Layout) -> np.ndarray:
    """Original indices held by valid slots, in slot order."""
    return np.asarray(layout.positions)[np.asarray(layout.valid)]


def _pad(layout: rx.Layout, capacity: int) -> rx.Layout:
    """The same placement with more padding slots at the end of every shard."""
    extra = capacity - layout.capacity
    widths = ((0, 0), (0, extra))

    def pad(x, fill):
        return jnp.pad(x, widths, constant_values=fill)

    return rx.Layout(
        pad(layout.positions, 0),
        pad(layout.segments, -1),
        pad(layout.spans, -1),
        pad(layout.valid, False),
        seq_len=layout.seq_len,
    )


# ---------------------------------------------------------------------------------------
# The layout contract


@pytest.mark.parametrize("devices", [1, 3, 4, 8])
@pytest.mark.parametrize("factory", [s[1] for s in STRATEGIES], ids=IDS)
def test_every_token_once_and_roundtrip(factory, devices):
    layout = factory(SEQ).layout(SEQ, devices, segment_ids=SEG, span_ids=SPANS)
    assert layout.num_shards == devices and layout.batch_shape == ()
    assert layout.sharded_len >= SEQ
    np.testing.assert_array_equal(np.sort(_tokens(layout)), np.arange(SEQ))
    # Records travel with their tokens; padding never matches a real segment.
    pos, valid = np.asarray(layout.positions), np.asarray(layout.valid)
    np.testing.assert_array_equal(np.asarray(layout.segments)[valid], np.asarray(SEG)[pos[valid]])
    np.testing.assert_array_equal(np.asarray(layout.spans)[valid], np.asarray(SPANS)[pos[valid]])
    assert np.all(np.asarray(layout.segments)[~valid] == -1)
    x = jax.random.normal(jax.random.key(0), (SEQ, 3, 5))
    sharded = layout.shard(x)
    assert sharded.shape == (layout.sharded_len, 3, 5)
    assert np.all(np.asarray(sharded).reshape(devices, -1, 3, 5)[~valid] == 0)
    np.testing.assert_array_equal(np.asarray(layout.unshard(sharded)), np.asarray(x))


@pytest.mark.parametrize("factory", [s[1] for s in STRATEGIES], ids=IDS)
def test_batched_segment_ids_give_batched_layout(factory):
    seg = jnp.stack([SEG, packed_segments(SEQ, [20, 2, 9, 1])])
    strategy = factory(SEQ)
    layout = strategy.layout(SEQ, 4, segment_ids=seg)
    assert layout.batch_shape == (2,)
    for b in range(2):
        one = strategy.layout(SEQ, 4, segment_ids=seg[b])
        row = jax.tree.map(lambda x: x[b], layout)
        for name in ("positions", "segments", "valid"):
            np.testing.assert_array_equal(getattr(row, name), getattr(one, name))
        np.testing.assert_array_equal(np.sort(_tokens(row)), np.arange(SEQ))
    x = jax.random.normal(jax.random.key(1), (2, SEQ, 3))
    back = jax.vmap(rx.Layout.unshard)(layout, jax.vmap(rx.Layout.shard)(layout, x))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


@pytest.mark.parametrize("factory", [s[1] for s in STRATEGIES], ids=IDS)
def test_num_shards_below_one_is_an_error(factory):
    with pytest.raises(ValueError, match="`num_shards` must be an integer >= 1; got 0"):
        factory(SEQ).layout(SEQ, 0)


# ---------------------------------------------------------------------------------------
# Exact through the ring, for every strategy


@pytest.mark.parametrize("devices", [1, 3, 4, 8])
def test_ring_matches_dense_for_every_strategy(devices):
    # All strategies run in one batched call (one compile per mask and device count,
    # which keeps the suite fast on CPU): example `b` of the batch is laid out by strategy
    # `b`, padded to the common capacity. The answer must not depend on the strategy.
    strategies = list(STRATEGIES)
    if devices >= 3:
        strategies.append(("edges_at", lambda n: EdgesAt((10, 20))))
    names = [s[0] for s in strategies]
    layouts = [f(SEQ).layout(SEQ, devices, segment_ids=SEG, span_ids=SPANS) for _, f in strategies]
    capacity = max(lay.capacity for lay in layouts)
    layout = jax.tree.map(lambda *xs: jnp.stack(xs), *[_pad(lay, capacity) for lay in layouts])
    num = len(strategies)
    q, k, v = qkv(jax.random.key(devices), (), SEQ, 3, 1, 5)
    m = mesh(devices)
    kernel = rx.XlaKernel(block_q=4, block_kv=3)
    stack = lambda x: jnp.broadcast_to(x, (num,) + x.shape)  # noqa: E731

    def ring(q, k, v):
        q, k, v = (jax.vmap(rx.Layout.shard)(layout, x) for x in (q, k, v))
        outs = []
        for _, mask in MASKS:
            out = rx.ring_attention(
                q, k, v, mask=mask, layout=layout, order="layout", mesh=m, kernel=kernel
            )
            outs.append(jax.vmap(rx.Layout.unshard)(layout, out))
        return outs

    def dense(q, k, v):
        return [rx.reference_attention(q, k, v, mask=mask, segment_ids=SEG) for _, mask in MASKS]

    # All masks in one program; each output gets its own random cotangent.
    cts = [jax.random.normal(jax.random.key(i), (SEQ, 3, 5)) for i in range(len(MASKS))]
    out, vjp = jax.vjp(jax.jit(ring), stack(q), stack(k), stack(v))
    ref, ref_vjp = jax.vjp(dense, q, k, v)
    for i, (mask_name, _) in enumerate(MASKS):
        # Gradients of one mask's output alone: zero cotangents for the others.
        one = [ct if j == i else jnp.zeros_like(ct) for j, ct in enumerate(cts)]
        grads = vjp([stack(ct) for ct in one])
        ref_grads = ref_vjp(one)
        for b, name in enumerate(names):
            where = f"{name} on {devices} devices, {mask_name} mask"
            try:
                assert_close(out[i][b], ref[i])
                for g, r in zip(grads, ref_grads):
                    assert_close(g[b], r)
            except AssertionError as e:
                raise AssertionError(where) from e


# ---------------------------------------------------------------------------------------
# Placement of each strategy


def test_zigzag_pairs_head_and_tail_chunks():
    layout = rx.Zigzag().layout(16, 4)
    expected = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    np.testing.assert_array_equal(layout.positions, expected)
    assert rx.Zigzag().layout(SEQ, 8).capacity == 6  # 2 * ceil(43 / 16)


def test_striped_deals_round_robin():
    np.testing.assert_array_equal(
        rx.Striped().layout(8, 4).positions, [[0, 4], [1, 5], [2, 6], [3, 7]]
    )
    layout = rx.Striped(stripe=2).layout(11, 2)
    np.testing.assert_array_equal(_tokens(layout)[:6], [0, 1, 4, 5, 8, 9])
    np.testing.assert_array_equal(np.asarray(layout.valid).sum(axis=1), [6, 5])


def test_boundary_snaps_edges_to_breaks():
    # Even edges of 40 tokens on 4 shards: 10, 20, 30. Nearest breaks: 12, 18, 31.
    layout = rx.Boundary(jnp.array([5, 12, 18, 27, 31, 36])).layout(40, 4)
    starts = np.asarray(layout.positions)[:, 0]
    np.testing.assert_array_equal(starts, [0, 12, 18, 31])
    np.testing.assert_array_equal(np.asarray(layout.valid).sum(axis=1), [12, 6, 13, 9])
    assert layout.capacity == 13  # the smallest that fits
    # A span longer than an even shard (ceil(40 / 4) = 10) is cut at the even edges.
    long = rx.Boundary(jnp.array([2, 38])).layout(40, 4)
    np.testing.assert_array_equal(np.asarray(long.positions)[:, 0], [0, 10, 20, 30])
    # A given capacity pads.
    assert rx.Boundary(jnp.array([5, 12, 18]), capacity=16).layout(40, 4).capacity == 16


def test_work_balanced_places_whole_chunks_in_order():
    seg = packed_segments(61, [30, 3, 5, 2, 7, 11])
    layout = rx.WorkBalanced(chunk=4, iterations=50).layout(61, 4, segment_ids=seg)
    assert layout.capacity == 16  # ceil(ceil(61 / 4) / 4) chunks of 4
    np.testing.assert_array_equal(np.sort(_tokens(layout)), np.arange(61))
    blocks = np.asarray(layout.positions).reshape(4, 4, 4)
    valid = np.asarray(layout.valid).reshape(4, 4, 4)
    for d in range(4):
        starts = [blk[0] for blk, ok in zip(blocks[d], valid[d]) if ok.any()]
        assert all(s % 4 == 0 for s in starts) and starts == sorted(starts)
        for blk, ok in zip(blocks[d], valid[d]):
            np.testing.assert_array_equal(blk[ok], blk[0] + np.arange(ok.sum()))


def test_modality_aware_never_splits_a_span():
    spans = jnp.full((50,), -1, jnp.int32).at[3:17].set(4).at[20:23].set(7).at[40:49].set(2)
    for zigzag in (True, False):
        layout = rx.ModalityAware(zigzag=zigzag).layout(50, 4, span_ids=spans)
        np.testing.assert_array_equal(np.sort(_tokens(layout)), np.arange(50))
        for span in (4, 7, 2):
            assert np.unique(np.nonzero(np.asarray(layout.spans) == span)[0]).size == 1
    # The same span id in two places is two spans: each stays whole, apart.
    twice = spans.at[30:33].set(7)
    layout = rx.ModalityAware(zigzag=False).layout(50, 4, span_ids=twice)
    pos, sp = np.asarray(layout.positions), np.asarray(layout.spans)
    for lo, hi in ((20, 23), (30, 33)):
        rows = {int(r) for r in np.nonzero((sp == 7) & (pos >= lo) & (pos < hi))[0]}
        assert len(rows) == 1


def test_custom_strategy_edges_at_special_tokens():
    layout = EdgesAt((10, 20)).layout(SEQ, 8)
    np.testing.assert_array_equal(np.asarray(layout.positions)[:3, 0], [0, 10, 20])
    np.testing.assert_array_equal(np.asarray(layout.valid).sum(axis=1), [10, 10, 3, 4, 4, 4, 4, 4])
    np.testing.assert_array_equal(np.sort(_tokens(layout)), np.arange(SEQ))


# ---------------------------------------------------------------------------------------
# Schedules and balance


def test_schedule_counts_match_the_ring():
    # Uniform, causal, 4 shards of 4: at step s device i sees shard i - s.
    layout = rx.Uniform().layout(16, 4)
    s = rx.tools.schedule(layout, rx.Causal(), kernel=rx.XlaKernel(2, 4))
    full, diag = 16, 10
    expected = np.array(
        [[diag] * 4, [0, full, full, full], [0, 0, full, full], [0, 0, 0, full]], np.float32
    )
    np.testing.assert_array_equal(s.pairs, expected)
    # Tiles: 2 x 1 per shard pair; both tiles run wherever the step runs.
    np.testing.assert_array_equal(s.tiles_run, (expected > 0) * 2)
    np.testing.assert_array_equal(s.tiles_run + s.tiles_skipped, np.full((4, 4), 2))
    assert int(s.critical_path) == 8 and int(s.total_tiles) == 20
    assert float(s.imbalance) == pytest.approx((10 + 3 * 16) / (10 + (3 + 2 + 1) * 16 / 4))
    # A method of every strategy, too (deprecated: a schedule is a tool).
    with pytest.warns(DeprecationWarning, match="ringeqx.tools.schedule"):
        method = rx.Uniform().schedule(layout, rx.Causal(), kernel=rx.XlaKernel(2, 4))
    np.testing.assert_array_equal(method.pairs, s.pairs)


@pytest.mark.parametrize("factory", [s[1] for s in STRATEGIES], ids=IDS)
def test_schedule_pairs_sum_to_the_dense_count(factory):
    layout = factory(SEQ).layout(SEQ, 4, segment_ids=SEG)
    mask = rx.Causal() & rx.Document()
    s = rx.tools.schedule(layout, mask, kernel=rx.XlaKernel(3, 2))
    seg = np.asarray(SEG)
    t = np.arange(SEQ)
    dense = ((t[:, None] >= t[None, :]) & (seg[:, None] == seg[None, :])).sum()
    assert float(s.pairs.sum()) == dense
    assert s.pairs.shape == (4, 4)
    c = layout.capacity
    tiles = math.ceil(c / 3) * math.ceil(c / 2)
    np.testing.assert_array_equal(s.tiles_run + s.tiles_skipped, np.full((4, 4), tiles))
    # A tile with attending pairs always runs.
    assert np.all(np.asarray(s.tiles_run)[np.asarray(s.pairs) > 0] > 0)


def test_zigzag_balances_causal_attention_on_8_devices():
    mask = rx.Causal()
    ratio = {
        name: float(
            rx.tools.schedule(s.layout(1000, 8), mask, kernel=rx.XlaKernel(32, 32)).imbalance
        )
        for name, s in [
            ("uniform", rx.Uniform()),
            ("zigzag", rx.Zigzag()),
            ("striped", rx.Striped()),
        ]
    }
    assert ratio["zigzag"] <= 1.05
    assert ratio["striped"] <= 1.05
    assert ratio["uniform"] > 1.8  # (1/2 + 7) / (1/2 + 28/8) = 1.875 for even shards


def test_work_balanced_beats_zigzag_on_long_tailed_documents():
    rng = np.random.default_rng(0)
    seq, block = 2048, 16
    seg = packed_segments(seq, np.maximum(1, rng.lognormal(4.0, 1.3, size=300).astype(int)))
    mask = rx.Causal() & rx.Document()

    def run(strategy):
        layout = strategy.layout(seq, 8, segment_ids=seg)
        return rx.tools.schedule(layout, mask, kernel=rx.XlaKernel(block, block))

    uniform, zigzag = run(rx.Uniform()), run(rx.Zigzag())
    balanced = run(rx.WorkBalanced(chunk=block))
    assert float(balanced.imbalance) <= 1.10
    assert float(balanced.imbalance) < float(zigzag.imbalance)
    # Chunks of one tile keep tiles dense: the same tiles in total as contiguous shards,
    # on a shorter critical path.
    assert int(balanced.total_tiles) == int(uniform.total_tiles)
    assert int(balanced.critical_path) < int(uniform.critical_path)
    assert int(balanced.critical_path) < int(zigzag.critical_path)


def test_schedule_reads_the_kernels_tiles():
    layout = rx.Uniform().layout(128, 4)  # shards of 32 tokens

    def tiles(**kernel):
        s = rx.tools.schedule(layout, rx.Full(), **kernel)
        per_pair = np.asarray(s.tiles_run + s.tiles_skipped)
        assert np.all(per_pair == per_pair[0, 0])
        return int(per_pair[0, 0])

    # The ring's default kernel on the CPU (one tile covers a shard of 32), a kernel's own
    # tiles, a TPU kernel planned here (its tiles shrink to the shard), and a name.
    assert tiles() == tiles(kernel="auto") == tiles(kernel="xla") == 1
    assert tiles(kernel=rx.XlaKernel(8, 16)) == 4 * 2
    assert tiles(kernel=rx.PallasGpuKernel(block_q=32, block_kv=16)) == 1 * 2
    assert tiles(kernel=rx.PallasTpuKernel()) == 1
    # The annotation (under the test hook) or select_kernel's own check.
    with pytest.raises((TypeError, ValueError), match="kernel"):
        rx.tools.schedule(layout, rx.Causal(), kernel="bogus")
    with pytest.raises(ValueError, match="kernel='pallas_tpu' needs device_type='tpu'"):
        rx.tools.schedule(layout, rx.Causal(), kernel="pallas_tpu")


# ---------------------------------------------------------------------------------------
# Array leaves: new values do not recompile


def test_new_boundary_positions_and_segment_ids_do_not_recompile():
    m = mesh(4)
    q, k, v = qkv(jax.random.key(4), (), SEQ, 3, 1, 5)
    mask = rx.Causal() & rx.Document()

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def model(strategy, seg, q, k, v):
        layout = strategy.layout(SEQ, 4, segment_ids=seg)
        q, k, v = (layout.shard(x) for x in (q, k, v))
        out = rx.ring_attention(q, k, v, mask=mask, layout=layout, order="layout", mesh=m)
        return layout.unshard(out)

    cases = [
        (rx.Boundary(jnp.array([4, 9, 20, 31]), capacity=16), SEG),
        (rx.Boundary(jnp.array([12, 13, 22, 43]), capacity=16), packed_segments(SEQ, [3, 8])),
    ]
    for strategy, seg in cases:
        ref = rx.reference_attention(q, k, v, mask=mask, segment_ids=seg)
        assert_close(model(strategy, seg, q, k, v), ref)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def balanced(seg, spans):
        lay = rx.WorkBalanced(chunk=2, iterations=50).layout(SEQ, 4, segment_ids=seg)
        lay2 = rx.ModalityAware(capacity=16).layout(SEQ, 4, span_ids=spans)
        return lay.positions, lay2.positions

    for seg, spans in [(SEG, SPANS), (packed_segments(SEQ, [30, 2]), jnp.roll(SPANS, 5))]:
        pos, pos2 = balanced(seg, spans)
        eager = rx.WorkBalanced(chunk=2, iterations=50).layout(SEQ, 4, segment_ids=seg)
        eager = eager.positions
        np.testing.assert_array_equal(pos, eager)
        eager2 = rx.ModalityAware(capacity=16).layout(SEQ, 4, span_ids=spans).positions
        np.testing.assert_array_equal(pos2, eager2)


# ---------------------------------------------------------------------------------------
# Per-layer plans: each layer its own kernel, mask and config; one shared layout


def test_layers_with_their_own_kernels_share_one_layout():
    # One ModalityAware layout (spans whole on a device) for a two-layer model: layer 1
    # causal + document with small tiles, layer 2 bidirectional inside spans with other
    # tiles and bf16 K/V on the wire. No relayout between the layers.
    dim, devices = 12, 4
    keys = jax.random.split(jax.random.key(5), 2)
    layers = [
        rx.nn.RingAttention(
            dim,
            3,
            1,
            mask=rx.Causal() & rx.Document(),
            kernel=rx.XlaKernel(4, 3),
            rope_theta=None,
            key=keys[0],
        ),
        rx.nn.RingAttention(
            dim,
            3,
            3,
            mask=rx.BidirectionalSpans(),
            kernel=rx.XlaKernel(8, 5),
            config=rx.RingConfig(compression_dtype=jnp.bfloat16),
            rope_theta=None,
            key=keys[1],
        ),
    ]
    layout = rx.ModalityAware().layout(SEQ, devices, segment_ids=SEG, span_ids=SPANS)
    for span in (0, 1):
        assert np.unique(np.nonzero(np.asarray(layout.spans) == span)[0]).size == 1
    x = jax.random.normal(jax.random.key(6), (SEQ, dim))

    @eqx.filter_jit
    def model(layers, x):
        h = layout.shard(x)
        for layer in layers:
            h = layer(h, layout, mesh=mesh(devices))
        return layout.unshard(h)

    def dense(layer, h):
        def proj(p, n):
            return jax.vmap(p)(h).reshape(SEQ, n, -1)

        q = proj(layer.query_proj, layer.num_heads)
        k, v = proj(layer.key_proj, layer.num_kv_heads), proj(layer.value_proj, layer.num_kv_heads)
        out = rx.reference_attention(q, k, v, mask=layer.mask, segment_ids=SEG, span_ids=SPANS)
        return jax.vmap(layer.output_proj)(out.reshape(SEQ, -1))

    ref = dense(layers[1], dense(layers[0], x))
    # bf16 K/V in layer 2: we measure 5e-5; ignoring the spans would be off by 1e-2.
    assert_close(model(layers, x), ref, rtol=0, atol=2e-3)
    assert layers[0].kernel != layers[1].kernel


# ---------------------------------------------------------------------------------------
# Plots


def test_plots_draw_layouts_and_schedules():
    layout = rx.Zigzag().layout(SEQ, 4, segment_ids=SEG)
    ax = rx.tools.plot_layout(layout, color_by="segment")
    assert ax.images[0].get_array().shape == (4, layout.capacity)
    assert ax.images[0].get_array().mask.sum() == layout.sharded_len - SEQ
    s = rx.tools.schedule(layout, rx.Causal(), kernel=rx.XlaKernel(4, 4))
    ax = rx.tools.plot_schedule(s, what="tiles")
    np.testing.assert_array_equal(ax.images[0].get_array(), s.tiles_run)
    assert "imbalance" in ax.get_title()
    with pytest.raises(ValueError, match="`color_by` must be 'position', 'segment' or 'span'"):
        rx.tools.plot_layout(layout, color_by="device")
    with pytest.raises(ValueError, match="`what` must be 'pairs' or 'tiles'; got 'flops'"):
        rx.tools.plot_schedule(s, what="flops")
    batched = rx.Uniform().layout(SEQ, 4, segment_ids=jnp.stack([SEG, SEG]))
    with pytest.raises(ValueError, match="plot_layout draws one example"):
        rx.tools.plot_layout(batched)


# ---------------------------------------------------------------------------------------
# Errors


def test_boundary_errors():
    with pytest.raises(ValueError, match="Boundary `positions` must be sorted; got \\[9, 4\\]"):
        rx.Boundary(jnp.array([9, 4]))
    with pytest.raises(ValueError, match="Boundary `positions` must be >= 0"):
        rx.Boundary(jnp.array([-1, 4]))
    with pytest.raises(ValueError, match="must be a 1-d integer array; got shape \\(2, 1\\)"):
        rx.Boundary(jnp.array([[1], [2]]))
    with pytest.raises(
        ValueError, match="must be a 1-d integer array; got shape \\(2,\\) and dtype float32"
    ):
        rx.Boundary(jnp.array([1.0, 2.0]))
    with pytest.raises(
        ValueError, match="Boundary `capacity` must be an integer >= 1 or None; got 0"
    ):
        rx.Boundary(jnp.array([3]), capacity=0)
    with pytest.raises(ValueError, match="must lie in \\[0, seq_len=20\\]; got \\[3, 21\\]"):
        rx.Boundary(jnp.array([3, 21])).layout(20, 2)
    with pytest.raises(ValueError, match="`capacity`=8 is too small for the tokens"):
        rx.Boundary(jnp.array([3, 12]), capacity=8).layout(20, 2)

    # Traced positions: a static capacity is needed, and values are checked at run time.
    with pytest.raises(ValueError, match="traced `positions` \\(under jit\\) needs a static"):
        eqx.filter_jit(lambda s: s.layout(20, 2).positions)(rx.Boundary(jnp.array([3, 12])))
    run = eqx.filter_jit(lambda s: s.layout(20, 2).positions)
    np.testing.assert_array_equal(run(rx.Boundary(jnp.array([3, 12]), capacity=12))[:, 0], [0, 12])
    with pytest.raises(RuntimeError, match="must be sorted and lie in \\[0, seq_len=20\\]"):
        run(rx.Boundary(jnp.array([3, 25]), capacity=12)).block_until_ready()
    with pytest.raises(RuntimeError, match="`capacity`=11 is too small for the tokens"):
        run(rx.Boundary(jnp.array([3, 12]), capacity=11)).block_until_ready()

    @eqx.filter_jit
    def unsorted(p):
        return rx.Boundary(p, capacity=12).layout(20, 2).positions

    with pytest.raises(RuntimeError, match="must be sorted"):
        unsorted(jnp.array([12, 3])).block_until_ready()


def test_work_balanced_errors():
    with pytest.raises(ValueError, match="WorkBalanced `chunk` must be an integer >= 1; got 0"):
        rx.WorkBalanced(chunk=0)
    with pytest.raises(ValueError, match="`iterations` must be an integer >= 0; got -2"):
        rx.WorkBalanced(iterations=-2)
    with pytest.raises(
        ValueError, match="`segment_ids` must have shape \\[\\*batch, seq_len=43\\]"
    ):
        rx.WorkBalanced().layout(SEQ, 4, segment_ids=SEG[:40])
    # Every strategy checks the length of segment ids and span ids.
    for _, factory in STRATEGIES:
        with pytest.raises(
            ValueError,
            match="`segment_ids` must have shape \\[\\*batch, seq_len=43\\]; got shape \\(44,\\)",
        ):
            factory(SEQ).layout(SEQ, 4, segment_ids=jnp.zeros(44, jnp.int32))
        with pytest.raises(
            ValueError, match="`span_ids` must have shape \\[\\*batch, seq_len=43\\]"
        ):
            factory(SEQ).layout(SEQ, 4, span_ids=jnp.zeros(42, jnp.int32))


def test_modality_aware_errors():
    spans = jnp.full((30,), -1, jnp.int32).at[4:16].set(0)
    with pytest.raises(
        ValueError, match="ModalityAware `capacity` must be an integer >= 1 or None"
    ):
        rx.ModalityAware(capacity=0)
    with pytest.raises(
        ValueError, match="A span of 12 tokens is longer than ModalityAware `capacity`=10"
    ):
        rx.ModalityAware(capacity=10).layout(30, 4, span_ids=spans)
    with pytest.raises(ValueError, match="`capacity`=12 is too small for the tokens"):
        rx.ModalityAware(capacity=12).layout(30, 4, span_ids=spans)

    @eqx.filter_jit
    def traced(spans, capacity):
        return rx.ModalityAware(capacity=capacity).layout(30, 4, span_ids=spans).positions

    with pytest.raises(ValueError, match="traced `span_ids` \\(under jit\\) needs a static"):
        traced(spans, None)
    with pytest.raises(RuntimeError, match="A span is longer than ModalityAware `capacity`=10"):
        traced(spans, 10).block_until_ready()
    with pytest.raises(RuntimeError, match="`capacity`=12 is too small for the tokens"):
        traced(spans, 12).block_until_ready()


def test_striped_errors():
    with pytest.raises(ValueError, match="Striped `stripe` must be an integer >= 1; got 0"):
        rx.Striped(stripe=0)


def test_concrete_leaves_closed_over_by_jit_need_no_capacity():
    # Concrete positions and span ids inside a jitted function are still concrete: the
    # smallest capacity is found at trace time, and checks raise at trace time.
    boundary = rx.Boundary(jnp.array([5, 12, 18, 27, 31, 36]))
    spans = jnp.full((40,), -1, jnp.int32).at[3:9].set(0)

    @jax.jit
    def positions():
        return (
            boundary.layout(40, 4).positions,
            rx.ModalityAware().layout(40, 4, span_ids=spans).positions,
        )

    got, got2 = positions()
    np.testing.assert_array_equal(got, boundary.layout(40, 4).positions)
    np.testing.assert_array_equal(got2, rx.ModalityAware().layout(40, 4, span_ids=spans).positions)
    with pytest.raises(ValueError, match="must lie in \\[0, seq_len=30\\]"):
        jax.jit(lambda: boundary.layout(30, 4).positions)()
