"""Checks of numbers and integer arrays given by users, whether Python, NumPy or JAX."""

import math

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


def check_size(name: str, x, minimum: int = 1) -> int:
    """`x` as a Python int, when it is an integer (Python or NumPy, not a bool) of at
    least `minimum`; else a ValueError that names `name`."""
    x = as_int(x)
    if not is_int(x) or x < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}; got {shown(x)}.")
    return int(x)


def shown(x) -> str:
    """`repr(x)` for an error message; for a traced value, also why it is traced: an
    integer that sets a static size cannot come through `jax.jit` / `eqx.filter_jit` as
    an argument (both trace NumPy integers and 0-d arrays too)."""
    if isinstance(x, jax.core.Tracer):
        return (
            f"a traced value {x!r} (under `jax.jit` or `eqx.filter_jit`, an integer passed "
            "as an argument is traced, NumPy integers included: give a Python int from "
            "outside the jitted function, or mark the argument static)"
        )
    return repr(x)


def as_number(x):
    """`x` as a Python number when it is a NumPy scalar or a concrete 0-d array (as
    `as_int`, floats included), else unchanged."""
    if isinstance(x, np.floating):
        return float(x)
    return as_int(x)


def check_positive(name: str, x, hint: str = "") -> int | float:
    """`x` when it is a finite real number > 0 (Python or NumPy, not a bool); else a
    ValueError that names `name` (and says `hint`, such as what else may be passed)."""
    x = as_number(x)
    real = isinstance(x, (int, float)) and not isinstance(x, bool)
    if not (real and math.isfinite(x) and x > 0):
        raise ValueError(f"`{name}` must be a finite number > 0{hint}; got {shown(x)}.")
    return x


def check_bool(name: str, x) -> bool:
    """`x` as a Python bool when it is one (or a NumPy bool); else a TypeError that names
    `name`. Truthiness is not enough: `"False"` and `"no"` are true, `0` and `1` may be
    a size given to the wrong argument."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool (True or False); got {type(x).__name__} {x!r}.")
    return bool(x)
