"""The ring's communication knobs (exact), compression (close, finite) and the
communication report (counts and bytes against hand-computed values)."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import assert_close, mesh, packed_segments, qkv

import ringeqx as rx
from ringeqx._cli._main import main as cli_main


HEADS, KV_HEADS, HEAD_DIM, CAP = 6, 2, 5, 8

# Exact settings: split transfers, and both directions with 4 pieces of 2 tokens.
EXACT = [
    rx.RingConfig(communication_parallelism=2),
    rx.RingConfig(bidirectional=True, ring_buffer_size=2),
]


def _vjp_all(fns, q, k, v):
    """Outputs and q/k/v cotangents of every fn, in one compiled program."""
    ct = jax.random.normal(jax.random.key(123), q.shape, q.dtype)

    @jax.jit
    def run(q, k, v, ct):
        results = []
        for fn in fns:
            # One ring after the other: XLA's CPU runtime runs independent collectives
            # concurrently, and with more rings than its thread pool has threads, a
            # device's permute can wait for a thread that another ring's blocked
            # rendezvous holds (measured: a deadlock on 2 cores).
            q, k, v, ct = jax.lax.optimization_barrier((q, k, v, ct, results))[:4]
            out, vjp = jax.vjp(fn, q, k, v)
            results.append((out, vjp(ct)))
        return results

    # Finished before anything else is dispatched: with asynchronous dispatch the next
    # program's compile (and the eager steps of a ring's set-up) would otherwise overlap
    # this program's collectives on XLA:CPU's few threads.
    return jax.block_until_ready(run(q, k, v, ct))


def _vjp_per_mesh(fns, q, k, v):
    """`_vjp_all` of `(group, fn)` pairs, one program per group (a mesh, or a mesh and
    a label; results in the order given). XLA's CPU runtime aborts when one program runs
    collective-permutes of two meshes over the same devices side by side (their
    rendezvous keys collide). Bidirectional rings, whose two directions' permutes run
    concurrently, get a program each: among the other rings of a program of 24 on 8
    devices, some devices' K/V records arrived as zeros (a different answer on each run
    of the same compiled program, after other test files had run in the process), and a
    program of bidirectional rings alone deadlocked in XLA:CPU's collectives on 2 cores."""
    results = [None] * len(fns)
    for group in dict.fromkeys(g for g, _ in fns):
        index = [i for i, (g, _) in enumerate(fns) if g == group]
        for i, r in zip(index, _vjp_all([fns[i][1] for i in index], q, k, v)):
            results[i] = r
    return results


HYBRID = rx.RingConfig(ulysses_axis="ulysses")
ALLGATHER = rx.AllGather()
HYBRID_ALLGATHER = rx.AllGather(ulysses_axis="ulysses")


def _hybrid_mesh(ring: int, ulysses: int):
    return mesh(ring, ulysses, names=("sequence", "ulysses"))


def _ring_in_layout(layout, mask, m, config, **kwargs):
    """ring_attention on q/k/v in the original order, through `layout` and back."""
    shard = jax.vmap(layout.shard, in_axes=1, out_axes=1)
    unshard = jax.vmap(layout.unshard, in_axes=1, out_axes=1)

    def ring(q, k, v):
        sq, sk, sv = (shard(x) for x in (q, k, v))
        out = rx.ring_attention(
            sq, sk, sv, mask=mask, layout=layout, order="layout", mesh=m, config=config, **kwargs
        )
        return unshard(out)

    return ring


