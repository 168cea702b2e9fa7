"""Contract tests of the per-device kernels, their selection and their tuning.

Every kernel in `helpers.KERNELS` (the Pallas ones in the interpreter) must give the
`out`, `lse` and gradients of dense attention and of `XlaKernel`, for every mask and
score modifier, GQA and not, head_dim 64 and 128, float32 and bfloat16, and lengths
that are not multiples of its tiles; and it must run inside the ring.
"""

import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ALL_MASKS,
    KERNELS,
    SCORE_MODS,
    assert_close,
    mesh,
    packed_segments,
    qkv,
    span_ids,
)
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jaxtyping import Array, Bool, Float, Int

import ringeqx as rx
from ringeqx._kernels._pallas import _tables as tables, _tiles as tiles
from ringeqx._kernels._select import default_kernel, resolve_device_type


XLA = rx.XlaKernel(block_q=8, block_kv=4)
KERNEL_IDS = [name for name, _ in KERNELS]
PALLAS = [k for _, k in KERNELS[1:]]
SEQ = 43  # As in test_ring.py, so that masks sized for a sequence (BlockSparse) fit.
# Compiling dominates these tests (the interpreted kernels are small programs with big
# loops); XLA's backend optimisations only slow that down. Each test also compiles all
# its cases as one program, which compiles much faster than one program per case.
COMPILE = {"xla_backend_optimization_level": 0}


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile(COMPILE)(*args)


def _records(batch: int, length: int, offset: int = 0) -> rx.TokenInfo:
    """Records `[batch, length]` at positions `offset, offset + 1, ...`; documents and
    spans differ per example (a mixed-up batch axis fails)."""
    total = offset + length
    seg = jnp.stack(
        [packed_segments(total, lens)[offset:] for lens in ([5, 11, 7], [9, 4, 13])]
    )[:batch]
    span = span_ids(total)[offset:]
    span = jnp.stack([span, jnp.roll(span, 4)])[:batch]
    pos = jnp.broadcast_to(
        offset + jnp.arange(length, dtype=jnp.int32), (batch, length)
    )
    return rx.TokenInfo(pos, seg, span, pos >= 0)


def _heads_major(x):
    return jnp.swapaxes(x, -2, -3)


class Case(eqx.Module):
    """One block of heads-major attention, with the cotangent of its output."""

    q: Array
    k: Array
    v: Array
    q_info: rx.TokenInfo
    kv_info: rx.TokenInfo
    mask: rx.AbstractMask
    score_mod: rx.AbstractScoreMod | None
    d_out: Array


def _run_one(kernel, c: Case):
    """Forward and backward of one block, as the ring drives them (a single block: its
    lse is the global lse)."""
    scale = 1.0 / math.sqrt(c.q.shape[-1])
    args = (c.q_info, c.kv_info, rx.Scores(c.mask, c.score_mod, scale))
    out, lse = kernel.forward(c.q, c.k, c.v, *args)
    delta = jnp.sum(c.d_out.astype(jnp.float32) * out, axis=-1)
    grads = kernel.backward(c.q, c.k, c.v, lse, delta, c.d_out, *args)
    return out, lse, grads


def _run(kernel, cases: list[Case]):
    return _compiled(lambda cases: [_run_one(kernel, c) for c in cases], cases)


def _dense(c: Case):
    """Float32 dense `(out, lse, (dq, dk, dv))` of a heads-major case."""
    g = c.q.shape[1] // c.k.shape[1]
    qi = jax.tree.map(lambda x: x[:, None, :, None], c.q_info)
    ki = jax.tree.map(lambda x: x[:, None, None, :], c.kv_info)
    ok = c.mask.allows(qi, ki) & qi.valid & ki.valid

    def attend(q, k, v):
        k, v = (jnp.repeat(x, g, axis=1) for x in (k, v))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        if c.score_mod is not None:
            s = c.score_mod(s, qi, ki)
        s = jnp.where(ok, s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isinf(lse), 0, lse)[..., None]), 0)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v), lse

    f32 = [x.astype(jnp.float32) for x in (c.q, c.k, c.v)]
    (out, lse), vjp = jax.vjp(attend, *f32)
    return out, lse, vjp((c.d_out.astype(jnp.float32), jnp.zeros_like(lse)))


def _close(what, got, want, tol):
    try:
        assert_close(got, want, tol, tol)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _lse_close(what, got, want, tol):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(
        np.isinf(got), np.isinf(want), err_msg=f"{what}: -inf rows"
    )
    _close(
        what, np.where(np.isinf(got), 0, got), np.where(np.isinf(want), 0, want), tol
    )


def _check(name, result, want, tol, kernel_name="kernel"):
    out, lse, grads = result
    w_out, w_lse, w_grads = want
    assert out.dtype == lse.dtype == jnp.float32, name
    assert not any(np.isnan(np.asarray(x)).any() for x in (out, lse, *grads)), name
    _close(f"{name}: out vs {kernel_name}", out, w_out, tol)
    _lse_close(f"{name}: lse vs {kernel_name}", lse, w_lse, tol)
    for label, g, w in zip(("dq", "dk", "dv"), grads, w_grads):
        assert g.dtype == jnp.float32 and g.shape == w.shape, (name, label)
        _close(f"{name}: {label} vs {kernel_name}", g, w, 2 * tol)


_CACHE = {}


