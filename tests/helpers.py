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
]

# (name, mask, needs segment ids)
MASKS = [
    ("full", rx.Full()),
    ("causal", rx.Causal()),
    ("document", rx.Document()),
    ("causal_document", rx.Causal() & rx.Document()),
]

# (name, factory(heads) -> score modifier or None)
SCORE_MODS = [
    ("none", lambda heads: None),
]

# (name, kernel) with small blocks so that tiling, padding and skipping are exercised.
KERNELS = [
    ("xla", rx.XlaKernel(block_q=8, block_kv=4)),
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
    """Output and the vjp of a fixed random cotangent w.r.t. q, k, v."""
    out, vjp = jax.vjp(fn, q, k, v)
    ct = jax.random.normal(jax.random.key(123), out.shape, jnp.float32).astype(out.dtype)
    return out, vjp(ct)


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol
    )
