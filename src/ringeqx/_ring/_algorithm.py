"""The ring algorithm: the float32 merge, the forward and backward steps (a custom VJP
that rings dK/dV home) and the `shard_map` that runs them, for a call resolved by
`ringeqx._ring._call` (the front door, which holds `ring_attention`)."""

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from .._kernels._base import Scores
from .._kernels._xla import score_mod_grads
from .._layout._layout import Layout
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask, block_rule
from .._score_mods import apply_sinks
from . import _order as order
from ._balance import from_zigzag, to_zigzag
from ._comm import RingPlan
from ._mesh import constrain


class _Sum(NamedTuple):
    """The ring's running softmax over the blocks seen so far, unnormalised: `acc` is
    each block's output weighted by `exp(lse_i - top)`, `total` the sum of those
    weights, `top` the largest `lse_i` (float32). Normalised once, at the end (`done`),
    so a weight's rounding cancels in the division by the sum of the computed weights.
    Merging normalised pairs by their log-sum-exp (`out = o exp(lse - logaddexp)`, one
    merge a block) scaled every output by the rounding of `logaddexp`, an error that
    grows with |lse|: 2.8x (3 devices) and 3.4x (8) a dense float32 computation's
    error against float64 in `tests/test_precision.py` (issue 45)."""

    acc: Array
    total: Array
    top: Array

    @staticmethod
    def of(o: Array, lse: Array) -> "_Sum":
        """The sum of one block: its output, weight 1 (0 where it saw nothing)."""
        seen = lse > -jnp.inf
        return _Sum(o, seen.astype(jnp.float32), lse)

    def add(self, o: Array, lse: Array) -> "_Sum":
        top = jnp.maximum(self.top, lse)
        safe = jnp.where(top == -jnp.inf, 0.0, top)
        old, new = jnp.exp(self.top - safe), jnp.exp(lse - safe)
        return _Sum(self.acc * old[..., None] + o * new[..., None], self.total * old + new, top)

    def done(self) -> tuple[Array, Array]:
        """`(out, lse)`; rows that saw nothing give 0 and -inf."""
        seen = self.total > 0
        total = jnp.where(seen, self.total, 1.0)
        lse = jnp.where(seen, self.top + jnp.log(total), -jnp.inf)
        return self.acc / total[..., None], lse


def _may_attend(mask: AbstractMask, q_info: TokenInfo, kv_info: TokenInfo):
    qs, ks = q_info.summary(), kv_info.summary()
    return block_rule(mask, qs, ks)


class RingSettings:
    """Hashable, static settings of one ring call (the custom VJP's non-diff argument):
    the kernel, the ring axis and its size, the steps the ring takes and the
    `RingConfig`, and whether the mesh is a CPU mesh (`ordered`: its collectives then
    carry a token that puts them in one order on every device, see `ringeqx._ring._order`)."""

    def __init__(
        self, kernel, axis_name, num_shards, num_steps, config, num_ahead=0, *, ordered=False
    ):
        self.kernel = kernel
        self.axis_name = axis_name
        self.num_shards = num_shards
        self.num_steps = num_steps
        self.config = config
        # The ring starts with each device holding the K/V of the shard `num_ahead` ahead
        # of its own (two-sided bounded masks), then moves them +1 per step.
        self.num_ahead = num_ahead
        self.ordered = ordered
        self._key = (kernel, axis_name, num_shards, num_steps, config, num_ahead, ordered)

    def plan(self, capacity: int) -> RingPlan:
        """How K/V travel, for shards of `capacity` tokens (known at trace time)."""
        return RingPlan(
            self.config,
            self.axis_name,
            self.num_shards,
            self.num_ahead,
            self.num_steps,
            capacity,
            self.ordered,
        )

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, RingSettings) and self._key == other._key


class RingCall(eqx.Module):
    """One `ring_attention` call, resolved by the front door (`ringeqx._ring._call`): everything
    the ring needs besides q/k/v.

    **Fields:**

    - `scores`: the mask, the score modifier and the scale, as the kernels take them;
        `sinks`: as resolved (`ringeqx._ring._call.resolve_attention`).
    - `layout`: the layout the ring runs on (given, or contiguous), batch axes flat.
    - `settings`: the ring's static settings (kernel, axis, steps, config).
    - `mesh`, `batch_axis`: where it runs; the batch is sharded over `batch_axis`.
    - `original`: whether q/k/v came (and the result goes back) in the original order.
    - `shape`: the shape of `q` as given (the result's).
    """

    scores: Scores
    sinks: Float[Array, " heads"] | None
    layout: Layout
    settings: RingSettings = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    batch_axis: str | None = eqx.field(static=True)
    original: bool = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)