def _cached(key: str, compute):
    """A reference answer, computed once per list of cases (shared by the kernels)."""
    if key not in _CACHE:
        _CACHE[key] = compute()
    return _CACHE[key]


def _square_cases(pairs, heads, kv_heads, head_dim=64, dtype=jnp.float32):
    q, k, v = qkv(jax.random.key(heads), (2,), SEQ, heads, kv_heads, head_dim, dtype)
    d_out = jax.random.normal(jax.random.key(7), q.shape, jnp.float32).astype(dtype)
    info = _records(2, SEQ)
    hq, hk, hv, hdo = (_heads_major(x) for x in (q, k, v, d_out))
    return [Case(hq, hk, hv, info, info, mask, mod, hdo) for mask, mod in pairs]


def _reference(c: Case):
    """`reference_attention`'s out and gradients (heads-major) and the dense lse of a
    case whose queries and keys are one sequence."""
    q, k, v, d_out = (_heads_major(x) for x in (c.q, c.k, c.v, c.d_out))

    def attend(q, k, v):
        return rx.reference_attention(
            q,
            k,
            v,
            mask=c.mask,
            segment_ids=c.q_info.segments,
            span_ids=c.q_info.spans,
            score_mod=c.score_mod,
        )

    out, vjp = jax.vjp(attend, q, k, v)
    grads = tuple(_heads_major(g) for g in vjp(d_out))
    return _heads_major(out), _dense(c)[1], grads


def _check_square(kernel, key, names, pairs, heads, kv_heads):
    """Every (mask, modifier) pair against `reference_attention`, a dense lse and
    XlaKernel, on SEQ x SEQ tokens of 2 examples, in float32."""
    cases = _square_cases(pairs, heads, kv_heads)
    results = _run(kernel, cases)
    refs = _cached(
        f"{key}-reference",
        lambda: _compiled(lambda cs: list(map(_reference, cs)), cases),
    )
    xla = results if kernel is XLA else _cached(f"{key}-xla", lambda: _run(XLA, cases))
    for name, res, ref, x in zip(names, results, refs, xla):
        _check(name, res, ref, 2e-5, "reference")
        if kernel is not XLA:
            _check(name, res, x, 2e-5, "XlaKernel")


@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=KERNEL_IDS)
def test_masks(kernel):
    # Every mask; GQA 4:1 with two kv heads (so the kv head of a query head matters).
    names = [name for name, _ in ALL_MASKS]
    pairs = [(factory(SEQ), None) for _, factory in ALL_MASKS]
    _check_square(kernel, "masks", names, pairs, heads=8, kv_heads=2)


@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=KERNEL_IDS)
def test_score_mods(kernel):
    # Every modifier under a causal document mask; GQA 1:1.
    names = [name for name, _ in SCORE_MODS]
    pairs = [(rx.Causal() & rx.Document(), factory(3)) for _, factory in SCORE_MODS]
    _check_square(kernel, "score_mods", names, pairs, heads=3, kv_heads=3)


CONFIGS = [
    # (heads, kv_heads, head_dim, dtype, tolerance)
    (3, 3, 128, jnp.float32, 2e-5),
    (8, 2, 128, jnp.bfloat16, 2e-2),
    (3, 3, 64, jnp.bfloat16, 2e-2),
]


def _config_cases():
    # 37 queries at positions 163..199 against 200 keys: several key tiles of every
    # kernel (Mosaic's are 128 wide), none of the lengths a multiple of a tile.
    q_len, kv_len = 37, 200
    q_info, kv_info = _records(2, q_len, kv_len - q_len), _records(2, kv_len)
    mask = rx.Causal() & rx.Document()
    cases = []
    for heads, kv_heads, head_dim, dtype, _ in CONFIGS:
        kq, kk, kv, kd = jax.random.split(jax.random.key(head_dim + heads), 4)
        q = jax.random.normal(kq, (2, heads, q_len, head_dim), dtype)
        k = jax.random.normal(kk, (2, kv_heads, kv_len, head_dim), dtype)
        v = jax.random.normal(kv, (2, kv_heads, kv_len, head_dim), dtype)
        d_out = jax.random.normal(kd, q.shape, dtype)
        cases.append(Case(q, k, v, q_info, kv_info, mask, None, d_out))
    return cases


@pytest.mark.parametrize("kernel", PALLAS, ids=KERNEL_IDS[1:])
def test_shapes_and_dtypes(kernel):
    # GQA 4:1 and 1:1, head_dim 64 and 128, float32 and bfloat16.
    cases = _config_cases()
    results = _run(kernel, cases)
    xla = _cached("configs-xla", lambda: _run(XLA, cases))
    dense = _cached(
        "configs-dense", lambda: _compiled(lambda cs: list(map(_dense, cs)), cases)
    )
    for config, res, x, d in zip(CONFIGS, results, xla, dense):
        tol = config[-1]
        _check(str(config), res, x, tol, "XlaKernel")
        # bfloat16 inputs: near the float32 dense answer too.
        _check(str(config), res, d, 4 * tol, "dense float32")


