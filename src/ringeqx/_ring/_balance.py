"""Causal load balance on the default path: contiguous shards to zigzag shards and back
inside the ring's `shard_map`, by two collective-permutes of half-shards (never a gather).

Contiguous shard `j` holds chunks `2j, 2j + 1` of the `2P` chunks of the sequence; zigzag
shard `i` holds chunks `i` and `2P - 1 - i` (as `ringeqx.Zigzag`). Chunk `c` goes to device
`c` if `c < P`, else `2P - 1 - c`: the even chunks form one permutation of the devices and
the odd chunks another, so each half-shard moves in one hop. On a CPU mesh (`ordered`)
the permutes are chained by a token (`ringeqx._ring._order`), forward and backward.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._layout._tokens import TokenInfo
from . import _order as order


def _home(chunk: int, num_shards: int) -> int:
    """The zigzag device of chunk `chunk`."""
    return chunk if chunk < num_shards else 2 * num_shards - 1 - chunk


def _perms(num_shards: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Source-target pairs that send each device's even and odd chunk to its zigzag home."""
    p = num_shards
    return (
        [(j, _home(2 * j, p)) for j in range(p)],
        [(j, _home(2 * j + 1, p)) for j in range(p)],
    )


def _halves(x: Array, axis: int) -> tuple[Array, Array]:
    if x.shape[axis] % 2:
        raise ValueError(
            "RingConfig(balance='zigzag') needs an even number of tokens per shard; got "
            f"{x.shape[axis]} (pad the sequence to a multiple of 2 x the ring size)."
        )
    return tuple(jnp.split(x, 2, axis))  # type: ignore[return-value]


def _even_device(axis_name: str) -> Array:
    return jax.lax.axis_index(axis_name) % 2 == 0


def _traded(tree: PyTree) -> PyTree:
    """`tree` after its half-shards were traded: the token records' `runs` (a claim the
    kernels trust) become those of shards made of any two half-shards."""

    def relabel(x):
        if isinstance(x, TokenInfo) and x.runs is not None:
            return TokenInfo(x.positions, x.segments, x.spans, x.valid, x.runs.halves())
        return x

    return jax.tree.map(relabel, tree, is_leaf=lambda x: isinstance(x, TokenInfo))


def _to_ordered(xs: list, axis_name: str, num_shards: int, axis: int, token):
    """`to_zigzag` of a list of arrays, its permutes chained from `token`."""
    even_perm, odd_perm = _perms(num_shards)
    even_device = _even_device(axis_name)
    lo, hi = zip(*(_halves(x, axis) for x in xs))
    even, token = order.ppermute(list(lo), axis_name, even_perm, token)
    odd, token = order.ppermute(list(hi), axis_name, odd_perm, token)
    out = [
        jnp.concatenate([jnp.where(even_device, e, o), jnp.where(even_device, o, e)], axis)
        for e, o in zip(even, odd)
    ]
    return out, token


def _from_ordered(ys: list, axis_name: str, num_shards: int, axis: int, token):
    """`from_zigzag` of a list of arrays, its permutes chained from `token`."""
    even_perm, odd_perm = _perms(num_shards)
    even_device = _even_device(axis_name)
    first, second = zip(*(_halves(y, axis) for y in ys))
    even = [jnp.where(even_device, f, s) for f, s in zip(first, second)]
    odd = [jnp.where(even_device, s, f) for f, s in zip(first, second)]
    lo, token = order.ppermute(even, axis_name, [(b, a) for a, b in even_perm], token)
    hi, token = order.ppermute(odd, axis_name, [(b, a) for a, b in odd_perm], token)
    return [jnp.concatenate([a, b], axis) for a, b in zip(lo, hi)], token


def _ordered(tree: PyTree, forward, backward, axis_name, num_shards, axis) -> PyTree:
    """`tree` through `forward` (and back through `backward`, its transpose) as one
    link of the token chain."""
    leaves, treedef = jax.tree.flatten(tree)
    there = order.skipping_none(lambda xs, t: forward(xs, axis_name, num_shards, axis, t))
    back = order.skipping_none(lambda xs, t: backward(xs, axis_name, num_shards, axis, t))
    return _traded(jax.tree.unflatten(treedef, order.linear(there, back)(leaves)))


def to_zigzag(
    tree: PyTree, axis_name: str, num_shards: int, axis: int = 1, *, ordered: bool = False
) -> PyTree:
    """This device's contiguous shard -> its zigzag shard, for every leaf (sequence on
    `axis`). Runs inside `shard_map` over `axis_name`. `ordered`: on a CPU mesh, as two
    collectives in the ring's token chain (`ringeqx._ring._order`)."""
    if ordered:
        return _ordered(tree, _to_ordered, _from_ordered, axis_name, num_shards, axis)
    even_perm, odd_perm = _perms(num_shards)
    even_device = _even_device(axis_name)

    def move(x):
        lo, hi = _halves(x, axis)
        even = jax.lax.ppermute(lo, axis_name, even_perm)
        odd = jax.lax.ppermute(hi, axis_name, odd_perm)
        # Device i's first chunk, i, has i's parity; its second, 2P - 1 - i, the other.
        first = jnp.where(even_device, even, odd)
        second = jnp.where(even_device, odd, even)
        return jnp.concatenate([first, second], axis)

    return _traded(jax.tree.map(move, tree))


def from_zigzag(
    tree: PyTree, axis_name: str, num_shards: int, axis: int = 1, *, ordered: bool = False
) -> PyTree:
    """Inverse of `to_zigzag`: this device's zigzag shard -> its contiguous shard."""
    if ordered:
        return _ordered(tree, _from_ordered, _to_ordered, axis_name, num_shards, axis)
    even_perm, odd_perm = _perms(num_shards)
    even_device = _even_device(axis_name)

    def move(y):
        first, second = _halves(y, axis)
        even = jnp.where(even_device, first, second)
        odd = jnp.where(even_device, second, first)
        lo = jax.lax.ppermute(even, axis_name, [(b, a) for a, b in even_perm])
        hi = jax.lax.ppermute(odd, axis_name, [(b, a) for a, b in odd_perm])
        return jnp.concatenate([lo, hi], axis)

    return _traded(jax.tree.map(move, tree))
