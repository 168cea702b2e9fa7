"""Trace-time checks of user arguments: one place for "expected versus got" messages."""

import jax
import jax.numpy as jnp

from .._masks._base import AbstractMask
from .._util._numbers import concrete_scalar


def check_mask_arg(mask) -> None:
    if isinstance(mask, type) and issubclass(mask, AbstractMask):
        raise TypeError(
            f"`mask` must be a mask instance; got the class {mask.__name__}. Write "
            f"`mask=ringeqx.{mask.__name__}()` (with its arguments)."
        )
    if mask is not None and not isinstance(mask, AbstractMask):
        raise TypeError(
            "`mask` must be a ringeqx.AbstractMask instance such as `ringeqx.Causal()`; "
            f"got {type(mask).__name__} {mask!r}."
        )


def check_scale(scale) -> None:
    if scale is None:
        return
    if isinstance(scale, jax.core.Tracer):
        raise TypeError(
            "`scale` must be a concrete Python number (it is a static compile-time "
            "constant); got a traced value. Pass it outside `jax.jit`, or mark it static "
            "(`jax.jit(..., static_argnames='scale')`)."
        )
    value = concrete_scalar(scale)
    if value is None:
        raise TypeError(f"`scale` must be a number or None; got {scale!r}.")


def check_qkv(q, k, v) -> None:
    """The ranks, dtypes and shapes of q/k/v (no axis empty), and the heads' GQA
    ratio."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 3:
            raise ValueError(
                f"`{name}` must have shape [*batch, seq, heads, head_dim]; got shape {x.shape}."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be a floating array; got dtype {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"`k` and `v` must have one shape; got {k.shape} and {v.shape}.")
    if q.shape[:-3] != k.shape[:-3]:
        raise ValueError(
            f"q and k/v must share batch dimensions; got q batch {q.shape[:-3]} and "
            f"k batch {k.shape[:-3]}."
        )
    if q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"q and k/v must share the sequence length; got q seq {q.shape[-3]} and "
            f"k seq {k.shape[-3]}."
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k/v must share head_dim; got q head_dim {q.shape[-1]} and k/v head_dim "
            f"{k.shape[-1]}."
        )
    check_sizes(q, k)
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads % kv_heads != 0:
        raise ValueError(
            f"q heads must be a multiple of kv_heads; got heads={heads}, kv_heads={kv_heads}."
        )


def check_sizes(q, k) -> None:
    """Every axis of q/k/v has size >= 1."""
    names = ("batch",) * (q.ndim - 3) + ("seq", "heads", "head_dim")
    for name, size in zip(names, q.shape):
        if size == 0:
            raise ValueError(
                f"`q` must have every axis of size >= 1; got {name} = 0 (shape {q.shape})."
            )
    if 0 in k.shape:
        raise ValueError(f"`k` and `v` must have every axis of size >= 1; got shape {k.shape}.")


def as_qkv(q, k, v):
    """q, k, v as JAX arrays (lists and NumPy arrays are converted)."""
    return tuple(x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