# The two reordering strategies split between the two ring sizes: each knob meets each
# strategy and each mask on one of them (both sizes once took 122 s of the suite).
@pytest.mark.parametrize(
    "devices, strategy", [(4, rx.Zigzag()), (8, rx.WorkBalanced(chunk=2, iterations=100))]
)
def test_knobs_match_reference(devices, strategy):
    m, hm = mesh(devices), _hybrid_mesh(devices // 2, 2)
    seq = CAP * devices
    seg = packed_segments(seq, [5, 11, 7])
    q, k, v = qkv(jax.random.key(devices), (), seq, HEADS, KV_HEADS, HEAD_DIM)
    product = [(strategy, mask) for mask in (rx.Causal(), rx.Document(), rx.SlidingWindow(5))]
    # Contiguous shards with a window: the early-stopped ring (and the -1 direction's
    # shifted start) on both one- and two-sided windows.
    cases = [(s, mask, EXACT) for s, mask in product]
    cases += [(rx.Uniform(), rx.SlidingWindow(5), EXACT)]
    cases += [(rx.Uniform(), rx.SlidingWindow(5, True), EXACT)]
    # The hybrid (rings of devices / 2 over a Ulysses axis of 2) with every mask;
    # allgather (on the full ring, and on top of the hybrid) with every mask.
    cases += [(s, mask, [HYBRID, ALLGATHER]) for s, mask in product]
    cases += [(product[1][0], product[1][1], [HYBRID_ALLGATHER])]
    fns, refs = [], []
    for strategy, mask, configs in cases:
        ref_index = len(refs)
        refs.append(
            lambda q, k, v, mask=mask: rx.reference_attention(q, k, v, mask=mask, segment_ids=seg)
        )
        for config in configs:
            hybrid = config.ulysses_axis is not None
            layout = strategy.layout(seq, devices // 2 if hybrid else devices, segment_ids=seg)
            assert layout.capacity == (2 * CAP if hybrid else CAP)
            mm = hm if hybrid else m
            bidirectional = isinstance(config, rx.RingConfig) and config.bidirectional
            group = (mm, len(fns)) if bidirectional else mm
            fns.append((ref_index, (group, _ring_in_layout(layout, mask, mm, config))))
    got = _vjp_per_mesh([f for _, f in fns], q, k, v)
    want = _vjp_all(refs, q, k, v)
    for (ref_index, _), (out, grads) in zip(fns, got):
        ref_out, ref_grads = want[ref_index]
        assert_close(out, ref_out)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r)


def test_hybrid_score_mods_sinks_and_gqa():
    # 12 query heads on 4 kv heads (groups of 3): Ulysses 4 leaves 3 query heads and one
    # kv head per device, Ulysses 2 six and two; ALiBi's slopes differ per head, so a
    # device that used another chunk's slopes (or pairs a q head with the wrong kv
    # head) would be caught.
    heads, kv_heads, seq = 12, 4, 64
    q, k, v = qkv(jax.random.key(7), (), seq, heads, kv_heads, HEAD_DIM)
    slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1, dtype=jnp.float32) / heads)
    sinks = jnp.linspace(-1.0, 2.0, heads)
    seg = packed_segments(seq, [9, 30, 4])
    mods = [rx.ALiBi(slopes), rx.Chain(rx.ALiBi(slopes), rx.Softcap(3.0))]
    layout = rx.Zigzag().layout(seq, 2)
    m24, m42 = _hybrid_mesh(2, 4), _hybrid_mesh(4, 2)
    cases = [
        (mods[0], rx.Causal(), True, m24, HYBRID),
        (mods[1], rx.Causal(), False, m24, HYBRID_ALLGATHER),
        (mods[1], rx.SlidingWindow(9), False, m42, HYBRID),
        (None, rx.Document(), False, m42, HYBRID_ALLGATHER),
    ]
    fns, refs = [], []
    for mod, mask, with_layout, m, config in cases:
        kw = dict(mask=mask, score_mod=mod, sinks=sinks)
        if isinstance(mask, rx.Document):
            kw["segment_ids"] = seg
        if with_layout:
            fns.append((m, _ring_in_layout(layout, mask, m, config, score_mod=mod, sinks=sinks)))
        else:
            # No layout: contiguous shards in the original order.
            fns.append(
                (
                    m,
                    lambda q, k, v, m=m, c=config, kw=kw: rx.ring_attention(
                        q, k, v, mesh=m, config=c, **kw
                    ),
                )
            )
        refs.append(lambda q, k, v, kw=kw: rx.reference_attention(q, k, v, **kw))
    got = _vjp_per_mesh(fns, q, k, v)
    want = _vjp_all(refs, q, k, v)
    for (out, grads), (ref_out, ref_grads) in zip(got, want):
        assert_close(out, ref_out)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r)


@pytest.mark.parametrize("devices", [4, 8])
def test_zigzag_balance_matches_reference(devices):
    # The balance trades shard halves inside the ring: exact on the default contiguous
    # path (batched, packed documents, a window) and on a layout, values and gradients.
    m = mesh(devices)
    seq = CAP * devices
    seg = packed_segments(seq, [5, 11, 7])
    q, k, v = qkv(jax.random.key(40 + devices), (2,), seq, HEADS, KV_HEADS, HEAD_DIM)
    balance = rx.RingConfig(balance="zigzag")
    cases = [
        (rx.Causal(), None),
        (rx.Causal() & rx.Document(), seg),
        (rx.SlidingWindow(5), None),
        (rx.Full(), None),
    ]
    fns, refs = [], []
    for mask, ids in cases:
        fns.append(
            lambda q, k, v, mask=mask, ids=ids: rx.ring_attention(
                q, k, v, mask=mask, segment_ids=ids, mesh=m, config=balance
            )
        )
        refs.append(
            lambda q, k, v, mask=mask, ids=ids: rx.reference_attention(
                q, k, v, mask=mask, segment_ids=ids
            )
        )
    layout = rx.WorkBalanced(chunk=2, iterations=50).layout(seq, devices, segment_ids=seg)

    def on_layout(q, k, v):
        return rx.ring_attention(
            q,
            k,
            v,
            mask=rx.Causal() & rx.Document(),
            layout=layout,
            order="original",
            mesh=m,
            config=balance,
        )

    fns.append(on_layout)
    refs.append(refs[1])
    for (out, grads), (ref_out, ref_grads) in zip(_vjp_all(fns, q, k, v), _vjp_all(refs, q, k, v)):
        assert_close(out, ref_out)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r)


