"""The Pallas kernels lower for the hardware they exist for.

The interpret-mode tests (test_kernels.py) check what the kernels compute; they cannot
see what Triton or Mosaic would refuse. Here every kernel is lowered, on this CPU-only
machine, with `jax.export` for `cuda` and for `tpu` (two TPU generations, whose lane and
VMEM rules differ): forward and backward for every mask and score modifier, every dtype
x head_dim x GQA combination, and the whole ring, forward and `jax.grad`, on an 8-device
abstract mesh. What lowering proves and what only hardware shows is written down in
docs/verification.md.

Exporting is dominated by fixed costs per program, so each test exports *one* program
holding many cases, and the cases are a covering design rather than the full cartesian
product: every mask with every modifier at least once (in one configuration), and every
dtype x head_dim x GQA combination at least once (with masks and modifiers rotating).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ALL_MASKS, block_pattern
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import ringeqx as rx
from ringeqx._kernels._mosaic._calls import kv_index_map, q_index_map, tile_plan
from ringeqx._kernels._pallas import _tables as tables


# The Triton custom call has no serialisation-compatibility guarantee; lowering is what
# is tested here, not the stability of the serialised form.
_DISABLED = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
# Mosaic needs a TPU generation to lower for: v5e ("TPU v5 lite") and v6e.
TPU_KINDS = ("TPU v5 lite", "TPU v6 lite")
# Tiles small enough that the lengths below span several of them, and lengths that are
# not multiples of them (GPU: 300 = 2.3 x 128 query tiles, 4.7 x 64 key tiles, 5 key
# tiles padded to a power-of-two table; TPU: 300 = 2.3 x 128).
GPU = rx.PallasGpuKernel(block_q=128, block_kv=64)
TPU = rx.PallasTpuKernel(
    block_q=128, block_kv=128, block_kv_compute=None, backward_block_kv=None
)
SEQ = 300
# Triton lowers for a compute capability. Without a GPU, JAX 0.10 assumed 9.0; JAX 0.12
# reads it from the abstract mesh's device and refuses to guess, so the cuda exports
# name a GPU of capability 9.0.
H100 = AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")

MASKS = ALL_MASKS + [
    ("sliding_or_spans", lambda n: rx.SlidingWindow(16) | rx.BidirectionalSpans()),
    ("causal_or_document", lambda n: rx.Causal() | rx.Document()),
]


def _mods(heads: int):
    slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1, dtype=jnp.float32) / heads)
    return [
        ("none", None),
        ("softcap", rx.Softcap(30.0)),
        ("alibi", rx.ALiBi(slopes)),
        ("chain", rx.Chain(rx.ALiBi(slopes), rx.Softcap(30.0))),
    ]


def _records(batch: int, length: int) -> rx.TokenInfo:
    # One run of consecutive positions, said statically (`rx.Runs`), as a ring shard of
    # a contiguous layout is: BlockSparse's per-tile windows are then exact when traced,
    # with no run-time check (a host callback, which cannot be exported for another
    # platform from this CPU host).
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    spans = jnp.where((pos >= 10) & (pos < 30), 0, -1)
    return rx.TokenInfo(pos, pos // 97, spans, pos < length - 3, rx.Runs((0,), length))


def _platform(platform: str, mesh=None):
    """`(jax platform, context)` for a target name, "cuda" or a TPU device kind; the
    context sets `mesh` (an AbstractMesh), or for a TPU one that names its kind."""
    if mesh is not None:
        return ("cuda" if platform == "cuda" else "tpu"), use_abstract_mesh(mesh)
    if platform == "cuda":
        return "cuda", use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H100))
    device = AbstractDevice(device_kind=platform, num_cores=1, platform="tpu")
    return "tpu", use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


def _export(fn, platform: str, *args, mesh=None) -> str:
    target, context = _platform(platform, mesh)
    with context:
        exported = export.export(
            jax.jit(fn), platforms=[target], disabled_checks=_DISABLED
        )(*args)
    assert exported.platforms == (target,)
    return exported.mlir_module()


def _custom_calls(text: str, platform: str) -> int:
    target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    return text.count(f"custom_call @{target}(")


def _block_call(kernel, q, k, v, mask, mod):
    """Forward and backward of one block, as the ring drives them."""
    info = _records(q.shape[0], q.shape[2])
    args = (info, info, rx.Scores(mask, mod, 0.125))
    out, lse = kernel.forward(q, k, v, *args)
    delta = jnp.sum(out, axis=-1)
    return out, kernel.backward(q, k, v, lse, delta, out.astype(q.dtype), *args)


def _lower_cases(kernel, platform, cases):
    """Lower every `(dtype, head_dim, heads, kv_heads, mask, mod)` case in one program;
    each must give its three Pallas calls (forward, dQ, dK/dV)."""
    args = [
        [
            jax.ShapeDtypeStruct((1, h, SEQ, d), dtype),
            jax.ShapeDtypeStruct((1, kh, SEQ, d), dtype),
            jax.ShapeDtypeStruct((1, kh, SEQ, d), dtype),
        ]
        for dtype, d, h, kh, _, _ in cases
    ]

    def program(args):
        return [
            _block_call(kernel, *qkv, mask, mod)
            for qkv, (*_, mask, mod) in zip(args, cases)
        ]

    text = _export(program, platform, args)
    # Mosaic's backward is one fused kernel, Triton's two (dQ, then dK/dV).
    parts = ("forward", "backward_dq", "backward_dkv") if platform == "cuda" else (
        "forward", "backward")
    assert _custom_calls(text, "cuda" if platform == "cuda" else "tpu") == len(parts) * len(cases)
    name = "gpu" if platform == "cuda" else "tpu"
    for part in parts:
        assert f"ringeqx_{name}_flash_{part}" in text


def _shapes(dtypes, head_dims):
    """Every dtype x head_dim x GQA (`(heads, kv_heads)`: 4:1 and 1:1) combination."""
    return [(t, d, h, kh) for t in dtypes for d in head_dims for h, kh in ((4, 1), (2, 2))]


def _covering(shapes, every_pair: bool):
    """Cases that cover every shape and, with `every_pair`, every mask with
    every modifier: the pairs are dealt round the shapes, so each shape gets some."""
    masks = [make(SEQ) for _, make in MASKS]
    pairs = [(m, i) for m in range(len(masks)) for i in range(4)]
    if not every_pair:
        pairs = [(n % len(masks), n % 4) for n in range(len(shapes))]
    cases = []
    for n, (m, i) in enumerate(pairs):
        dtype, d, h, kh = shapes[n % len(shapes)]
        cases.append((dtype, d, h, kh, masks[m], _mods(h)[i][1]))
    assert len(pairs) >= len(shapes)
    return cases


GPU_SHAPES = _shapes((jnp.float16, jnp.bfloat16, jnp.float32), (64, 128, 256))
TPU_SHAPES = _shapes((jnp.bfloat16, jnp.float32), (64, 128))


def test_gpu_every_mask_modifier_dtype_head_dim_and_gqa_lowers():
    assert len(GPU_SHAPES) == 18
    _lower_cases(GPU, "cuda", _covering(GPU_SHAPES, every_pair=True))


def test_tpu_every_mask_modifier_dtype_head_dim_and_gqa_lowers():
    assert len(TPU_SHAPES) == 8
    _lower_cases(TPU, TPU_KINDS[0], _covering(TPU_SHAPES, every_pair=True))


def test_tpu_second_generation_every_dtype_head_dim_and_gqa_lowers():
    _lower_cases(TPU, TPU_KINDS[1], _covering(TPU_SHAPES, every_pair=False))


def test_mask_with_a_per_pair_table_is_a_clear_error():
    class Lookup(rx.AbstractMask):
        table: jax.Array

        def allows(self, q, k):
            return self.table[q.positions % 4, k.positions % 4]

        def may_attend(self, q, k):
            return jnp.ones(jnp.broadcast_shapes(q.pos_min.shape, k.pos_min.shape), bool)

        def max_distance(self):
            return None

        def max_lookahead(self):
            return None

        def check(self, seq_len):
            pass

    mask = Lookup(jnp.eye(4, dtype=bool))
    q = jax.ShapeDtypeStruct((1, 4, SEQ, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1, SEQ, 64), jnp.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"PallasTpuKernel\(interpret=False\) cannot run mask Lookup on a TPU: "
        r".* uses gather, .*tile_local.*Use XlaKernel",
    ):
        _export(lambda q, k: _block_call(TPU, q, k, k, mask, None), TPU_KINDS[0], q, k)


def test_tpu_tiles_too_large_for_vmem_are_a_clear_error():
    # 2048 x 2048 tiles hold ~78 MiB of VMEM in the backward; Mosaic would refuse them
    # only when compiling for a chip (aot/test_tpu_matrix.py compiles the ones allowed).
    q = jax.ShapeDtypeStruct((1, 4, 2048, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1, 2048, 128), jnp.bfloat16)
    kernel = rx.PallasTpuKernel(
        block_q=2048, block_kv=2048, block_kv_compute=None, backward_block_kv=None
    )

    def program(q, k):
        return _block_call(kernel, q, k, k, rx.Causal(), None)

    with pytest.raises(
        ValueError,
        match=r"PallasTpuKernel forward tiles `block_q`=2048 x 2048 keys \(computed 2048 at "
        r"a time\) at head_dim 128 need about 7\d\.\d MiB of VMEM; expected at most 56 "
        r"MiB: choose smaller tiles",
    ):
        _export(program, TPU_KINDS[0], q, k)
    # The same tiles on a short sequence shrink to it, and lower.
    short = [jax.ShapeDtypeStruct(x.shape[:2] + (256, 128), x.dtype) for x in (q, k)]
    text = _export(program, TPU_KINDS[0], *short)
    assert _custom_calls(text, "tpu") == 2  # the forward and the fused backward


# ----------------------------------------------------------------------------------
# The whole ring on an 8-device abstract mesh.


@pytest.mark.parametrize(
    "kernel, platform",
    [
        (GPU, "cuda"),
        (TPU, TPU_KINDS[0]),
        (rx.XlaKernel(block_q=128, block_kv=128), "cuda"),
        (rx.XlaKernel(block_q=128, block_kv=128), TPU_KINDS[1]),
    ],
    ids=["pallas_gpu", "pallas_tpu", "xla_cuda", "xla_tpu"],
)
def test_ring_forward_and_grad_lower(kernel, platform):
    """Zigzag layout, causal documents, ALiBi, sinks and bfloat16 K/V on the wire
    (float32 inputs), `jax.grad` in q, k, v and the sinks."""
    target, _ = _platform(platform)
    seq, heads, kv_heads, head_dim = 8 * 40, 4, 1, 64
    device = H100
    if target == "tpu":
        device = AbstractDevice(device_kind=platform, num_cores=1, platform="tpu")
    mesh = AbstractMesh(
        (8,), ("sequence",), axis_types=(AxisType.Explicit,), abstract_device=device
    )
    segments = (jnp.arange(seq, dtype=jnp.int32) // 100)[None]
    layout = rx.Zigzag().layout(seq, 8, segment_ids=segments)
    slopes = jnp.linspace(0.1, 1.0, heads)

    def loss(q, k, v, sinks):
        out = rx.ring_attention(
            q,
            k,
            v,
            mask=rx.Causal() & rx.Document(),
            layout=layout,
            order="layout",
            mesh=mesh,
            kernel=kernel,
            config=rx.RingConfig(compression_dtype=jnp.bfloat16),
            score_mod=rx.ALiBi(slopes),
            sinks=sinks,
        )
        return out.astype(jnp.float32).sum(), out

    def program(q, k, v, sinks):
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)

    args = [
        jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32),
        *[jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.float32)] * 2,
        jax.ShapeDtypeStruct((heads,), jnp.float32),
    ]
    text = _export(program, platform, *args, mesh=mesh)
    # The ring: K/V (and in the backward the float32 dK/dV) pass between devices, K/V
    # (float32 inputs) as 16 bits (bfloat16, sent bitcast to uint16, K and V stacked
    # into one array).
    permutes = [line for line in text.splitlines() if "collective_permute" in line]
    kv = f"<2x1x{kv_heads}x{seq // 8}x{head_dim}xui16>"
    assert any(kv in line for line in permutes)
    pallas = _custom_calls(text, target)
    if isinstance(kernel, rx.XlaKernel):
        assert pallas == 0
    else:
        assert pallas >= 2
        assert "ringeqx_" in text and "_flash_backward" in text


def test_pallas_kernel_lowered_for_the_wrong_platform_is_an_error():
    q = jax.ShapeDtypeStruct((1, 4, SEQ, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1, SEQ, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"PallasGpuKernel.*needs a GPU.*'tpu'"):
        _export(lambda q, k: _block_call(GPU, q, k, k, rx.Causal(), None), "TPU v5 lite", q, k)
    with pytest.raises(ValueError, match=r"PallasTpuKernel.*needs a TPU.*'cuda'"):
        _export(lambda q, k: _block_call(TPU, q, k, k, rx.Causal(), None), "cuda", q, k)


# ----------------------------------------------------------------------------------
# Skipped TPU tiles fetch the block already resident.


def _fetched(index_map, grid, run, fetch):
    """The block index along the swept axis that each grid step fetches."""
    return np.array(
        [[int(index_map(0, 0, *step, run, fetch)[2]) for step in row] for row in grid]
    )


def test_tpu_causal_skipped_tiles_fetch_the_resident_block():
    # 4 x 4 tiles of 128 tokens, causal: query tile i needs key tiles 0..i.
    n, block = 4, 128
    info = _records(1, n * block)
    info = rx.TokenInfo(info.positions, info.segments, info.spans, info.positions >= 0)
    run = tables.tile_mask(rx.Causal(), info, info, n * block, block, n * block, block)[0][..., 0]
    # Tiles on the diagonal run masked (1), those below it dense (2).
    ones = np.ones((n, n), np.int32)
    np.testing.assert_array_equal(run[0], np.tril(ones) + np.tril(ones, -1))

    # Forward / dQ: row i sweeps key tiles j; after the diagonal it keeps tile i.
    forward = kv_index_map(1, n, n)
    got = _fetched(forward, [[(i, j) for j in range(n)] for i in range(n)], *tile_plan(run))
    want = [[0, 0, 0, 0], [0, 1, 1, 1], [0, 1, 2, 2], [0, 1, 2, 3]]
    np.testing.assert_array_equal(got, want)

    # dK/dV: key tile t sweeps query tiles i >= t; before it, the first needed one.
    backward = q_index_map(1, n, n)
    run_t = jnp.swapaxes(run, 1, 2)

    def dkv(index_map, grid, run, fetch):
        return np.array(
            [[int(index_map(0, 0, t, 0, i, run, fetch)[2]) for t, i in row] for row in grid]
        )

    got = dkv(backward, [[(t, i) for i in range(n)] for t in range(n)], *tile_plan(run_t))
    want = [[0, 1, 2, 3], [1, 1, 2, 3], [2, 2, 2, 3], [3, 3, 3, 3]]
    np.testing.assert_array_equal(got, want)


def test_tpu_block_sparse_skipped_tiles_fetch_the_resident_block():
    n, block = 5, 128
    pattern = np.asarray(block_pattern(n * block, block))
    info = _records(1, n * block)
    info = rx.TokenInfo(info.positions, info.segments, info.spans, info.positions >= 0)
    mask = rx.BlockSparse(jnp.asarray(pattern), block)
    run = tables.tile_mask(mask, info, info, n * block, block, n * block, block)[0][..., 0]
    # Tiles of the map's blocks: each set block is a dense tile (2).
    np.testing.assert_array_equal(run[0], 2 * pattern.astype(np.int32))

    got = _fetched(
        kv_index_map(1, n, n), [[(i, j) for j in range(n)] for i in range(n)], *tile_plan(run)
    )
    for i in range(n):
        needed = np.flatnonzero(pattern[i])
        for j in range(n):
            earlier = needed[needed <= j]
            # A step that runs fetches its own tile; a skipped one the last tile that
            # ran (or, before any, the first that will run): no new copy either way.
            want = j if pattern[i, j] else (earlier[-1] if len(earlier) else needed[0])
            assert got[i, j] == want, (i, j, got[i])
    # Only the needed tiles are ever fetched, each row fetches each once in a row.
    for i in range(n):
        assert set(got[i]) == set(np.flatnonzero(pattern[i]))


def test_resident_blocks_of_a_row_that_runs_nothing():
    run = jnp.asarray([[0, 0, 0], [0, 1, 0]], jnp.int32)
    np.testing.assert_array_equal(tables.resident_blocks(run), [[0, 0, 0], [1, 1, 1]])
