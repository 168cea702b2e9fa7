"""The whole ring, forward and `jax.grad`, compiled by XLA's real CUDA compiler for
compile-only H100 (sm_90) and A100 (sm_80) meshes of 4 GPUs (`ringeqx.tools.target_mesh`).

The GPU side of test_tpu_matrix's ring check, from the same case generator and program
(aot/ring_programs.py): `kernel="auto"` must pick `PallasGpuKernel` on the mesh's GPUs,
and every case (every mask, every score modifier, sinks, a Zigzag layout, K/V
compressed to bfloat16 and float8 on the wire, the dtypes and head_dims below) must
compile, Triton and ptxas included, with its three kernels found in the scheduled HLO as
`__gpu$xla.gpu.triton` calls named `ringeqx_gpu_flash_*`, no all-gather, and the
compressed K/V travelling as u16/u8. One program per GPU holds every case.
"""

import jax.numpy as jnp
import pytest
from ring_programs import BLOCK_SPARSE, compile_ring, ring_cases, ring_masks

import ringeqx as rx


# BlockSparse is left out: its ring compiles for GPUs (test_gpu_block_sparse, 256-token
# blocks), but helpers' maps of 4- and 5-token blocks are 18 words of the map a pair of
# 128 x 64 tiles, and one ring with them takes ~6 min of CPU to compile for H100
# (benchmarks/block_sparse_compile.py: 12 s at block_size 64, 36 s at 16).
RING_MASKS = ring_masks(leave_out=BLOCK_SPARSE)

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
HEAD_DIMS = (64, 128, 256)
GQA = ((4, 1), (2, 2))  # (heads, kv_heads)

# (dtype, head_dim, heads, kv_heads): every dtype x head_dim pair, the GQA ratio
# alternating like a Latin square, so that each dtype and each head_dim also meets both
# ratios (a covering design: the full product would be 18 ring cases instead of the 11
# that the masks need). All compile with PallasGpuKernel's tuned tiles on both GPUs
# (at the former 128 x 64 tiles, head_dim 256 exceeded the shared memory of a block on
# A100 and in float32 on H100: `RESOURCE_EXHAUSTED: Shared memory size limit exceeded`).
SHAPES = [
    (dtype, d, *GQA[(i + j) % len(GQA)])
    for i, dtype in enumerate(DTYPES)
    for j, d in enumerate(HEAD_DIMS)
]


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_ring_forward_and_grad_every_mask(gpu):
    """Every mask and every shape at least once; modifiers, sinks, layouts and wires
    rotate round them."""
    for axis in (0, 1):  # each dtype, each head_dim: with both GQA ratios
        for value in {s[axis] for s in SHAPES}:
            assert {s[2:] for s in SHAPES if s[axis] == value} == set(GQA), value
    cases = ring_cases(RING_MASKS, SHAPES)
    assert {c.name.split("-")[0] for c in cases} == {name for name, _ in RING_MASKS}
    mesh = rx.tools.target_mesh(gpu, 4)
    assert isinstance(rx.select_kernel(mesh=mesh), rx.PallasGpuKernel)
    compile_ring(mesh, cases)
