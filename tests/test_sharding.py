"""Sequence parallelism end to end, read from the compiled programs.

What is asserted, for inputs sharded `P(None, "sequence")` on 8 devices:

- Attention (forward and backward, with and without a layout): the only collectives are
  collective-permutes (no all-gather, all-to-all, reduce-scatter or all-reduce at all),
  every ring loop runs `num_ring_steps - 1` hops, and the output and the gradients keep
  the input's sharding.
- One LM training step: no all-gather, all-to-all or reduce-scatter. All-reduces over the
  sequence axis are expected, but only of parameter gradients and the loss (each operand
  parameter-shaped or a scalar): a sequence-sharded model sums its parameter gradients
  over the devices. No all-reduce carries an activation.
- Per-device memory (`memory_analysis()`) falls when the device count doubles.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, mesh, packed_segments, qkv, ring_loop_trips
from jax.sharding import NamedSharding, PartitionSpec as P

import ringeqx as rx
from ringeqx.tools._hlo._parse import collectives


SHAPE = dict(heads=4, kv_heads=2, head_dim=6)
KERNEL = rx.XlaKernel(block_q=8, block_kv=4)
# 8 shards of 7 tokens.
SEQ = 56


def _gathers(hlo: str) -> list:
    return [c for c in collectives(hlo) if c[0] != "collective-permute"]


def _seq_sharded(m, x):
    spec = P(None, "sequence") if x.ndim > 1 else P("sequence")
    return jax.device_put(x, NamedSharding(m, spec))


@pytest.mark.parametrize(
    "mask",
    [rx.Causal(), rx.Document(), rx.SlidingWindow(9)],
    ids=["causal", "document", "sliding_window"],
)
def test_attention_stays_sharded(mask):
    m = mesh(8)
    q, k, v = qkv(jax.random.key(0), (2,), SEQ, **SHAPE)
    ct = jax.random.normal(jax.random.key(1), q.shape)
    seg = jnp.broadcast_to(packed_segments(SEQ, [9, 20, 13]), (2, SEQ))
    # A non-contiguous layout: the caller shards once, at the input, before the program.
    layout = rx.Zigzag().layout(SEQ, 8, segment_ids=seg[0])
    q_l, k_l, v_l, ct_l = (layout.shard(x) for x in (q, k, v, ct))
    args = tuple(_seq_sharded(m, x) for x in (q, k, v, ct, seg, q_l, k_l, v_l, ct_l))

    def both(q, k, v, ct, seg, q_l, k_l, v_l, ct_l):
        def plain(q, k, v):
            return rx.ring_attention(q, k, v, mask=mask, segment_ids=seg, mesh=m, kernel=KERNEL)

        def laid(q, k, v):
            return rx.ring_attention(
                q, k, v, mask=mask, layout=layout, order="layout", mesh=m, kernel=KERNEL
            )

        out, vjp = jax.vjp(plain, q, k, v)
        out_l, vjp_l = jax.vjp(laid, q_l, k_l, v_l)
        return out, vjp(ct), out_l, vjp_l(ct_l)

    compiled = jax.jit(both).lower(*args).compile()
    hlo = compiled.as_text()
    assert _gathers(hlo) == []
    # Each ring call loops over its hops forward and backward (`ring_loop_trips`).
    steps = rx.num_ring_steps(mask, rx.Uniform().layout(SEQ, 8))
    steps_l = rx.num_ring_steps(mask, layout)
    if isinstance(mask, rx.SlidingWindow):
        assert steps < 8  # the contiguous default path stops early
    _, _, trips = rx.tools.permute_stats(hlo)
    assert sorted(trips) == sorted(ring_loop_trips(steps) + ring_loop_trips(steps_l))
    sharding = args[0].sharding
    for s in jax.tree.leaves(compiled.output_shardings):
        assert s.is_equivalent_to(sharding, 4)

    out, grads, out_l, grads_l = compiled(*args)
    ref, ref_vjp = jax.vjp(
        lambda q, k, v: rx.reference_attention(q, k, v, mask=mask, segment_ids=seg), q, k, v
    )
    assert_close(out, ref)
    assert_close(layout.unshard(out_l), ref)
    for g, g_l, r in zip(grads, grads_l, ref_vjp(ct)):
        assert_close(g, r)
        assert_close(layout.unshard(g_l), r)


def test_lm_training_step_gathers_nothing():
    m = mesh(8)
    model = rx.nn.RingTransformerLM(
        vocab_size=11, dim=16, num_heads=4, num_layers=2, num_kv_heads=2, hidden=20,
        attention=rx.nn.AttentionOptions(kernel=KERNEL, mask=rx.SlidingWindow(10)),
        key=jax.random.key(2),
    )
    data = jax.random.randint(jax.random.key(3), (2, SEQ + 1), 0, 11)
    # Labels are shifted before sharding, so the loss needs no token from another device.
    tokens, labels = _seq_sharded(m, data[:, :-1]), _seq_sharded(m, data[:, 1:])

    @eqx.filter_jit
    def step(model, tokens, labels):
        def loss(model):
            return jnp.mean(jax.vmap(lambda t, y: model.loss(t, y, mesh=m))(tokens, labels))

        return eqx.filter_value_and_grad(loss)(model)

    compiled = step.lower(model, tokens, labels).compile().compiled
    hlo = compiled.as_text()
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    # Parameter gradients, the loss, and the per-example losses (batch-shaped).
    params = {f"f32[{','.join(map(str, x.shape))}]" for x in leaves} | {"f32[]", "f32[2]"}
    found = _gathers(hlo)
    assert {kind for kind, _ in found} <= {"all-reduce"}, found
    for _, result in found:
        shapes = set(re.findall(r"\w+\[[\d,]*\]", result))
        assert shapes <= params, (shapes - params)
    steps = rx.num_ring_steps(rx.SlidingWindow(10), rx.Uniform().layout(SEQ, 8))
    _, _, trips = rx.tools.permute_stats(hlo)
    assert sorted(trips) == sorted(ring_loop_trips(steps) * 2)

    loss, grads = step(model, tokens, labels)
    # The same step unsharded, on a one-device ring.
    one = mesh(1)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(
        lambda model: jnp.mean(
            jax.vmap(lambda t, y: model.loss(t, y, mesh=one))(data[:, :-1], data[:, 1:])
        )
    ))(model)
    assert_close(loss, ref_loss, 1e-5, 1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert_close(g, r, 1e-4, 1e-5)


def _memory(compiled) -> int:
    stats = compiled.memory_analysis()
    return (
        stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    )


def test_memory_per_device_falls_with_devices():
    # Forward+backward at a fixed length on 4 and on 8 devices: per-device memory
    # (arguments + outputs + temporaries) must roughly halve. Tiles of 64 keep the
    # kernel's fixed score tiles small beside these small shards (256 tokens on 8).
    seq = 2048

    def program(p):
        m = mesh(p)
        x = jax.ShapeDtypeStruct(
            (1, seq, 2, 32), jnp.float32, sharding=NamedSharding(m, P(None, "sequence"))
        )

        def loss(q, k, v):
            kernel = rx.XlaKernel(64, 64)
            out = rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m, kernel=kernel)
            return jnp.sum(out**2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()

    ratio = _memory(program(8)) / _memory(program(4))
    assert ratio <= 0.6, ratio


def test_layout_shard_batched():
    x = jax.random.normal(jax.random.key(4), (3, 2, 13, 5))
    seg = jnp.stack([packed_segments(13, [4, 9]), packed_segments(13, [6, 7])])
    for layout in (rx.Uniform().layout(13, 4), rx.Zigzag().layout(13, 4)):
        one = jax.vmap(jax.vmap(layout.shard))(x)
        assert_close(layout.shard(x), one)
        assert_close(layout.shard(x, axis=2), one)
        assert_close(layout.unshard(layout.shard(x)), x)
        # The sequence axis may also come later than the first after the batch axes.
        xt = jnp.swapaxes(x, 2, 3)
        assert_close(layout.shard(xt, axis=-1), jnp.swapaxes(one, 2, 3))
    # A batched layout maps its own batch axes over the array's leading ones.
    layout = rx.Zigzag().layout(13, 4, segment_ids=seg)
    xb = x[0]
    expect = jax.vmap(lambda lay, x: lay.shard(x))(layout, xb)
    assert_close(layout.shard(xb), expect)
    assert_close(layout.unshard(layout.shard(xb)), xb)
    contiguous = rx.contiguous_layout(13, 4, segment_ids=seg)
    assert contiguous.in_order and contiguous.contiguous
    assert contiguous.batch_shape == (2,)
    uniform = rx.Uniform().layout(13, 4, segment_ids=seg)
    for a, b in zip(jax.tree.leaves(contiguous), jax.tree.leaves(uniform)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="must start with it"):
        layout.shard(x)
    with pytest.raises(ValueError, match="an axis of length 13"):
        rx.Uniform().layout(13, 4).shard(x[..., :12, :])
    with pytest.raises(ValueError, match="`axis`=3 must be an axis of length 13"):
        rx.Uniform().layout(13, 4).shard(x, axis=3)


def test_contiguous_layout_is_a_pad_and_keeps_sharding():
    # seq = 52 on 8 devices: capacity 7, padding at the end. The padded array is sharded
    # once at the input and the program gathers nothing.
    m = mesh(8)
    layout = rx.contiguous_layout(52, 8)
    q, k, v = qkv(jax.random.key(5), (2,), 52, **SHAPE)
    padded = tuple(_seq_sharded(m, layout.shard(x, axis=1)) for x in (q, k, v))
    f = jax.jit(
        lambda q, k, v: rx.ring_attention(
            q, k, v, mask=rx.Causal(), layout=layout, order="layout", mesh=m, kernel=KERNEL
        )
    )
    compiled = f.lower(*padded).compile()
    assert _gathers(compiled.as_text()) == []
    assert compiled.output_shardings.is_equivalent_to(padded[0].sharding, 4)
    out = layout.unshard(compiled(*padded), axis=1)
    assert_close(out, rx.reference_attention(q, k, v, mask=rx.Causal()))
    with pytest.raises(ValueError, match="`num_shards` must be an integer"):
        rx.contiguous_layout(52, 0)
