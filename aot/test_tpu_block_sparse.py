"""BlockSparse on PallasTpuKernel compiles for real TPU slices (libtpu, compile-only; v5p
and v5e): alone, `&` Causal and `|` PrefixLM, forward and `jax.grad`, through Mosaic."""

import pytest
from ring_programs import block_sparse_mask, lowered_ring_grad

import ringeqx as rx


SEQ, BLOCK = 4 * 1024, 256


@pytest.mark.parametrize("target", [("v5p", "2x2x1"), ("v5e", "2x2")])
@pytest.mark.parametrize("which", ["alone", "and_causal", "or_prefix"])
def test_block_sparse_compiles_with_mosaic(which, target):
    mesh = rx.tools.target_mesh(*target)
    lowered = lowered_ring_grad(
        mesh, block_sparse_mask(which, SEQ, BLOCK), seq=SEQ, heads=4, kv_heads=4,
        head_dim=128, kernel=rx.PallasTpuKernel(
            block_q=256, block_kv=256, block_kv_compute=None, backward_block_kv=None
        ),
    )
    # The default layout is one run per shard: no run-time exactness check (a callback).
    assert "callback" not in lowered.as_text()
    text = lowered.compile().as_text()
    assert "tpu_custom_call" in text
    for part in ("forward", "backward"):
        assert f"ringeqx_tpu_flash_{part}" in text
