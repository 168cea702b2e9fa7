"""No silent wrong answers on bad input: a catalogue of misuses and the message each gives.

Each case names the misuse and matches a fragment of the message that names the argument
and what was expected. The cases run with jaxtyping's checks off (the `_own_checks`
fixture), as a user without the hook runs them: with the hook, a NumPy integer, a NumPy id
array or a 2-D slopes array is already refused by the annotations (naming the argument),
before our checks run.

Not catchable, and so documented here rather than tested:

- Values traced under `jax.jit` (a `Softcap` cap, ids computed inside the jitted function)
  cannot be checked at trace time; the checks are skipped for them, never failing.
- With `layout=`, q/k/v are in the original order unless `order='layout'` says
  otherwise; nothing is guessed from their length. An input of the layout's length in the
  other order than the one stated is indistinguishable by its shape; a different length
  is caught (and the message says when the length is the other order's).
- `check_mask` is randomised: it finds a non-conservative block rule with high
  probability on small blocks, not with certainty. With `layout=` it is exact for that
  layout (its shards and its tiles of `block` slots).
"""

import warnings

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import mesh, qkv

import ringeqx as rx
from ringeqx._util._numbers import check_int32


SEQ, HEADS, DIM = 16, 2, 8
Q, K, V = qkv(jax.random.key(0), (), SEQ, HEADS, HEADS, DIM)
MESH = mesh(2)


