"""The programs the aot checks compile: `jax.grad` of a ring attention loss over q, k, v
sharded along the sequence of a compile-only mesh, lowered (the caller compiles)."""

import jax
import jax.numpy as jnp
from helpers import block_pattern
from jax.sharding import NamedSharding, PartitionSpec as P

import ringeqx as rx


def lowered_ring_grad(mesh, mask, *, seq, heads, kv_heads, head_dim, kernel="auto"):
    """`jax.jit(jax.grad(loss)).lower(...)` for bfloat16 `q [1, seq, heads, head_dim]`
    and K/V with `kv_heads`, the loss the sum of `ring_attention`'s output."""

    def loss(q, k, v):
        out = rx.ring_attention(q, k, v, mask=mask, mesh=mesh, kernel=kernel)
        return out.astype(jnp.float32).sum()

    spec = NamedSharding(mesh, P(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.bfloat16, sharding=spec)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv)


def block_sparse_mask(which: str, seq: int, block: int) -> rx.AbstractMask:
    """BlockSparse `"alone"`, `"and_causal"` or `"or_prefix"` (`(... & Causal) |
    PrefixLM(100)`), over `helpers.block_pattern`."""
    sparse = rx.BlockSparse(block_pattern(seq, block), block)
    return {
        "alone": sparse,
        "and_causal": sparse & rx.Causal(),
        "or_prefix": (sparse & rx.Causal()) | rx.PrefixLM(100),
    }[which]