@pytest.mark.parametrize("kernel", PALLAS, ids=KERNEL_IDS[1:])
def test_in_ring(kernel):
    # 4 fake devices, 70 tokens (capacity 18 per device, padded), GQA 4:1.
    q, k, v = qkv(jax.random.key(3), (2,), 70, 8, 2, 64)
    ct = jax.random.normal(jax.random.key(4), q.shape)
    kw = dict(
        mask=rx.Causal() & rx.Document(), segment_ids=packed_segments(70, [13, 30, 9])
    )

    def grads(attend):
        def f(q, k, v, ct):
            out, vjp = jax.vjp(attend, q, k, v)
            return out, vjp(ct)

        return f

    def ring(*a):
        return rx.ring_attention(*a, mesh=mesh(4), kernel=kernel, **kw)

    out, grads_ = _compiled(grads(ring), q, k, v, ct)
    ref, ref_grads = _cached(
        "ring-reference",
        lambda: _compiled(
            grads(lambda *a: rx.reference_attention(*a, **kw)), q, k, v, ct
        ),
    )
    assert_close(out, ref, 2e-5, 2e-5)
    for g, r in zip(grads_, ref_grads):
        assert_close(g, r, 2e-5, 2e-5)


class _NeverBlocks(rx.AbstractMask):
    """Allows every pair but claims that no pair of blocks attends: a kernel that
    honours the block rule skips every tile and returns empty rows."""

    def allows(self, q: rx.TokenInfo, k: rx.TokenInfo) -> Bool[Array, "..."]:
        return jnp.ones(
            jnp.broadcast_shapes(q.positions.shape, k.positions.shape), bool
        )

    def may_attend(
        self, q: rx.BlockSummary, k: rx.BlockSummary
    ) -> Bool[Array, "*blocks"]:
        return jnp.zeros(jnp.broadcast_shapes(q.pos_min.shape, k.pos_min.shape), bool)

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


class _FirstKeysOnly(rx.AbstractMask):
    """Allows every pair but claims that only blocks holding key position 0 attend:
    keys in later tiles must be skipped (whole tiles, not pairs)."""

    def allows(self, q: rx.TokenInfo, k: rx.TokenInfo) -> Bool[Array, "..."]:
        return jnp.ones(
            jnp.broadcast_shapes(q.positions.shape, k.positions.shape), bool
        )

    def may_attend(
        self, q: rx.BlockSummary, k: rx.BlockSummary
    ) -> Bool[Array, "*blocks"]:
        return k.pos_min == 0

    def max_distance(self) -> int | None:
        return None

    def max_lookahead(self) -> int | None:
        return None

    def check(self, seq_len: int) -> None:
        pass


@pytest.mark.parametrize("kernel", [k for _, k in KERNELS], ids=KERNEL_IDS)
def test_skips_tiles(kernel):
    hq, hk, hv = (_heads_major(x) for x in qkv(jax.random.key(5), (1,), 150, 4, 2, 64))
    info = _records(1, 150)
    cases = [
        Case(hq, hk, hv, info, info, _NeverBlocks(), None, hq),
        Case(hq, hk, hv, info, info, _FirstKeysOnly(), None, hq),
    ]
    (out, lse, grads), (first_out, first_lse, _) = _run(kernel, cases)
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)
    assert not any(np.any(np.asarray(g)) for g in grads)
    # Only the first key tile runs: the answer is attention over its keys alone.
    n = kernel.block_kv
    cut = jax.tree.map(lambda x: x[:, :n], info)
    want = _dense(Case(hq, hk[:, :, :n], hv[:, :, :n], info, cut, rx.Full(), None, hq))
    _close("out", first_out, want[0], 2e-5)
    _lse_close("lse", first_lse, want[1], 2e-5)