@pytest.fixture(autouse=True)
def _own_checks():
    """Our own checks, as a user without jaxtyping's hook sees them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


def _call(q=Q, k=K, v=V, **kw):
    kw.setdefault("mesh", MESH)
    kw.setdefault("kernel", rx.XlaKernel(8, 8))
    return rx.ring_attention(q, k, v, **kw)


# 1. Values given as arrays get the check of their Python twin; NumPy integers are ints.

INT = "must be an integer >= 1"


@pytest.mark.parametrize(
    "misuse, make, match",
    [
        ("cap 0 as an array", lambda: rx.Softcap(jnp.array(0.0)), "Softcap `cap` must be > 0"),
        ("negative NumPy cap", lambda: rx.Softcap(np.float32(-1.0)), "Softcap `cap` must be > 0"),
        ("negative Python cap", lambda: rx.Softcap(-2.0), "Softcap `cap` must be > 0"),
        ("window as an array", lambda: rx.SlidingWindow(jnp.array(0)), f"`window` {INT}"),
        ("window 0 as NumPy", lambda: rx.SlidingWindow(np.int64(0)), f"`window` {INT}"),
        ("block size 0 as NumPy", lambda: rx.XlaKernel(np.int64(0), 8), f"`block_q` {INT}"),
        ("0 shards as NumPy", lambda: rx.contiguous_layout(16, np.int64(0)), f"`num_shards` {INT}"),
        ("2-D ALiBi slopes", lambda: rx.ALiBi(jnp.ones((2, 2))), "ALiBi `slopes` must be 1-D"),
    ],
)  # fmt: skip
def test_array_values_are_checked(misuse, make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_scalar_arrays_in_static_fields_get_our_error_and_no_warning():
    # Equinox warns about an array set as a static field after the field's converter;
    # the converter turns a concrete scalar array into a Python number first.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=f"SlidingWindow `window` {INT}; got 0\\."):
            rx.SlidingWindow(jnp.array(0))
        with pytest.raises(ValueError, match=f"SlidingWindow `window` {INT}; got 2.5"):
            rx.SlidingWindow(jnp.array(2.5))
        with pytest.raises(ValueError, match=f"XlaKernel `block_kv` {INT}; got -1"):
            rx.XlaKernel(8, np.array(-1))
        window = rx.SlidingWindow(jnp.array(4)).window
        kernel = rx.XlaKernel(jnp.array(8, jnp.int32), np.array(16))
    assert [str(w.message) for w in caught] == []
    assert (window, type(window)) == (4, int)
    assert (kernel.block_q, kernel.block_kv, type(kernel.block_q)) == (8, 16, int)


def test_traced_cap_is_not_checked():
    assert jax.jit(lambda c: rx.Softcap(c).cap)(1.0) == 1.0


def test_numpy_integers_are_ints():
    assert rx.SlidingWindow(np.int64(4)).window == 4
    assert type(rx.SlidingWindow(np.int64(4)).window) is int
    kernel = rx.XlaKernel(np.int64(8), np.int32(8))
    assert (kernel.block_q, kernel.block_kv) == (8, 8)
    assert type(kernel.block_q) is int
    assert rx.contiguous_layout(np.int64(16), np.int64(2)).capacity == 8
    assert rx.Uniform().layout(np.int64(16), np.int64(2)).capacity == 8
    assert rx.BlockSparse(jnp.ones((2, 2), bool), np.int64(8)).block_size == 8
    # Every strategy, the config's counts, the kernels' tiles, the layers' sizes and the
    # planner's and generate's counts, as Python ints.
    i = np.int64
    for strategy in (rx.Zigzag(), rx.Striped(stripe=i(2)), rx.WorkBalanced(chunk=i(2))):
        lay = strategy.layout(i(16), i(2), segment_ids=jnp.zeros(16, jnp.int32))
        assert (lay.seq_len, type(lay.seq_len)) == (16, int), strategy
    config = rx.RingConfig(communication_parallelism=i(2), ring_buffer_size=np.int32(1))
    assert (config.communication_parallelism, config.ring_buffer_size) == (2, 1)
    assert type(config.communication_parallelism) is int
    assert type(rx.PallasGpuKernel(block_q=i(32), block_kv=i(32), interpret=True).block_q) is int
    assert type(rx.PallasTpuKernel(block_q=i(128), interpret=True).block_q) is int
    lm = rx.nn.RingTransformerLM(i(32), i(16), i(2), i(1), hidden=i(32), key=jax.random.key(0))
    attention = lm.blocks[0].attention
    assert (attention.num_heads, attention.head_dim, type(attention.head_dim)) == (2, 8, int)
    sizes = dict(heads=i(8), kv_heads=i(2), head_dim=i(64), max_memory_usage=i(2**30))
    assert rx.tools.plan(i(4096), i(4), **sizes).seq_len == 4096


def test_numpy_integers_under_filter_jit():
    # Modules holding NumPy integers go through eqx.filter_jit as static configuration
    # (one compile for the whole bundle); a NumPy integer passed as a jitted argument is
    # traced by Equinox, and the error says so.
    import equinox as eqx

    i = np.int64
    mask = rx.SlidingWindow(i(4))
    config = rx.RingConfig(communication_parallelism=i(2))
    kernel = rx.XlaKernel(i(8), i(8))
    layout = rx.Zigzag().layout(i(SEQ), i(2))

    @eqx.filter_jit
    def run(mask, config, kernel, layout, q):
        kw = dict(mask=mask, config=config, kernel=kernel, mesh=MESH)
        return rx.ring_attention(q, q, q, layout=layout, **kw), rx.ring_attention(q, q, q, **kw)

    out, plain = run(mask, config, kernel, layout, Q)
    ref = rx.reference_attention(Q, Q, Q, mask=mask)
    assert float(jnp.abs(out - ref).max()) < 1e-5
    assert float(jnp.abs(plain - ref).max()) < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Equinox's "array set as static", before our check
        with pytest.raises(ValueError, match=r"`window` must be .*a traced value.*filter_jit"):
            eqx.filter_jit(lambda w: rx.SlidingWindow(w))(i(4))


# 2. Ids that do not fit in int32 are refused, not wrapped.

BIG = np.array([0] * 8 + [2**40] * 8, np.int64)


@pytest.mark.parametrize(
    "misuse, call",
    [
        ("segment_ids in ring_attention", lambda: _call(mask=rx.Document(), segment_ids=BIG)),
        ("segment_ids in a strategy", lambda: rx.Zigzag().layout(16, 2, segment_ids=BIG)),
        ("span_ids in contiguous_layout", lambda: rx.contiguous_layout(16, 2, span_ids=BIG)),
        ("span_ids in ring_attention", lambda: _call(mask=rx.BidirectionalSpans(), span_ids=-BIG)),
    ],
)
def test_ids_beyond_int32(misuse, call):
    with pytest.raises(ValueError, match=r"_ids` must fit in int32"):
        call()


def test_int64_ids_that_fit_are_fine():
    check_int32("segment_ids", np.arange(16, dtype=np.int64))


# 3. A mask whose block rule is not conservative.


class _BadCausal(rx.AbstractMask):
    """Causal, but its block rule forgets the diagonal blocks."""

    def allows(self, q, k):
        return q.positions >= k.positions

    def may_attend(self, q, k):
        return q.pos_min > k.pos_max

    def max_distance(self):
        return None

    def max_lookahead(self):
        return 0

    def check(self, seq_len):
        pass


def test_check_mask_finds_a_counterexample():
    match = r"_BadCausal.may_attend is not conservative.*query block \d+ and key block \d+"
    with pytest.raises(ValueError, match=match):
        rx.check_mask(_BadCausal(), 16, samples=2)


@pytest.mark.parametrize(
    "mask",
    [
        rx.Causal(),
        rx.SlidingWindow(3),
        rx.Document() & rx.Causal(),
        rx.BidirectionalSpans() | rx.Causal(),
        rx.Full(),
        rx.Document(),
    ],
)
def test_check_mask_passes_library_masks(mask):
    rx.check_mask(mask, 16, samples=3)


class _Claims(rx.AbstractMask):
    """Causal, with the rules the ring and kernels act on given as wrong claims."""

    dense_everywhere: bool = False
    distance: int | None = None
    lookahead: int | None = 0

    def allows(self, q, k):
        return q.positions >= k.positions

    def may_attend(self, q, k):
        return q.pos_max >= k.pos_min

    def must_attend(self, q, k):
        ok = q.pos_min >= k.pos_max
        return jnp.ones_like(ok) if self.dense_everywhere else ok

    def max_distance(self):
        return self.distance

    def max_lookahead(self):
        return self.lookahead

    def check(self, seq_len):
        pass


@pytest.mark.parametrize(
    "claims, match",
    [
        # Too permissive a dense rule: the kernels would run tiles above the diagonal
        # unmasked (issue 45: 2.66 off on the XLA kernel).
        (dict(dense_everywhere=True), r"_Claims.must_attend is too permissive.*refuses "),
        (dict(distance=3), r"_Claims.max_distance\(\) is 3, but .* \(\d+ back\)"),
        (dict(lookahead=None, distance=None), None),
    ],
)
def test_check_mask_checks_every_rule_the_kernels_act_on(claims, match):
    layout = rx.Uniform().layout(16, 2)
    if match is None:
        rx.check_mask(_Claims(**claims), 16, samples=2)
        rx.check_mask(_Claims(**claims), 16, layout=layout)
        return
    with pytest.raises(ValueError, match=match):
        rx.check_mask(_Claims(**claims), 16, samples=2)
    with pytest.raises(ValueError, match=match) as error:
        rx.check_mask(_Claims(**claims), 16, layout=layout)
    assert "on this layout, for the queries of shard" in str(error.value)


def test_check_mask_checks_the_lookahead():
    class Bidirectional(_Claims):
        def allows(self, q, k):
            return q.positions >= 0

        def may_attend(self, q, k):
            return q.any_valid & k.any_valid

    with pytest.raises(ValueError, match=r"max_lookahead\(\) is 0, but .* \(\d+ ahead\)"):
        rx.check_mask(Bidirectional(), 16, samples=1)


def test_check_mask_with_given_ids():
    seg = jnp.array([0] * 5 + [1] * 11)
    rx.check_mask(rx.Document(), 16, samples=2, segment_ids=seg)


class _BlindToSmallBlocks(rx.AbstractMask):
    """Causal, but its block rule says False for blocks of at most 4 positions."""

    def allows(self, q, k):
        return q.positions >= k.positions

    def may_attend(self, q, k):
        return (q.pos_max >= k.pos_min) & (q.pos_max - q.pos_min >= 4)

    def max_distance(self):
        return None

    def max_lookahead(self):
        return None

    def check(self, seq_len):
        pass


def test_check_mask_on_an_actual_layout():
    # Debug option: the layout's own shards (the ring's blocks) and tiles inside them
    # (the kernels' blocks), with the layout's own documents; every example if batched.
    seg = jnp.array([[0] * 10 + [1] * 22, [0] * 20 + [1] * 12])
    batched = rx.Zigzag().layout(32, 4, segment_ids=seg)
    rx.check_mask(rx.Causal() & rx.Document(), 32, layout=batched)
    layout = rx.Zigzag().layout(32, 4)  # shards of two chunks of 4 positions
    match = (
        r"_BadCausal.may_attend is not conservative on this layout, for the queries of "
        r"shard \d and the keys of shard \d: it says False for the two blocks, but "
        r"`allows` lets query position \d+ attend key position \d+"
    )
    with pytest.raises(ValueError, match=match):
        rx.check_mask(_BadCausal(), 32, layout=layout)
    # Whole shards span more than 4 positions: only the tiles of 4 slots break the rule.
    tile = r"tile \d \(4 slots\) of shard \d"
    with pytest.raises(ValueError, match=f"queries of {tile} and the keys of {tile}"):
        rx.check_mask(_BlindToSmallBlocks(), 32, layout=layout, block=4)
    rx.check_mask(_BlindToSmallBlocks(), 32, layout=layout, block=8)


LAYOUT_32 = rx.Zigzag().layout(32, 4)


@pytest.mark.parametrize(
    "misuse, kw, match",
    [
        (
            "layout of another length",
            {"layout": rx.Zigzag().layout(16, 4)},
            r"`layout` was built for seq_len 16; got seq_len 32",
        ),
        (
            "ids with a layout",
            {"layout": LAYOUT_32, "segment_ids": jnp.zeros(32, jnp.int32)},
            r"Pass `segment_ids`/`span_ids` to the strategy",
        ),
        ("not a layout", {"layout": "zigzag"}, r"`layout` must be a ringeqx.Layout; got str"),
    ],
)
def test_check_mask_layout_misuse(misuse, kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        rx.check_mask(rx.Causal(), 32, **kw)


# 4. A NaN in a value row that a query never attends stays out of its output.


def test_masked_nan_value_does_not_leak():
    v = V.at[-1].set(jnp.nan)
    out = _call(v=v, mask=rx.Causal())
    # Rows before the last never see the last key, so its value does not matter to them.
    want = rx.reference_attention(Q, K, V.at[-1].set(0.0), mask=rx.Causal())
    assert bool(jnp.all(jnp.isfinite(out[:-1])))
    np.testing.assert_allclose(out[:-1], want[:-1], rtol=1e-5, atol=1e-5)


def test_masked_nan_key_and_value_do_not_leak_into_gradients():
    # The backward's 0 x NaN: dP = dO V^T and dQ = dS K read the masked last key too.
    k, v = K.at[-1].set(jnp.nan), V.at[-1].set(jnp.inf)

    def loss(q, k, v, call):
        return jnp.sum(call(q, k, v, mask=rx.Causal())[:-1] ** 2)

    got = jax.grad(loss, argnums=(0, 1, 2))(Q, k, v, _call)
    want = jax.grad(loss, argnums=(0, 1, 2))(
        Q, K.at[-1].set(0.0), V.at[-1].set(0.0), rx.reference_attention
    )
    # dK is left out: the last query does attend the NaN key, and its NaN output reaches
    # every key's dK through that row's dS (delta = 0 x NaN), as in dense autodiff.
    for g, w in ((got[0], want[0]), (got[2], want[2])):
        assert bool(jnp.all(jnp.isfinite(g[:-1])))
        np.testing.assert_allclose(g[:-1], w[:-1], rtol=1e-5, atol=1e-5)


PALLAS = [
    ("pallas_gpu", rx.PallasGpuKernel(16, 16, interpret=True)),
    (
        "pallas_tpu",
        rx.PallasTpuKernel(8, 128, interpret=True, block_kv_compute=None, backward_block_kv=None),
    ),
]


@pytest.mark.parametrize("name, kernel", PALLAS)
def test_masked_non_finite_rows_do_not_leak_in_pallas_kernels(name, kernel):
    # The Pallas kernels' tiles (16 and 128 keys) hold the masked last key beside keys
    # that every row of its shard attends: the 0 x NaN of P @ V, dP = dO V^T and dS K.
    q, k, v = qkv(jax.random.key(2), (), SEQ, HEADS, HEADS, 64)  # head_dim both can run
    bad_k, bad_v = k.at[-1].set(jnp.nan), v.at[-1].set(jnp.inf)
    ct = jnp.ones_like(q).at[-1].set(0.0)

    def out_and_grads(q, k, v, call):
        out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, mask=rx.Causal()), q, k, v)
        return out, vjp(ct)

    ring = jax.jit(lambda *a: out_and_grads(*a, lambda *b, **kw: _call(*b, kernel=kernel, **kw)))
    out, (dq, _, dv) = ring(q, bad_k, bad_v)
    zero_k, zero_v = k.at[-1].set(0.0), v.at[-1].set(0.0)
    want, (want_dq, _, want_dv) = out_and_grads(q, zero_k, zero_v, rx.reference_attention)
    assert bool(jnp.all(jnp.isnan(out[-1])))  # the last row attends the bad key: NaN
    for got, w in ((out, want), (dq, want_dq), (dv, want_dv)):
        assert bool(jnp.all(jnp.isfinite(got[:-1])))
        np.testing.assert_allclose(got[:-1], w[:-1], rtol=1e-5, atol=1e-5)


# 4b. Compressed payloads of large magnitude: scaled per block, never inf (no message:
# the answer is right). The full set of wire formats is in test_comm.py.


def test_float16_compression_of_large_values_stays_finite():
    v = V * 1e5  # past float16's largest finite value, 65504
    config = rx.RingConfig(compression_dtype=jnp.float16)
    out = _call(v=v, mask=rx.Causal(), config=config)
    want = rx.reference_attention(Q, K, v, mask=rx.Causal())
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-3 * float(jnp.max(jnp.abs(want))))


# 5. Vague errors made specific.


def _qkv(f):
    return {"q": f(Q), "k": f(K), "v": f(V)}


@pytest.mark.parametrize(
    "misuse, kw, error, match",
    [
        ("mask class", {"mask": rx.Causal}, TypeError, r"Causal\. Write `mask=ringeqx.Causal\(\)`"),
        ("string mask", {"mask": "causal"}, TypeError, r"`mask` must be a ringeqx.AbstractMask"),
        ("zero heads", _qkv(lambda x: x[:, :0]), ValueError, "`q` .* got heads = 0"),
        ("zero head_dim", _qkv(lambda x: x[..., :0]), ValueError, "`q` .* got head_dim = 0"),
        ("zero batch", _qkv(lambda x: x[None][:0]), ValueError, "`q` .* got batch = 0"),
    ],
)  # fmt: skip
def test_vague_errors(misuse, kw, error, match):
    with pytest.raises(error, match=match):
        _call(**kw)


def test_traced_scale():
    with pytest.raises(TypeError, match=r"`scale` must be a concrete Python number"):
        jax.jit(lambda s: _call(scale=s))(0.5)


def test_lists_are_converted():
    out = _call(q=Q.tolist(), k=K.tolist(), v=V.tolist())
    np.testing.assert_allclose(out, _call(), rtol=1e-6, atol=1e-6)


def test_batched_x_to_nn_ring_attention():
    attn = rx.nn.RingAttention(16, 2, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"`x` must have shape \[seq, dim=16\].*jax.vmap"):
        attn(jnp.zeros((2, SEQ, 16)), mesh=MESH)


# 6. Layout order.


def test_input_is_in_the_original_order_by_default():
    # A padded layout (capacity 8: sharded length 16, original 14): q/k/v of the
    # original length are sharded by it, and the result comes back in that order.
    mask, layout = rx.Causal(), rx.Zigzag().layout(14, 2)
    out = _call(Q[:14], K[:14], V[:14], layout=layout, mask=mask)
    want = rx.reference_attention(Q[:14], K[:14], V[:14], mask=mask)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_layout_for_another_length():
    layout = rx.Zigzag().layout(32, 2)
    match = r"With `order='original'`, q/k/v must have seq = the layout's seq_len = 32; got seq 16"
    with pytest.raises(ValueError, match=match):
        _call(layout=layout)


ZIGZAG = rx.Zigzag().layout(SEQ, 2)  # capacity 8: original and sharded length are both 16


def test_same_length_orders_are_never_guessed():
    # Original and sharded lengths are both 16: without `order=`, q/k/v are in the
    # original order (never reinterpreted as layout order because the length fits).
    mask = rx.Causal()
    default = _call(layout=ZIGZAG, mask=mask)
    np.testing.assert_allclose(
        default, rx.reference_attention(Q, K, V, mask=mask), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(default, _call(layout=ZIGZAG, order="original", mask=mask))


def test_layout_order_length_without_order_says_so():
    # 16 tokens against a layout of 14 (sharded length 16): the original order is meant
    # unless stated, so the error says how to state the other.
    match = (
        r"With `order='original'`, q/k/v must have seq = the layout's seq_len = 14; got "
        r"seq 16\. They have the layout-order length: pass `order='layout'`"
    )
    with pytest.raises(ValueError, match=match):
        _call(layout=rx.Zigzag().layout(14, 2))


_LAYOUT_14, _LAYOUT_15 = rx.Zigzag().layout(14, 2), rx.Zigzag().layout(15, 2)


@pytest.mark.parametrize(
    "misuse, kw, match",
    [
        (
            "stated layout order, original length",
            {"layout": _LAYOUT_14, "order": "layout"},
            r"With `order='layout'`, q/k/v must have seq = num_shards \* capacity = 16; "
            r"got seq 14",
        ),
        (
            "stated original order, sharded length",
            {"layout": _LAYOUT_15, "order": "original"},
            r"With `order='original'`, q/k/v must have seq = the layout's seq_len = 15; "
            r"got seq 14",
        ),
        (
            "layout order without a layout",
            {"order": "layout"},
            r"`order='layout'` needs a `layout=`",
        ),
        (
            "unknown order",
            {"layout": ZIGZAG, "order": "sharded"},
            r"`order` must be 'original' or 'layout'; got 'sharded'",
        ),
    ],
)
def test_stated_order_must_fit_the_length(misuse, kw, match):
    with pytest.raises(ValueError, match=match):
        _call(Q[:14], K[:14], V[:14], **kw)


def test_both_orders_give_the_reference():
    mask, padded = rx.Causal(), rx.Zigzag().layout(14, 2)

    @jax.jit
    def both(q, k, v):
        laid = _call(
            *(ZIGZAG.shard(x) for x in (q, k, v)), layout=ZIGZAG, order="layout", mask=mask
        )
        original = _call(q, k, v, layout=ZIGZAG, order="original", mask=mask)
        # A padded layout (14 tokens, capacity 8): sharded and unsharded inside.
        short = _call(q[:14], k[:14], v[:14], layout=padded, order="original", mask=mask)
        return ZIGZAG.unshard(laid), original, short

    want = rx.reference_attention(Q, K, V, mask=mask)
    laid, original, short = both(Q, K, V)
    np.testing.assert_allclose(laid, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(original, want, rtol=1e-5, atol=1e-5)
    want_short = rx.reference_attention(Q[:14], K[:14], V[:14], mask=mask)
    np.testing.assert_allclose(short, want_short, rtol=1e-5, atol=1e-5)
    # On Explicit mesh axes the gathers of `Layout.shard`/`unshard` must say their
    # sharding: ring_attention does that for them.
    explicit = mesh(2, explicit=True)
    call = jax.jit(lambda *a: _call(*a, layout=ZIGZAG, order="original", mask=mask, mesh=explicit))
    np.testing.assert_allclose(call(Q, K, V), want, rtol=1e-5, atol=1e-5)


# 7. Sizes, budgets and counts of the cost model and the planner.


_H100 = rx.tools.HARDWARE["h100"].gpu


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: rx.tools.RingCost(0, 8, 8, 8, 64),
            r"`RingCost seq_len` must be an integer >= 1; got 0",
        ),
        (lambda: rx.tools.RingCost(1024.5, 8, 8, 8, 64), r"`RingCost seq_len` .* got 1024.5"),
        (lambda: rx.tools.RingCost(1024, True, 8, 8, 64), r"`RingCost num_devices` .* got True"),
        (lambda: rx.tools.RingCost(1024, 8, 8, 3, 64), r"heads=8, kv_heads=3"),
        (lambda: rx.tools.RingCost(64, 8, 8, 8, 64, kv_bytes=0), r"`RingCost kv_bytes` must be a "
         r"finite number > 0; got 0"),
        (lambda: rx.tools.Hardware("x", 0, 1e9), r"`Hardware flops` must be a finite number > 0"),
        (lambda: rx.tools.Hardware("x", float("nan"), 1e9), r"`Hardware flops` .* got nan"),
        (lambda: rx.tools.Hardware("x", 1e12, -1.0), r"`Hardware bandwidth` .* got -1.0"),
        (lambda: rx.tools.Hardware("x", True, 1e9), r"`Hardware flops` .* got True"),
        (
            lambda: rx.tools.Hardware("x", 1e12, 1e9, memory=0),
            r"`Hardware memory` must be an integer",
        ),
        (lambda: rx.tools.Hardware("x", 1e12, 1e9, kind="npu"),
         r"`Hardware kind` must be 'tpu', 'gpu' or None; got 'npu'"),
        (lambda: rx.tools.Hardware("x", 1e12, 1e9, kind="tpu", gpu=_H100),
         r"`Hardware gpu` figures describe a GPU: `kind` must be 'gpu'; got 'tpu'"),
        (lambda: rx.tools.Hardware("x", 1e12, 1e9, kind="gpu", target="x100"),
         r"`Hardware target` 'x100' needs `gpu` figures exactly when `kind` is 'gpu'"),
        (lambda: rx.tools.table2(heads=0), r"`heads` must be an integer >= 1; got 0"),
        (lambda: rx.tools.table2(heads=8, kv_heads=3), r"heads=8, kv_heads=3"),
        (lambda: rx.tools.table2(kv_dtype="int8"), r"`kv_dtype` must be a floating dtype .*'int8'"),
        (lambda: rx.tools.table2(kv_dtype="bf17"), r"`kv_dtype` must be a floating dtype .*'bf17'"),
        (lambda: rx.tools.plan(64, 8, heads=8, head_dim=64, dtype="int8", max_memory_usage=2**30),
         r"`dtype` must be a floating dtype .*'int8'"),
        (lambda: rx.tools.plan(64, 8, heads=8, dim=100, num_layers=1, vocab_size=16),
         r"`dim`=100 is not a multiple of `heads`=8"),
    ],
)  # fmt: skip
def test_cost_model_sizes_are_checked(make, match):
    # Our own checks, as a user without jaxtyping's runtime hook meets them.
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(ValueError, match=match):
            make()
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def test_cost_model_takes_numpy_numbers():
    cost = rx.tools.RingCost(np.int64(1024), np.int32(8), 8, 2, 64, kv_bytes=np.float32(1.0))
    assert cost == rx.tools.RingCost(1024, 8, 8, 2, 64, kv_bytes=1.0)
    hw = rx.tools.Hardware("x", np.float64(1e12), np.int64(10**9), memory=np.int64(2**30))
    assert (hw.flops, hw.bandwidth, hw.memory) == (1e12, 10**9, 2**30)
    assert type(hw.memory) is int
