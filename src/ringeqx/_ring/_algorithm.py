"""The ring algorithm for a call resolved by `ringeqx._ring._call` (the front door,
which holds `ring_attention`): the custom VJP that ties the forward steps
(`ringeqx._ring._forward`) to the backward (`ringeqx._ring._backward`, which rings dK/dV
home), and the `shard_map` (with the Ulysses hybrid's all-to-alls) that runs them."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array

from .._kernels._base import Scores
from .._layout._tokens import TokenInfo
from .._score_mods import apply_sinks
from . import _order as order
from ._backward import Differentiated, ring_bwd
from ._balance import from_zigzag, to_zigzag
from ._forward import ring_forward
from ._mesh import constrain
from ._settings import RingCall, RingSettings


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: RingSettings, q, k, v, q_info, kv_info, scores: Scores):
    out, lse, _ = ring_forward(st, q, k, v, q_info, kv_info, scores)
    return out, lse


def _ring_fwd(st, q, k, v, q_info, kv_info, scores):
    # Symbolic zeros tell which inputs are differentiated: the modifier's leaves that are
    # get their gradient from an extra pass in the backward; the others cost nothing.
    def differentiated(p):
        return p.perturbed and jnp.issubdtype(jnp.result_type(p.value), jnp.inexact)

    flags = tuple(differentiated(p) for p in jax.tree.leaves(scores.score_mod))
    q, k, v, q_info, kv_info, scores = jax.tree.map(
        lambda p: p.value, (q, k, v, q_info, kv_info, scores)
    )
    out, lse, token = ring_forward(st, q, k, v, q_info, kv_info, scores)
    res = (q, k, v, q_info, kv_info, scores, out, lse, token, Differentiated(flags))
    return (out, lse), res


_ring.defvjp(_ring_fwd, ring_bwd, symbolic_zeros=True)


def _broadcast_info(info: TokenInfo, batch: int) -> TokenInfo:
    def flat(x):
        return jnp.broadcast_to(x.reshape(-1, x.shape[-1]), (batch, x.shape[-1]))

    return jax.tree.map(flat, info)


def _specs(st: RingSettings, batch_axis) -> tuple[PartitionSpec, PartitionSpec]:
    """The specs of q/k/v in layout order and of the token records: the sequence over the
    ring axis, and for the hybrid over `(ring, ulysses)` (ring major: an all-to-all over
    the Ulysses axis then gives each device one whole ring shard)."""
    u = st.config.ulysses_axis
    seq = st.axis_name if u is None else (st.axis_name, u)
    return PartitionSpec(batch_axis, seq), PartitionSpec(batch_axis, st.axis_name)


def _attend(st: RingSettings, q, k, v, info, scores: Scores, with_lse: bool):
    """One device's attention for its ring shard `[b, C, h, d]`: the ring, or (allgather
    mode) one kernel call over the gathered K/V. Float32 out and lse `[b, C, h]`;
    `with_lse`: whether the caller reads lse."""
    if st.config.balance is not None:
        q, k, v, info = to_zigzag(
            (q, k, v, info), st.axis_name, st.num_shards, ordered=st.ordered
        )
    # Heads-major inside the device: the kernels' matmuls then batch over heads.
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    kv_info = info
    if st.config.mode == "allgather" and st.ordered:
        # The gathers (and the reduce-scatters back) in the token's chain.
        leaves, treedef = jax.tree.flatten((kh, vh, info))
        axes = [2, 2] + [1] * (len(leaves) - 2)
        gather = order.linear(
            lambda xs, t: order.all_gather(xs, axes, st.axis_name, t),
            lambda cts, t: order.psum_scatter(cts, axes, st.axis_name, t),
        )
        kh, vh, kv_info = jax.tree.unflatten(treedef, gather(leaves))
    elif st.config.mode == "allgather":
        # Autodiff turns the gather into a reduce-scatter of dK/dV in the backward pass.
        def gather(x, axis):
            return jax.lax.all_gather(x, st.axis_name, axis=axis, tiled=True)

        kh, vh = gather(kh, 2), gather(vh, 2)
        kv_info = jax.tree.map(lambda x: gather(x, 1), info)
    out, lse = _ring(st, qh, kh, vh, info, kv_info, scores)
    out, lse = jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)
    if st.config.balance is not None and st.ordered and not with_lse:
        # In the CPU chain every trade feeds the next token, so XLA could no longer drop
        # the trade of an lse nobody reads: it is not made (its value is never used).
        return from_zigzag(out, st.axis_name, st.num_shards, ordered=True), lse
    if st.config.balance is not None:
        out, lse = from_zigzag((out, lse), st.axis_name, st.num_shards, ordered=st.ordered)
    return out, lse


def _ulysses(st: RingSettings, q, k, v, info, scores: Scores, cast, with_lse: bool):
    """The hybrid on one device: all-to-all over the Ulysses axis from `[b, C/U, H, d]`
    to `[b, C, H/U, d]` (contiguous head chunks: q head `h` and its kv head `h // groups`
    land on one device), the ring on those heads, and the inverse all-to-all back."""
    u = st.config.ulysses_axis

    def trade(xs, split, concat):
        """All-to-all of each array of `xs` (on a CPU mesh in the token's chain)."""
        if not st.ordered:
            return [jax.lax.all_to_all(x, u, split, concat, tiled=True) for x in xs]
        n = len(xs)
        run = order.linear(
            lambda xs, t: order.all_to_all(xs, [split] * n, [concat] * n, u, t),
            lambda cts, t: order.all_to_all(cts, [concat] * n, [split] * n, u, t),
        )
        return run(list(xs))

    q, k, v = trade((q, k, v), 2, 1)
    heads = q.shape[2]
    mod = scores.score_mod
    if mod is not None:
        mod = mod.for_heads(jax.lax.axis_index(u) * heads, heads)
        mod.check(heads)
        scores = Scores(scores.mask, mod, scores.scale)
    out, lse = _attend(st, q, k, v, info, scores, with_lse)
    if with_lse:
        return tuple(trade((cast(out), lse), 1, 2))
    return trade((cast(out),), 1, 2)[0], lse


def run(call: RingCall, qkv: tuple[Array, Array, Array]) -> Array:
    """The ring of a resolved call on each device, over
    `[batch, seq, heads, head_dim]` q/k/v in layout order; the result, in that order, is
    typed like q. The ring algorithm's one entry: everything before it is resolution.

    Always traced (`eqx.filter_jit`; inside a caller's `jit` it is inlined): the custom
    VJP learns which score-modifier leaves are differentiated from symbolic zeros, which
    JAX supports inside a traced `shard_map` only, and a called-eagerly ring then runs
    as one compiled program rather than op by op."""
    return _reverse_mode_only(call, qkv)


def _reverse_mode_only(call: RingCall, qkv: tuple[Array, Array, Array]) -> Array:
    """`_run(call, qkv)`, saying what to use when a caller differentiates it in forward mode
    (`jax.jvp`, `jax.jacfwd`), where JAX's own message names only "a custom_vjp
    function" (issue 45)."""
    try:
        return _run(call, qkv)
    except TypeError as error:
        if "forward-mode" not in str(error):
            raise
        raise TypeError(
            "ring_attention is differentiated in reverse mode only: jax.grad, jax.vjp, "
            "jax.jacrev and jax.value_and_grad work (and jax.hessian, forward over "
            "reverse, with kernel=\"xla\"); jax.jvp, jax.jacfwd and jax.linearize do "
            "not, because the ring's gradients are a custom VJP (dK/dV ring home in "
            "the backward pass). Use jax.jacrev for a Jacobian."
        ) from error


@eqx.filter_jit
def _run(call: RingCall, qkv: tuple[Array, Array, Array]) -> Array:
    st, mesh, scores, sinks = call.settings, call.mesh, call.scores, call.sinks
    dtype = qkv[0].dtype
    seq_spec, info_spec = _specs(st, call.batch_axis)
    info = _broadcast_info(call.layout.token_info(), qkv[0].shape[0])

    def cast(out):
        # With sinks, the float32 result is rescaled outside (where autodiff gives the
        # sinks their gradient) before the cast.
        return out if sinks is not None else out.astype(dtype)

    def local(q, k, v, info, scores):
        if st.config.ulysses_axis is not None:
            out, lse = _ulysses(st, q, k, v, info, scores, cast, sinks is not None)
        else:
            out, lse = _attend(st, q, k, v, info, scores, sinks is not None)
            out = cast(out)
        return (out, lse) if sinks is not None else out

    qkv = tuple(constrain(x, mesh, seq_spec) for x in qkv)
    info = jax.tree.map(lambda x: constrain(x, mesh, info_spec), info)
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq_spec, seq_spec, seq_spec, info_spec, PartitionSpec()),
        out_specs=(seq_spec, seq_spec) if sinks is not None else seq_spec,
        check_vma=False,
    )(*qkv, info, scores)
    if sinks is not None:
        out, lse = out
        out = apply_sinks(out, lse, sinks).astype(dtype)
    return out