def test_tile_table_marks_dense_tiles():
    # The Pallas kernels' tile table: 0 skipped, 1 masked, 2 dense (every pair attends:
    # the TPU kernel leaves the elementwise mask out). 30 tokens in 4 tiles of 8, the
    # last tile padded.
    info = tiles.pad_info(_records(2, 30), 32)

    def table(mask, block=8):
        return np.asarray(tables.tile_mask(mask, info, info, 32, block, 32, block)[0][..., 0])

    # Causal: below the diagonal dense unless padded, on it masked, above it skipped.
    causal = np.array([[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(table(rx.Causal()), [causal, causal])
    np.testing.assert_array_equal(table(rx.Full())[0], [[2, 2, 2, 1]] * 3 + [[1] * 4])
    # Packed documents, tiles of 4: a tile pair is dense exactly where its every pair
    # of tokens attends, and runs wherever one pair does.
    mask = rx.Causal() & rx.Document()
    got = table(mask, 4)
    q = jax.tree.map(lambda x: x[:, :, None], info)
    k = jax.tree.map(lambda x: x[:, None, :], info)
    pairs = np.asarray(mask.allows(q, k) & q.valid & k.valid).reshape(2, 8, 4, 8, 4)
    np.testing.assert_array_equal(got == 2, pairs.all(axis=(2, 4)))
    assert np.all(got[pairs.any(axis=(2, 4))] != 0)
    assert (got == 2).any() and (got == 1).any()


@pytest.mark.parametrize("kernel", PALLAS, ids=KERNEL_IDS[1:])
def test_array_leaves_are_inputs_not_constants(kernel):
    # A mask leaf (PrefixLM's prefix length) and a modifier leaf (ALiBi's slopes) reach
    # the Pallas kernels as inputs: new values give new answers without a retrace.
    q, k, v = qkv(jax.random.key(6), (1,), 40, 4, 1, 64)
    hq, hk, hv = (_heads_major(x) for x in (q, k, v))
    info = _records(1, 40)

    @jax.jit(compiler_options=COMPILE)
    @eqx.debug.assert_max_traces(max_traces=1)
    def run(mask, score_mod):
        return kernel.forward(hq, hk, hv, info, info, rx.Scores(mask, score_mod, 0.125))

    @jax.jit(compiler_options=COMPILE)
    def reference(mask, score_mod):
        return rx.reference_attention(q, k, v, mask=mask, score_mod=score_mod)

    outs = []
    for n, slope in ((5, 0.5), (29, 0.25)):
        mask = rx.PrefixLM(jnp.asarray(n, jnp.int32))
        mod = rx.ALiBi(jnp.linspace(slope, 2 * slope, 4))
        out, _ = run(mask, mod)
        assert_close(_heads_major(out), reference(mask, mod), 2e-5, 2e-5)
        outs.append(out)
    assert not np.allclose(outs[0], outs[1])


# ----------------------------------------------------------------------------------
# Selection


def test_auto_on_cpu_is_xla():
    assert jax.default_backend() == "cpu"
    for device_type in ("auto", "cpu"):
        kernel = rx.select_kernel("auto", device_type)
        assert kernel == rx.XlaKernel(block_q=256, block_kv=256)
    assert rx.select_kernel("xla") == rx.XlaKernel(block_q=256, block_kv=256)


def test_interpret_selects_pallas_anywhere():
    # PallasGpuKernel's tiles default to its tuned table (None), chosen per call.
    assert rx.select_kernel("auto", "gpu", interpret=True) == rx.PallasGpuKernel(
        interpret=True
    )
    assert rx.select_kernel("auto", "tpu", interpret=True) == rx.PallasTpuKernel(
        block_q=1024,
        block_kv=4096,
        block_kv_compute=1024,
        backward_block_kv=2048,
        backward_block_kv_compute=512,
        interpret=True,
    )
    assert rx.select_kernel("pallas_gpu", interpret=True) == rx.PallasGpuKernel(
        interpret=True
    )
    assert rx.select_kernel("xla", "tpu", interpret=True) == rx.XlaKernel(
        block_q=512, block_kv=1024
    )
    obj = rx.PallasTpuKernel(interpret=True)
    assert rx.select_kernel(obj) is obj


def _abstract_mesh(platform, kind):
    device = AbstractDevice(device_kind=kind, num_cores=1, platform=platform)
    return AbstractMesh((8,), ("sequence",), abstract_device=device)


@pytest.mark.parametrize(
    "platform, kind, expected",
    [
        ("tpu", "TPU v5", rx.PallasTpuKernel()),
        ("gpu", "NVIDIA H100 80GB HBM3", rx.PallasGpuKernel()),
        ("cuda", "NVIDIA A100-SXM4-80GB", rx.PallasGpuKernel()),
        ("cpu", "cpu", rx.XlaKernel(block_q=256, block_kv=256)),
    ],
)
def test_auto_follows_the_mesh_not_the_default_backend(platform, kind, expected):
    # The process's backend is the CPU; the mesh's devices decide.
    assert jax.default_backend() == "cpu"
    m = _abstract_mesh(platform, kind)
    assert rx.select_kernel("auto", mesh=m) == expected
    assert rx.select_kernel("auto", "auto", mesh=m) == expected
    with use_abstract_mesh(m):  # the mesh set for the program
        assert rx.select_kernel("auto") == expected
    if platform != "cpu":
        name = "gpu" if platform in ("gpu", "cuda") else "tpu"
        assert rx.select_kernel("auto", name, mesh=m) == expected
        assert rx.select_kernel(f"pallas_{name}", mesh=m) == expected
        other = {"gpu": "tpu", "tpu": "gpu"}[name]
        with pytest.raises(ValueError, match=f"device_type='{other}' but the mesh's "
                           f"devices are {name} devices"):
            rx.select_kernel("auto", other, mesh=m)
        with pytest.raises(ValueError, match=f"kernel='pallas_{other}' needs"):
            rx.select_kernel(f"pallas_{other}", mesh=m)


def test_auto_follows_the_mesh_in_the_ring_and_the_layer():
    # Traced for a TPU mesh on this CPU machine: the default kernel is Mosaic's.
    m = _abstract_mesh("tpu", "TPU v5 lite")
    q = jax.ShapeDtypeStruct((1, 8 * 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8 * 128, 1, 64), jnp.bfloat16)

    def loss(q, k, v):
        return rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m).astype(jnp.float32).sum()

    with use_abstract_mesh(m):
        program = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))
    for part in ("forward", "backward"):
        assert f"ringeqx_tpu_flash_{part}" in program
    layer = rx.nn.RingAttention(64, 4, 1, head_dim=64, key=jax.random.key(0))
    assert layer.kernel == "auto"  # resolved per call, from the mesh
    x = jax.ShapeDtypeStruct((8 * 128, 64), jnp.float32)
    with use_abstract_mesh(m):
        program = str(jax.make_jaxpr(lambda x: layer(x, mesh=m))(x))
    assert "ringeqx_tpu_flash_forward" in program
    # A name is still checked at construction (under the jaxtyping hook, its Literal
    # annotation refuses it first).
    with pytest.raises((TypeError, ValueError), match="kernel"):
        rx.nn.RingAttention(64, 4, 1, kernel="flash", key=jax.random.key(0))