def test_zigzag_balance_trades_halves_by_permutes():
    # Hand-computed: q, k, v go out as two half-shard permutes each and the output comes
    # back as two: 8 more float32 permutes of half a shard, and no gather of any kind.
    p = 4
    m = mesh(p)
    q, k, v = qkv(jax.random.key(7), (), CAP * p, HEADS, KV_HEADS, HEAD_DIM)

    def forward(config):
        return jax.jit(
            lambda q, k, v: rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m, config=config)
        )

    plain = rx.tools.comm_report(forward(rx.RingConfig()), q, k, v, mesh=m)
    balanced = rx.tools.comm_report(forward(rx.RingConfig(balance="zigzag")), q, k, v, mesh=m)
    half = CAP // 2
    extra = 2 * (half * HEADS * HEAD_DIM * 4) * 2 + 2 * 2 * (half * KV_HEADS * HEAD_DIM * 4)
    assert (
        balanced.bytes("collective-permute", "f32")
        == plain.bytes("collective-permute", "f32") + extra
    )
    assert (
        balanced.count("collective-permute", "f32") == plain.count("collective-permute", "f32") + 8
    )
    for kind in ("all-gather", "all-to-all", "all-reduce", "reduce-scatter"):
        assert balanced.count(kind) == 0
    # Odd shards cannot be halved: a clear error.
    q, k, v = qkv(jax.random.key(7), (), 3 * p, HEADS, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="balance='zigzag'.*even number of tokens per shard"):
        forward(rx.RingConfig(balance="zigzag")).trace(q, k, v)
    # Our own check, as a user without jaxtyping's runtime hook meets it.
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(ValueError, match="`balance` must be None or 'zigzag'"):
            rx.RingConfig(balance="striped")
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bidirectional=1), "`bidirectional` must be True or False; got 1"),
        (dict(bidirectional="no"), "`bidirectional` must be True or False; got 'no'"),
        (dict(compression_dtype="bf16"), "`compression_dtype` must be a dtype .*got 'bf16', "
         "which names no dtype"),
        (dict(compression_dtype="float4_e2m1fn"), "`compression_dtype` must be a floating "
         "dtype of whole bytes .*float4_e2m1fn"),
        (dict(grad_compression_dtype=jnp.int8), "`grad_compression_dtype` must be a "
         "floating dtype of whole bytes .*int8"),
    ],
)  # fmt: skip
def test_ring_config_flags_are_read_strictly(kw, match):
    # Our own checks, as a user without jaxtyping's runtime hook meets them.
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(ValueError, match=match):
            rx.RingConfig(**kw)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    assert rx.RingConfig(bidirectional=np.True_) == rx.RingConfig(bidirectional=True)
    assert rx.RingConfig(compression_dtype="bfloat16").compression_dtype == jnp.bfloat16


def test_compression_is_close_and_never_overflows():
    m = mesh(4)
    q, k, v = qkv(jax.random.key(3), (), 32, HEADS, KV_HEADS, HEAD_DIM)
    # Values past float16's range (65504) and past float8_e4m3fn's (448): finite in
    # the dense answer, so they must stay finite through the scaled wire formats.
    v = v * 1e5
    configs = [
        (rx.RingConfig(compression_dtype=jnp.bfloat16), 2e-2),
        (rx.RingConfig(compression_dtype=jnp.float16), 2e-3),
        (rx.RingConfig(compression_dtype=jnp.float8_e4m3fn), 0.25),
        (rx.RingConfig(compression_dtype=jnp.float8_e5m2, bidirectional=True), 0.5),
        (rx.RingConfig(grad_compression_dtype=jnp.bfloat16), 1e-5),
        (rx.RingConfig(grad_compression_dtype=jnp.float16), 1e-5),
    ]
    fns = [
        lambda q, k, v, c=c: rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m, config=c)
        for c, _ in configs
    ]
    got = _vjp_all(fns, q, k, v)
    ((ref, ref_grads),) = _vjp_all(
        [lambda q, k, v: rx.reference_attention(q, k, v, mask=rx.Causal())], q, k, v
    )
    scale = float(jnp.max(jnp.abs(ref)))
    for (config, tol), (out, grads) in zip(configs, got):
        assert bool(jnp.all(jnp.isfinite(out))), config
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads), config
        # Errors relative to the output's size (v is ~1e5).
        assert float(jnp.max(jnp.abs(out - ref))) <= tol * scale, config
        if config.compression_dtype is None:
            # dK/dV compression: forward exact, dQ exact, dK/dV close.
            assert_close(out, ref, 1e-5, 1e-5 * scale)
            assert_close(grads[0], ref_grads[0], 1e-5, 1e-5 * scale)
            for g, r in zip(grads[1:], ref_grads[1:]):
                err = float(jnp.max(jnp.abs(g - r)))
                assert 0 < err <= 1e-2 * float(jnp.max(jnp.abs(r))), config


def _kv_bytes(n_tokens, itemsize):
    return KV_HEADS * n_tokens * HEAD_DIM * itemsize


