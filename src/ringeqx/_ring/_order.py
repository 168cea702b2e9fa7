"""One order for every device's collectives on a CPU mesh: a token threaded through them.

XLA:CPU runs the operations of a device's program that do not depend on each other
concurrently, so two collectives that do not depend on each other may start in one order
on one device and in the other order on another. JAX lowers every collective of a
`shard_map` with the same channel id, which is what XLA:CPU's rendezvous keys a collective
by (with the launch and the devices), so a device's collective then meets the other
collective of the other devices: their buffers are exchanged (a wrong answer) or more
participants arrive than there are devices (the process aborts, "id < num_threads").
Optimization barriers do not order them there: XLA:CPU removes them and adds no edges.

What XLA:CPU keeps is data: so on a CPU mesh the ring threads a *token* (one byte; its
value means nothing) through its collectives. Each collective's operand is computed from
the token (`_tie`: a select on a test XLA cannot decide, which leaves the values as they
are), and the next token is read from the collective's result. Every collective then
waits for the previous one on every device, so all devices run them in the program's one
order. What travels is unchanged (the same arrays, dtypes and shapes, so the HLO readers
and the communication report see the same collectives), only no longer concurrently.

TPU and GPU programs run their collectives in the order of one compiled schedule on
every device and need none of this (a chain would stop a step's transfers from
overlapping each other there): the ring threads no token on them.
"""

import functools

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


def join(token: Array | None, *trees: PyTree) -> Array | None:
    """`token`, made to depend also on every array of `trees` (None: no chain, None)."""
    return None if token is None else token + start_token(*trees)


def after(tree: PyTree, token: Array | None) -> PyTree:
    """`tree` with every array computed from `token` (its values unchanged), so that what
    reads the ring's results runs after its last collective (None: no chain, `tree`)."""
    if token is None:
        return tree
    return jax.tree.map(lambda x: _tie(x, token) if _is_array(x) else x, tree)


def _tie(x: Array, token: Array) -> Array:
    """`x`, unchanged, but computed from `token`: a select that XLA keeps, since it cannot
    tell that a float times zero is never NaN, and whose other side is made from the
    token too (were it a constant, a constant `x`, such as a zero cotangent, would let
    XLA fold the select away)."""
    never = jnp.isnan(token.astype(jnp.float32)[0] * 0.0)
    return jnp.where(never, jnp.broadcast_to(token[0].astype(x.dtype), x.shape), x)


def _token_of(y: Array, token: Array) -> Array:
    """The next token, read from a collective's result `y` (an empty `y` gives none)."""
    if y.size == 0:
        return token
    return _to_bytes(y.reshape(-1)[:1])[:1]


def chain(collective, xs: list, token: Array, *per_array: list) -> tuple[list, Array]:
    """`collective(x, *args)` of each array `x` of `xs` (with its entries `args` of the
    lists `per_array`), each one's operand tied to the previous one's result, the first
    to `token`: `(results, token)`."""
    out = []
    for x, *args in zip(xs, *per_array):
        y = collective(_tie(x, token), *args)
        token = _token_of(y, token)
        out.append(y)
    return out, token


def ppermute(tree: PyTree, axis_name, perm, token: Array) -> tuple[PyTree, Array]:
    """`jax.lax.ppermute` of every array of `tree`, in the chain: `(tree, token)`."""
    leaves, treedef = jax.tree.flatten(tree)
    out, token = chain(lambda x: jax.lax.ppermute(x, axis_name, perm), leaves, token)
    return jax.tree.unflatten(treedef, out), token


def any_device(flag: Array, axis_name, token: Array) -> tuple[Array, Array]:
    """Whether `flag` is true on any device of `axis_name` (one `psum`), in the chain:
    `(flag, token)`."""
    (total,), token = chain(
        lambda x: jax.lax.psum(x, axis_name), [flag.astype(jnp.int32)], token
    )
    return total > 0, token


def skipping_none(op):
    """`op(xs, *args, token)` on the arrays of `xs` that are not None (a transpose's
    cotangents: None where the input is not floating), with the lists among `args` (one
    entry per array) cut to match; None elsewhere, and no collective at all where every
    entry is None."""

    @functools.wraps(op)
    def run(xs, *args):
        *args, token = args
        idx = [i for i, x in enumerate(xs) if x is not None]
        if not idx:
            return list(xs), token
        args = [[a[i] for i in idx] if isinstance(a, list) else a for a in args]
        ys, token = op([xs[i] for i in idx], *args, token)
        out = [None] * len(xs)
        for i, y in zip(idx, ys):
            out[i] = y
        return out, token

    return run


@skipping_none
def all_to_all(xs: list, split_axes: list, concat_axes: list, axis_name, token: Array):
    """`jax.lax.all_to_all(x, axis_name, s, c, tiled=True)` of every array of `xs` (with
    its `s` of `split_axes` and `c` of `concat_axes`), in the chain."""

    def run(x, s, c):
        return jax.lax.all_to_all(x, axis_name, s, c, tiled=True)

    return chain(run, xs, token, split_axes, concat_axes)


@skipping_none
def all_gather(xs: list, axes: list, axis_name, token: Array):
    """`jax.lax.all_gather(x, axis_name, axis=a, tiled=True)` of every array of `xs`
    (along its `a` of `axes`), in the chain."""

    def run(x, a):
        return jax.lax.all_gather(x, axis_name, axis=a, tiled=True)

    return chain(run, xs, token, axes)


@skipping_none
def psum_scatter(xs: list, axes: list, axis_name, token: Array):
    """`jax.lax.psum_scatter(x, axis_name, scatter_dimension=a, tiled=True)` of every
    array of `xs` (the transpose of `all_gather`), in the chain."""

    def run(x, a):
        return jax.lax.psum_scatter(x, axis_name, scatter_dimension=a, tiled=True)

    return chain(run, xs, token, axes)


def linear(forward, transpose):
    """A linear map made of collectives, as one link of the chain with its own backward.

    `forward(xs, token) -> (ys, token)` maps a list of arrays with the ordered
    collectives above; `transpose(cts, token) -> (cts, token)` is its transpose, on
    lists with None where an array is not floating (it has no cotangent). The forward's
    chain starts after all of `xs` are computed; the backward's after the forward's last
    collective and after the cotangents; and what reads either result waits for its
    last collective. Autodiff of the collectives themselves would give a backward whose
    collectives depend on nothing but the cotangents (so they could run during the
    forward)."""

    @jax.custom_vjp
    def run(xs):
        ys, token = forward(xs, start_token(xs))
        return after(ys, token)

    def run_fwd(xs):
        ys, token = forward(xs, start_token(xs))
        return after(ys, token), token

    def run_bwd(token, cts):
        cts = [c if jnp.issubdtype(c.dtype, jnp.floating) else None for c in cts]
        back, token = transpose(cts, join(token, cts))
        return (after(back, token),)

    run.defvjp(run_fwd, run_bwd)
    return run