@pytest.mark.parametrize("device_type", ["gpu", "tpu"])
def test_missing_device_is_an_error(device_type):
    with pytest.raises(ValueError, match=f"device_type='{device_type}' but JAX has no"):
        rx.select_kernel("auto", device_type)
    q, k, v = qkv(jax.random.key(0), (), 8, 2, 2, 64)
    with pytest.raises(
        ValueError, match=f"device_type='{device_type}' but the mesh's devices are cpu"
    ):
        rx.ring_attention(q, k, v, mesh=mesh(1), device_type=device_type)


def test_pallas_away_from_its_device_is_an_error():
    with pytest.raises(ValueError, match="kernel='pallas_gpu' needs device_type='gpu'"):
        rx.select_kernel("pallas_gpu")
    with pytest.raises(ValueError, match="kernel='pallas_tpu' needs device_type='tpu'"):
        rx.select_kernel("pallas_tpu", "cpu")
    with pytest.raises(ValueError, match="PallasGpuKernel runs on device_type gpu,"):
        rx.select_kernel(rx.PallasGpuKernel(), "cpu")
    with pytest.raises(ValueError, match="PallasTpuKernel runs on device_type tpu,"):
        rx.select_kernel(rx.PallasTpuKernel(), "cpu")
    # With "auto" the platform is the one lowered for: checked when lowering (below,
    # and tests/test_lowering.py lowers these same objects for cuda and tpu).
    obj = rx.PallasGpuKernel()
    assert rx.select_kernel(obj) is obj


def test_devices():
    for kernel in (rx.XlaKernel(), *(k(interpret=True) for k in (rx.PallasGpuKernel,
                                                               rx.PallasTpuKernel))):
        assert kernel.devices() == {"cpu", "gpu", "tpu"}
    assert rx.PallasGpuKernel().devices() == {"gpu"}
    assert rx.PallasTpuKernel().devices() == {"tpu"}


def test_unknown_names_are_errors(monkeypatch):
    # Under the jaxtyping hook the Literal annotations reject them first.
    with pytest.raises((TypeError, ValueError), match="kernel"):
        rx.select_kernel("flash")
    with pytest.raises(
        ValueError, match="`kernel` must be 'auto', 'xla', 'pallas_gpu'"
    ):
        inspect.unwrap(rx.select_kernel)("flash")
    with pytest.raises(ValueError, match="`device_type` must be 'auto', 'cpu', 'gpu'"):
        inspect.unwrap(resolve_device_type)("npu")
    monkeypatch.setattr(jax, "default_backend", lambda: "metal")
    with pytest.raises(ValueError, match="found JAX backend 'metal'"):
        rx.select_kernel("auto")


@pytest.mark.parametrize("device_type", ["gpu", "tpu"])
def test_ring_device_type_interpret(device_type):
    # `device_type` reaches the ring: its Pallas kernel is what runs (traced, not run;
    # test_in_ring runs both kernels in the ring).
    q, k, v = qkv(jax.random.key(1), (), 20, 2, 1, 64)

    def ring(q, k, v):
        return rx.ring_attention(
            q, k, v, mesh=mesh(1), device_type=device_type, interpret=True
        )

    program = str(jax.make_jaxpr(jax.grad(lambda *a: ring(*a).sum()))(q, k, v))
    parts = {"tpu": ("forward", "backward"), "gpu": ("forward", "backward_dq", "backward_dkv")}
    for part in parts[device_type]:
        assert f"ringeqx_{device_type}_flash_{part}" in program
    other = {"gpu": "tpu", "tpu": "gpu"}[device_type]
    assert f"ringeqx_{other}_flash" not in program


def _block(kernel, q, k, v):
    info = _records(q.shape[0], q.shape[2])
    return kernel.forward(q, k, v, info, info, rx.Scores(rx.Full(), None, 1.0))


