"""`ring_attention` takes `jax.nn.dot_product_attention`'s keyword names and means the same.

One table of calls, run through both functions on rings of 1, 3 and 8 devices: values and
gradients equal. All cases of one ring size run in one jitted program (few compiles). Every
refused argument has its message tested.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh

import ringeqx as rx


# Odd length (padding on 3 and 8 devices), GQA (4 query heads on 2 key/value heads).
B, S, H, KH, D = 2, 21, 4, 2, 8
_keys = jax.random.split(jax.random.key(0), 5)
Q = jax.random.normal(_keys[0], (B, S, H, D))
K = jax.random.normal(_keys[1], (B, S, KH, D))
V = jax.random.normal(_keys[2], (B, S, KH, D))
Q_LENS = jnp.array([21, 13], jnp.int32)
KV_LENS = jnp.array([17, 21], jnp.int32)
KEY_BIAS = jax.random.normal(_keys[3], (1, H, 1, S))
_d = jnp.arange(S)[:, None] - jnp.arange(S)[None, :]
WINDOW_3 = ((_d >= 0) & (_d < 3))[None, None]  # SlidingWindow(3) as a dense mask

# (keywords for both, ringeqx-only keywords[, their dense equivalent]): one call each,
# several names at once (each case is a ring program to compile).
CASES = [
    (
        {
            "is_causal": True,
            "scale": 0.3,
            "query_seq_lengths": Q_LENS,
            "key_value_seq_lengths": KV_LENS,
        },
        {},
    ),
    ({"local_window_size": 3, "bias": KEY_BIAS}, {}),
    ({"local_window_size": (4, 1), "key_value_seq_lengths": KV_LENS}, {}),
    ({"local_window_size": (2, 0), "query_seq_lengths": Q_LENS, "bias": KEY_BIAS[:, :1] * 3.0}, {}),
    # Combined with `mask=` by `&`; a bias constant along the keys changes nothing.
    (
        {"local_window_size": (4, 4), "is_causal": True, "bias": jnp.ones((B, H, S, 1))},
        {"mask": rx.SlidingWindow(3)},
        {"mask": WINDOW_3},
    ),
]


def _both(n: int):
    m = mesh(n)
    kernel = rx.XlaKernel(8, 8)

    def run(q, k, v):
        def pair(kw, extra, dense_extra=None):
            def dense(q, k, v):
                return jax.nn.dot_product_attention(q, k, v, **kw, **(dense_extra or {}))

            def ring(q, k, v):
                return rx.ring_attention(q, k, v, mesh=m, kernel=kernel, **kw, **extra)

            ct = jnp.cos(jnp.arange(q.size, dtype=q.dtype)).reshape(q.shape)
            out = []
            for f in (dense, ring):
                y, vjp = jax.vjp(f, q, k, v)
                out.append((y, vjp(ct)))
            return out

        return [pair(*case) for case in CASES]

    return jax.jit(run)(Q, K, V)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_matches_dot_product_attention(n):
    for (kw, *_), (want, got) in zip(CASES, _both(n)):
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=str(list(kw)))


def test_window_translations():
    from ringeqx._ring._compat import _Window, _window_mask

    assert _window_mask(False, (4, 0)) == rx.SlidingWindow(5)
    assert _window_mask(False, 2) == rx.SlidingWindow(3, two_sided=True)
    assert _window_mask(True, (3, 7)) == rx.SlidingWindow(4)
    assert _window_mask(True, None) == rx.Causal()
    assert _window_mask(False, (1, 2)) == _Window(1, 2)
    assert _window_mask(False, None) is None


def _call(**kw):
    return rx.ring_attention(Q, K, V, mesh=mesh(2), **kw)


_IDS = jnp.zeros(S, jnp.int32)
_BOTH_IDS = {"mask": rx.Document() & rx.BidirectionalSpans(), "segment_ids": _IDS, "span_ids": _IDS}
_DENSE = r"cannot be ring-sharded"
REFUSED = [
    ({"implementation": "cudnn"}, ValueError, r"`implementation=` .* `kernel=` .* `device_type=`"),
    ({"mask": jnp.ones((B, H, S, S), bool)}, TypeError, rf"`mask` got a bool array .* {_DENSE}"),
    ({"bias": jnp.ones((1, H, S, S))}, ValueError, rf"varies over queries and keys: it {_DENSE}"),
    ({"bias": jnp.ones((B, 1, 1, S))}, ValueError, r"per key: padding is `key_value_seq_lengths=`"),
    ({"bias": jnp.ones((3, 1, 1, S))}, ValueError, r"`bias` must broadcast to \[batch"),
    ({"local_window_size": (2, -1)}, ValueError, r"`local_window_size` must be an integer >= 0"),
    ({"is_causal": 1}, TypeError, r"`is_causal` must be a Python bool"),
    ({"query_seq_lengths": _IDS[:3]}, ValueError, r"`query_seq_lengths` must be .* \[\*batch\]"),
    ({"key_value_seq_lengths": KV_LENS, "layout": rx.contiguous_layout(S, 2)}, ValueError,
     r"index the original order"),
    ({"key_value_seq_lengths": KV_LENS, **_BOTH_IDS}, ValueError, r"travel round .* span ids"),
]  # fmt: skip


@pytest.mark.parametrize("kw, error, match", REFUSED)
def test_refused(kw, error, match):
    # Our own messages, as a user without jaxtyping's hook sees them.
    import jaxtyping

    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(error, match=match):
            _call(**kw)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def test_lengths_use_span_ids_when_segments_are_taken():
    # A Document mask reads the segments: the lengths travel as span ids instead.
    seg = jnp.repeat(jnp.arange(3, dtype=jnp.int32), 7)
    got = jax.jit(
        lambda q: rx.ring_attention(
            q,
            K,
            V,
            mesh=mesh(2),
            mask=rx.Document(),
            segment_ids=seg,
            key_value_seq_lengths=KV_LENS,
        )
    )(Q)
    allowed = (seg[:, None] == seg[None, :])[None, None] & (
        jnp.arange(S)[None, None, None, :] < KV_LENS[:, None, None, None]
    )
    want = jax.nn.dot_product_attention(Q, K, V, mask=allowed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_new_lengths_do_not_recompile():
    # The lengths travel as id arrays (leaves), so new values reuse the compiled program.
    @jax.jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def ring(q, q_lens, kv_lens):
        return rx.ring_attention(
            q, q[..., :KH, :], q[..., :KH, :], mesh=mesh(3), is_causal=True,
            query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        )  # fmt: skip

    for q_lens, kv_lens in ((Q_LENS, KV_LENS), (KV_LENS[::-1], Q_LENS - 9)):
        want = jax.nn.dot_product_attention(
            Q, Q[..., :KH, :], Q[..., :KH, :], is_causal=True,
            query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        )  # fmt: skip
        np.testing.assert_allclose(ring(Q, q_lens, kv_lens), want, rtol=1e-5, atol=1e-5)


def test_bias_constant_along_the_keys_is_kept_beside_sinks():
    # Softmax ignores a bias constant along the keys, but not beside `sinks=`: it shifts
    # every key against the sinks, so it equals shifting the sinks the other way. (It
    # was dropped there: the fuzzer found it with one-token sequences, whose per-key
    # bias is constant along the keys.)
    m, kernel = mesh(3), rx.XlaKernel(8, 8)
    shift = jnp.array([0.7, -1.3, 0.2, 2.0])
    sinks = jnp.array([0.5, 0.1, -0.4, 1.0])

    def run(sinks, bias=None):
        return rx.ring_attention(Q, K, V, mesh=m, kernel=kernel, sinks=sinks, bias=bias)

    kept = run(sinks, shift.reshape(1, H, 1, 1))
    np.testing.assert_allclose(kept, run(sinks - shift), rtol=1e-5, atol=1e-5)
    assert not np.allclose(kept, run(sinks), atol=1e-3)
    with pytest.raises(ValueError, match=r"constant along the keys.*`sinks=`"):
        run(sinks, jnp.ones((B, H, S, 1)))