def _kv_axes(kv_info):
    """Token axes of `(k, v, kv_info)`: heads-major K/V `[b, h, tokens, d]`, records
    `[b, tokens]`."""
    return (2, 2, jax.tree.map(lambda _: 1, kv_info))


def _checked(st: RingSettings, tree, groups, q, q_info, scores: Scores, token, *, backward):
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


def _ring_forward(st: RingSettings, q, k, v, q_info, kv_info, scores: Scores):
    """Per-device forward: `num_steps` ring steps; K/V (and their records) travel as the
    plan says (by default one piece, +1 per step). Returns `(out, lse, token)`: the token
    of the last collective on a CPU mesh (the backward's chain continues from it), else
    None."""
    kernel = st.kernel
    plan = st.plan(k.shape[2])
    axes = _kv_axes(kv_info)

    def compute(kv):
        k, v, kv_info = kv

        def run(_):
            return kernel.forward(q, k, v, q_info, kv_info, scores)

        def skip(_):
            zero = jnp.zeros_like(q, jnp.float32)
            return zero, zero[..., 0] - jnp.inf

        return jax.lax.cond(_may_attend(scores.mask, q_info, kv_info), run, skip, None)

    def step(carry, _):
        groups, run, token = carry
        groups, token = _checked(st, groups, groups, q, q_info, scores, token, backward=False)
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
    init = (groups, _Sum(zero, zero[..., 0], zero[..., 0] - jnp.inf), token)
    (groups, run, token), _ = jax.lax.scan(step, init, None, length=st.num_steps - 1)
    groups, token = _checked(st, groups, groups, q, q_info, scores, token, backward=False)
    results = [compute(kv) for kv in groups]
    if st.num_steps == 1 and len(results) == 1:
        # One block (one chip): its answer is the answer, not a sum of one.
        o, lse = order.after(results[0], token)
        return o, lse, token
    if st.num_steps == 1:
        # Nothing summed yet (AllGather): the first block starts the sum.
        run, results = _Sum.of(*results[0]), results[1:]
    for new in results:
        run = run.add(*new)
    o, lse = order.after(run.done(), token)
    return o, lse, token


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: RingSettings, q, k, v, q_info, kv_info, scores: Scores):
    out, lse, _ = _ring_forward(st, q, k, v, q_info, kv_info, scores)
    return out, lse


class _Differentiated(eqx.Module):
    """Which leaves of the score modifier the caller differentiates (a residual of the
    custom VJP: static, one flag per leaf)."""

    flags: tuple[bool, ...] = eqx.field(static=True)

    def spec(self, score_mod):
        """The flags as a filter spec of `score_mod` (for `eqx.partition`), or None when
        no leaf is differentiated."""
        if not any(self.flags):
            return None
        return jax.tree.unflatten(jax.tree.structure(score_mod), self.flags)


def _ring_fwd(st, q, k, v, q_info, kv_info, scores):
    # Symbolic zeros tell which inputs are differentiated: the modifier's leaves that are
    # get their gradient from an extra pass in the backward; the others cost nothing.
    def differentiated(p):
        return p.perturbed and jnp.issubdtype(jnp.result_type(p.value), jnp.inexact)

    flags = tuple(differentiated(p) for p in jax.tree.leaves(scores.score_mod))
    q, k, v, q_info, kv_info, scores = jax.tree.map(
        lambda p: p.value, (q, k, v, q_info, kv_info, scores)
    )
    out, lse, token = _ring_forward(st, q, k, v, q_info, kv_info, scores)
    res = (q, k, v, q_info, kv_info, scores, out, lse, token, _Differentiated(flags))
    return (out, lse), res


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

    return jax.lax.cond(_may_attend(scores.mask, q_info, kv_info), run, skip, None)


def _instantiate(ct):
    """A cotangent as an array: symbolic zeros (`defvjp(..., symbolic_zeros=True)`) mark
    an output nobody reads."""
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


def _ring_bwd(st: RingSettings, res, cts):
    q, k, v, q_info, kv_info, scores, out, lse, token, differentiated = res
    d_out, d_lse = (_instantiate(ct) for ct in cts)
    # On a CPU mesh: after the forward's last collective and what made the cotangents
    # (the layers above, their collectives), which the first K/V hop reads neither of.
    token = order.join(token, d_out, d_lse)
    plan = st.plan(k.shape[2])
    axes = _kv_axes(kv_info)
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
        (groups, accs, pending), token = _checked(
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


_ring.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


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
