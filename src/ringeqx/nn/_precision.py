"""`Precision`: which dtype a layer stores its parameters in, computes in, and returns."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


_FLOATS = ("float32", "bfloat16", "float16")


def _floating(name: str, dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, one of `_FLOATS`, or an error naming the argument."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in _FLOATS:
        expected = ", ".join(repr(f) for f in _FLOATS)
        raise ValueError(
            f"`{name}` must be one of {expected} (a name or a jnp dtype); got {dtype!r}."
        )
    return resolved


def _cast(tree: Any, dtype: np.dtype) -> Any:
    """Every floating array of `tree` as `dtype`; everything else (integers, static
    fields) as it is. Differentiable: gradients come back in the original dtype."""

    def cast(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


class Precision(eqx.Module):
    """A mixed-precision policy for the layers of `ringeqx.nn`: the dtype parameters are
    stored in, the dtype the layer computes in, and the dtype it returns.

    A layer with a policy builds its parameters in `param_dtype`; inside each call it
    casts its weight matrices and its input to `compute_dtype` (so the matrix products
    and ring attention run there, and gradients flow back through the casts to the
    parameters, in `param_dtype`), and casts its result to `output_dtype`. What needs
    range stays float32 whatever the policy: normalisation statistics (Equinox's
    `RMSNorm` computes in float32), attention's scores and softmax (see the ring's
    numerics), the LM's logits (the head's product accumulates in float32) and its loss.

    The default, `Precision()`, is float32 throughout: today's models, unchanged.

    **The recipe** for training on TPUs and GPUs: float32 master parameters (and
    optimiser state), bfloat16 compute, a float32 residual stream between blocks:

    ```python
    lm = ringeqx.nn.RingTransformerLM(
        32000, 1024, 16, 20, precision=ringeqx.nn.Precision.mixed(), key=key
    )
    ```

    **Arguments:**

    - `param_dtype`, `compute_dtype`, `output_dtype`: each `"float32"`, `"bfloat16"` or
        `"float16"` (a name or a `jnp` dtype); default `"float32"`.
    """

    param_dtype: np.dtype = eqx.field(static=True)
    compute_dtype: np.dtype = eqx.field(static=True)
    output_dtype: np.dtype = eqx.field(static=True)

    def __init__(
        self,
        param_dtype: Any = "float32",
        compute_dtype: Any = "float32",
        output_dtype: Any = "float32",
    ):
        self.param_dtype = _floating("param_dtype", param_dtype)
        self.compute_dtype = _floating("compute_dtype", compute_dtype)
        self.output_dtype = _floating("output_dtype", output_dtype)

    @classmethod
    def mixed(cls) -> "Precision":
        """`Precision("float32", "bfloat16", "float32")`: float32 parameters, bfloat16
        compute, float32 outputs (the recipe above)."""
        return cls("float32", "bfloat16", "float32")

    def cast_to_param(self, tree: Any) -> Any:
        """Every floating array of `tree` in `param_dtype` (other leaves unchanged)."""
        return _cast(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Every floating array of `tree` in `compute_dtype` (other leaves unchanged)."""
        return _cast(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Every floating array of `tree` in `output_dtype` (other leaves unchanged)."""
        return _cast(tree, self.output_dtype)


def check_precision(precision) -> "Precision":
    """`precision` (default `Precision()`), or a `TypeError` that says what it must be."""
    if precision is None:
        return Precision()
    if not isinstance(precision, Precision):
        raise TypeError(
            "`precision` must be a ringeqx.nn.Precision (e.g. `Precision.mixed()`) or None; "
            f"got {type(precision).__name__} {precision!r}."
        )
    return precision