def test_unsupported_head_dim_and_dtype():
    gpu = rx.PallasGpuKernel(interpret=True)
    tpu = rx.PallasTpuKernel(interpret=True)
    x = jnp.zeros((1, 2, 8, 5))
    with pytest.raises(
        ValueError, match=r"head_dim=5 is not supported by PallasGpuKernel"
    ):
        _block(gpu, x, x, x)
    x = jnp.zeros((1, 2, 8, 96))
    with pytest.raises(
        ValueError, match=r"head_dim=96 is not supported by PallasTpuKernel"
    ):
        _block(tpu, x, x, x)
    x = jnp.zeros((1, 2, 8, 64), jnp.float16)
    with pytest.raises(
        TypeError, match="PallasTpuKernel does not support dtype float16"
    ):
        _block(tpu, x, x, x)
    x = jnp.zeros((1, 2, 8, 64), jnp.float8_e4m3fn)
    with pytest.raises(
        TypeError, match="PallasGpuKernel does not support dtype float8_e4m3fn"
    ):
        info = _records(1, 8)
        lse = x[..., 0].astype(jnp.float32)
        gpu.backward(x, x, x, lse, lse, x, info, info, rx.Scores(rx.Full(), None, 1.0))
    y = jnp.zeros((1, 2, 8, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="needs q, k and v of one dtype"):
        _block(gpu, y, y.astype(jnp.float32), y)


def test_compiled_pallas_without_its_device_is_an_error():
    # Raised when the program is lowered for this machine's CPU: eagerly, under jit,
    # and through the ring with device_type="auto".
    x = jnp.zeros((1, 2, 8, 64))
    gpu = r"PallasGpuKernel\(interpret=False\) .* needs a GPU.*platform 'cpu'"
    tpu = r"PallasTpuKernel\(interpret=False\) .* needs a TPU.*platform 'cpu'"
    with pytest.raises(ValueError, match=gpu):
        _block(rx.PallasGpuKernel(), x, x, x)
    with pytest.raises(ValueError, match=tpu):
        jax.jit(lambda x: _block(rx.PallasTpuKernel(), x, x, x))(x)
    # Through the ring, the mesh's devices say the platform: refused before tracing.
    q, k, v = qkv(jax.random.key(0), (), 8, 2, 2, 64)
    with pytest.raises(ValueError, match="PallasGpuKernel runs on device_type gpu, not on "
                       "the mesh's cpu devices"):
        rx.ring_attention(q, k, v, mesh=mesh(1), kernel=rx.PallasGpuKernel())


def test_tile_sizes_are_checked():
    with pytest.raises(
        ValueError, match="PallasGpuKernel `block_q` must be a power of two"
    ):
        rx.PallasGpuKernel(block_q=24)
    with pytest.raises(
        ValueError, match="PallasGpuKernel `block_kv` must be a power of two"
    ):
        rx.PallasGpuKernel(block_kv=8)
    with pytest.raises(
        ValueError, match="PallasTpuKernel `block_q` must be a positive multiple of 8"
    ):
        rx.PallasTpuKernel(block_q=12)
    with pytest.raises(
        ValueError,
        match="PallasTpuKernel `block_kv` must be a positive multiple of 128",
    ):
        rx.PallasTpuKernel(block_kv=64)


class _PerHeadBias(rx.AbstractScoreMod):
    """A modifier with per-head parameters that wrongly ignores `for_head`."""

    bias: Float[Array, " heads"]

    def __call__(self, scores, q, k):
        return scores + self.bias.reshape(1, -1, 1, 1)

    def for_head(self, head: Int[Array, ""]) -> "_PerHeadBias":
        return self

    def check(self, heads: int) -> None:
        pass


def test_score_mod_must_select_its_head():
    x = jnp.zeros((1, 3, 16, 64))
    info = _records(1, 16)
    with pytest.raises(
        ValueError, match=r"_PerHeadBias.for_head\(h\) must give scores"
    ):
        rx.PallasGpuKernel(interpret=True).forward(
            x, x, x, info, info, rx.Scores(rx.Full(), _PerHeadBias(jnp.arange(3.0)), 1.0)
        )


# ----------------------------------------------------------------------------------
# Tuning


def test_tune_block_sizes():
    candidates = [(8, 8), (16, 16)]
    best, timings = rx.tune_block_sizes(
        rx.XlaKernel(),
        heads=2,
        kv_heads=1,
        q_len=24,
        kv_len=40,
        head_dim=8,
        dtype=jnp.float32,
        mask=rx.Causal(),
        candidates=candidates,
        repeats=2,
    )
    assert set(timings) == set(candidates)
    assert all(t > 0 for t in timings.values())
    assert isinstance(best, rx.XlaKernel)
    assert (best.block_q, best.block_kv) in candidates
    assert timings[best.block_q, best.block_kv] == min(timings.values())


class _Delegate(rx.AbstractAttentionKernel):
    """A user kernel without tiles: not a kernel (`block_q`/`block_kv` are abstract)."""

    inner: rx.XlaKernel

    def devices(self):
        return self.inner.devices()

    def forward(self, *args):
        return self.inner.forward(*args)

    def backward(self, *args):
        return self.inner.backward(*args)

    def runtime_check(self, *args, backward):
        return self.inner.runtime_check(*args, backward=backward)

    def tile_candidates(self) -> list[tuple[int, int]]:
        return [(8, 8)]

    def tiles(self, dtype, head_dim):
        return self.inner.tiles(dtype, head_dim)


class _DelegateTiles(rx.AbstractAttentionKernel):
    """A user kernel with its own candidates and no `tiles` method (the base class
    reads its fields)."""

    block_q: int = eqx.field(static=True, default=8)
    block_kv: int = eqx.field(static=True, default=8)

    def devices(self):
        return frozenset({"cpu"})

    def forward(self, *args):
        return rx.XlaKernel(self.block_q, self.block_kv).forward(*args)

    def backward(self, *args):
        return rx.XlaKernel(self.block_q, self.block_kv).backward(*args)

    def tile_candidates(self) -> list[tuple[int, int]]:
        return [(4, 8), (8, 4)]


def test_user_kernel_tiles():
    with pytest.raises(TypeError, match="block_kv.*block_q|block_q.*block_kv"):
        _Delegate(rx.XlaKernel())
    kw = dict(heads=1, q_len=8, head_dim=8, dtype=jnp.float32, backward=False, repeats=1)
    best, timings = rx.tune_block_sizes(_DelegateTiles(), **kw)
    assert set(timings) == {(4, 8), (8, 4)}
    assert isinstance(best, _DelegateTiles) and (best.block_q, best.block_kv) in timings
    # The defaults of the package's kernels are theirs too.
    assert (512, 1024) in rx.PallasTpuKernel().tile_candidates()
    gpu = rx.PallasGpuKernel()
    for kind in ("forward", "dq", "dkv"):
        for dtype, head_dim in ((jnp.bfloat16, 64), (jnp.float16, 256), (jnp.float32, 128)):
            assert gpu.launch(kind, dtype, head_dim)[:2] in gpu.tile_candidates()
    # A field that is set is used; the others come from the table.
    assert rx.PallasGpuKernel(block_kv=128).launch("dkv", jnp.bfloat16, 128) == (
        32, 128, 8, 2
    )
    assert (256, 256) in rx.XlaKernel().tile_candidates()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kernels_say_their_own_tiles(dtype, head_dim):
    # Asked of the kernel (issue 44): the fields where the kernel has them, else its table;
    # by name, each device's defaults.
    by_name = {
        d: rx.select_kernel("xla", d, interpret=True).tiles(dtype, head_dim)
        for d in ("cpu", "gpu", "tpu")
    }
    assert by_name == {"cpu": (256, 256), "gpu": (512, 1024), "tpu": (512, 1024)}
    assert rx.XlaKernel(8, 16).tiles(dtype, head_dim) == (8, 16)
    assert rx.PallasTpuKernel().tiles(dtype, head_dim) == (1024, 4096)
    gpu = rx.PallasGpuKernel()
    assert gpu.tiles(dtype, head_dim) == gpu.launch("forward", dtype, head_dim)[:2]
    assert rx.PallasGpuKernel(block_kv=128).tiles(dtype, head_dim)[1] == 128
    assert _DelegateTiles().tiles(dtype, head_dim) == (8, 8)
    # What the planner asks about a device it does not have: the "auto" kernel's.
    assert isinstance(default_kernel("tpu"), rx.PallasTpuKernel)
    assert default_kernel("cpu").tiles(dtype, head_dim) == (256, 256)
    assert rx.XlaKernel().unsupported_head_dim(head_dim) is None
    assert rx.XlaKernel().unsupported_dtype("float16") is None


def test_tune_block_sizes_errors():
    kw = dict(heads=1, q_len=8, head_dim=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="`repeats` must be an integer >= 1"):
        rx.tune_block_sizes(rx.XlaKernel(), repeats=0, **kw)
    with pytest.raises(ValueError, match="`candidates` must hold at least one"):
        rx.tune_block_sizes(rx.XlaKernel(), candidates=[], **kw)
    with pytest.raises(ValueError, match="PallasTpuKernel `block_kv` must be"):
        rx.tune_block_sizes(
            rx.PallasTpuKernel(interpret=True), candidates=[(8, 100)], **kw
        )


def test_tpu_kernel_splits_queries_when_its_tables_overflow_smem(monkeypatch):
    # Mosaic prefetches a call's tile tables into SMEM (1 MiB), and they grow with
    # query tiles x key tiles: a long shard runs as several calls over equal chunks of
    # query tiles (libtpu refused 256K tokens a chip in one call). Shrunk here to a few
    # bytes, so that these small cases split: every mask, several key tiles, GQA and
    # bfloat16, and the ring, against the same references as one call.
    from ringeqx._kernels._mosaic import _calls
    from ringeqx._kernels._pallas import _common

    kernel = dict(KERNELS)["pallas_tpu"]
    t = _common.Tiling(2, 8, 2, 64, SEQ, SEQ, 16, 128)  # 3 query tiles, 1 key

    def split(stride):
        s = _calls.QuerySplit.of(t, stride)
        return s.calls, s.rows

    # Block-sparse masks carry 7 per-tile operands (stride 8): 72 bytes a row of tiles,
    # one row a call. The other masks (stride 1, 16 bytes a row) stay in one call here.
    monkeypatch.setattr(_calls, "_TABLE_SMEM", 72)
    assert [split(1), split(8)] == [(1, 3), (3, 1)]
    names = [name for name, _ in ALL_MASKS]
    pairs = [(factory(SEQ), None) for _, factory in ALL_MASKS]
    _check_square(kernel, "masks", names, pairs, heads=8, kv_heads=2)

    # 3 query tiles x 2 key tiles under `Causal() & Document()`: 32 bytes a row, so a
    # call of 2 rows and one of the last.
    monkeypatch.setattr(_calls, "_TABLE_SMEM", 64)
    cases = _config_cases()
    xla = _cached("configs-xla", lambda: _run(XLA, cases))
    for config, res, x in zip(CONFIGS, _run(kernel, cases), xla):
        _check(str(config), res, x, config[-1], "XlaKernel")

    monkeypatch.setattr(_calls, "_TABLE_SMEM", 24)  # the ring's shards: 2 calls
    test_in_ring(kernel)

    # The fused backward's dQ accumulator bounds its calls' query rows too: one query
    # tile a call (the forward stays one call), dK and dV carried across them.
    monkeypatch.setattr(_calls, "_TABLE_SMEM", 1 << 20)
    monkeypatch.setattr(_calls, "_DQ_VMEM", 1)
    assert _calls.dq_row_tiles(t) == 1
    assert _calls.QuerySplit.of(t, 1, _calls.dq_row_tiles(t)).calls == 3
    for config, res, x in zip(CONFIGS, _run(kernel, cases), xla):
        _check(str(config), res, x, config[-1], "XlaKernel")

    monkeypatch.setattr(_calls, "_TABLE_SMEM", 8)
    with pytest.raises(ValueError, match="one row of tiles' tables takes 16 bytes of SMEM"):
        _calls.QuerySplit.of(t, 1)


def test_tpu_kernel_computes_a_key_tile_in_pieces():
    # `block_kv_compute`: a 256-wide key tile copied whole and computed 128 columns at a
    # time, each piece on its own branch of the tile table, forward and fused backward
    # (the backward's tiles given apart, 512 shrunk to the 200 keys: one tile, two
    # pieces, the second partly padding), every config against XlaKernel.
    kernel = rx.PallasTpuKernel(
        block_q=16,
        block_kv=256,
        block_kv_compute=128,
        backward_block_kv=512,
        backward_block_kv_compute=128,
        interpret=True,
    )
    cases = _config_cases()
    xla = _cached("configs-xla", lambda: _run(XLA, cases))
    for config, res, x in zip(CONFIGS, _run(kernel, cases), xla):
        _check(str(config), res, x, config[-1], "XlaKernel")
    for bad in (100, 384, 0):
        with pytest.raises(ValueError, match="`block_kv_compute` must be None or a positive"):
            rx.PallasTpuKernel(block_kv=1024, block_kv_compute=bad)
        with pytest.raises(ValueError, match="`backward_block_kv_compute` must be None or"):
            rx.PallasTpuKernel(backward_block_kv=1024, backward_block_kv_compute=bad)
    # A piece at least the tile is the whole tile (the defaults' pieces on small tiles).
    assert rx.PallasTpuKernel(block_kv=256, backward_block_kv=128).block_kv_compute == 1024
    with pytest.raises(ValueError, match="`backward_block_kv` must be None or a positive"):
        rx.PallasTpuKernel(backward_block_kv=100)


def test_tpu_kernel_key_tiles_fit_the_sequence_and_head_dim():
    # The default key tiles (4096 computed 1024 at a time; the backward's 2048 by 512):
    # a sequence past a tile is cut into as few tiles as whole pieces make (5000 keys:
    # two of 3072, not two of 4096; 300 keys: one of 384), and past head_dim 128 the
    # tiles hold as many elements as at 128 (head_dim 256: 2048 and 1024 keys).
    kernel = rx.PallasTpuKernel(interpret=True)

    def tiles(length, head_dim, backward):
        x = jnp.zeros((1, 2, length, head_dim), jnp.bfloat16)
        t = kernel._tiling(x, x, backward)
        return t.block_kv, t.kv_padded, kernel._compute(t, backward)

    assert tiles(5000, 128, False) == (3072, 6144, 1024)
    assert tiles(300, 128, False) == (384, 384, 384)
    assert tiles(32768, 128, False) == (4096, 32768, 1024)
    assert tiles(32768, 128, True) == (2048, 32768, 512)
    assert tiles(32768, 256, False) == (2048, 32768, 1024)
    assert tiles(32768, 256, True) == (1024, 32768, 512)
    assert tiles(32768, 64, False) == (4096, 32768, 1024)


def test_tpu_kernel_pieces_take_their_own_branches():
    # A wide key tile's pieces are skipped where nobody attends and unmasked where all
    # do: each piece's branch in the table is the branch the table of tiles as narrow
    # as the pieces gives (Causal over 1024 tokens: query tiles 256, key tiles 512 in
    # pieces of 128; a SlidingWindow, whose pieces start and stop inside the tiles).
    from ringeqx._kernels._pallas import _common as common

    info = _records(2, 1024)
    q = jnp.zeros((2, 4, 1024, 64), jnp.float32)
    k = jnp.zeros((2, 2, 1024, 64), jnp.float32)
    for mask in (rx.Causal(), rx.SlidingWindow(600)):
        wide, _ = common.tile_mask(common.tiling(q, k, 256, 512), mask, info, info, 128)
        narrow, _ = common.tile_mask(common.tiling(q, k, 256, 128), mask, info, info)
        pieces = np.asarray(wide[..., 1:5]).reshape(narrow.shape[:3])
        np.testing.assert_array_equal(pieces, np.asarray(narrow[..., 0]), str(mask))
        assert {0, 1, 2} <= set(pieces.ravel().tolist()), str(mask)


def test_tpu_kernel_query_tiles_of_whole_vregs(monkeypatch):
    # Query tiles 128 wide (the tiles of a real chip, where the tests above use 16): 300
    # queries in 3 tiles (the last partly padding), in one call and split into calls of
    # one query tile each (the fused backward's dQ written a call's rows at a time).
    from ringeqx._kernels._mosaic import _calls

    length, heads, kv_heads = 300, 4, 2
    q, k, v = qkv(jax.random.key(5), (2,), length, heads, kv_heads, 64)
    d_out = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)
    info = _records(2, length)
    hq, hk, hv, hdo = (_heads_major(x) for x in (q, k, v, d_out))
    cases = [Case(hq, hk, hv, info, info, rx.Causal() & rx.Document(), None, hdo)]
    kernel = rx.PallasTpuKernel(
        block_q=128, block_kv=256, block_kv_compute=128, backward_block_kv=128, interpret=True
    )
    xla = _run(XLA, cases)
    for smem in (1 << 20, 80):  # 80 bytes: a row of the forward's table, with its pieces
        monkeypatch.setattr(_calls, "_TABLE_SMEM", smem)
        _check(f"SMEM {smem}", _run(kernel, cases)[0], xla[0], 2e-5, "XlaKernel")
