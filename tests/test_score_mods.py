"""Score modifiers and attention sinks: exact under the ring, against independent dense
implementations written here, forward and backward.

The default run covers modifiers x sinks x devices x strategies with a rotation;
`RINGEQX_FULL_MATRIX=1` runs every combination on 1, 3, 4 and 8 devices under every
strategy.
"""

import itertools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    KERNELS,
    SCORE_MODS,
    SINKS,
    STRATEGIES,
    assert_close,
    block_pattern,
    mesh,
    packed_segments,
    qkv,
    span_ids,
)

import ringeqx as rx
from ringeqx._score_mods import check_sinks


HEADS, KV_HEADS, HEAD_DIM = 3, 1, 5
SEQ = 29
DEVICES = [1, 3, 4, 8]
FULL = os.environ.get("RINGEQX_FULL_MATRIX") == "1"
KERNEL = KERNELS[0][1]
# Masks that the modifiers meet in the rotation: early stop, documents, spans.
ROTATION_MASKS = [
    rx.Causal(),
    rx.SlidingWindow(6),
    rx.Causal() & rx.Document(),
    rx.BidirectionalSpans() | rx.SlidingWindow(4, two_sided=True),
]


def _check(strategy, devices, cases, *, key=0):
    """`cases`: (name, mask, score_mod, sinks). One compiled program for all of them;
    values and gradients (q, k, v and sinks) must match `reference_attention`."""
    seg, spans = packed_segments(SEQ, [4, 9, 6]), span_ids(SEQ)
    layout = strategy.layout(SEQ, devices, segment_ids=seg, span_ids=spans)
    q, k, v = qkv(jax.random.key(key), (), SEQ, HEADS, KV_HEADS, HEAD_DIM)
    ct = jax.random.normal(jax.random.key(key + 1), q.shape)
    m = mesh(devices)

    def ring(q, k, v, ct, sinks_list):
        results = []
        for (_, mask, mod, _), sinks in zip(cases, sinks_list):

            def f(q, k, v, sinks, mask=mask, mod=mod):
                return rx.ring_attention(
                    q,
                    k,
                    v,
                    mask=mask,
                    score_mod=mod,
                    sinks=sinks,
                    layout=layout,
                    order="layout",
                    mesh=m,
                    kernel=KERNEL,
                )

            out, vjp = jax.vjp(f, q, k, v, sinks)
            results.append((out, vjp(ct)))
        return results

    sinks_list = [c[3] for c in cases]
    got = jax.jit(ring)(*(layout.shard(x) for x in (q, k, v, ct)), sinks_list)
    for (name, mask, mod, sinks), (out, grads) in zip(cases, got):

        def ref(q, k, v, sinks, mask=mask, mod=mod):
            return rx.reference_attention(
                q, k, v, mask=mask, score_mod=mod, sinks=sinks, segment_ids=seg, span_ids=spans
            )

        ref_out, vjp = jax.vjp(ref, q, k, v, sinks)
        ref_grads = vjp(ct)
        try:
            assert_close(out, layout.shard(ref_out))
            for g, r in zip(grads[:3], ref_grads[:3]):
                assert_close(g, layout.shard(r))
            if sinks is not None:
                assert_close(grads[3], ref_grads[3])
        except AssertionError as e:
            raise AssertionError(f"{name} on {devices} devices") from e


def _cases(index: int):
    combos = list(itertools.product(SCORE_MODS, SINKS))
    out = []
    for i, ((mod_name, mod), (sink_name, sinks)) in enumerate(combos):
        if FULL or i % len(DEVICES) == index:
            mask = ROTATION_MASKS[(i + index) % len(ROTATION_MASKS)]
            out.append((f"{mod_name}+{sink_name}", mask, mod(HEADS), sinks(HEADS)))
    return out


@pytest.mark.parametrize("index", range(len(DEVICES)), ids=[f"{d}dev" for d in DEVICES])
def test_modifiers_and_sinks_match_reference(index):
    devices = DEVICES[index]
    if FULL:
        for _, factory in STRATEGIES:
            _check(factory(SEQ), devices, _cases(index))
    else:
        # Rotation: each (modifier, sinks) pair once, on one device count and strategy.
        name, factory = STRATEGIES[(3 * index) % len(STRATEGIES)]
        _check(factory(SEQ), devices, _cases(index), key=index)


