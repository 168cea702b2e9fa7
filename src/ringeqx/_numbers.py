"""Checks of numbers and integer arrays given by users, whether Python, NumPy or JAX."""

import jax
import numpy as np


def as_int(x):
    """`x` as a Python int when it is a NumPy integer (`np.int64(4)`) or a concrete 0-d
    integer array (`jnp.array(4)`), as a Python float when it is a concrete 0-d floating
    array, else unchanged.

    Used as the converter of static integer fields and on integer arguments, so NumPy
    integers and concrete scalar arrays are accepted wherever a Python int is, and
    checked the same way. Equinox runs converters before it warns about arrays in
    static fields: a bad scalar array (`jnp.array(0)`) gets the field's own error, and
    no warning first.
    """
    if isinstance(x, np.integer):
        return int(x)
    if _concrete_array(x) and np.ndim(x) == 0:
        dtype = np.dtype(x.dtype)
        if np.issubdtype(dtype, np.integer):
            return int(x)
        if np.issubdtype(dtype, np.floating):
            return float(x)
    return x


def _concrete_array(x) -> bool:
    """Whether `x` is a NumPy array or a JAX array whose value can be read here."""
    if isinstance(x, np.ndarray):
        return True
    return (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_fully_addressable
    )


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
    info = np.iinfo(np.int32)
    dtype = getattr(ids, "dtype", None)
    if dtype is not None and np.issubdtype(dtype, np.integer):
        if np.iinfo(dtype).min >= info.min and np.iinfo(dtype).max <= info.max:
            return  # fits by its dtype: no need to read the values (no device transfer)
    if isinstance(ids, jax.Array) and not ids.is_fully_addressable:
        return
    x = np.asarray(ids)
    if x.size == 0 or not np.issubdtype(x.dtype, np.integer):
        return
    lo, hi = x.min(), x.max()
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"`{name}` must fit in int32 [{info.min}, {info.max}]; got values in "
            f"[{lo}, {hi}]. Renumber the ids (e.g. with `np.unique(ids, "
            "return_inverse=True)`)."
        )
