"""BlockSparse in the Pallas kernels: exact per-tile windows decided when traced.

A layout says statically where its runs of consecutive positions start (`rx.Runs`, on
`Layout.runs` and `TokenInfo.runs`); the kernels trust it to bound every tile's extent,
so that BlockSparse's tile-local form is exact without a run-time check (a host callback,
which a compile-only GPU cannot lower). These tests check the claims against the layouts'
values, that trusted claims leave no callback and still give the reference's answer, and
that where no claim covers a tile the check stays, or the kernel refuses when traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import STRATEGIES, assert_close, block_pattern, mesh, qkv

import ringeqx as rx
from ringeqx._kernels._pallas import _tables as tables


GPU = rx.PallasGpuKernel(block_q=16, block_kv=16, interpret=True)
TPU = rx.PallasTpuKernel(
    block_q=16, block_kv=128, block_kv_compute=None, backward_block_kv=None, interpret=True
)


def _mask(seq_len: int, block: int = 8) -> rx.AbstractMask:
    # BlockSparse, `&` and `|`: the tile-local forms of all three meet here. (Not `|
    # PrefixLM`, which holds every causal pair and so would hide the map.)
    sparse = rx.BlockSparse(block_pattern(seq_len, block), block)
    return (sparse & rx.Causal()) | rx.SlidingWindow(3)


def _has_callback(text: str) -> bool:
    return "callback" in text or "xla_python" in text


# ----------------------------------------------------------------------------------
# The claims are true of the layouts' values.


def _check_runs(layout: rx.Layout) -> None:
    """Every valid slot holds the position its run's first slot implies (with the
    stride between runs where one is claimed)."""
    runs = layout.runs
    pos = np.asarray(layout.positions).reshape(-1, layout.capacity)
    valid = np.asarray(layout.valid).reshape(-1, layout.capacity)
    starts = np.asarray(runs.starts)
    run = np.searchsorted(starts, np.arange(layout.capacity), side="right") - 1
    model = np.arange(layout.capacity) - starts[run]
    if runs.stride is not None:
        model = model + run * runs.stride
    for p, ok in zip(pos, valid):
        groups = [np.zeros_like(run)] if runs.stride is not None else [run]
        for g in groups:
            for j in np.unique(g):
                sel = ok & (g == j)
                if sel.any():
                    base = p[sel] - model[sel]
                    assert np.all(base == base[0]), (runs, p)


@pytest.mark.parametrize("name, strategy", STRATEGIES, ids=[n for n, _ in STRATEGIES])
@pytest.mark.parametrize("seq_len, shards", [(37, 4), (64, 4), (50, 3)])
def test_strategy_runs_hold(name, strategy, seq_len, shards):
    layout = strategy(seq_len).layout(seq_len, shards)
    if layout.runs is None:
        assert name == "modality_aware"  # zigzag pieces cut where the spans allow
        return
    assert layout.runs.period == layout.capacity
    _check_runs(layout)


def test_runs_of_the_layouts():
    assert rx.Uniform().layout(40, 4).runs == rx.Runs((0,), 10)
    assert rx.contiguous_layout(40, 4).token_info().runs == rx.Runs((0,), 10)
    # 4 tokens over 8 chunks of 5 or 4: the tail chunk starts after 4 or 5 slots.
    assert rx.Zigzag().layout(37, 4).runs == rx.Runs((0, 4, 5), 10)
    assert rx.Striped(stripe=2).layout(40, 4).runs == rx.Runs(range(0, 10, 2), 10, stride=8)
    assert rx.Striped().layout(40, 1).runs == rx.Runs((0,), 40)
    assert rx.WorkBalanced(chunk=4, iterations=2).layout(40, 2).runs.starts == range(0, 20, 4)
    # A contiguous layout built by hand is one run per shard.
    order = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    lay = rx.layout_from_order(order, 12, contiguous=True)
    assert lay.runs is None and lay.token_info().runs == rx.Runs((0,), 4)


def test_tile_extent():
    one = rx.Runs((0,), 40)
    assert one.tile_extent(40, 16) == 16
    assert one.tile_extent(120, 8) == 8  # whole periods: tiles of 8 never straddle one
    assert one.tile_extent(80, 16) is None  # tile [32, 48) holds two shards
    assert one.tile_extent(20, 16) is None  # a piece of a period: not these runs
    two = rx.Runs((0, 20), 40)
    assert two.tile_extent(40, 4) == 4
    assert two.tile_extent(40, 16) is None  # tile [16, 32) holds both chunks
    # Striped over 4 shards: stripes of 8 slots, 32 positions apart.
    striped = rx.Runs(range(0, 40, 8), 40, stride=32)
    assert striped.tile_extent(40, 8) == 8
    assert striped.tile_extent(40, 16) == 40
    assert rx.Runs(range(40), 40, stride=4).tile_extent(40, 16) == 61
    assert two.halves() == two and one.halves() == two
    assert rx.Runs((0, 5, 30), 40).halves() == rx.Runs((0, 5, 10, 20, 25, 30), 40)


def test_runs_errors():
    with pytest.raises(ValueError, match="Runs `period` must be an integer >= 1; got 0"):
        rx.Runs((0,), 0)
    with pytest.raises(ValueError, match=r"Runs `starts` must be increasing .* got \(1, 3\)"):
        rx.Runs((1, 3), 8)
    with pytest.raises(ValueError, match=r"Runs `starts` must be increasing .* got \(0, 9\)"):
        rx.Runs((0, 9), 8)
    with pytest.raises(ValueError, match=r"Runs `starts` must be increasing .* got \(0, 4, 4\)"):
        rx.Runs((0, 4, 4), 8)
    with pytest.raises(ValueError, match="Runs `stride` must be None or an integer >= 1"):
        rx.Runs((0,), 8, stride=0)
    order = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    with pytest.raises(ValueError, match="Layout `runs` must describe a shard: period = "
                       "capacity = 4; got period 12"):
        rx.layout_from_order(order, 12, runs=rx.Runs((0,), 12))


# ----------------------------------------------------------------------------------
# Trusted claims: no callback, the reference's answer.


# (layout, shards, kernel): one run per shard, Zigzag's chunks of whole tiles, stripes
# of a tile, and stripes of one token (4 shards apart: a tile of 16 spans 61 positions,
# a window of 9 x 9 map blocks of 8).
TRUSTED = [
    ("uniform_gpu", None, GPU),
    ("uniform_tpu", None, TPU),
    ("zigzag", rx.Zigzag(), GPU),
    ("striped16", rx.Striped(stripe=16), GPU),
    ("striped1", rx.Striped(), GPU),
]


@pytest.mark.parametrize("name, strategy, kernel", TRUSTED, ids=[t[0] for t in TRUSTED])
def test_trusted_runs_leave_no_check_and_are_exact(name, strategy, kernel):
    seq, shards = 256, 4
    q, k, v = qkv(jax.random.key(1), (), seq, 3, 1, 64 if kernel is TPU else 16)
    mask = _mask(seq)
    kw = {} if strategy is None else dict(layout=strategy.layout(seq, shards), order="original")

    def attend(q, k, v):
        return rx.ring_attention(q, k, v, mask=mask, mesh=mesh(shards), kernel=kernel, **kw)

    ct = jax.random.normal(jax.random.key(2), q.shape)

    def run(q, k, v, ct):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(ct)

    lowered = jax.jit(run).lower(q, k, v, ct)
    assert not _has_callback(lowered.as_text())
    out, grads = lowered.compile()(q, k, v, ct)
    ref, vjp = jax.vjp(lambda q, k, v: rx.reference_attention(q, k, v, mask=mask), q, k, v)
    assert_close(out, ref, 2e-5, 2e-5)
    for g, r in zip(grads, vjp(ct)):
        assert_close(g, r, 2e-5, 2e-5)


def test_balance_trades_the_runs_with_the_half_shards():
    # RingConfig(balance="zigzag") gives each device two half-shards of 32: whole tiles,
    # still no check. Halves of 20 would put two half-shards in the tile [16, 32): the
    # claim must change with the trade, or that tile would go unchecked.
    def lowered(seq, shards):
        q, k, v = qkv(jax.random.key(3), (), seq, 3, 1, 16)
        config = rx.RingConfig(balance="zigzag")
        return jax.jit(
            lambda q, k, v: rx.ring_attention(
                q, k, v, mask=_mask(seq), mesh=mesh(shards), kernel=GPU, config=config
            )
        ).lower(q, k, v), (q, k, v)

    whole, args = lowered(256, 4)
    assert not _has_callback(whole.as_text())
    out = whole.compile()(*args)
    assert_close(out, rx.reference_attention(*args, mask=_mask(256)), 2e-5, 2e-5)
    halves, _ = lowered(160, 4)
    assert _has_callback(halves.as_text())


# ----------------------------------------------------------------------------------
# Where no claim covers a tile: checked at run time, or refused when traced.


def _call(info: rx.TokenInfo, mask, kernel=GPU):
    x = jnp.ones((1, 2, info.positions.shape[-1], 16), jnp.float32)
    return kernel.forward(x, x, x, info, info, rx.Scores(mask, None, 0.25))


def test_records_without_runs_are_checked_at_run_time():
    n = 64
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    mask = rx.BlockSparse(block_pattern(256, 4), 4)
    plain = rx.TokenInfo(pos, pos * 0, pos * 0 - 1, pos >= 0)
    claimed = rx.TokenInfo(pos, pos * 0, pos * 0 - 1, pos >= 0, rx.Runs((0,), n))
    assert _has_callback(jax.jit(lambda i: _call(i, mask)).lower(plain).as_text())
    assert not _has_callback(jax.jit(lambda i: _call(i, mask)).lower(claimed).as_text())
    # Far-apart positions in a tile (every fourth): an error, not an answer.
    spread = rx.TokenInfo(pos * 4, pos * 0, pos * 0 - 1, pos >= 0)
    with pytest.raises(Exception, match="BlockSparse cannot run exactly in a Pallas kernel"):
        jax.block_until_ready(jax.jit(lambda i: _call(i, mask))(spread))


def test_zigzag_tile_across_its_chunks_is_checked_at_run_time():
    # 200 tokens on 4 shards: chunks of 25 slots, so the tile [16, 32) holds the end of
    # the head chunk and the start of the tail chunk, which the runs do not relate: the
    # run-time check stays. It fails on the shards whose chunks are far apart and passes
    # on the one whose are adjacent: the ring makes it on every device together, so all
    # raise (a device that passed alone would wait in the ring's next transfer, and the
    # CPU runtime aborts the process after its 40 s rendezvous timeout).
    seq, shards = 200, 4
    layout = rx.Zigzag().layout(seq, shards)
    assert layout.runs == rx.Runs((0, 25), 50)
    q, k, v = qkv(jax.random.key(4), (), seq, 3, 1, 16)
    mask = rx.BlockSparse(block_pattern(seq, 4), 4)

    def attend(q, k, v):
        return rx.ring_attention(
            q, k, v, mask=mask, layout=layout, order="original", mesh=mesh(shards),
            kernel=GPU,
        )

    assert _has_callback(jax.jit(attend).lower(q, k, v).as_text())
    with pytest.raises(Exception, match="BlockSparse cannot run exactly in a Pallas kernel"):
        jax.block_until_ready(jax.jit(attend)(q, k, v))


def test_striped_too_spread_for_a_window_is_refused_when_traced():
    # Stripes of one token over 8 shards: a tile of 16 spans 121 positions, 61 blocks of
    # the map; no halving of the tiles brings the window to a few words.
    seq, shards = 256, 8
    layout = rx.Striped().layout(seq, shards)
    q, k, v = qkv(jax.random.key(5), (), seq, 3, 1, 16)
    mask = rx.BlockSparse(block_pattern(seq, 2), 2) & rx.Causal()
    with pytest.raises(
        ValueError,
        match=r"And cannot run exactly in a Pallas kernel with 16x16 tiles on this "
        r"layout: its query tiles hold positions up to 121 apart .*stride=8.*Use smaller "
        r"tiles, .*Striped with a longer stripe.*XlaKernel",
    ):
        rx.ring_attention(q, k, v, mask=mask, layout=layout, order="original",
                          mesh=mesh(shards), kernel=GPU)


def test_refusal_names_tiles_that_fit():
    # Stripes of 16 over 4 shards: tiles of 64 x 64 span 4 stripes (208 positions, 27
    # blocks of 8); tiles of 16 are one stripe each.
    n = 64
    runs = rx.Runs(range(0, n, 16), n, stride=64)
    pos = jnp.asarray(np.arange(n) // 16 * 64 + np.arange(n) % 16, jnp.int32)[None]
    info = rx.TokenInfo(pos, pos * 0, pos * 0 - 1, pos >= 0, runs)
    mask = rx.BlockSparse(block_pattern(256, 8), 8)
    with pytest.raises(ValueError, match=r"up to 208 apart.*Tiles of 64x16 fit"):
        tables.tile_mask(mask, info, info, n, 64, n, 64)
