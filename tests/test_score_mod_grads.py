"""Trainable score modifiers and biases: the gradient of `ring_attention` with respect to
a modifier's array leaves (ALiBi slopes, a softcap given as an array, a user modifier's
parameters) and to `bias=` is the true one, on every kernel and device count, against
dense autodiff (`reference_attention`, `jax.nn.dot_product_attention`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import KERNELS, assert_close, mesh, packed_segments, qkv
from jaxtyping import Array, Float, Int

import ringeqx as rx


HEADS, KV_HEADS, SEQ = 4, 2, 24
# The smallest head_dim each kernel takes (Triton: a power of two >= 16; Mosaic: 64).
HEAD_DIM = {"xla": 5, "pallas_gpu": 16, "pallas_tpu": 64}


class _Affine(rx.AbstractScoreMod):
    """A user modifier with trainable per-head parameters: `s * exp(t_h) + b_h`."""

    log_temperature: Float[Array, " heads"]
    offset: Float[Array, " heads"]

    def __call__(self, scores, q, k):
        shape = (1,) * (scores.ndim - 3) + (scores.shape[-3], 1, 1)
        t = jnp.exp(self.log_temperature).reshape(shape).astype(scores.dtype)
        return scores * t + self.offset.reshape(shape).astype(scores.dtype)

    def for_head(self, head: Int[Array, ""]) -> "_Affine":
        return self.for_heads(head, 1)

    def for_heads(self, first, count: int) -> "_Affine":
        def cut(x):
            return jax.lax.dynamic_slice_in_dim(x, first, count)

        return _Affine(cut(self.log_temperature), cut(self.offset))

    def check(self, heads: int) -> None:
        if self.offset.shape != (heads,):
            raise ValueError(f"_Affine needs {heads} offsets; got {self.offset.shape}.")


class _DenseBias(rx.AbstractScoreMod):
    """`s[h, i, j] + bias[h, j]`, written here for the dense side (`bias=` of
    `ring_attention` runs before the caller's modifier)."""

    bias: Float[Array, "heads seq"]

    def __call__(self, scores, q, k):
        pos = k.positions.reshape(-1, SEQ)[0]  # the same positions in every example
        bias = jnp.take(self.bias, pos, axis=-1)[:, None, :]
        return scores + bias.reshape((1,) * (scores.ndim - 3) + bias.shape)

    def for_head(self, head):
        raise NotImplementedError

    def check(self, heads: int) -> None:
        pass


def _leaves():
    """Every kind of trainable leaf: ALiBi slopes, a user modifier's parameters, a softcap
    given as an array, and a bias per key and head."""
    return dict(
        slopes=jnp.array([0.3, 0.1, 0.05, 0.2]),
        log_temperature=jnp.array([0.1, -0.2, 0.3, 0.0]),
        offset=jnp.array([0.5, -1.0, 0.25, 2.0]),
        cap=jnp.float32(4.0),
        bias=jnp.sin(jnp.arange(HEADS * SEQ, dtype=jnp.float32)).reshape(1, HEADS, 1, SEQ),
    )


def _mod(p):
    return rx.Chain(
        rx.ALiBi(p["slopes"]),
        _Affine(p["log_temperature"], p["offset"]),
        rx.Softcap(p["cap"]),
    )


def _mask_and_ids():
    return rx.Causal() & rx.Document(), packed_segments(SEQ, [5, 11, 8])


@pytest.mark.parametrize("devices", [1, 3, 8])
@pytest.mark.parametrize("name,kernel", KERNELS, ids=[n for n, _ in KERNELS])
def test_modifier_and_bias_gradients_match_dense_autodiff(name, kernel, devices):
    q, k, v = qkv(jax.random.key(devices), (), SEQ, HEADS, KV_HEADS, HEAD_DIM[name])
    ct = jax.random.normal(jax.random.key(7), q.shape)
    mask, seg = _mask_and_ids()
    layout = (rx.Zigzag() if devices > 1 else rx.Uniform()).layout(SEQ, devices, segment_ids=seg)
    m = mesh(devices)

    def ring(p, q, k, v):
        return rx.ring_attention(
            q, k, v, mask=mask, score_mod=_mod(p), bias=p["bias"],
            layout=layout, mesh=m, kernel=kernel,
        )

    def dense(p, q, k, v):
        mod = rx.Chain(_DenseBias(p["bias"][0, :, 0]), _mod(p))
        return rx.reference_attention(q, k, v, mask=mask, segment_ids=seg, score_mod=mod)

    @jax.jit
    def grads(p, q, k, v):
        out, vjp = jax.vjp(ring, p, q, k, v)
        return out, vjp(ct)

    p = _leaves()
    out, got = grads(p, q, k, v)
    ref_out, vjp = jax.vjp(dense, p, q, k, v)
    want = vjp(ct)
    assert_close(out, ref_out)
    for key in p:
        assert jnp.any(want[0][key] != 0), key  # a leaf the test truly exercises
        assert_close(got[0][key], want[0][key], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1:], want[1:]):
        assert_close(g, w)


