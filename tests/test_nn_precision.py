"""The layers' precision policy, the SwiGLU block and the named Llama shapes."""

import dataclasses

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
from helpers import assert_close, mesh

import ringeqx as rx
from ringeqx.tools._planner._model import LMShapes, Shapes


BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
MIXED = rx.nn.Precision.mixed()


def _dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))}


def _dot_operand_dtypes(jaxpr) -> set:
    """The operand dtypes of every matrix product in `jaxpr`, its sub-jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found |= {v.aval.dtype for v in eqn.invars}
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found |= _dot_operand_dtypes(sub)
    return found


@pytest.fixture
def _own_checks():
    """Our own checks, as a user without jaxtyping's hook meets them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@pytest.mark.usefixtures("_own_checks")
def test_precision_values_and_errors():
    p = rx.nn.Precision()
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, F32, F32)
    assert MIXED == rx.nn.Precision("float32", jnp.bfloat16, "float32")
    assert MIXED.compute_dtype == BF16
    tree = (jnp.ones(2), jnp.arange(2), "static")
    cast = MIXED.cast_to_compute(tree)
    assert cast[0].dtype == BF16 and cast[1].dtype == jnp.int32 and cast[2] == "static"
    expected = r"must be one of 'float32', 'bfloat16', 'float16' \(a name or a jnp dtype\)"
    for name, bad in (("param_dtype", "float64"), ("compute_dtype", "int32"),
                      ("output_dtype", "bf16"), ("compute_dtype", None)):
        with pytest.raises(ValueError, match=rf"`{name}` {expected}; got {bad!r}"):
            rx.nn.Precision(**{name: bad})
    key = jax.random.key(0)
    with pytest.raises(TypeError, match=r"`precision` must be a ringeqx.nn.Precision .*got str"):
        rx.nn.RingTransformerLM(11, 8, 2, 1, precision="mixed", key=key)
    with pytest.raises(TypeError, match=r"`precision` must be a ringeqx.nn.Precision"):
        rx.nn.AttentionOptions(precision="bfloat16")
    with pytest.raises(ValueError, match=r"Pass the precision once"):
        rx.nn.RingTransformerLM(
            11, 8, 2, 1, precision=MIXED,
            attention=rx.nn.AttentionOptions(precision=rx.nn.Precision()), key=key,
        )


def test_mixed_attention_is_the_hand_cast_computation():
    m = mesh(2)
    kw = dict(head_dim=6, kernel=rx.XlaKernel(4, 4), key=jax.random.key(1))
    attn = rx.nn.RingAttention(10, 3, 1, precision=MIXED, **kw)
    assert _dtypes(attn) == {F32}  # float32 master weights
    x = jax.random.normal(jax.random.key(2), (12, 10))
    out = attn(x, mesh=m)
    assert out.dtype == F32
    # The same layer, hand-cast: its weights and input in bfloat16, bfloat16 throughout.
    bf16 = rx.nn.Precision("bfloat16", "bfloat16", "bfloat16")
    hand = eqx.tree_at(lambda a: a.precision, MIXED.cast_to_compute(attn), bf16)
    np.testing.assert_array_equal(out, hand(x.astype(BF16), mesh=m).astype(F32))
    # And written out independently, against dense attention in bfloat16.
    w = {n: getattr(attn, n).weight.astype(BF16) for n in
         ("query_proj", "key_proj", "value_proj", "output_proj")}
    xb, pos = x.astype(BF16), jnp.arange(12)
    q = rx.nn.apply_rope((xb @ w["query_proj"].T).reshape(12, 3, 6), pos)
    k = rx.nn.apply_rope((xb @ w["key_proj"].T).reshape(12, 1, 6), pos)
    v = (xb @ w["value_proj"].T).reshape(12, 1, 6)
    ref = rx.reference_attention(q, k, v, mask=rx.Causal())
    ref = (ref.astype(BF16).reshape(12, -1) @ w["output_proj"].T).astype(F32)
    assert_close(out, ref, 3e-2, 3e-2)
    # Every matrix product takes bfloat16 operands (attention's too).
    jaxpr = jax.make_jaxpr(lambda a, x: a(x, mesh=m))(attn, x)
    assert _dot_operand_dtypes(jaxpr.jaxpr) == {BF16}


