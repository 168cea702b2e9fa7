"""The Equinox layers: RingAttention, the transformer block and the small LM."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import assert_close, mesh, packed_segments

import ringeqx as rx


def _dense_attention(attn: rx.nn.RingAttention, x, segment_ids=None):
    """The module's maths written independently, with dense attention."""
    seq = x.shape[0]
    q = (x @ attn.query_proj.weight.T).reshape(seq, attn.num_heads, attn.head_dim)
    k = (x @ attn.key_proj.weight.T).reshape(seq, attn.num_kv_heads, attn.head_dim)
    v = (x @ attn.value_proj.weight.T).reshape(seq, attn.num_kv_heads, attn.head_dim)
    pos = jnp.arange(seq)
    q = rx.nn.apply_rope(q, pos, attn.rope_theta)
    k = rx.nn.apply_rope(k, pos, attn.rope_theta)
    out = rx.reference_attention(
        q, k, v, mask=attn.mask, segment_ids=segment_ids, sinks=attn.sinks
    )
    return out.reshape(seq, -1) @ attn.output_proj.weight.T


def test_rope_rotates_by_position():
    x = jax.random.normal(jax.random.key(0), (5, 3, 4))
    pos = jnp.arange(5)
    y = rx.nn.apply_rope(x, pos)
    # Rotations keep norms, and a shift of both positions keeps dot products.
    assert_close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1))
    y2 = rx.nn.apply_rope(x, pos + 7)
    assert_close(jnp.einsum("qhd,khd->hqk", y, y), jnp.einsum("qhd,khd->hqk", y2, y2), 1e-4, 1e-4)
    with pytest.raises(ValueError, match="even head_dim"):
        rx.nn.apply_rope(x[..., :3], pos)


def test_module_matches_dense_values_and_gradients():
    m = mesh(4)
    attn = rx.nn.RingAttention(
        12, 4, 2, head_dim=6, mask=rx.Causal() & rx.Document(), kernel=rx.XlaKernel(4, 8),
        sinks=True, key=jax.random.key(1),
    )
    attn = eqx.tree_at(lambda a: a.sinks, attn, jnp.array([0.5, -1.0, 2.0, 0.0]))
    x = jax.random.normal(jax.random.key(2), (23, 12))
    seg = packed_segments(23, [7, 10])

    def ring_loss(attn, x):
        return jnp.sum(attn(x, segment_ids=seg, mesh=m) ** 2)

    def dense_loss(attn, x):
        return jnp.sum(_dense_attention(attn, x, seg) ** 2)

    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(ring_loss))(attn, x)
    ref_loss, ref_grads = eqx.filter_value_and_grad(dense_loss)(attn, x)
    assert_close(loss, ref_loss, 1e-5, 1e-4)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert_close(g, r, 1e-4, 1e-5)


def test_module_under_vmap_with_batch_mesh_and_layout():
    m = mesh(2, 4, names=("batch", "sequence"))
    attn = rx.nn.RingAttention(12, 6, 3, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (4, 19, 12))
    layout = rx.Uniform().layout(19, 4)
    xs = jax.vmap(layout.shard)(x)

    @eqx.filter_jit
    def run(attn, xs):
        return jax.vmap(lambda x: attn(x, layout), spmd_axis_name="batch")(xs)

    with jax.set_mesh(m):
        out = jax.vmap(layout.unshard)(run(attn, xs))
    ref = jax.vmap(lambda x: _dense_attention(attn, x))(x)
    assert out.shape == x.shape
    assert_close(out, ref, 1e-5, 1e-5)


def test_module_errors():
    with pytest.raises(ValueError, match="multiple of `num_kv_heads`"):
        rx.nn.RingAttention(12, 4, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="even `head_dim`"):
        rx.nn.RingAttention(12, 4, head_dim=5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="not divisible by `num_heads`"):
        rx.nn.RingAttention(10, 4, key=jax.random.key(0))
    # The kernel is resolved at construction: no silent fallback at call time.
    with pytest.raises(ValueError, match="JAX has no gpu devices"):
        rx.nn.RingAttention(16, 4, device_type="gpu", key=jax.random.key(0))
    attn = rx.nn.RingAttention(
        16, 2, kernel="pallas_gpu", device_type="gpu", interpret=True, key=jax.random.key(0)
    )
    assert isinstance(attn.kernel, rx.PallasGpuKernel)


