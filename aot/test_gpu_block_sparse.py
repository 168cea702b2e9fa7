"""BlockSparse on PallasGpuKernel for a real GPU (the CUDA plugin, compile-only): alone,
`&` Causal and `|` PrefixLM, forward and `jax.grad`."""

import pytest
from ring_programs import block_sparse_mask, lowered_ring_grad

import ringeqx as rx


SEQ, BLOCK = 4 * 1024, 256


@pytest.mark.parametrize("which", ["alone", "and_causal", "or_prefix"])
def test_block_sparse_gpu_compile_stops_at_the_exactness_callback(which):
    mesh = rx.target_mesh("h100", 8)
    mask = block_sparse_mask(which, SEQ, BLOCK)
    kernel = rx.PallasGpuKernel(block_q=128, block_kv=64)
    # Open (measured): BlockSparse's exactness check on the tile table is `eqx.error_if`,
    # a host callback, and a compile-only GPU has no backend to lower a callback for
    # (on a real GPU it lowers). Until that check is made without a callback, this is
    # where the GPU compile stops; the Triton kernels themselves lower for it in
    # tests/test_lowering.py. Asserted precisely, so a change shows.
    with pytest.raises(Exception, match="Unknown backend: 'gpu' requested"):
        lowered_ring_grad(
            mesh, mask, seq=SEQ, heads=4, kv_heads=4, head_dim=64, kernel=kernel
        ).compile()
