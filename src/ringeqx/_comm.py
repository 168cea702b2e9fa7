"""Ring communication: configuration and the ppermute helpers."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import PyTree


class RingConfig(eqx.Module):
    """How the ring communicates.

    **Arguments:**

    - `compression_dtype`: if set (e.g. `jnp.bfloat16`), K/V travel between devices in this
        dtype and are cast back to their own dtype on arrival; the device's own block is
        used exactly. The gradient accumulators dK/dV always travel in float32. None (the
        default) sends K/V as they are.
    """

    compression_dtype: DTypeLike | None = eqx.field(
        static=True, default=None, converter=lambda d: None if d is None else jnp.dtype(d)
    )

    def __check_init__(self):
        dt = self.compression_dtype
        if dt is not None and not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(
                f"RingConfig `compression_dtype` must be a floating dtype or None; got {dt!r}."
            )


def shift(tree: PyTree, axis_name: str, num_shards: int, offset: int) -> PyTree:
    """Send every array of `tree` from device `i` to device `(i + offset) % num_shards`."""
    offset %= num_shards
    if offset == 0:
        return tree
    perm = [(i, (i + offset) % num_shards) for i in range(num_shards)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def shift_compressed(
    tree: PyTree, axis_name: str, num_shards: int, config: RingConfig
) -> PyTree:
    """`shift(tree, +1)`, with floating arrays sent in `config.compression_dtype`."""
    dt = config.compression_dtype
    if dt is None:
        return shift(tree, axis_name, num_shards, 1)

    bits = jnp.dtype(f"uint{8 * jnp.dtype(dt).itemsize}")

    # Sent as raw bits: otherwise XLA may move the narrowing convert past the transfer
    # (it does on CPU) and send the wide dtype after all.
    def pack(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.lax.bitcast_convert_type(x.astype(dt), bits)

    def unpack(new, old):
        if not jnp.issubdtype(old.dtype, jnp.floating):
            return new
        return jax.lax.bitcast_convert_type(new, dt).astype(old.dtype)

    sent = shift(jax.tree.map(pack, tree), axis_name, num_shards, 1)
    return jax.tree.map(unpack, sent, tree)
