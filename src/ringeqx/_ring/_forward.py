"""The ring's forward steps on one device: each step's kernel call on the K/V it holds
while they travel on, merged in float32; and the per-block pieces the backward shares
(whether a block can attend, the K/V token axes, the kernel's run-time check)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from .._kernels._base import Scores
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask, block_rule
from . import _order as order
from ._merge import RunningSum
from ._settings import RingSettings


def may_attend(mask: AbstractMask, q_info: TokenInfo, kv_info: TokenInfo):
    qs, ks = q_info.summary(), kv_info.summary()
    return block_rule(mask, qs, ks)


def kv_axes(kv_info):
    """Token axes of `(k, v, kv_info)`: heads-major K/V `[b, h, tokens, d]`, records
    `[b, tokens]`."""
    return (2, 2, jax.tree.map(lambda _: 1, kv_info))


def checked(st: RingSettings, tree, groups, q, q_info, scores: Scores, token, *, backward):
    """`(tree, token)`: `tree` behind the kernel's run-time check of the K/V `groups` a
    step holds (if it makes one), made on every device of the mesh together and before
    the step sends anything (`tree` holds all it sends): a check that failed on some
    devices only, or after others had entered a transfer, would leave devices waiting in
    a collective (a hang, or XLA:CPU's abort after its 40 s rendezvous timeout), never an
    error the caller sees. On a CPU mesh the `psum` carries the token."""
    kernel = st.kernel
    checks = [
        kernel.runtime_check(q, k, q_info, kv_info, scores, backward=backward)
        for k, _, kv_info in groups
    ]
    checks = [c for c in checks if c is not None]
    if not checks:
        return tree, token
    flag = functools.reduce(jnp.logical_or, [flag for flag, _ in checks])
    # Outside the step's branches (which are per device), so every device reaches it.
    axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if token is None:
        flag = jax.lax.psum(flag.astype(jnp.int32), axes) > 0
    else:
        flag, token = order.any_device(flag, axes, token)
    return eqx.error_if(tree, flag, checks[0][1]), token


def ring_forward(st: RingSettings, q, k, v, q_info, kv_info, scores: Scores):
    """Per-device forward: `num_steps` ring steps; K/V (and their records) travel as the
    plan says (by default one piece, +1 per step). Returns `(out, lse, token)`: the token
    of the last collective on a CPU mesh (the backward's chain continues from it), else
    None."""
    kernel = st.kernel
    plan = st.plan(k.shape[2])
    axes = kv_axes(kv_info)

    def compute(kv):
        k, v, kv_info = kv

        def run(_):
            return kernel.forward(q, k, v, q_info, kv_info, scores)

        def skip(_):
            zero = jnp.zeros_like(q, jnp.float32)
            return zero, zero[..., 0] - jnp.inf

        return jax.lax.cond(may_attend(scores.mask, q_info, kv_info), run, skip, None)

    def step(carry, _):
        groups, run, token = carry
        groups, token = checked(st, groups, groups, q, q_info, scores, token, backward=False)
        # Group by group (one per direction): the group's hop starts first, and nothing
        # reads what it delivers before the barrier that also holds the group's kernel
        # results, so the kernel is the only work the transfer can hide behind (the
        # merges and the unpacking would otherwise do as cover). What is done so far
        # passes through the next group's send barrier, so that it cannot cover either.
        received = ()
        rest = groups
        for i in range(len(groups)):
            wire, layouts, (rest, run, received), token = plan.send(
                rest[0], i, axes, st.config.compression_dtype, (rest, run, received), token
            )
            new = compute(rest[0])
            new, wire, rest = jax.lax.optimization_barrier((new, wire, rest[1:]))
            run = run.add(*new)
            received += (plan.receive(wire, layouts, axes),)
        return (received, run, token), None

    zero = jnp.zeros_like(q, jnp.float32)
    # The chain starts after everything the ring reads (and the collectives behind it).
    token = order.start_token(q, k, v, q_info, kv_info) if st.ordered else None
    groups, token = plan.start((k, v, kv_info), axes, token)
    init = (groups, RunningSum(zero, zero[..., 0], zero[..., 0] - jnp.inf), token)
    (groups, run, token), _ = jax.lax.scan(step, init, None, length=st.num_steps - 1)
    groups, token = checked(st, groups, groups, q, q_info, scores, token, backward=False)
    results = [compute(kv) for kv in groups]
    if st.num_steps == 1 and len(results) == 1:
        # One block (one chip): its answer is the answer, not a sum of one.
        o, lse = order.after(results[0], token)
        return o, lse, token
    if st.num_steps == 1:
        # Nothing summed yet (AllGather): the first block starts the sum.
        run, results = RunningSum.of(*results[0]), results[1:]
    for new in results:
        run = run.add(*new)
    o, lse = order.after(run.done(), token)
    return o, lse, token
