"""Every Pallas TPU kernel and the whole ring, compiled by the real TPU compiler.

tests/test_lowering.py exports the kernels with `jax.export`, which stops at Mosaic's
lowering. Here libtpu compiles them for compile-only TPU v5e, v5p and v6e devices
(`ringeqx.tools.target_mesh`): Mosaic's own passes (VMEM limits, vreg layouts) and XLA's TPU
scheduler run on every program, so what they refuse fails here. For each generation:

- the kernels' forward and backward on one block (`kernel.forward` / `kernel.backward`,
  as the ring drives them), for every mask (combinations with `&` and `|` included) and
  every score modifier of tests/helpers.py, every dtype x head_dim x GQA combination,
  on a length that is not a multiple of the tiles;
- the whole ring, forward and `jax.grad`, on a 4-chip slice with `kernel="auto"` (the
  mesh's platform picks `PallasTpuKernel`): every mask and modifier again, attention
  sinks, a Zigzag layout and K/V compressed to bfloat16 and float8 on the wire.

Compiling costs a fixed amount per program and per Mosaic kernel, so each test compiles
*one* program holding many cases, chosen as a covering design (as in test_lowering):
every case runs under a `jax.named_scope` of its own, and the check counts that case's
Mosaic calls in the scheduled HLO by their op names.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SCORE_MODS
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ring_programs import BLOCK_SPARSE, MASKS, compile_ring, kernel_calls, ring_cases, ring_masks
from test_lowering import _block_call

import ringeqx as rx


# (target, slice): two 4-chip slices whose cores differ (v5e: one TensorCore, 128 x 128
# MXUs; v5p: a megacore), and v6e's 256 x 256 MXUs.
TARGETS = {"v5e": ("v5e", "2x2"), "v5p": ("v5p", "2x2x1"), "v6e": ("v6e", "2x2")}

# Every mask of ring_programs.MASKS (tests/helpers.py's, and `&`/`|` combinations).
COMPILED_MASKS = MASKS

# Block tiles smaller than the default, so that SEQ spans several: 300 tokens is 2.3
# query and key tiles of 128 (padded, the padding masked).
def _same_tiles(block_q: int, block_kv: int) -> rx.PallasTpuKernel:
    """A Mosaic kernel with these tiles, forward and backward, each computed whole."""
    return rx.PallasTpuKernel(block_q, block_kv, block_kv_compute=None, backward_block_kv=None)


BLOCK_KERNEL = _same_tiles(128, 128)
SEQ = 300
# Every dtype x head_dim x GQA ((heads, kv_heads): 4:1 and 1:1) combination.
SHAPES = [
    (dtype, d, h, kh)
    for dtype in (jnp.bfloat16, jnp.float32)
    for d in (64, 128)
    for h, kh in ((4, 1), (2, 2))
]


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _one_chip(target: str) -> Mesh:
    """One compile-only chip of `target`: a kernel called outside `shard_map` must not
    be partitioned (Mosaic calls cannot be)."""
    mesh = rx.tools.target_mesh(*TARGETS[target])
    return Mesh(np.array(list(mesh.devices.flat)[:1]), ("chip",))


def _covering(every_pair: bool):
    """`(name, dtype, head_dim, heads, kv_heads, mask, mod)` cases covering every shape,
    and every compiled mask with every modifier (`every_pair`) or each mask and each
    modifier at least once; shapes are dealt round the cases."""
    if every_pair:
        pairs = [(m, i) for m in range(len(COMPILED_MASKS)) for i in range(len(SCORE_MODS))]
    else:
        count = max(len(COMPILED_MASKS), len(SCORE_MODS), len(SHAPES))
        pairs = [(n % len(COMPILED_MASKS), n % len(SCORE_MODS)) for n in range(count)]
    cases = []
    for n, (m, i) in enumerate(pairs):
        dtype, d, h, kh = SHAPES[n % len(SHAPES)]
        mask_name, make_mask = COMPILED_MASKS[m]
        mod_name, make_mod = SCORE_MODS[i]
        name = f"{mask_name}-{mod_name}-{jnp.dtype(dtype).name}-d{d}-{h}x{kh}"
        cases.append((name, dtype, d, h, kh, make_mask(SEQ), make_mod(h)))
    return cases


def _compile_blocks(target: str, cases):
    mesh = _one_chip(target)
    chip = NamedSharding(mesh, P())
    args = [
        [
            jax.ShapeDtypeStruct((1, h, SEQ, d), dtype, sharding=chip),
            jax.ShapeDtypeStruct((1, kh, SEQ, d), dtype, sharding=chip),
            jax.ShapeDtypeStruct((1, kh, SEQ, d), dtype, sharding=chip),
        ]
        for _, dtype, d, h, kh, _, _ in cases
    ]

    def program(args):
        outs = []
        for n, (qkv, case) in enumerate(zip(args, cases)):
            with jax.named_scope(f"case{n}"):
                outs.append(_block_call(BLOCK_KERNEL, *qkv, case[5], case[6]))
        return outs

    # Mosaic reads the TPU generation from the mesh in context.
    with jax.set_mesh(mesh):
        text = _compile(program, args)
    for n, case in enumerate(cases):
        assert sorted(kernel_calls(text, f"case{n}", "tpu")) == [
            "ringeqx_tpu_flash_backward",
            "ringeqx_tpu_flash_forward",
        ], case[0]
    assert text.count('custom_call_target="tpu_custom_call"') == 2 * len(cases)


def test_v5e_kernels_every_mask_modifier_dtype_head_dim_and_gqa():
    cases = _covering(every_pair=True)
    assert len(cases) == len(COMPILED_MASKS) * len(SCORE_MODS) >= len(SHAPES)
    _compile_blocks("v5e", cases)


@pytest.mark.parametrize("target", ["v5p", "v6e"])
def test_kernels_every_mask_modifier_dtype_head_dim_and_gqa(target):
    _compile_blocks(target, _covering(every_pair=False))


# Tiles whose kernels hold more than Mosaic's default 16 MiB of scoped VMEM (v5e, v5p):
# head_dim 256 at the default tiles (17.2 MiB in the backward's dK/dV kernel) and the
# larger tiles `tile_candidates` and users try (1024 x 1024: 23.5 MiB). Each asks Mosaic
# for 64 MiB; before it did, none of these compiled.
LARGE_VMEM = [
    (rx.PallasTpuKernel(), jnp.bfloat16, 256),
    (_same_tiles(1024, 1024), jnp.bfloat16, 128),
    (_same_tiles(1024, 2048), jnp.float32, 64),
]


@pytest.mark.parametrize("target", ["v5e", "v5p"])
def test_kernels_whose_tiles_need_more_vmem_compile(target):
    mesh = _one_chip(target)
    chip = NamedSharding(mesh, P())
    seq = 2048  # the tiles are not shrunk to it

    def spec(heads, dtype, d):
        return jax.ShapeDtypeStruct((1, heads, seq, d), dtype, sharding=chip)

    args = [[spec(4, t, d), spec(1, t, d), spec(1, t, d)] for _, t, d in LARGE_VMEM]

    def program(args):
        return [
            _block_call(kernel, *qkv, rx.Causal(), None)
            for qkv, (kernel, _, _) in zip(args, LARGE_VMEM)
        ]

    with jax.set_mesh(mesh):
        text = _compile(program, args)
    assert text.count('custom_call_target="tpu_custom_call"') == 2 * len(LARGE_VMEM)


# ----------------------------------------------------------------------------------
# The whole ring, forward and `jax.grad`, on 4 chips.

# The ring leaves out BLOCK_SPARSE (measured, benchmarks/block_sparse_compile.py): the
# kernels give each pair of tiles the window of the map their positions can meet, packed
# into words that each cost a select per pair of tokens, and helpers' maps of 4- and
# 5-token blocks are ~1000 and ~700 words a tile at Mosaic's default 512 x 1024 tiles. One
# ring with block_size 4 does not compile in 10 min (v5e and v5p alike: ~2 s CPU a word,
# block_size 8's 263 words took 9 min); a ring program of every mask took 37 min for
# v5e. Its kernels compile above on 300 tokens and 128 x 128 tiles (~35 words).
RING_MASKS = ring_masks(leave_out=BLOCK_SPARSE)


# v5e and v5p: the cores differ (v5e one TensorCore with 128 x 128 MXUs, v5p a megacore);
# ~2 min each for the 11 cases (~10 s of CPU a case, linear in the cases).
@pytest.mark.parametrize("target", ["v5e", "v5p"])
def test_ring_forward_and_grad_every_mask(target):
    """Every mask once; modifiers, sinks, shapes, layouts and wires rotate round them
    (`kernel="auto"`: the mesh's TPUs pick PallasTpuKernel)."""
    cases = ring_cases(RING_MASKS, SHAPES)
    assert {c.name.split("-")[0] for c in cases} == {name for name, _ in RING_MASKS}
    compile_ring(rx.tools.target_mesh(*TARGETS[target]), cases)


# A shard whose tile tables overflow SMEM (1 MiB): libtpu refused 256K tokens a chip in
# one call ("Ran out of memory in memory space smem"). The kernels now run as several
# calls over the query tiles, writing into one set of outputs: at 256K tokens and the
# 512 x 1024 tiles, two calls of each kernel. Nothing is copied between them: its temp is
# twice 128K tokens' (one call each); on 8 chips the ring's split cost 3.9% (LOG.md).
# v5e, v5p and v6e alike: each refused 256K tokens in one call (1 MiB of SMEM). (The
# default 1024 x 1024 tiles have half the table rows: one forward call holds 256K.)
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_shard_past_smem_runs_as_several_calls_without_copies(target):
    mesh = _one_chip(target)
    chip = NamedSharding(mesh, P())
    kernel = _same_tiles(512, 1024)

    def program(q, k, v):
        with jax.named_scope("long"):
            return _block_call(kernel, q, k, v, rx.Causal(), None)

    def compiled(seq):
        shapes = [(1, 8, seq, 128), (1, 2, seq, 128), (1, 2, seq, 128)]
        args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=chip) for s in shapes]
        with jax.set_mesh(mesh):
            return jax.jit(program).lower(*args).compile()

    one, two = compiled(128 * 1024), compiled(256 * 1024)
    # One forward call at 128K; the fused backward's calls are bounded by its dQ
    # accumulator (VMEM) as well, so it is split at either length, twice as many at 256K.
    kernels = sorted(kernel_calls(one.as_text(), "long", "tpu"))
    assert set(kernels) == {"ringeqx_tpu_flash_backward", "ringeqx_tpu_flash_forward"}
    assert kernels.count("ringeqx_tpu_flash_forward") == 1
    assert sorted(kernel_calls(two.as_text(), "long", "tpu")) == sorted(kernels * 2)
    temp = [c.memory_analysis().temp_size_in_bytes for c in (one, two)]
    assert temp[1] <= 2.08 * temp[0], temp  # measured: v5e 2.00x, v5p 2.02x, v6e 2.00x