def _lm(**kw):
    options = rx.nn.AttentionOptions(kernel=rx.XlaKernel(4, 4))
    return rx.nn.RingTransformerLM(
        17, 12, 3, 2, num_kv_heads=1, hidden=20, attention=options, key=jax.random.key(0), **kw
    )


def test_mixed_lm_loss_and_gradients_are_float32():
    m = mesh(2)
    tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, 17)
    labels = jnp.roll(tokens, -1, axis=1)
    plain, mixed = _lm(), _lm(precision=MIXED)
    assert mixed.precision == MIXED and plain.precision == rx.nn.Precision()
    # The same float32 master weights: only the computation differs.
    for a, b in zip(*(jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (plain, mixed))):
        np.testing.assert_array_equal(a, b)

    @eqx.filter_jit
    def step(model):
        def loss(model):
            per_example = jax.vmap(lambda t, y: model.loss(t, y, mesh=m))(tokens, labels)
            return jnp.mean(per_example)

        return eqx.filter_value_and_grad(loss)(model)

    loss, grads = step(mixed)
    ref_loss, ref_grads = step(plain)
    assert loss.dtype == F32 and _dtypes(grads) == {F32}
    assert_close(loss, ref_loss, 2e-2, 0)
    g, r = (jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]) for t in (grads, ref_grads))
    assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 5e-2
    # `__call__` returns the output dtype; the matrix products run in bfloat16, the
    # head's accumulating in float32.
    logits = mixed(tokens[0], mesh=m)
    assert logits.dtype == F32
    jaxpr = jax.make_jaxpr(lambda model, t: model(t, mesh=m))(mixed, tokens[0])
    assert _dot_operand_dtypes(jaxpr.jaxpr) == {BF16}


def test_swiglu_block_is_llamas_mlp_and_trains():
    # Scanned and rematerialised, as a deep model trains: the casts happen per layer.
    model = _lm(mlp="swiglu", norm_bias=False, precision=MIXED, scan_layers=True,
                checkpoint="block")
    block = model.layers[0]
    assert isinstance(block.mlp, rx.nn.SwiGLUMLP) and block.mlp_norm.bias is None
    assert model.final_norm.bias is None
    gelu = _lm().blocks[0]
    assert isinstance(gelu.mlp, rx.nn.GeluMLP) and gelu.mlp_in is gelu.mlp.mlp_in
    with pytest.raises(AttributeError, match="this block's MLP is a SwiGLUMLP"):
        block.mlp_in
    x = jax.random.normal(jax.random.key(4), (5, 12))
    mlp = block.mlp
    want = (jax.nn.silu(x @ mlp.gate.weight.T) * (x @ mlp.up.weight.T)) @ mlp.down.weight.T
    assert_close(mlp(x), want, 1e-5, 1e-5)

    m = mesh(2)
    tokens = jax.random.randint(jax.random.key(5), (2, 10), 0, 17)
    labels = jnp.roll(tokens, -1, axis=1)
    optimiser = optax.adam(3e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = optimiser.init(params)

    @jax.jit
    def step(params, state):
        def loss(params):
            model = eqx.combine(params, static)
            return jnp.mean(jax.vmap(lambda t, y: model.loss(t, y, mesh=m))(tokens, labels))

        value, grads = jax.value_and_grad(loss)(params)
        # optax mixes Python floats with int32 step counts; our code is strict, optax not.
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimiser.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(6):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0], losses
    assert _dtypes(params) == {F32}