# --- independent dense implementations ---------------------------------------------------


def _dense(q, k, v, *, causal, softcap=None, slopes=None, sinks=None):
    """Softmax attention written directly: [seq, heads, dim], kv heads repeated."""
    n, h, d = q.shape
    k = jnp.repeat(k, h // k.shape[1], axis=1)
    v = jnp.repeat(v, h // v.shape[1], axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / d**0.5
    i = jnp.arange(n)
    if slopes is not None:
        s = s - slopes[:, None, None] * jnp.abs(i[:, None] - i[None, :])[None].astype(s.dtype)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if causal:
        s = jnp.where((i[:, None] >= i[None, :])[None], s, -jnp.inf)
    if sinks is not None:
        # The sink is one more key, of logit sinks[h] and value zero.
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[:, None, None], (h, n, 1))], axis=-1)
        v = jnp.concatenate([v, jnp.zeros((1, h, d))], axis=0)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v)


def test_against_dense_implementations():
    # Softcap, ALiBi and sinks, separately and together, on 4 devices: values and
    # gradients with respect to q, k, v and the sink logits.
    q, k, v = qkv(jax.random.key(20), (), 26, HEADS, KV_HEADS, HEAD_DIM)
    q = 3.0 * q  # large logits, so that the cap matters
    ct = jax.random.normal(jax.random.key(21), q.shape)
    slopes = jnp.array([0.5, 0.25, 0.125])
    sinks = jnp.array([0.3, -0.5, 1.2])
    m = mesh(4)
    cases = [
        (rx.Softcap(2.0), None, dict(softcap=2.0)),
        (rx.ALiBi(slopes), None, dict(slopes=slopes)),
        (None, sinks, dict(sinks=sinks)),
        (
            rx.Chain(rx.ALiBi(slopes), rx.Softcap(2.0)),
            sinks,
            dict(softcap=2.0, slopes=slopes, sinks=sinks),
        ),
    ]

    def loss_grads(f):
        def loss(q, k, v, sinks):
            return jnp.sum(f(q, k, v, sinks) * ct)

        # Cases without sinks ignore the last argument (its gradient is then zero).
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

    def ring_fn(mod, with_sinks):
        def f(q, k, v, z):
            z = z if with_sinks else None
            return rx.ring_attention(
                q, k, v, mask=rx.Causal(), score_mod=mod, sinks=z, mesh=m, kernel=KERNEL
            )

        return f

    ring = jax.jit(lambda: [loss_grads(ring_fn(mod, z is not None)) for mod, z, _ in cases])
    for (mod, z, kw), (value, grads) in zip(cases, ring()):

        def dense(q, k, v, s, kw=kw):
            # The sink logits are the argument (differentiated), where the case has them.
            return _dense(q, k, v, causal=True, **(dict(kw, sinks=s) if "sinks" in kw else kw))

        want, want_grads = loss_grads(dense)
        assert_close(value, want, rtol=1e-5, atol=1e-4)
        for g, r in zip(grads, want_grads):
            assert_close(g, r)
        if z is not None:
            assert np.abs(np.asarray(grads[3])).min() > 1e-3  # the sinks really learn
        ref = rx.reference_attention(q, k, v, mask=rx.Causal(), score_mod=mod, sinks=z)
        assert_close(ref, dense(q, k, v, z))


def test_alibi_matches_dot_product_attention_with_bias():
    q, k, v = qkv(jax.random.key(22), (2,), 24, HEADS, 3, 8)
    slopes = jnp.array([0.4, 0.1, 0.02])
    i = jnp.arange(24)
    bias = -slopes[:, None, None] * jnp.abs(i[:, None] - i[None, :])[None].astype(jnp.float32)
    ref = jax.nn.dot_product_attention(q, k, v, bias=bias[None], is_causal=True)
    f = jax.jit(
        lambda q, k, v: rx.ring_attention(
            q, k, v, mask=rx.Causal(), score_mod=rx.ALiBi(slopes), mesh=mesh(3), kernel=KERNEL
        )
    )
    assert_close(f(q, k, v), ref)