def test_small_lm_trains_and_matches_dense_gradients():
    # With gradient checkpointing: the rematerialised backward must still be exact.
    m = mesh(4)
    model = rx.nn.RingTransformerLM(
        vocab_size=11, dim=16, num_heads=4, num_layers=2, num_kv_heads=2, hidden=24,
        checkpoint=True, attention=rx.nn.AttentionOptions(kernel=rx.XlaKernel(8, 8)),
        key=jax.random.key(5),
    )
    tokens = jax.random.randint(jax.random.key(6), (2, 25), 0, 11)

    def loss_fn(model, tokens):
        logits = jax.vmap(lambda t: model(t[:-1], mesh=m))(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    opt = optax.adam(3e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        # optax mixes Python floats with int32 step counts; our code is strict, optax not.
        with jax.numpy_dtype_promotion("standard"):
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    # Gradients of the ring model equal those of the same model on one device (dense).
    one = mesh(1)

    def dense_loss(model, tokens):
        logits = jax.vmap(lambda t: model(t[:-1], mesh=one))(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    g_ring = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, tokens)
    g_one = eqx.filter_jit(eqx.filter_grad(dense_loss))(model, tokens)
    for a, b in zip(jax.tree.leaves(g_ring), jax.tree.leaves(g_one)):
        assert_close(a, b, 1e-4, 1e-5)

    losses = []
    for _ in range(8):
        model, state, loss = step(model, state, tokens)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0], losses


def test_attention_options_build_every_block():
    options = rx.nn.AttentionOptions(
        mask=rx.SlidingWindow(5), sinks=True, kernel=rx.XlaKernel(8, 8), rope_theta=None
    )
    lm = rx.nn.RingTransformerLM(11, 12, 3, 2, num_kv_heads=1, attention=options,
                                 key=jax.random.key(0))
    for block in lm.blocks:
        attn = block.attention
        assert attn.mask == rx.SlidingWindow(5) and attn.kernel == rx.XlaKernel(8, 8)
        assert attn.sinks is not None and attn.sinks.shape == (3,)
        assert attn.rope_theta is None and attn.num_kv_heads == 1
    # Checked where the layer is built, naming the layer's argument.
    with pytest.raises(ValueError, match="Rotary embeddings need an even `head_dim`"):
        rx.nn.AttentionOptions(head_dim=3).build(12, 3, 1, key=jax.random.key(0))


def test_attention_kwargs_is_a_deprecated_alias():
    key = jax.random.key(0)
    with pytest.warns(DeprecationWarning, match="attention=ringeqx.nn.AttentionOptions"):
        old = rx.nn.RingTransformerLM(
            11, 12, 3, 1, attention_kwargs=dict(sinks=True, kernel=rx.XlaKernel(8, 8)), key=key
        )
    new = rx.nn.RingTransformerLM(
        11, 12, 3, 1, attention=rx.nn.AttentionOptions(sinks=True, kernel=rx.XlaKernel(8, 8)),
        key=key,
    )
    assert eqx.tree_equal(old, new)
    with pytest.raises(ValueError, match="Pass the attention options once"):
        rx.nn.RingTransformerLM(
            11, 12, 3, 1, attention=rx.nn.AttentionOptions(), attention_kwargs={}, key=key
        )


def test_save_model_keeps_the_configuration(tmp_path):
    key = jax.random.key(0)
    options = rx.nn.AttentionOptions(
        mask=rx.SlidingWindow(3), sinks=True, kernel=rx.XlaKernel(8, 8)
    )
    model = rx.nn.RingTransformerLM(11, 12, 3, 1, attention=options, key=key)
    model = eqx.tree_at(lambda m: m.blocks[0].attention.sinks, model, jnp.arange(3.0))
    # The arrays alone, into a template of another configuration: the template's mask
    # is kept (what `save_model` exists to avoid).
    other = rx.nn.RingTransformerLM(
        11, 12, 3, 1, attention=rx.nn.AttentionOptions(sinks=True), key=jax.random.key(1)
    )
    eqx.tree_serialise_leaves(tmp_path / "leaves.eqx", model)
    restored = eqx.tree_deserialise_leaves(tmp_path / "leaves.eqx", other)
    assert restored.blocks[0].attention.mask == rx.Causal()
    np.testing.assert_array_equal(restored.blocks[0].attention.sinks, jnp.arange(3.0))
    rx.nn.save_model(tmp_path / "model.ringeqx", model)
    loaded = rx.nn.load_model(tmp_path / "model.ringeqx")
    assert eqx.tree_equal(loaded, model)
    assert loaded.blocks[0].attention.mask == rx.SlidingWindow(3)
    assert loaded.blocks[0].attention.kernel == rx.XlaKernel(8, 8)
    (tmp_path / "junk").write_bytes(b"junk")
    with pytest.raises(ValueError, match="is not a model saved by ringeqx.nn.save_model"):
        rx.nn.load_model(tmp_path / "junk")


def test_scanned_layers_are_the_unrolled_model():
    # `scan_layers=True` stacks the same weights (the same keys) and scans them: the
    # loss, every gradient (stacked) and prefill + decode equal the unrolled model's,
    # under remat too; `layers` gives the stacked block's slices one by one.
    m = mesh(4)
    options = rx.nn.AttentionOptions(kernel=rx.XlaKernel(8, 8))
    kw = dict(attention=options, key=jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (32,), 0, 16)

    @eqx.filter_jit
    def loss_and_grads(model):
        return eqx.filter_value_and_grad(lambda model: model.loss(tokens, tokens, mesh=m))(model)

    for remat in ("none", "block"):
        unrolled = rx.nn.RingTransformerLM(16, 8, 2, 3, checkpoint=remat, **kw)
        scanned = rx.nn.RingTransformerLM(16, 8, 2, 3, checkpoint=remat, scan_layers=True, **kw)
        assert isinstance(scanned.blocks, rx.nn.TransformerBlock) and len(scanned.layers) == 3
        assert eqx.tree_equal(scanned.layers, unrolled.blocks)
        (a, da), (b, db) = loss_and_grads(unrolled), loss_and_grads(scanned)
        assert_close(b, a, rtol=1e-6, atol=1e-6)
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *eqx.filter(da.blocks, eqx.is_array))
        leaves = jax.tree.leaves(eqx.filter(db.blocks, eqx.is_array))
        assert len(leaves) == len(jax.tree.leaves(stacked)) > 0
        for x, y in zip(jax.tree.leaves(stacked), leaves):
            assert_close(y, x, rtol=1e-5, atol=1e-6)
    # Prefill and one decode step, compiled (eagerly, op by op, they took most of the
    # test's time).
    @eqx.filter_jit
    def prefill_and_decode(model):
        logits, cache = model.prefill(tokens[:16], max_new_tokens=4, mesh=m)
        return logits, model.decode(tokens[16], cache, mesh=m)[0]

    (logits, step), (expected, expected_step) = map(prefill_and_decode, (scanned, unrolled))
    assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert_close(step, expected_step, rtol=1e-5, atol=1e-6)
    # A bool only: beartype (in the tests) or the model itself rejects anything else.
    with pytest.raises((ValueError, TypeError), match="scan_layers"):
        rx.nn.RingTransformerLM(16, 8, 2, 3, scan_layers="yes", **kw)


