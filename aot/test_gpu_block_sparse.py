"""BlockSparse on PallasGpuKernel compiles for a real GPU (the CUDA plugin, compile-only):
alone, `&` Causal and `|` PrefixLM, forward and `jax.grad`, through Triton."""

import jax
import jax.numpy as jnp
import pytest
from helpers import block_pattern
from jax.sharding import NamedSharding, PartitionSpec as P

import ringeqx as rx


SEQ, BLOCK = 4 * 1024, 256


# Open: Triton's lowering fails on a `closed_call` of `jnp.where(bool[1, 512], int32
# scalar, int32[1, 512])` (KeyError) that Causal alone does not produce; found at the
# deadline, not yet traced to its source. Strict, so a fix shows up.
@pytest.mark.xfail(strict=True, reason="Triton lowering KeyError: closed_call")
@pytest.mark.parametrize("which", ["alone", "and_causal", "or_prefix"])
def test_block_sparse_compiles_with_triton(which):
    mesh = rx.target_mesh("h100", 8)
    sparse = rx.BlockSparse(block_pattern(SEQ, BLOCK), BLOCK)
    mask = {
        "alone": sparse,
        "and_causal": sparse & rx.Causal(),
        "or_prefix": (sparse & rx.Causal()) | rx.PrefixLM(100),
    }[which]
    kernel = rx.PallasGpuKernel(block_q=128, block_kv=64)

    def loss(q, k, v):
        out = rx.ring_attention(q, k, v, mesh=mesh, mask=mask, kernel=kernel)
        return out.astype(jnp.float32).sum()

    spec = NamedSharding(mesh, P(None, "sequence"))
    args = [jax.ShapeDtypeStruct((1, SEQ, 4, 64), jnp.bfloat16, sharding=spec)] * 3
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    text = compiled.as_text()
    assert "__gpu$xla.gpu.triton" in text
    for part in ("forward", "backward_dq", "backward_dkv"):
        assert f"ringeqx_gpu_flash_{part}" in text