def test_sinks_on_rows_that_see_nothing():
    # BlockSparse rows with no allowed block: zero output, finite gradients, and the sink
    # gradient only from the rows that see keys.
    n, bs = 24, 4
    pattern = block_pattern(n, bs).at[2].set(False)  # queries 8..11 see nothing
    mask = rx.BlockSparse(pattern, bs)
    q, k, v = qkv(jax.random.key(23), (), n, HEADS, KV_HEADS, HEAD_DIM)
    sinks = jnp.array([0.0, 1.0, -1.0])
    ct = jax.random.normal(jax.random.key(24), q.shape)

    def grads(f):
        def loss(q, k, v, z):
            out = f(q, k, v, z)
            return jnp.sum(out * ct), out

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)

    m = mesh(4)
    (_, out), g = jax.jit(
        lambda: grads(
            lambda q, k, v, z: rx.ring_attention(q, k, v, mask=mask, sinks=z, mesh=m, kernel=KERNEL)
        )
    )()
    (_, ref), rg = grads(lambda q, k, v, z: rx.reference_attention(q, k, v, mask=mask, sinks=z))
    assert np.all(np.asarray(out[8:12]) == 0)
    assert all(np.isfinite(np.asarray(x)).all() for x in g)
    assert_close(out, ref)
    for a, b in zip(g, rg):
        assert_close(a, b)


def test_for_head_is_the_head_slice():
    scores = jax.random.normal(jax.random.key(25), (2, HEADS, 4, 6))
    pos = jnp.arange(6)
    info = rx.TokenInfo(pos, pos * 0, pos * 0 - 1, pos >= 0)
    qi = jax.tree.map(lambda x: x[:4].reshape(1, 1, 4, 1), info)
    ki = jax.tree.map(lambda x: x.reshape(1, 1, 1, 6), info)
    mod = rx.Chain(rx.ALiBi(jnp.array([0.5, 0.25, 0.125])), rx.Softcap(1.5))
    full = mod(scores, qi, ki)
    for h in range(HEADS):
        one = mod.for_head(jnp.asarray(h, jnp.int32))(scores[:, h : h + 1], qi, ki)
        assert_close(one, full[:, h : h + 1])
    cap = rx.Softcap(1.5)
    assert cap.for_head(jnp.asarray(0, jnp.int32)) is cap


def test_new_modifier_values_do_not_recompile():
    q, k, v = qkv(jax.random.key(26), (), 20, HEADS, KV_HEADS, HEAD_DIM)
    m = mesh(2)

    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def f(mod, sinks, q, k, v):
        return rx.ring_attention(
            q, k, v, mask=rx.Causal(), score_mod=mod, sinks=sinks, mesh=m, kernel=KERNEL
        )

    for scale in (1.0, 2.0):
        mod = rx.Chain(
            rx.ALiBi(scale * jnp.array([0.1, 0.2, 0.3])), rx.Softcap(jnp.asarray(scale + 1.0))
        )
        sinks = scale * jnp.array([0.5, -0.5, 0.0])
        ref = rx.reference_attention(q, k, v, mask=rx.Causal(), score_mod=mod, sinks=sinks)
        assert_close(f(mod, sinks, q, k, v), ref)


def test_ring_attention_module_takes_masks_and_modifiers():
    dim, seq = 12, 20
    attn = rx.nn.RingAttention(
        dim,
        HEADS,
        1,
        head_dim=4,
        mask=rx.SlidingWindow(5),
        score_mod=rx.ALiBi(jnp.array([0.3, 0.2, 0.1])),
        rope_theta=None,
        kernel=KERNEL,
        key=jax.random.key(27),
    )
    x = jax.random.normal(jax.random.key(28), (seq, dim))
    out = jax.jit(lambda x: attn(x, mesh=mesh(4)))(x)

    def heads(proj, n):
        return jax.vmap(proj)(x).reshape(seq, n, 4)

    q, k, v = heads(attn.query_proj, HEADS), heads(attn.key_proj, 1), heads(attn.value_proj, 1)
    y = rx.reference_attention(q, k, v, mask=attn.mask, score_mod=attn.score_mod)
    assert_close(out, jax.vmap(attn.output_proj)(y.reshape(seq, -1)))


