"""Trace-time checks of user arguments: one place for "expected versus got" messages."""

import jax
import jax.numpy as jnp
import numpy as np


def as_int(x):
    """`x` as a Python int when it is a NumPy integer (`np.int64(4)`), else unchanged.

    Used as the converter of static integer fields and on integer arguments, so NumPy
    integers are accepted wherever a Python int is, and checked the same way.
    """
    if isinstance(x, np.integer):
        return int(x)
    return x


def is_int(x) -> bool:
    """Whether `x` is a Python or NumPy integer (not a bool)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def concrete_scalar(x):
    """`x` as a Python scalar when it is a concrete 0-d value (a Python number, a NumPy
    scalar or a concrete JAX/NumPy array), else None (traced values cannot be checked)."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, (np.generic, np.ndarray, jax.Array)) and np.ndim(x) == 0:
        return np.asarray(x).item()
    return None


def check_int32(name: str, ids) -> None:
    """Raise when concrete integer ids do not fit in int32 (the layout stores int32;
    casting would wrap them silently onto other ids)."""
    if ids is None or isinstance(ids, jax.core.Tracer):
        return
    if isinstance(ids, jax.Array) and not ids.is_fully_addressable:
        return
    x = np.asarray(ids)
    if x.size == 0 or not np.issubdtype(x.dtype, np.integer):
        return
    info = np.iinfo(np.int32)
    lo, hi = x.min(), x.max()
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"`{name}` must fit in int32 [{info.min}, {info.max}]; got values in "
            f"[{lo}, {hi}]. Renumber the ids (e.g. with `np.unique(ids, "
            "return_inverse=True)`)."
        )


def _check_mask_arg(mask) -> None:
    from ._masks import AbstractMask  # _masks imports this module's integer helpers

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