@pytest.mark.parametrize(
    "config,names",
    [
        (rx.RingConfig(ulysses_axis="ulysses"), ("sequence", "ulysses")),
        (rx.AllGather(), ("sequence",)),
        (rx.RingConfig(bidirectional=True), ("sequence",)),
        (rx.RingConfig(), ("batch", "sequence")),
    ],
    ids=["hybrid", "allgather", "bidirectional", "batch_axis"],
)
def test_modifier_gradients_under_every_ring_config(config, names):
    # The hybrid hands each device its heads' slice of the leaves (`for_heads`), and a
    # batch axis its examples: each gradient is summed over the devices once.
    m = mesh(*((2, 2) if len(names) == 2 else (4,)), names=names)
    q, k, v = qkv(jax.random.key(3), (2,), SEQ, HEADS, KV_HEADS, 8)
    ct = jax.random.normal(jax.random.key(4), q.shape)
    p = _leaves()

    def ring(p):
        out = rx.ring_attention(
            q, k, v, mask=rx.Causal(), score_mod=_mod(p), bias=p["bias"], mesh=m, config=config
        )
        return jnp.sum(out * ct)

    def dense(p):
        mod = rx.Chain(_DenseBias(p["bias"][0, :, 0]), _mod(p))
        return jnp.sum(rx.reference_attention(q, k, v, mask=rx.Causal(), score_mod=mod) * ct)

    got, want = jax.jit(jax.grad(ring))(p), jax.grad(dense)(p)
    for key in p:
        assert_close(got[key], want[key])


def test_bias_gradient_matches_jax_nn_dot_product_attention():
    # `bias=` as `jax.nn.dot_product_attention` takes it, one row per head or one shared.
    q, k, v = qkv(jax.random.key(5), (2,), SEQ, HEADS, KV_HEADS, 8)
    ct = jax.random.normal(jax.random.key(6), q.shape)
    m = mesh(3)
    biases = (
        jnp.cos(jnp.arange(HEADS * SEQ, dtype=jnp.float32)).reshape(1, HEADS, 1, SEQ),
        jnp.linspace(-2.0, 2.0, SEQ, dtype=jnp.float32).reshape(1, 1, 1, SEQ),
    )

    def loss(attend, bias, q, k, v):
        return jnp.sum(attend(q, k, v, bias=bias, is_causal=True) * ct)

    def ring(q, k, v, **kw):
        return rx.ring_attention(q, k, v, mesh=m, **kw)

    grad = jax.grad(loss, argnums=(1, 2, 3, 4))
    got = jax.jit(lambda biases: [grad(ring, b, q, k, v) for b in biases])(biases)
    for b, g in zip(biases, got):
        want = grad(jax.nn.dot_product_attention, b, q, k, v)
        for x, y in zip(g, want):
            assert_close(x, y)


def test_ring_attention_layer_trains_its_alibi_slopes():
    dim, heads = 16, 4
    layer = rx.nn.RingAttention(
        dim,
        heads,
        2,
        score_mod=rx.ALiBi(jnp.full(heads, 0.5)),
        rope_theta=None,
        kernel=KERNELS[0][1],
        key=jax.random.key(8),
    )
    x = jax.random.normal(jax.random.key(9), (SEQ, dim))
    # A target made by the same layer with other slopes: only the slopes can fit it.
    target_slopes = jnp.array([0.05, 0.2, 0.8, 1.5])
    target = eqx.tree_at(lambda m: m.score_mod.slopes, layer, target_slopes)(x, mesh=mesh(4))
    train_only_slopes = eqx.tree_at(
        lambda m: m.score_mod.slopes, jax.tree.map(lambda _: False, layer), True
    )

    def loss(slopes, layer, attend):
        layer = eqx.tree_at(lambda m: m.score_mod.slopes, layer, slopes)
        return jnp.mean((attend(layer) - target) ** 2)

    def ring(layer):
        return layer(x, mesh=mesh(4))

    def dense(layer):
        # The same layer's projections around `reference_attention`.
        def split(proj, n):
            return jax.vmap(proj)(x).reshape(SEQ, n, dim // heads)

        q = split(layer.query_proj, heads)
        k, v = split(layer.key_proj, 2), split(layer.value_proj, 2)
        y = rx.reference_attention(q, k, v, mask=layer.mask, score_mod=layer.score_mod)
        return jax.vmap(layer.output_proj)(y.reshape(SEQ, -1))

    slopes = layer.score_mod.slopes
    got = jax.jit(jax.grad(loss), static_argnums=2)(slopes, layer, ring)
    want = jax.grad(loss)(slopes, layer, dense)
    assert jnp.all(want != 0)
    assert_close(got, want)

    optim = optax.adam(0.05)

    @eqx.filter_jit
    def step(layer, state):
        params, static = eqx.partition(layer, train_only_slopes)
        value, grads = eqx.filter_value_and_grad(
            lambda p: jnp.mean((ring(eqx.combine(p, static)) - target) ** 2)
        )(params)
        # optax mixes Python floats with int32 step counts; our code is strict, optax not.
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optim.update(grads, state)
        return eqx.apply_updates(layer, updates), state, value

    state = optim.init(eqx.filter(layer, train_only_slopes))
    losses = []
    for _ in range(40):
        layer, state, value = step(layer, state)
        losses.append(float(value))
    assert losses[-1] < 0.05 * losses[0], losses
    assert jnp.max(jnp.abs(layer.score_mod.slopes - target_slopes)) < 0.1, layer.score_mod.slopes