# --- errors -----------------------------------------------------------------------------


def test_alibi_slopes_must_match_heads():
    q, k, v = qkv(jax.random.key(29), (), 12, HEADS, KV_HEADS, HEAD_DIM)
    bad = rx.ALiBi(jnp.ones(4))
    msg = r"ALiBi `slopes` must have one entry per query head \(3\); got 4"
    with pytest.raises(ValueError, match=msg):
        rx.ring_attention(q, k, v, score_mod=bad, mesh=mesh(2))
    with pytest.raises(ValueError, match=msg):
        rx.reference_attention(q, k, v, score_mod=rx.Chain(rx.Softcap(1.0), bad))
    pos = jnp.arange(12).reshape(1, 1, 12, 1)
    info = rx.TokenInfo(pos, pos, pos, pos >= 0)
    with pytest.raises(ValueError, match=msg):
        bad(jnp.zeros((1, HEADS, 12, 12)), info, info)
    # A 2-D slopes array: the annotation (under the test hook) or __check_init__.
    with pytest.raises((TypeError, ValueError), match="slopes"):
        rx.ALiBi(jnp.ones((HEADS, 1)))


class _HeadBias(rx.AbstractScoreMod):
    """A user modifier with one bias per head, which checks its own length."""

    bias: jax.Array

    def __call__(self, scores, q, k):
        return scores + self.bias.reshape(-1, 1, 1)

    def for_head(self, head):
        return _HeadBias(jax.lax.dynamic_slice_in_dim(self.bias, head, 1))

    def check(self, heads: int) -> None:
        if self.bias.shape != (heads,):
            raise ValueError(f"_HeadBias `bias` must have shape ({heads},); got {self.bias.shape}.")


def test_user_modifier_checks_itself():
    # The ring and the reference ask the modifier itself, alone or inside a Chain.
    q, k, v = qkv(jax.random.key(31), (), 12, HEADS, KV_HEADS, HEAD_DIM)
    bad = _HeadBias(jnp.ones(HEADS + 1))
    msg = rf"_HeadBias `bias` must have shape \({HEADS},\); got \({HEADS + 1},\)"
    with pytest.raises(ValueError, match=msg):
        rx.ring_attention(q, k, v, score_mod=bad, mesh=mesh(2))
    with pytest.raises(ValueError, match=msg):
        rx.reference_attention(q, k, v, score_mod=rx.Chain(rx.Softcap(1.0), bad))


def test_sinks_must_be_one_logit_per_head():
    q, k, v = qkv(jax.random.key(30), (), 12, HEADS, KV_HEADS, HEAD_DIM)
    # Under the test hook the annotation `sinks: Float[Array, " heads"]` (heads bound by
    # q) answers first, naming `sinks`; without it, the same check in words:
    for bad in (jnp.zeros(4), jnp.zeros((1, 3))):
        with pytest.raises((TypeError, ValueError), match=r"sinks"):
            rx.ring_attention(q, k, v, sinks=bad, mesh=mesh(2))
        with pytest.raises((TypeError, ValueError), match=r"sinks"):
            rx.reference_attention(q, k, v, sinks=bad)
    msg = (
        r"`sinks` must have shape \[heads\] = \(3,\) \(one logit per query head\); got shape \(4,\)"
    )
    with pytest.raises(ValueError, match=msg):
        check_sinks(jnp.zeros(4), 3)
    with pytest.raises(ValueError, match=r"got shape \(1, 3\)"):
        check_sinks(jnp.zeros((1, 3)), 3)
    with pytest.raises(TypeError, match=r"`sinks` must be a floating array; got dtype int32"):
        check_sinks(jnp.zeros(3, jnp.int32), 3)


def test_softcap_and_chain_errors():
    with pytest.raises(ValueError, match=r"Softcap `cap` must be > 0; got 0.0"):
        rx.Softcap(0.0)
    with pytest.raises(ValueError, match=r"got -2.5"):
        rx.Softcap(-2.5)
    # The annotation `*mods: AbstractScoreMod` (under the test hook) or Chain's own check.
    with pytest.raises(TypeError, match=r"mods|Chain arguments"):
        rx.Chain(rx.Softcap(1.0), rx.Causal())
