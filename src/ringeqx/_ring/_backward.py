"""The ring's backward on one device (the custom VJP's `bwd`): each step's gradients of
the block it holds, dK/dV accumulators ringing home one step behind their K/V, and the
score modifier's gradients from an extra pass when the caller differentiates it."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .._kernels._base import Scores
from .._kernels._score_mod_grads import score_mod_grads
from . import _order as order
from ._forward import checked, kv_axes, may_attend
from ._settings import RingSettings


class Differentiated(eqx.Module):
    """Which leaves of the score modifier the caller differentiates (a residual of the
    custom VJP: static, one flag per leaf)."""

    flags: tuple[bool, ...] = eqx.field(static=True)

    def spec(self, score_mod):
        """The flags as a filter spec of `score_mod` (for `eqx.partition`), or None when
        no leaf is differentiated."""
        if not any(self.flags):
            return None
        return jax.tree.unflatten(jax.tree.structure(score_mod), self.flags)


def _zero_mod_grads(score_mod, diff):
    """Float32 zeros for the differentiated leaves of `score_mod` (None when `diff`, their
    filter spec, is None)."""
    if diff is None:
        return None
    params, _ = eqx.partition(score_mod, diff)
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)


def _backward_block(
    st: RingSettings, q, lse, delta, d_out, q_info, scores: Scores, diff, k, v, kv_info
):
    """dQ, dK, dV of one block (zeros where the mask rules the whole block out), and with
    `diff` (a filter spec of the score modifier's differentiated leaves) their gradients."""

    def run(_):
        grads = st.kernel.backward(q, k, v, lse, delta, d_out, q_info, kv_info, scores)
        if diff is None:
            return grads, None
        mod = score_mod_grads(q, k, v, lse, delta, d_out, q_info, kv_info, scores, diff)
        return grads, mod

    def skip(_):
        grads = (
            jnp.zeros_like(q, jnp.float32),
            jnp.zeros_like(k, jnp.float32),
            jnp.zeros_like(v, jnp.float32),
        )
        return grads, _zero_mod_grads(scores.score_mod, diff)

    return jax.lax.cond(may_attend(scores.mask, q_info, kv_info), run, skip, None)


def _instantiate(ct):
    """A cotangent as an array: symbolic zeros (`defvjp(..., symbolic_zeros=True)`) mark
    an output nobody reads."""
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


def ring_bwd(st: RingSettings, res, cts):
    """The custom VJP's `bwd` (residuals from `ringeqx._ring._algorithm`'s `fwd`): the
    cotangents of `(q, k, v, q_info, kv_info, scores)`."""
    q, k, v, q_info, kv_info, scores, out, lse, token, differentiated = res
    d_out, d_lse = (_instantiate(ct) for ct in cts)
    # On a CPU mesh: after the forward's last collective and what made the cotangents
    # (the layers above, their collectives), which the first K/V hop reads neither of.
    token = order.join(token, d_out, d_lse)
    plan = st.plan(k.shape[2])
    axes = kv_axes(kv_info)
    acc_axes = (2, 2)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out, axis=-1) - d_lse
    d_out = d_out.astype(q.dtype)

    diff = differentiated.spec(scores.score_mod)
    compute = functools.partial(
        _backward_block, st, q, lse, delta, d_out, q_info, scores, diff
    )
    grad_dt = st.config.grad_compression_dtype
    grad_dt = None if grad_dt == jnp.float32 else grad_dt

    def hop(groups, accs, pending, local, token, *, send_kv: bool, send_acc: bool):
        """One step on the K/V `groups` held, group by group as in the forward. dK/dV
        travel one step behind their K/V: what this device adds to the accumulator of
        the previous step's block (`accs` received plus its `pending` part) leaves now,
        so that neither transfer waits for this step's kernel and both hide behind it.
        `local` is what stays on the device: dQ and the modifier's gradients. On a CPU
        mesh the K/V hop's collective carries the token on to the dK/dV hop's."""
        out_groups, out_accs, out_pending = (), (), ()
        (groups, accs, pending), token = checked(
            st, (groups, accs, pending), groups, q, q_info, scores, token, backward=True
        )
        rest = groups
        for i in range(len(groups)):
            done = (rest, local, out_groups, out_accs, out_pending)
            kv_wire, kv_layouts, acc_wire, acc_layouts = [], (), [], ()
            if send_kv:
                kv_wire, kv_layouts, done, token = plan.send(
                    rest[0], i, axes, st.config.compression_dtype, done, token
                )
            if send_acc:
                out = jax.tree.map(jnp.add, accs[i], pending[i])
                acc_wire, acc_layouts, done, token = plan.send(
                    out, i, acc_axes, grad_dt, done, token
                )
            rest, local, out_groups, out_accs, out_pending = done
            held = rest[0]
            new = compute(*held)
            new, kv_wire, acc_wire, rest = jax.lax.optimization_barrier(
                (new, kv_wire, acc_wire, rest[1:])
            )
            (dq, dk, dv), mod = new
            local = jax.tree.map(jnp.add, local, (dq, mod))
            out_pending += ((dk, dv),)
            out_groups += (plan.receive(kv_wire, kv_layouts, axes) if send_kv else held,)
            # Before any accumulator arrives (step 0), the device's own part is all.
            out_accs += (
                plan.receive(acc_wire, acc_layouts, acc_axes)
                if send_acc
                else (jnp.zeros_like(dk), jnp.zeros_like(dv)),
            )
        return out_groups, out_accs, out_pending, local, token

    groups, token = plan.start((k, v, kv_info), axes, token)
    local = (jnp.zeros_like(q, jnp.float32), _zero_mod_grads(scores.score_mod, diff))
    state = _backward_steps(st.num_steps, hop, (groups, None, None, local, token))
    _, accs, pending, (dq, mod), token = state
    accs = jax.tree.map(jnp.add, accs, pending)
    (dk, dv), token = plan.home(accs, acc_axes, token)
    # dQ and the modifier's gradients do not travel, yet what reads them must wait too.
    dq, mod = order.after((dq, mod), token)
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
        None,
        _scores_cotangent(scores, diff, mod),
    )


def _backward_steps(n: int, hop, state):
    """The backward's `n` steps from `state`: the first sends K/V only, the last the
    dK/dV accumulators only, and the scanned ones between both."""
    state = hop(*state, send_kv=n > 1, send_acc=False)
    if n > 2:

        def step(state, _):
            return hop(*state, send_kv=True, send_acc=True), None

        state, _ = jax.lax.scan(step, state, None, length=n - 2)
    if n > 1:
        state = hop(*state, send_kv=False, send_acc=True)
    return state


def _scores_cotangent(scores: Scores, diff, mod):
    """The cotangent of `scores`: None, or the modifier's gradients `mod` (float32, this
    device's share) cast to their leaves' dtypes, with None for every other leaf.
    `shard_map` sums the cotangent of its replicated input over the mesh, so every query
    of every device counts once."""
    if mod is None:
        return None
    params, _ = eqx.partition(scores.score_mod, diff)
    mod = jax.tree.map(lambda g, x: g.astype(jnp.result_type(x)), mod, params)
    d_scores = jax.tree.map(lambda _: None, scores)
    return eqx.tree_at(lambda s: s.score_mod, d_scores, mod, is_leaf=lambda x: x is None)
