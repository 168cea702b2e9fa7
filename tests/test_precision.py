"""The ring's float32 answer is as exact as a dense float32 softmax (issue 45, class 7).

Against a float64 dense answer, the root-mean-square error of `ring_attention`'s output is
at most 1.1x that of a dense float32 computation, on 3 and 8 devices and 2 to 64 tokens a
device. The ring used to merge each block's normalised output by its log-sum-exp, which
scaled every output by the rounding of `logaddexp` (an error that grows with |lse|): this
test gave 2.8x (3 devices) and 3.4x (8). It now sums the blocks unnormalised and divides
once. Measured and left open: 1 token a device, 1.2-1.5x (benchmarks/RESULTS.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import ringeqx as rx


def _dense64(q, k, v, causal):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def _dense32(q, k, v, causal):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _rms(x, ref):
    return float(np.sqrt(np.mean((np.asarray(x, np.float64) - ref) ** 2)))


@pytest.mark.parametrize(
    "devices, tokens", [(3, (2, 16, 64)), (8, (2, 16, 64))], ids=["3", "8"]
)
def test_ring_output_is_as_exact_as_dense_float32(devices, tokens):
    mesh = jax.make_mesh(
        (devices,), ("sequence",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
    )
    ratios = {}
    for n in tokens:
        for causal in (False, True):
            seq = devices * n
            keys = jax.random.split(jax.random.key(seq + causal), 3)
            # Logits of a few units (|lse| up to ~30), where the old merge lost most.
            q, k, v = (
                jax.random.normal(key, (4, seq, 8, 32), jnp.float32) * scale
                for key, scale in zip(keys, (3.0, 3.0, 1.0))
            )
            exact = _dense64(q, k, v, causal)
            mask = rx.Causal() if causal else None
            with jax.set_mesh(mesh):
                out = jax.jit(lambda q, k, v: rx.ring_attention(q, k, v, mask=mask))(q, k, v)
            dense = _rms(_dense32(q, k, v, causal), exact)
            ratios[n, causal] = _rms(out, exact) / dense
    assert max(ratios.values()) <= 1.1, ratios
