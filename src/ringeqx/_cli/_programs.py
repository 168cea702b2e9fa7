"""The problem the commands build and what they read off it: random q, k, v and a
cotangent, the forward + backward program, the largest error against a reference, and a
compiled program's memory per device."""

from collections.abc import Callable
from typing import Any


def qkv(key, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int):
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32)
    d_out = jax.random.normal(kd, (batch, seq, heads, head_dim), jnp.float32)
    return q, k, v, d_out


def forward_backward(attention: Callable):
    """`(q, k, v, d_out) -> (out, (dq, dk, dv))`: the output and its vjp at `d_out`."""
    import jax

    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out)

    return run


def max_error(a, b) -> float:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    # In a multi-process run the ring's result spans every process: gather it first.
    a, b = (
        multihost_utils.process_allgather(x, tiled=True)
        if isinstance(x, jax.Array) and not x.is_fully_addressable
        else x
        for x in (a, b)
    )

    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def temp_bytes(compiled: Any) -> int | None:
    """Per-device scratch memory of a compiled program (None where XLA does not say)."""
    stats = compiled.memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)


def device_bytes(compiled: Any) -> tuple[int, int, int] | None:
    """Per-device `(arguments, outputs, temp)` bytes of a compiled program (None where
    XLA does not say)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (
        int(stats.argument_size_in_bytes),
        int(stats.output_size_in_bytes),
        int(stats.temp_size_in_bytes),
    )
