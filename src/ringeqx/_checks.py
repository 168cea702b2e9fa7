"""Trace-time checks of user arguments: one place for "expected versus got" messages."""

import jax
import jax.numpy as jnp

from ._masks import AbstractMask
from ._numbers import check_int32, concrete_scalar


def _check_mask_arg(mask) -> None:
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


def _check_scale(scale) -> None:
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


def _check_sizes(q, k) -> None:
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


def check_ring_args(q, k, v, mask, scale, segment_ids, span_ids):
    """Argument checks of `ring_attention` not covered by its shape checks; returns
    q, k, v as JAX arrays."""
    q, k, v = as_qkv(q, k, v)
    check_int32("segment_ids", segment_ids)
    check_int32("span_ids", span_ids)
    _check_mask_arg(mask)
    _check_scale(scale)
    if min(q.ndim, k.ndim) >= 3:
        _check_sizes(q, k)
    return q, k, v