@pytest.mark.usefixtures("_own_checks")
def test_block_options_are_refused_clearly():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"`mlp` must be 'gelu' or 'swiglu'; got 'relu'"):
        rx.nn.RingTransformerLM(11, 8, 2, 1, mlp="relu", key=key)
    with pytest.raises(TypeError, match="norm_bias"):
        rx.nn.RingTransformerLM(11, 8, 2, 1, norm_bias="no", key=key)
    with pytest.raises(TypeError, match=r"`config` must be a ringeqx.nn.LMConfig \(e.g. "):
        rx.nn.RingTransformerLM.from_config("llama3-8b", key=key)
    with pytest.raises(ValueError, match=r"`mlp` must be 'gelu' or 'swiglu'; got 'glu'"):
        dataclasses.replace(rx.nn.LLAMA_300M, mlp="glu")
    with pytest.raises(ValueError, match=r"`num_heads` must divide `dim`"):
        dataclasses.replace(rx.nn.LLAMA_300M, num_kv_heads=3)


# Published parameter counts (Llama 3's model cards: 8.03B and 70.6B; TinyLlama: 1.1B).
PUBLISHED = [
    (rx.nn.LLAMA3_8B, 8_030_261_248),
    (rx.nn.LLAMA3_70B, 70_553_706_496),
    (rx.nn.TINYLLAMA_1B, 1_100_048_384),
    (rx.nn.LLAMA_300M, 301_507_584),
]


@pytest.mark.parametrize("config, count", PUBLISHED, ids=["8b", "70b", "1b", "300m"])
def test_named_configs_have_their_published_sizes(config, count):
    assert config.param_count() == count
    # The model built from the config (shapes only) holds exactly that many.
    model = eqx.filter_eval_shape(
        rx.nn.RingTransformerLM.from_config, config, scan_layers=True, key=jax.random.key(0)
    )
    arrays = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    assert sum(int(np.prod(a.shape)) for a in arrays) == count
    attention = model.blocks.attention
    assert attention.rope_theta == config.rope_theta
    assert attention.head_dim == config.head_dim
    # The planner counts the same parameters.
    a = config
    shapes = Shapes(1, 8, 1, a.num_heads, a.num_kv_heads, a.head_dim, 4, 8, 8)
    lm = LMShapes(shapes, a.vocab_size, a.dim, a.num_layers, a.hidden, "none",
                  mlp=a.mlp, norm_bias=a.norm_bias)
    assert lm.param_count() == count


def test_gelu_config_counts_todays_model():
    config = rx.nn.LMConfig(11, 12, 2, 3, 1, 20, mlp="gelu", norm_bias=True)
    model = rx.nn.RingTransformerLM.from_config(config, key=jax.random.key(0))
    sizes = [a.size for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    assert sum(sizes) == config.param_count()
    today = rx.nn.RingTransformerLM(11, 12, 3, 2, num_kv_heads=1, hidden=20,
                                    attention=rx.nn.AttentionOptions(rope_theta=500000.0),
                                    key=jax.random.key(0))
    assert eqx.tree_equal(model, today)
    shapes = Shapes(1, 8, 1, 3, 1, 4, 4, 8, 8)
    assert LMShapes(shapes, 11, 12, 2, 20, "none").param_count() == config.param_count()


def test_mixed_model_saves_and_prefills_in_compute_dtype(tmp_path):
    model = _lm(precision=MIXED)
    rx.nn.save_model(tmp_path / "m.eqx", model)
    loaded = rx.nn.load_model(tmp_path / "m.eqx")
    assert loaded.precision == MIXED and eqx.tree_equal(loaded, model)
    m = mesh(2)
    tokens = jax.random.randint(jax.random.key(6), (9,), 0, 17)
    # Each call one program (eager, every op of the two layers was its own compile).
    prefill, decode, forward = (eqx.filter_jit(f) for f in (model.prefill, model.decode, model))
    logits, cache = prefill(tokens, mesh=m, max_new_tokens=2)
    assert logits.dtype == F32 and cache.keys[0].dtype == BF16
    assert_close(logits, forward(tokens, mesh=m)[-1], 2e-2, 2e-2)
    logits, cache = decode(tokens[0], cache, mesh=m)
    assert logits.dtype == F32 and cache.values[1].dtype == BF16
