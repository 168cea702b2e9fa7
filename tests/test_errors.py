"""Every error of the foundation says what was expected and what it got.

With runtime shape checks on (the test suite runs under jaxtyping's pytest hook), a
mismatched shape may be caught by the annotation before our own check; both name the
argument, so each test accepts either, and `_check_qkv` is also tested directly.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import CausalSameDocument, OnlyWithinSpans, mesh, qkv

import ringeqx as rx
from ringeqx._ring._checks import check_qkv as _check_qkv


def _call(q, k, v, **kw):
    kw.setdefault("mesh", mesh(2))
    return rx.ring_attention(q, k, v, **kw)


Q, K, V = qkv(jax.random.key(0), (2,), 8, 4, 2, 6)


@pytest.mark.parametrize(
    "q, k, v, match",
    [
        (Q[0, 0], K, V, r"`q` must have shape \[\*batch, seq, heads, head_dim\]"),
        (Q, K[:, :, :1].repeat(3, 2), V[:, :, :1].repeat(3, 2), "multiple of kv_heads"),
        (Q, K[..., :5], V[..., :5], "share head_dim"),
        (Q, K[:1], V[:1], "share batch dimensions"),
        (Q, K[:, :6], V[:, :6], "share the sequence length"),
        (Q, K, V[..., :5], "`k` and `v` must have one shape"),
    ],
)
def test_shape_errors(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        _check_qkv(q, k, v)
    # Through the public function: our message, or the annotation's naming the argument.
    with pytest.raises((ValueError, TypeError), match=f"{match}|parameter '[qkv]'"):
        _call(q, k, v)


def test_axis_name_not_in_mesh():
    with pytest.raises(ValueError, match=r"`axis_name` 'ring' is not an axis of the mesh"):
        _call(Q, K, V, axis_name="ring")


def test_no_mesh_with_many_devices():
    with pytest.raises(ValueError, match="needs a mesh with axis 'sequence'"):
        rx.ring_attention(Q, K, V)


@pytest.mark.parametrize(
    "seg, match",
    [
        (jnp.zeros((3, 8), jnp.int32), r"`segment_ids` must have shape|parameter 'segment_ids'"),
        (jnp.zeros((7,), jnp.int32), "segment_ids"),
        (jnp.zeros((8,), jnp.float32), "segment_ids"),
    ],
)
def test_segment_id_errors(seg, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(Q, K, V, mask=rx.Document(), segment_ids=seg)


def test_document_mask_without_segments():
    with pytest.raises(ValueError, match="reads segment ids"):
        _call(Q, K, V, mask=rx.Document())
    with pytest.raises(ValueError, match="reads segment ids"):
        rx.reference_attention(Q, K, V, mask=rx.Document())


def test_user_masks_name_the_ids_they_read():
    # Nothing declares what these user masks read: it is read off their rules. Without the
    # ids every record would hold -1 and the answer would silently be another mask's.
    seg = r"reads segment ids: pass `segment_ids=` .*CausalSameDocument reads `segments`"
    with pytest.raises(ValueError, match=seg):
        _call(Q, K, V, mask=CausalSameDocument())
    with pytest.raises(ValueError, match=r"`segment_ids=` .*Or reads `segments`"):
        _call(Q, K, V, mask=rx.SlidingWindow(3) | CausalSameDocument())
    with pytest.raises(ValueError, match=seg):
        rx.reference_attention(Q, K, V, mask=CausalSameDocument())
    span = r"reads span ids: pass `span_ids=` .*OnlyWithinSpans reads `spans`"
    with pytest.raises(ValueError, match=span):
        _call(Q, K, V, mask=OnlyWithinSpans())
    with pytest.raises(ValueError, match=span):
        segments = jnp.zeros(8, jnp.int32)
        rx.reference_attention(Q, K, V, mask=OnlyWithinSpans(), segment_ids=segments)


def test_layout_shard_count_mismatch():
    layout = rx.Uniform().layout(8, 4)
    with pytest.raises(ValueError, match="layout has 4 shards but the ring axis"):
        _call(Q, K, V, layout=layout)


def test_layout_order_length_mismatch():
    layout = rx.Uniform().layout(7, 2)
    q, k, v = qkv(jax.random.key(1), (2,), 7, 4, 2, 6)
    match = r"With `order='layout'`, q/k/v must have seq = num_shards \* capacity = 8; got seq 7"
    with pytest.raises(ValueError, match=match):
        _call(q, k, v, layout=layout, order="layout")


def test_layout_with_segment_ids():
    layout = rx.Uniform().layout(8, 2)
    with pytest.raises(ValueError, match="Pass `segment_ids` to the strategy"):
        _call(Q, K, V, layout=layout, segment_ids=jnp.zeros(8, jnp.int32))


def test_batch_not_divisible_by_batch_axis():
    q, k, v = qkv(jax.random.key(2), (3,), 8, 4, 2, 6)
    with pytest.raises(ValueError, match="batch size 3 must be divisible"):
        _call(q, k, v, mesh=mesh(2, 2, names=("batch", "sequence")))


def test_kernel_and_config_errors():
    with pytest.raises(ValueError, match="block_q` must be an integer >= 1"):
        rx.XlaKernel(block_q=0)
    with pytest.raises(ValueError, match="compression_dtype` must be a floating dtype"):
        rx.RingConfig(compression_dtype=jnp.int8)


def test_layout_shard_errors():
    layout = rx.Uniform().layout(8, 2)
    with pytest.raises((ValueError, TypeError), match="an axis of length 8"):
        layout.shard(jnp.zeros((7, 3)))
    with pytest.raises((ValueError, TypeError), match="an axis of length 8"):
        layout.unshard(jnp.zeros((9, 3)))


def test_forward_mode_says_reverse_mode_works():
    # JAX's own message named only "a custom_vjp function" (issue 45).
    def f(q):
        return _call(q, K, V).sum()

    for transform in (lambda: jax.jvp(f, (Q,), (Q,)), lambda: jax.jacfwd(f)(Q)):
        with pytest.raises(TypeError, match="reverse mode only: jax.grad, jax.vjp"):
            transform()


@pytest.mark.parametrize("kernel", ["pallas_tpu", "pallas_gpu"])
def test_second_derivatives_through_pallas_say_what_works(kernel):
    # An empty NotImplementedError (Mosaic) or "Linearization failed" (Triton) came from
    # inside Pallas; raised while tracing, so nothing compiles.
    q, k, v = qkv(jax.random.key(1), (1,), 32, 2, 2, 128)
    picked = rx.select_kernel(kernel, interpret=True)

    def grad_sum(x):
        return jax.grad(lambda y: _call(y, k, v, kernel=picked).sum())(x).sum()

    said = 'Second derivatives through Pallas.*kernel="xla"'
    with pytest.raises(NotImplementedError, match=said):
        jax.grad(grad_sum)(q)
