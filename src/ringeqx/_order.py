"""One order for every device's collectives on a CPU mesh: a token threaded through them.

XLA:CPU runs the operations of a device's program that do not depend on each other
concurrently, so two collectives that do not depend on each other may start in one order
on one device and in the other order on another. JAX lowers every collective of a
`shard_map` with the same channel id, which is what XLA:CPU's rendezvous keys a collective
by (with the launch and the devices), so a device's collective then meets the other
collective of the other devices: their buffers are exchanged (a wrong answer) or more
participants arrive than there are devices (the process aborts, "id < num_threads").
Optimization barriers do not order them there: XLA:CPU removes them and adds no edges.

What XLA:CPU keeps is data: so on a CPU mesh each of the ring's collectives carries a
*token*, one byte (its value means nothing), packed with what it sends, and the next
collective's operand is built from the token it received. Every collective then waits for
the previous one on every device, so all devices run them in the program's one order.
Each collective moves one packed buffer, so that the arrays of one hop (K, V, their
records, their pieces) cannot race each other either.

TPU and GPU programs run their collectives in the order of one compiled schedule on
every device and need none of this (it would cost them copies, and a chain would stop a
step's transfers from overlapping each other): the ring threads no token there.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree


def _is_array(x) -> bool:
    return isinstance(x, jax.Array)


def _to_bytes(x: Array) -> Array:
    """`x` as a flat uint8 array of its bytes."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).reshape(-1)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(b: Array, shape: tuple[int, ...], dtype) -> Array:
    """The inverse of `_to_bytes`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return b.reshape(shape) != 0
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b.reshape(shape), dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*shape, dtype.itemsize), dtype)


def start_token(*trees: PyTree) -> Array:
    """A token that depends on every array of `trees` (one byte of each), so that the
    first collective that carries it runs after all of them are computed, with the
    collectives that made them."""
    firsts = [
        _to_bytes(x.reshape(-1)[:1])[:1]
        for x in jax.tree.leaves(trees)
        if _is_array(x) and x.size
    ]
    token = jnp.zeros((1,), jnp.uint8)
    for b in firsts:
        token = token + b
    return token


def join(token: Array, *trees: PyTree) -> Array:
    """`token`, made to depend also on every array of `trees`."""
    return token + start_token(*trees)


def after(tree: PyTree, token: Array) -> PyTree:
    """`tree` with every floating array made to depend on `token` (its values unchanged:
    the token's float is multiplied by zero, which XLA keeps, since for floats that is
    not always zero), so that what reads the ring's results runs after its last
    collective. Other arrays are returned as they are."""
    zero = token.astype(jnp.float32)[0] * 0.0

    def tie(x):
        if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x + zero.astype(x.dtype)
        return x

    return jax.tree.map(tie, tree)


def ppermute(tree: PyTree, axis_name, perm, token: Array) -> tuple[PyTree, Array]:
    """`jax.lax.ppermute` of every array of `tree` as one collective that also carries
    `token`: `(tree received, token received)`."""
    leaves, treedef = jax.tree.flatten(tree)
    wire = jnp.concatenate([_to_bytes(x) for x in leaves] + [token])
    got = jax.lax.ppermute(wire, axis_name, perm)
    out, at = [], 0
    for x in leaves:
        n = math.prod(x.shape) * (1 if x.dtype == jnp.bool_ else x.dtype.itemsize)
        out.append(_from_bytes(got[at : at + n], x.shape, x.dtype))
        at += n
    return jax.tree.unflatten(treedef, out), got[at:]


def any_device(flag: Array, axis_name, token: Array) -> tuple[Array, Array]:
    """Whether `flag` is true on any device of `axis_name` (one `psum` that also carries
    `token`): `(flag, token)`."""
    wire = jnp.concatenate([flag.astype(jnp.int32).reshape(1), token.astype(jnp.int32)])
    got = jax.lax.psum(wire, axis_name)
    return got[0] > 0, got[1:].astype(jnp.uint8)