def test_report_counts_and_bytes():
    p = 4
    m = mesh(p)
    seq = CAP * p
    q, k, v = qkv(jax.random.key(4), (), seq, HEADS, KV_HEADS, HEAD_DIM)

    def forward(config):
        return jax.jit(
            lambda q, k, v: rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m, config=config)
        )

    def both(config):
        def f(q, k, v):
            out, vjp = jax.vjp(forward(config), q, k, v)
            return vjp(out)

        return jax.jit(f)

    def kv_shape(tokens):
        return (1, KV_HEADS, tokens, HEAD_DIM)

    # Forward: P - 1 hops of K and V.
    r = rx.tools.comm_report(forward(rx.RingConfig()), q, k, v, mesh=m)
    (row,) = [x for x in r.rows if x.kind == "collective-permute" and x.dtype == "f32"]
    assert row.shape == kv_shape(CAP) and row.axes == ("sequence",)
    assert row.count == 2 * (p - 1) and row.bytes_per_op == _kv_bytes(CAP, 4)
    assert r.bytes("collective-permute", "f32") == 2 * (p - 1) * _kv_bytes(CAP, 4)
    # Backward too: K/V and dK/dV each P - 1 hops, then one hop home for dK/dV.
    r = rx.tools.comm_report(both(rx.RingConfig()), q, k, v, mesh=m)
    assert r.count("collective-permute", "f32") == 2 * (p - 1) + 2 * (p - 1) + 2 * (p - 1) + 2
    # n pieces: n times the permutes at 1/n the bytes (forward).
    n = 4
    r = rx.tools.comm_report(forward(rx.RingConfig(communication_parallelism=n)), q, k, v, mesh=m)
    (row,) = [x for x in r.rows if x.kind == "collective-permute" and x.dtype == "f32"]
    assert row.shape == kv_shape(CAP // n)
    assert row.count == n * 2 * (p - 1) and row.bytes_per_op == _kv_bytes(CAP, 4) // n
    # ring_buffer_size gives the same split.
    r2 = rx.tools.comm_report(forward(rx.RingConfig(ring_buffer_size=CAP // n)), q, k, v, mesh=m)
    assert r2.rows == r.rows
    # bfloat16: half the bytes, sent as u16 bits; no float32 K/V on the wire.
    r = rx.tools.comm_report(
        forward(rx.RingConfig(compression_dtype=jnp.bfloat16)), q, k, v, mesh=m
    )
    assert r.count("collective-permute", "f32") == 0
    assert r.bytes("collective-permute", "u16") == 2 * (p - 1) * _kv_bytes(CAP, 2)
    # float8: a quarter, plus one float32 scale per (batch, kv head) block.
    r = rx.tools.comm_report(
        forward(rx.RingConfig(compression_dtype=jnp.float8_e4m3fn)), q, k, v, mesh=m
    )
    assert r.bytes("collective-permute", "u8") == 2 * (p - 1) * _kv_bytes(CAP, 1)
    assert r.bytes("collective-permute", "f32") == 2 * (p - 1) * KV_HEADS * 4
    # Bidirectional: half the shard each way, so each direction carries half the bytes.
    r = rx.tools.comm_report(forward(rx.RingConfig(bidirectional=True)), q, k, v, mesh=m)
    (row,) = [x for x in r.rows if x.kind == "collective-permute" and x.dtype == "f32"]
    assert row.count == 2 * 2 * (p - 1) and row.shape == kv_shape(CAP // 2)
    # dK/dV in bfloat16 on the backward ring; the hop home stays float32.
    r = rx.tools.comm_report(
        both(rx.RingConfig(grad_compression_dtype=jnp.bfloat16)), q, k, v, mesh=m
    )
    assert r.bytes("collective-permute", "u16") == 2 * (p - 1) * _kv_bytes(CAP, 2)
    assert "collective-permute" in str(r)


def test_report_hybrid_and_allgather():
    # 8 devices, 64 tokens: the pure ring has 8 shards of 8; the hybrid a ring of 4
    # shards of 16 tokens over a Ulysses axis of 2 (3 query heads and 1 kv head each).
    seq, f32 = CAP * 8, 4
    q, k, v = qkv(jax.random.key(8), (), seq, HEADS, KV_HEADS, HEAD_DIM)
    sinks = jnp.linspace(-1.0, 1.0, HEADS)
    hm, m = _hybrid_mesh(4, 2), mesh(8)

    def report(m, config, backward=False, **kw):
        def f(q, k, v):
            return rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m, config=config, **kw)

        def g(q, k, v):
            out, vjp = jax.vjp(f, q, k, v)
            return vjp(out)

        return rx.tools.comm_report(jax.jit(g if backward else f), q, k, v, mesh=m)

    ring, hybrid = report(m, rx.RingConfig()), report(hm, HYBRID)
    # All-to-alls over the Ulysses axis, each moving the device's whole array (its
    # bytes before or after: equal): q, k and v in (seq / 8 tokens, all heads), the
    # output back (float32 here); no lse without sinks.
    q_bytes = seq // 8 * HEADS * HEAD_DIM * f32  # 960
    kv_bytes = seq // 8 * KV_HEADS * HEAD_DIM * f32  # 320
    rows = [r for r in hybrid.rows if r.kind == "all-to-all"]
    assert rows and all(r.axes == ("ulysses",) for r in rows)
    assert hybrid.count("all-to-all") == 4
    assert hybrid.bytes("all-to-all") == 2 * q_bytes + 2 * kv_bytes == 2560
    # K/V on the ring: 2 (R - 1) hops of [1 kv head, 16 tokens] on the ring of 4, against
    # [2 kv heads, 8 tokens] on the ring of 8: 1920 bytes per device against 4480.
    assert hybrid.bytes("collective-permute", "f32") == 2 * 3 * 1 * 16 * HEAD_DIM * f32 == 1920
    assert ring.bytes("collective-permute", "f32") == 2 * 7 * 2 * 8 * HEAD_DIM * f32 == 4480
    assert ring.count("all-to-all") == 0
    # With sinks the lse (seq / 8 tokens, all heads) comes back too.
    with_sinks = report(hm, HYBRID, sinks=sinks)
    assert with_sinks.count("all-to-all") == 5
    assert with_sinks.bytes("all-to-all") == 2560 + seq // 8 * HEADS * f32
    # Backward: the transposes: d_out in, dq/dk/dv out (4 more).
    assert report(hm, HYBRID, backward=True).count("all-to-all") == 8
    # allgather: K and V gathered whole once over the ring axis (plus the token
    # records); no collective-permute; the backward reduce-scatters dK and dV.
    fwd = report(m, ALLGATHER)
    assert fwd.count("collective-permute") == 0
    (row,) = [r for r in fwd.rows if r.kind == "all-gather" and r.dtype == "f32"]
    assert row.axes == ("sequence",) and row.count == 2
    assert row.bytes_per_op == KV_HEADS * seq * HEAD_DIM * f32 == 2560
    both = report(m, ALLGATHER, backward=True)
    assert both.count("collective-permute") == 0
    (row,) = [r for r in both.rows if r.kind == "reduce-scatter"]
    assert row.count == 2 and row.bytes_per_op == kv_bytes


def test_report_names_the_mesh_axis():
    m = mesh(2, 4, names=("batch", "sequence"))
    q, k, v = qkv(jax.random.key(5), (2,), 16, HEADS, KV_HEADS, HEAD_DIM)
    f = jax.jit(lambda q, k, v: rx.ring_attention(q, k, v, mesh=m))
    r = rx.tools.comm_report(f, q, k, v, mesh=m)
    permutes = [x for x in r.rows if x.kind == "collective-permute"]
    assert permutes and all(x.axes == ("sequence",) for x in permutes)
    # Device ids that vary along "batch" only.
    hlo_attrs = "replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add"
    from ringeqx.tools._hlo._report import _axes_of

    assert _axes_of(hlo_attrs, m) == ("batch",)
    assert _axes_of("replica_groups=[2,4]<=[8]", m) == ("sequence",)
    assert _axes_of("replica_groups=[4,2]<=[2,4]T(1,0)", m) == ("batch",)
    assert _axes_of("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", m) == ("sequence",)
    assert _axes_of("replica_groups=mesh['batch'=2,'sequence'=4] {'batch'}", m) == ("batch",)


@pytest.mark.parametrize(
    "hlo_type, itemsize",
    [
        ("pred", 1),
        ("s8", 1),
        ("u8", 1),
        ("f8e4m3fn", 1),
        ("f8e5m2", 1),
        ("bf16", 2),
        ("f16", 2),
        ("s16", 2),
        ("u16", 2),
        ("f32", 4),
        ("s32", 4),
        ("u32", 4),
        ("f64", 8),
        ("s64", 8),
        ("u64", 8),
    ],
)
def test_permute_stats_counts_every_dtype(hlo_type, itemsize):
    pairs = "source_target_pairs={{0,1},{1,0}}"
    trip = 'backend_config={"known_trip_count":{"n":"7"}}'
    hlo = f"""HloModule m

%body (p: (s32[], {hlo_type}[3,5])) -> (s32[], {hlo_type}[3,5]) {{
  %x = {hlo_type}[3,5]{{1,0}} get-tuple-element(%p), index=1
  %cp = {hlo_type}[3,5]{{1,0}} collective-permute(%x), channel_id=1, {pairs}
}}

ENTRY %main (a: {hlo_type}[3,5]) -> {hlo_type}[3,5] {{
  %w = (s32[], {hlo_type}[3,5]) while(%t), condition=%cond, body=%body, {trip}
  %cp2 = {hlo_type}[3,5]{{1,0}} collective-permute(%a), channel_id=2, {pairs}
}}
"""
    ops, nbytes, trips = rx.tools.permute_stats(hlo)
    assert (ops, nbytes, trips) == (8, 8 * 15 * itemsize, [7])


def test_table2_reproduces_the_paper():
    # Ring Attention (Liu et al. 2023), Table 2: (min block, min sequence per device), K.
    paper = {
        "a100-nvlink": (1.0, 6.2),
        "a100-infiniband": (24.5, 149.5),
        "tpu-v3": (1.1, 6.6),
        "tpu-v4": (1.0, 6.2),
        "tpu-v5e": (1.1, 6.3),
    }
    table = rx.tools.table2()
    for name, (block, seq) in paper.items():
        got_block, got_seq = table[name]
        assert got_seq == 6 * got_block
        # The paper rounds (24.96K is printed 24.5K, 6.36K 6.3K): within 2%.
        assert abs(got_block / 1e3 - block) <= 0.02 * block + 0.05, name
        assert abs(got_seq / 1e3 - seq) <= 0.02 * seq, name
    # GQA with 8 query heads per kv head: an eighth; float8 payloads: a half; float32:
    # twice.
    for name, (block, _) in table.items():
        assert abs(rx.tools.table2(8, 1)[name][0] - block / 8) <= 1
        assert abs(rx.tools.table2(kv_dtype=jnp.float8_e4m3fn)[name][0] - block / 2) <= 1
        assert abs(rx.tools.table2(kv_dtype=jnp.float32)[name][0] - 2 * block) <= 1
    cost = rx.tools.RingCost(8 * 2048, 8, 8, 8, 128, 2)
    hw = rx.tools.HARDWARE["a100-nvlink"]
    assert cost.hides(hw) and cost.min_shard(hw) == 1040
    assert not rx.tools.RingCost(8 * 512, 8, 8, 8, 128, 2).hides(hw)


def test_bad_knob_values():
    with pytest.raises(ValueError, match="communication_parallelism` must be a positive"):
        rx.RingConfig(communication_parallelism=0)
    with pytest.raises(ValueError, match="ring_buffer_size` must be a positive"):
        rx.RingConfig(ring_buffer_size=-2)
    with pytest.raises(ValueError, match="grad_compression_dtype` must be a floating"):
        rx.RingConfig(grad_compression_dtype=jnp.int8)
    m = mesh(4)
    q, k, v = qkv(jax.random.key(6), (), 32, HEADS, KV_HEADS, HEAD_DIM)
    bad = [
        (
            rx.RingConfig(ring_buffer_size=3),
            r"ring_buffer_size` must divide the 8 tokens.*got 3.*\[1, 2, 4, 8\]",
        ),
        (
            rx.RingConfig(communication_parallelism=3),
            r"communication_parallelism` must divide the 8",
        ),
        (
            rx.RingConfig(communication_parallelism=8, ring_buffer_size=2, bidirectional=True),
            None,
        ),
        (
            rx.RingConfig(ring_buffer_size=8, communication_parallelism=2, bidirectional=False),
            None,
        ),
    ]
    for config, match in bad:
        f = jax.jit(lambda q, k, v, c=config: rx.ring_attention(q, k, v, mesh=m, config=c))
        if match is None:
            # ring_buffer_size wins over communication_parallelism: these trace.
            f.trace(q, k, v)
            continue
        with pytest.raises(ValueError, match=match):
            f.trace(q, k, v)
    q, k, v = qkv(jax.random.key(6), (), 24, HEADS, KV_HEADS, HEAD_DIM)
    f = jax.jit(
        lambda q, k, v: rx.ring_attention(
            q, k, v, mesh=m, config=rx.RingConfig(communication_parallelism=3, bidirectional=True)
        )
    )
    with pytest.raises(ValueError, match=r"bidirectional=True.*communication_parallelism=3"):
        f.trace(q, k, v)


def test_bad_hybrid_and_allgather():
    # (the tests' runtime type checker may refuse it first, as a TypeError)
    with pytest.raises((ValueError, TypeError), match="mode"):
        rx.RingConfig(mode="gather")
    for knob in (
        dict(compression_dtype=jnp.bfloat16),
        dict(grad_compression_dtype=jnp.bfloat16),
        dict(communication_parallelism=2),
        dict(ring_buffer_size=4),
        dict(bidirectional=True),
    ):
        with pytest.raises(ValueError, match=f"allgather.*{next(iter(knob))} set"):
            rx.RingConfig(mode="allgather", **knob)
    # The deprecated spelling of AllGather: warned, and the same ring.
    with pytest.warns(DeprecationWarning, match=r"config=ringeqx.AllGather\("):
        old = rx.RingConfig(mode="allgather", ulysses_axis="ulysses")
    assert old == HYBRID_ALLGATHER.ring_config()
    with pytest.raises((ValueError, TypeError), match="balance"):
        rx.AllGather(balance="striped")
    # (the tests' runtime type checker may refuse it first, with its own TypeError)
    x = jnp.zeros((8, 2, 4))
    with pytest.raises(TypeError, match="config"):
        rx.ring_attention(x, x, x, config="allgather")
    q, k, v = qkv(jax.random.key(9), (), 32, HEADS, KV_HEADS, HEAD_DIM)
    bad = [
        (mesh(4), HYBRID, 32, r"`ulysses_axis` 'ulysses' must be a mesh axis other"),
        (
            _hybrid_mesh(2, 2),
            rx.RingConfig(ulysses_axis="sequence"),
            32,
            "must be a mesh axis other than the ring axis",
        ),
        # 6 heads, 2 kv heads: Ulysses 4 does not divide them; 1 and 2 would.
        (_hybrid_mesh(2, 4), HYBRID, 32, r"heads=6, kv_heads=2.*would work: \[1, 2\]"),
        # 30 tokens on a ring of 2: shards of 15, not a multiple of 2.
        (_hybrid_mesh(2, 2), HYBRID, 30, "15 tokens .*capacity.* multiple of 2"),
    ]
    for m, config, seq, match in bad:
        args = (x[:seq] for x in (q, k, v))
        f = jax.jit(lambda q, k, v, m=m, c=config: rx.ring_attention(q, k, v, mesh=m, config=c))
        with pytest.raises(ValueError, match=match):
            f.trace(*args)


def test_cli_report():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(
            [
                "report",
                "--seq-len",
                "64",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--head-dim",
                "4",
                "--devices",
                "4",
                "--forward-only",
                "--dtype",
                "float32",
                "--compression",
                "bfloat16",
            ]
        )
    text = out.getvalue()
    assert code == 0
    assert "collective-permute  u16" in text and "A100 InfiniBand" in text
    assert "collective-permute  f32" not in text and "TPU v5p" in text


# --- communication the mask rules out -----------------------------------------------------


def _needed_window(mask, layout):
    """Brute force, token by token (`allows`, not the block rule): the shard offsets
    `i - j` of attending valid pairs, and the shortest circular run holding them and 0."""
    p, cap = layout.num_shards, layout.capacity
    pos, seg, val = (
        np.asarray(x).reshape(-1) for x in (layout.positions, layout.segments, layout.valid)
    )
    info = rx.TokenInfo(*map(jnp.asarray, (pos, seg, np.full_like(pos, -1), val)))
    q = jax.tree.map(lambda x: x[:, None], info)
    k = jax.tree.map(lambda x: x[None, :], info)
    ok = np.asarray(mask.allows(q, k)) & val[:, None] & val[None, :]
    shard = np.arange(p * cap) // cap
    offsets = set(((shard[:, None] - shard[None, :]) % p)[ok].tolist()) | {0}
    best = (p, 0)
    for low in offsets:  # the run starting at `low` (offset -num_ahead), going up
        length = max((d - low) % p for d in offsets) + 1
        best = min(best, (length, -low % p))
    return (0, p) if best[0] >= p else (best[1], best[0])


def test_masked_out_shard_offsets_are_never_sent():
    # 8 devices x 8 slots, documents of 3-6 tokens: each device needs its own shard and a
    # neighbour or two, not the whole ring. The ring runs only the window of offsets the
    # block rule allows (values and gradients exact), sends K/V and the records the mask
    # reads for those hops only, and the schedule counts the same steps. A layout passed
    # traced (a jit argument) has no values at trace time: the full ring, still exact.
    p = 8
    seq, m = CAP * p, mesh(p)
    seg = jnp.asarray(np.repeat(np.arange(20), [3, 5, 4, 6] * 5)[:seq], jnp.int32)
    i, j = np.indices((p, p))
    band = jnp.asarray((i - j >= 0) & (i - j <= 1))  # blocks of 8: block i sees i - 1, i
    doc, doc_causal = rx.Document(), rx.Document() & rx.Causal()
    aligned = jnp.arange(seq, dtype=jnp.int32) // CAP  # one document per shard
    cases = [  # (strategy, mask, segment ids, (num_ahead, num_steps)), windows by hand:
        # documents cross shard edges both ways; causally only the shard behind
        (rx.Uniform(), doc, seg, (1, 3)),
        (rx.Uniform(), doc_causal, seg, (0, 2)),
        # Zigzag's second chunk runs backwards: its earlier tokens are one shard ahead
        (rx.Zigzag(), doc_causal, seg, (1, 3)),
        # chunks of 2 spread over the shards: two shards either way
        (rx.WorkBalanced(chunk=2, iterations=100), doc, seg, (2, 5)),
        # a document per shard: no hop at all, and the dK/dV stay home
        (rx.Uniform(), doc, aligned, (0, 1)),
        # no bounds here: only the block rule on the concrete layout finds these
        (rx.Uniform(), rx.PrefixLM(6) & doc, seg, (0, 2)),
        (rx.Zigzag(), rx.PrefixLM(12) & rx.SlidingWindow(6), seg, (2, 5)),
        (rx.Uniform(), rx.BlockSparse(band, CAP), seg, (0, 2)),
    ]
    q, k, v = qkv(jax.random.key(7), (), seq, HEADS, KV_HEADS, HEAD_DIM)
    layouts = [s.layout(seq, p, segment_ids=ids) for s, _, ids, _ in cases]
    for layout, (_, mask, _, window) in zip(layouts, cases):
        assert rx.num_ring_steps(mask, layout) == window[1] < p
        assert _needed_window(mask, layout) == window
    zig = layouts[2]

    def ring(q, k, v, layout, mask):
        return rx.ring_attention(
            q, k, v, mask=mask, layout=layout, order="original", mesh=m, kernel=rx.XlaKernel(8, 4)
        )

    fns = [
        functools.partial(ring, layout=lay, mask=mask)
        for lay, (_, mask, _, _) in zip(layouts, cases)
    ]
    refs = [
        functools.partial(rx.reference_attention, mask=mask, segment_ids=ids)
        for _, mask, ids, _ in cases
    ]
    ct = jax.random.normal(jax.random.key(123), q.shape)

    @jax.jit
    def run(q, k, v, ct, traced):
        fs = fns + [functools.partial(ring, layout=traced, mask=doc_causal)]
        return [(lambda o, vjp: (o, vjp(ct)))(*jax.vjp(f, q, k, v)) for f in fs]

    compiled = run.lower(q, k, v, ct, zig).compile()
    got = compiled(q, k, v, ct, zig)
    want = _vjp_all(refs, q, k, v)
    for (out, grads), (ref, ref_grads) in zip(got, want + [want[2]]):
        assert_close(out, ref)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r)
    # The traced layout's ring loops over all p - 1 hops; no concrete one does.
    _, _, trips = rx.tools.permute_stats(compiled.as_text())
    assert max(trips) == p - 1 and sorted(trips)[-3] < p - 1

    # Forward permutes per call: one per hop of K, V and the records (packed into one
    # array); hops: num_steps - 1, plus the first one ahead when num_ahead > 0. The full
    # ring: p - 1 hops.
    for lay, (_, mask, _, (ahead, steps)) in list(zip(layouts, cases))[:5]:
        arrays = 3
        fwd = jax.jit(functools.partial(ring, layout=lay, mask=mask)).lower(q, k, v).compile()
        ops, _, _ = rx.tools.permute_stats(fwd.as_text())
        assert ops == arrays * (steps - 1 + (ahead > 0)) < arrays * (p - 1)
        # The schedule follows: the same steps, all the useful pairs of the full ring's,
        # and no more tiles (the full ring also runs tiles the finer rule rules out).
        kernel = rx.XlaKernel(4, 4)
        sched = rx.tools.schedule(lay, mask, kernel=kernel)
        full = jax.jit(lambda lay, mask=mask: rx.tools.schedule(lay, mask, kernel=kernel))(lay)
        assert sched.tiles_run.shape == (steps, p) and full.tiles_run.shape == (p, p)
        assert float(jnp.sum(sched.pairs)) == float(jnp.sum(full.pairs)) > 0
        assert 0 < int(sched.total_tiles) <= int(full.total_tiles)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_wire_packs_records_and_compressed_kv_into_few_arrays(dtype):
    # XLA's TPU scheduler keeps at most five permutes in flight over a kernel, so a ring
    # step's K, V and records must travel as at most three arrays, and decode exactly
    # what a cast to the wire dtype keeps.
    from ringeqx._ring._comm import from_wire, to_wire

    k = jax.random.normal(jax.random.key(0), (1, 2, 8, 4), jnp.float32) * 300
    v = jax.random.normal(jax.random.key(1), (1, 2, 8, 4), jnp.float32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    info = rx.TokenInfo(pos, pos // 3, jnp.where(pos > 4, pos, -1), pos % 5 != 2)
    wire, layout = to_wire((k, v, info), dtype)
    assert len(wire) == {None: 3, jnp.bfloat16: 2, jnp.float16: 3, jnp.float8_e4m3fn: 3}[dtype]
    k2, v2, info2 = from_wire(wire, layout)
    for name in ("positions", "segments", "spans", "valid"):
        np.testing.assert_array_equal(getattr(info2, name), getattr(info, name))
        assert getattr(info2, name).dtype == getattr(info, name).dtype
    for x, y in ((k, k2), (v, v2)):
        assert y.dtype == x.dtype and y.shape == x.shape
        if dtype is None:
            np.testing.assert_array_equal(y, x)
        else:
            # Within the wire dtype's relative rounding (scaled formats: of the block max).
            eps = float(jnp.finfo(dtype).eps)
            bound = eps * jnp.max(jnp.abs(x)) if dtype != jnp.bfloat16 else eps * jnp.abs(x)
            assert bool(jnp.all(jnp.abs(y - x) <= bound + 1e-30)), dtype


def test_reports_refuse_questions_they_do_not_understand():
    report = rx.tools.CommReport(
        (rx.tools.CollectiveRow("collective-permute", "f32", (2, 3), ("sequence",), 4, 24),)
    )
    assert report.count("collective-permute", "f32") == 4 and report.bytes() == 96
    assert report.count("all-gather") == 0  # a kind it knows, absent from the program
    with pytest.raises(ValueError, match=r"`kind` must be one of \('collective-permute'"):
        report.count("permute")
    with pytest.raises(ValueError, match="`dtype` must be an HLO element type name .*'float32'"):
        report.bytes("collective-permute", "float32")
    with pytest.raises(ValueError, match="`hlo` must be the text of a compiled HLO module"):
        rx.tools.permute_stats("not a program")