def test_lm_on_a_length_the_ring_does_not_divide():
    # The stream is held on the ring between layers only where the ring divides it: in
    # the original order (no layout) the ring pads the sequence itself.
    m = jax.make_mesh((2, 4), ("batch", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    options = rx.nn.AttentionOptions(kernel=rx.XlaKernel(8, 8))
    model = rx.nn.RingTransformerLM(16, 8, 2, 1, attention=options, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 16)

    @eqx.filter_jit
    def logits(model, tokens):
        return jax.vmap(lambda t: model(t, mesh=m), spmd_axis_name="batch")(tokens)

    out = logits(model, tokens)
    assert out.shape == (2, 10, 16) and bool(jnp.all(jnp.isfinite(out)))
    assert_close(out[0], model(tokens[0], mesh=m), rtol=1e-5, atol=1e-6)


@pytest.fixture
def _own_checks():
    """Our own checks, as a user without jaxtyping's hook meets them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.mark.parametrize(
    "name, value, error, match",
    [
        # Truthy strings and ints turned a feature on (issue 45).
        ("sinks", "False", TypeError, r"`sinks` must be a bool \(True or False\); got str 'False'"),
        ("use_bias", "no", TypeError, r"`use_bias` must be a bool \(True or False\); got str 'no'"),
        ("interpret", 1, TypeError, r"`interpret` must be a bool \(True or False\); got int 1"),
        # A base <= 0 or NaN gave all-NaN outputs; inf, a rotation of one pair only.
        ("rope_theta", 0.0, ValueError, r"`rope_theta` must be a finite number > 0 \(the base "
         r"of rotary embeddings\), or None for none; got 0.0"),
        ("rope_theta", -1.0, ValueError, r"`rope_theta` must be a finite number > 0 .*got -1.0"),
        ("rope_theta", float("nan"), ValueError, r"`rope_theta` must be .*got nan"),
        ("rope_theta", float("inf"), ValueError, r"`rope_theta` must be .*got inf"),
        ("rope_theta", "1e4", ValueError, r"`rope_theta` must be .*got '1e4'"),
        ("head_dim", 4.0, ValueError, r"`head_dim` must be an integer >= 1; got 4.0"),
        ("head_dim", True, ValueError, r"`head_dim` must be an integer >= 1; got True"),
        ("mask", "causal", TypeError, r"`mask` must be a ringeqx.AbstractMask instance .*got "
         r"str 'causal'"),
        ("score_mod", "softcap", TypeError, r"`score_mod` must be a ringeqx.AbstractScoreMod "
         r"instance .*got str 'softcap'"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("_own_checks")
def test_options_that_are_not_what_they_say_are_refused(name, value, error, match):
    key = jax.random.key(0)
    with pytest.raises(error, match=match):
        rx.nn.RingAttention(8, 2, kernel=rx.XlaKernel(8, 8), key=key, **{name: value})
    # Where the options are written, not when a model builds its first block.
    with pytest.raises(error, match=match):
        rx.nn.AttentionOptions(**{name: value})


@pytest.mark.usefixtures("_own_checks")
def test_model_options_that_are_not_what_they_say_are_refused():
    key = jax.random.key(0)

    def lm(**kw):
        return rx.nn.RingTransformerLM(11, 8, 2, 1, hidden=8, key=key, **kw)

    with pytest.raises(TypeError, match=r"`attention` must be a ringeqx.nn.AttentionOptions or "
                       r"None; got dict. Pass `attention=ringeqx.nn.AttentionOptions\(...\)`"):
        lm(attention=dict(sinks=True))
    with pytest.raises(TypeError, match=r"`attention_kwargs` must be a dict or None; got tuple"):
        lm(attention_kwargs=(("sinks", True),))
    # 1 == True, but `match` tells them apart: refused only at the first call before.
    with pytest.raises(ValueError, match=r"`checkpoint` must be a bool or one of 'none', "
                       r"'attention', 'block'; got 1\."):
        lm(checkpoint=1)
    with pytest.raises(TypeError, match=r"`scan_layers` must be a bool \(True or False\); got "
                       r"int 1"):
        lm(scan_layers=1)
    with pytest.raises(TypeError, match=r"`attention` must be a ringeqx.nn.RingAttention; got "
                       r"AttentionOptions"):
        rx.nn.TransformerBlock(rx.nn.AttentionOptions(), 8, key=key)
    # NumPy bools and numbers are what they say, and stored as Python ones.
    attn = rx.nn.RingAttention(8, 2, sinks=np.bool_(True), rope_theta=np.float32(500.0), key=key)
    assert attn.sinks is not None and type(attn.rope_theta) is float
    assert lm(checkpoint=np.bool_(True)).checkpoint is True


def test_save_model_round_trips_every_float_dtype_and_refuses_damaged_files(tmp_path):
    model = rx.nn.RingTransformerLM(11, 8, 2, 1, hidden=8, key=jax.random.key(0))
    path = tmp_path / "model.ringeqx"
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        typed = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
        rx.nn.save_model(path, typed)
        loaded = rx.nn.load_model(path)
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(typed), strict=True):
            assert a.dtype == b.dtype == dtype
            assert bool(jnp.all(a == b))
    data = path.read_bytes()
    body = data[: data.rindex(b"sha256:")]
    damaged = {
        "half": data[: len(data) // 2],
        "magic only": data[:16],
        "end cut": data[:-10],
        # One bit of the arrays (the last bytes before the checksum): with no checksum,
        # a model with another weight.
        "one bit": body[:-40] + bytes([body[-40] ^ 1]) + data[len(body) - 39 :],
    }
    for name, bad in damaged.items():
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(ValueError, match=r"`path` '.*bad' is damaged or not a ringeqx "
                           r"model \(a file written by ringeqx.nn.save_model\)"):
            rx.nn.load_model(tmp_path / "bad")
    # Files written before the checksum load as they did.
    (tmp_path / "old").write_bytes(body)
    assert eqx.tree_equal(rx.nn.load_model(tmp_path / "old"), rx.nn.load_model(path))
