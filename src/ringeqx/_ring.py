"""Exact ring attention: the schedule, its custom VJP, and the public entry point."""

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from ._balance import from_zigzag, to_zigzag
from ._checks import check_ring_args
from ._comm import RingConfig, RingPlan
from ._compat import translate
from ._kernels._base import AbstractAttentionKernel
from ._kernels._select import DeviceType, KernelName, select_kernel
from ._layout import Layout, contiguous_layout
from ._masks import AbstractMask, Full, block_rule, check_ids
from ._score_mods import AbstractScoreMod, apply_sinks, check_sinks
from ._steps import analytic_window, early_stop_error, ring_window
from ._tokens import TokenInfo


def _merge(o, lse, o_new, lse_new):
    """Combine two softmax-normalised partial results by their log-sum-exp, in float32."""
    lse_out = jnp.logaddexp(lse, lse_new)
    safe = jnp.where(lse_out == -jnp.inf, 0.0, lse_out)
    w = jnp.exp(lse - safe)[..., None]
    w_new = jnp.exp(lse_new - safe)[..., None]
    return o * w + o_new * w_new, lse_out


def _may_attend(mask: AbstractMask, q_info: TokenInfo, kv_info: TokenInfo):
    qs, ks = q_info.summary(), kv_info.summary()
    return block_rule(mask, qs, ks)


class _Static:
    """Hashable, static settings of one ring call (the custom VJP's non-diff argument)."""

    def __init__(self, kernel, scale, axis_name, num_shards, num_steps, config, num_ahead=0):
        self.kernel = kernel
        self.scale = scale
        self.axis_name = axis_name
        self.num_shards = num_shards
        self.num_steps = num_steps
        self.config = config
        # The ring starts with each device holding the K/V of the shard `num_ahead` ahead
        # of its own (two-sided bounded masks), then moves them +1 per step.
        self.num_ahead = num_ahead
        self._key = (kernel, scale, axis_name, num_shards, num_steps, config, num_ahead)

    def plan(self, capacity: int) -> RingPlan:
        """How K/V travel, for shards of `capacity` tokens (known at trace time)."""
        return RingPlan(
            self.config,
            self.axis_name,
            self.num_shards,
            self.num_ahead,
            self.num_steps,
            capacity,
        )

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Static) and self._key == other._key


def _kv_axes(kv_info):
    """Token axes of `(k, v, kv_info)`: heads-major K/V `[b, h, tokens, d]`, records
    `[b, tokens]`."""
    return (2, 2, jax.tree.map(lambda _: 1, kv_info))


def _ring_forward(st: _Static, q, k, v, q_info, kv_info, mask, score_mod):
    """Per-device forward: `num_steps` ring steps; K/V (and their records) travel as the
    plan says (by default one piece, +1 per step)."""
    kernel = st.kernel
    plan = st.plan(k.shape[2])
    axes = _kv_axes(kv_info)

    def compute(kv):
        k, v, kv_info = kv

        def run(_):
            return kernel.forward(q, k, v, q_info, kv_info, mask, score_mod, st.scale)

        def skip(_):
            zero = jnp.zeros_like(q, jnp.float32)
            return zero, zero[..., 0] - jnp.inf

        return jax.lax.cond(_may_attend(mask, q_info, kv_info), run, skip, None)

    def step(carry, _):
        groups, o, lse = carry
        # Group by group (one per direction): the group's hop starts first, and nothing
        # reads what it delivers before the barrier that also holds the group's kernel
        # results, so the kernel is the only work the transfer can hide behind (the
        # merges and the unpacking would otherwise do as cover). What is done so far
        # passes through the next group's send barrier, so that it cannot cover either.
        received = ()
        rest = groups
        for i in range(len(groups)):
            wire, layouts, (rest, o, lse, received) = plan.send(
                rest[0], i, axes, st.config.compression_dtype, (rest, o, lse, received)
            )
            new = compute(rest[0])
            new, wire, rest = jax.lax.optimization_barrier((new, wire, rest[1:]))
            o, lse = _merge(o, lse, *new)
            received += (plan.receive(wire, layouts, axes),)
        return (received, o, lse), None

    zero = jnp.zeros_like(q, jnp.float32)
    groups = plan.start((k, v, kv_info), axes)
    init = (groups, zero, zero[..., 0] - jnp.inf)
    (groups, o, lse), _ = jax.lax.scan(step, init, None, length=st.num_steps - 1)
    for kv in groups:
        o, lse = _merge(o, lse, *compute(kv))
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Static, q, k, v, q_info, kv_info, mask, score_mod):
    return _ring_forward(st, q, k, v, q_info, kv_info, mask, score_mod)


def _ring_fwd(st, q, k, v, q_info, kv_info, mask, score_mod):
    out, lse = _ring_forward(st, q, k, v, q_info, kv_info, mask, score_mod)
    return (out, lse), (q, k, v, q_info, kv_info, mask, score_mod, out, lse)


def _backward_block(st: _Static, q, lse, delta, d_out, q_info, mask, score_mod, k, v, kv_info):
    """dQ, dK, dV of one block (zeros where the mask rules the whole block out)."""

    def run(_):
        return st.kernel.backward(
            q, k, v, lse, delta, d_out, q_info, kv_info, mask, score_mod, st.scale
        )

    def skip(_):
        return (
            jnp.zeros_like(q, jnp.float32),
            jnp.zeros_like(k, jnp.float32),
            jnp.zeros_like(v, jnp.float32),
        )

    return jax.lax.cond(_may_attend(mask, q_info, kv_info), run, skip, None)


def _ring_bwd(st: _Static, res, cts):
    q, k, v, q_info, kv_info, mask, score_mod, out, lse = res
    d_out, d_lse = cts
    plan = st.plan(k.shape[2])
    axes = _kv_axes(kv_info)
    acc_axes = (2, 2)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out, axis=-1) - d_lse
    d_out = d_out.astype(q.dtype)

    compute = functools.partial(
        _backward_block, st, q, lse, delta, d_out, q_info, mask, score_mod
    )
    grad_dt = st.config.grad_compression_dtype
    grad_dt = None if grad_dt == jnp.float32 else grad_dt

    def hop(groups, accs, pending, dq, *, send_kv: bool, send_acc: bool):
        """One step on the K/V `groups` held, group by group as in the forward. dK/dV
        travel one step behind their K/V: what this device adds to the accumulator of
        the previous step's block (`accs` received plus its `pending` part) leaves now,
        so that neither transfer waits for this step's kernel and both hide behind it."""
        out_groups, out_accs, out_pending = (), (), ()
        rest = groups
        for i in range(len(groups)):
            done = (rest, dq, out_groups, out_accs, out_pending)
            kv_wire, kv_layouts, acc_wire, acc_layouts = [], (), [], ()
            if send_kv:
                kv_wire, kv_layouts, done = plan.send(
                    rest[0], i, axes, st.config.compression_dtype, done
                )
            if send_acc:
                out = jax.tree.map(jnp.add, accs[i], pending[i])
                acc_wire, acc_layouts, done = plan.send(out, i, acc_axes, grad_dt, done)
            rest, dq, out_groups, out_accs, out_pending = done
            held = rest[0]
            new = compute(*held)
            new, kv_wire, acc_wire, rest = jax.lax.optimization_barrier(
                (new, kv_wire, acc_wire, rest[1:])
            )
            dq_s, dk, dv = new
            dq = dq + dq_s
            out_pending += ((dk, dv),)
            out_groups += (plan.receive(kv_wire, kv_layouts, axes) if send_kv else held,)
            # Before any accumulator arrives (step 0), the device's own part is all.
            out_accs += (
                plan.receive(acc_wire, acc_layouts, acc_axes)
                if send_acc
                else (jnp.zeros_like(dk), jnp.zeros_like(dv)),
            )
        return out_groups, out_accs, out_pending, dq

    n = st.num_steps
    groups = plan.start((k, v, kv_info), axes)
    state = hop(groups, None, None, jnp.zeros_like(q, jnp.float32), send_kv=n > 1, send_acc=False)
    if n > 2:

        def step(state, _):
            return hop(*state, send_kv=True, send_acc=True), None

        state, _ = jax.lax.scan(step, state, None, length=n - 2)
    if n > 1:
        state = hop(*state, send_kv=False, send_acc=True)
    _, accs, pending, dq = state
    accs = jax.tree.map(jnp.add, accs, pending)
    dk, dv = plan.home(accs, acc_axes)
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
        None,
        None,
        None,
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 3:
            raise ValueError(
                f"`{name}` must have shape [*batch, seq, heads, head_dim]; got shape {x.shape}."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be a floating array; got dtype {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"`k` and `v` must have one shape; got {k.shape} and {v.shape}.")
    if q.shape[:-3] != k.shape[:-3]:
        raise ValueError(
            f"q and k/v must share batch dimensions; got q batch {q.shape[:-3]} and "
            f"k batch {k.shape[:-3]}."
        )
    if q.shape[-3] != k.shape[-3]:
        raise ValueError(
            f"q and k/v must share the sequence length; got q seq {q.shape[-3]} and "
            f"k seq {k.shape[-3]}."
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k/v must share head_dim; got q head_dim {q.shape[-1]} and k/v head_dim "
            f"{k.shape[-1]}."
        )
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if heads % kv_heads != 0:
        raise ValueError(
            f"q heads must be a multiple of kv_heads; got heads={heads}, kv_heads={kv_heads}."
        )


def _resolve_mesh(mesh, axis_name: str):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            if len(jax.devices()) != 1:
                raise ValueError(
                    f"ring_attention needs a mesh with axis {axis_name!r}: pass `mesh=` or "
                    f"call it under `with jax.set_mesh(mesh):` (there are "
                    f"{len(jax.devices())} devices, so no default ring is assumed)."
                )
            mesh = jax.make_mesh((1,), (axis_name,), axis_types=(AxisType.Auto,))
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not an axis of the mesh; the mesh has axes "
            f"{tuple(mesh.axis_names)}."
        )
    return mesh


def _constrain(x, mesh, spec: PartitionSpec):
    """Put `x` on `spec` where the mesh axes are Explicit (Auto axes need nothing)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types))

    def explicit_only(a):
        names = a if isinstance(a, tuple) else (a,)
        explicit = a is not None and all(types[n] == AxisType.Explicit for n in names)
        return a if explicit else None

    if AxisType.Explicit not in types.values():
        return x
    explicit = PartitionSpec(*(explicit_only(a) for a in spec))
    return jax.sharding.reshard(x, NamedSharding(mesh, explicit))


def _broadcast_info(info: TokenInfo, batch: int) -> TokenInfo:
    def flat(x):
        return jnp.broadcast_to(x.reshape(-1, x.shape[-1]), (batch, x.shape[-1]))

    return jax.tree.map(flat, info)


def _check_arguments(q, k, v, score_mod, sinks) -> None:
    """The checks of ring_attention's arguments that need no mesh or layout."""
    _check_qkv(q, k, v)
    if score_mod is not None:
        score_mod.check(q.shape[-2])
    check_sinks(sinks, q.shape[-2])


def _contiguous(q, num_shards: int, segment_ids, span_ids):
    """The contiguous layout of `q`'s sequence (no `layout=` given), and the segment ids
    flattened to `[batch, seq]`."""
    batch_shape, seq = q.shape[:-3], q.shape[-3]
    batch = math.prod(batch_shape)

    def ids(name, x):
        if x is None:
            return None
        x = jnp.asarray(x)
        if x.ndim > 1 and x.shape[:-1] != batch_shape:
            raise ValueError(
                f"`{name}` must have shape [*batch, seq] = {batch_shape + (seq,)} "
                f"or [seq]; got shape {x.shape}."
            )
        return x.reshape(batch, -1) if x.ndim > 1 else x

    segment_ids = ids("segment_ids", segment_ids)
    # Contiguous shards in the original order: sharding them only pads the end, so
    # sequence-sharded inputs stay sharded (no device ever holds the whole sequence).
    lay = contiguous_layout(
        seq,
        num_shards,
        segment_ids=segment_ids,
        span_ids=ids("span_ids", span_ids),
    )
    return lay, segment_ids


def _check_layout(layout: Layout, q, mesh, axis_name: str, segment_ids, span_ids) -> Layout:
    """Check that an explicit `layout=` fits the ring and the batch of `q` (its order is
    checked by `_input_order`)."""
    num_shards, batch_shape = mesh.shape[axis_name], q.shape[:-3]
    for name, ids_given in (("segment_ids", segment_ids), ("span_ids", span_ids)):
        if ids_given is not None:
            raise ValueError(
                f"Pass `{name}` to the strategy that builds the layout, not to "
                "ring_attention together with `layout=`."
            )
    if layout.num_shards != num_shards:
        raise ValueError(
            f"The layout has {layout.num_shards} shards but the ring axis "
            f"{axis_name!r} has {num_shards} devices; they must be equal."
        )
    if layout.batch_shape not in ((), batch_shape):
        raise ValueError(
            f"The layout's batch shape {layout.batch_shape} must be () or the batch "
            f"shape of q {batch_shape}."
        )
    return layout


def _input_order(layout: Layout | None, seq: int, order: str | None) -> str:
    """The order q/k/v of length `seq` are in: the one `order` states, or the one their
    length implies. A length that fits both orders needs `order`; a stated order must
    fit the length."""
    if order not in (None, "layout", "original"):
        raise ValueError(f"`order` must be 'layout', 'original' or None; got {order!r}.")
    if layout is None:
        if order == "layout":
            raise ValueError(
                "`order='layout'` needs a `layout=`; without one q/k/v are in the "
                "original order (pass order=None or 'original')."
            )
        return "original"
    lengths = {"layout": layout.sharded_len, "original": layout.seq_len}
    if order is None and seq == lengths["layout"] == lengths["original"]:
        raise ValueError(
            f"With `layout=`, q/k/v of seq {seq} may be in either order (the layout's "
            "original length and its layout-order length num_shards * capacity are "
            "equal): pass `order='layout'` if they are already in layout order (made by "
            "`layout.shard`; the result is in layout order too), or `order='original'` "
            "if they are in the original token order (ring_attention then shards them "
            "and returns the result in the original order)."
        )
    if order is None and seq != lengths["layout"]:
        hint = " or pass `order='original'`" if seq == lengths["original"] else ""
        raise ValueError(
            "With `layout=`, q/k/v must be in layout order with seq = num_shards * "
            f"capacity = {lengths['layout']}; got seq {seq}. Use `layout.shard`{hint}."
        )
    order = "layout" if order is None else order
    if seq != lengths[order]:
        what = "num_shards * capacity" if order == "layout" else "the layout's seq_len"
        raise ValueError(
            f"With `order={order!r}`, q/k/v must have seq = {what} = {lengths[order]}; "
            f"got seq {seq}."
        )
    return order


def _flat_batch(layout: Layout) -> Layout:
    """`layout` with its batch axes flattened into one (as q/k/v are inside)."""
    if len(layout.batch_shape) <= 1:
        return layout
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[-2:]), layout)


def _check_early_stop(mask: AbstractMask, lay: Layout) -> None:
    """Raise when the mask's bounds would stop the ring early but a shard they skip may
    attend (wrong bounds, or short shards in a contiguous layout)."""
    num_steps = analytic_window(mask, lay)[1]
    if num_steps >= lay.num_shards:
        return
    # Checked whenever the layout and mask are concrete (a runtime check would need a
    # host callback, which cannot stop an SPMD program on every device). The ring then
    # runs the block rule's window, but a traced run of the same mask and layout would
    # trust the bounds and be silently wrong.
    with jax.ensure_compile_time_eval():
        bad = early_stop_error(mask, lay)
    if not isinstance(bad, jax.core.Tracer) and bool(bad):
        raise ValueError(
            f"The mask's max_distance/max_lookahead and a contiguous layout stop the ring "
            f"after {num_steps} of {lay.num_shards} steps, but a shard it "
            "skips may attend: either the mask's bounds are wrong or the layout's "
            "shards hold fewer than `capacity` tokens between others. Fix the "
            "bounds, or use a layout with contiguous=False."
        )


def _settings(kernel, scale, axis_name, num_shards, config, mask, lay) -> _Static:
    """The static settings of the ring: how many steps it takes, from which start (the
    block rule's window when the layout and mask are concrete, else the bounds';
    allgather mode: one step over the gathered K/V)."""
    if config.mode == "allgather":
        return _Static(kernel, scale, axis_name, num_shards, 1, config)
    _check_early_stop(mask, lay)
    if config.balance is not None:
        # The traded shards are not the layout's: the ring runs all its steps.
        return _Static(kernel, scale, axis_name, num_shards, num_shards, config)
    num_ahead, num_steps = ring_window(mask, lay)
    return _Static(kernel, scale, axis_name, num_shards, num_steps, config, num_ahead)


def _check_ulysses(config: RingConfig, mesh, axis_name, batch_axis, q, k, lay: Layout):
    """The hybrid's checks: its axis is a second mesh axis that divides the heads, the kv
    heads and the tokens per ring shard."""
    u = config.ulysses_axis
    if u is None:
        return
    if u not in mesh.axis_names or u in (axis_name, batch_axis):
        raise ValueError(
            f"RingConfig `ulysses_axis` {u!r} must be a mesh axis other than the ring axis "
            f"{axis_name!r} and the batch axis; the mesh has axes {tuple(mesh.axis_names)}."
        )
    size, heads, kv_heads = mesh.shape[u], q.shape[-2], k.shape[-2]
    if heads % size or kv_heads % size:
        g = math.gcd(heads, kv_heads)
        fits = [d for d in range(1, g + 1) if g % d == 0]
        raise ValueError(
            f"The Ulysses axis {u!r} splits the heads over its {size} devices, so `heads` "
            f"and `kv_heads` must both be multiples of {size}; got heads={heads}, "
            f"kv_heads={kv_heads}. Ulysses sizes that would work: {fits}."
        )
    if lay.capacity % size:
        raise ValueError(
            f"The Ulysses axis {u!r} splits each ring shard's {lay.capacity} tokens "
            f"(the layout's capacity) over its {size} devices; the capacity must be a "
            f"multiple of {size} (choose a sequence length or layout that gives one)."
        )


def _batch_axis(mesh, batch_shape) -> str | None:
    """The mesh axis the batch is sharded over: `"batch"` where the mesh has one."""
    if not (batch_shape and "batch" in mesh.axis_names):
        return None
    batch = math.prod(batch_shape)
    if batch % mesh.shape["batch"] != 0:
        raise ValueError(
            f"The batch size {batch} must be divisible by the mesh axis 'batch' of size "
            f"{mesh.shape['batch']}."
        )
    return "batch"


def _specs(st: _Static, batch_axis) -> tuple[PartitionSpec, PartitionSpec]:
    """The specs of q/k/v in layout order and of the token records: the sequence over the
    ring axis, and for the hybrid over `(ring, ulysses)` (ring major: an all-to-all over
    the Ulysses axis then gives each device one whole ring shard)."""
    u = st.config.ulysses_axis
    seq = st.axis_name if u is None else (st.axis_name, u)
    return PartitionSpec(batch_axis, seq), PartitionSpec(batch_axis, st.axis_name)


def _attend(st: _Static, q, k, v, info, mask, score_mod):
    """One device's attention for its ring shard `[b, C, h, d]`: the ring, or (allgather
    mode) one kernel call over the gathered K/V. Float32 out and lse `[b, C, h]`."""
    if st.config.balance is not None:
        q, k, v, info = to_zigzag((q, k, v, info), st.axis_name, st.num_shards)
    # Heads-major inside the device: the kernels' matmuls then batch over heads.
    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    kv_info = info
    if st.config.mode == "allgather":
        # Autodiff turns the gather into a reduce-scatter of dK/dV in the backward pass.
        def gather(x, axis):
            return jax.lax.all_gather(x, st.axis_name, axis=axis, tiled=True)

        kh, vh = gather(kh, 2), gather(vh, 2)
        kv_info = jax.tree.map(lambda x: gather(x, 1), info)
    out, lse = _ring(st, qh, kh, vh, info, kv_info, mask, score_mod)
    out, lse = jnp.swapaxes(out, 1, 2), jnp.swapaxes(lse, 1, 2)
    if st.config.balance is not None:
        out, lse = from_zigzag((out, lse), st.axis_name, st.num_shards)
    return out, lse


def _ulysses(st: _Static, q, k, v, info, mask, score_mod, cast, with_lse: bool):
    """The hybrid on one device: all-to-all over the Ulysses axis from `[b, C/U, H, d]`
    to `[b, C, H/U, d]` (contiguous head chunks: q head `h` and its kv head `h // groups`
    land on one device), the ring on those heads, and the inverse all-to-all back."""
    u = st.config.ulysses_axis
    q, k, v = (jax.lax.all_to_all(x, u, 2, 1, tiled=True) for x in (q, k, v))
    heads = q.shape[2]
    if score_mod is not None:
        score_mod = score_mod.for_heads(jax.lax.axis_index(u) * heads, heads)
        score_mod.check(heads)
    out, lse = _attend(st, q, k, v, info, mask, score_mod)

    def back(x):
        return jax.lax.all_to_all(x, u, 1, 2, tiled=True)

    return back(cast(out)), (back(lse) if with_lse else lse)


def _shard_map(st: _Static, mesh, batch_axis, qkv, lay: Layout, mask, score_mod, sinks):
    """Run the ring on each device over `[batch, seq, heads, head_dim]` q/k/v in layout
    order; the result, in that order, is typed like q (float32 before the sinks)."""
    dtype = qkv[0].dtype
    seq_spec, info_spec = _specs(st, batch_axis)
    info = _broadcast_info(lay.token_info(), qkv[0].shape[0])

    def cast(out):
        # With sinks, the float32 result is rescaled outside (where autodiff gives the
        # sinks their gradient) before the cast.
        return out if sinks is not None else out.astype(dtype)

    def local(q, k, v, info, mask, score_mod):
        if st.config.ulysses_axis is not None:
            out, lse = _ulysses(st, q, k, v, info, mask, score_mod, cast, sinks is not None)
        else:
            out, lse = _attend(st, q, k, v, info, mask, score_mod)
            out = cast(out)
        return (out, lse) if sinks is not None else out

    qkv = tuple(_constrain(x, mesh, seq_spec) for x in qkv)
    info = jax.tree.map(lambda x: _constrain(x, mesh, info_spec), info)
    out = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(seq_spec, seq_spec, seq_spec, info_spec, PartitionSpec(), PartitionSpec()),
        out_specs=(seq_spec, seq_spec) if sinks is not None else seq_spec,
        check_vma=False,
    )(*qkv, info, mask, score_mod)
    if sinks is not None:
        out, lse = out
        out = apply_sinks(out, lse, sinks).astype(dtype)
    return out


def _shard(x, lay: Layout, mesh, batch_axis):
    """From the original order to layout order."""
    # A layout in the original order only pads the end (the sharding of x is kept);
    # others gather, which Explicit axes need to see done on the whole sequence.
    if not lay.in_order:
        x = _constrain(x, mesh, PartitionSpec(batch_axis, None))
    return lay.shard(x, axis=1)


def _unshard(out, lay: Layout, mesh, batch_axis):
    """Back from layout order to the original order."""
    # A layout in the original order drops the end padding: a slice, so the output
    # keeps the input's sharding. With padding, `seq` has no even sharding (JAX cannot
    # have placed q sharded): the result comes back whole, as q came in; Explicit axes
    # need that said first, as they do before the gather of other layouts.
    if lay.sharded_len != lay.seq_len or not lay.in_order:
        out = _constrain(out, mesh, PartitionSpec(batch_axis, None))
    return lay.unshard(out, axis=1)


def ring_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    *,
    mask: AbstractMask | Bool[ArrayLike, "..."] | None = None,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    layout: Layout | None = None,
    mesh=None,
    axis_name: str = "sequence",
    scale: float | None = None,
    kernel: KernelName | AbstractAttentionKernel = "auto",
    device_type: DeviceType = "auto",
    interpret: bool = False,
    config: RingConfig | None = None,
    score_mod: AbstractScoreMod | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
    sinks: Float[Array, " heads"] | None = None,
    order: Literal["layout", "original"] | None = None,
    is_causal: bool = False,
    local_window_size: int | tuple[int, int] | None = None,
    query_seq_lengths: Int[ArrayLike, "*batch"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, "*batch"] | None = None,
    bias: Float[ArrayLike, "..."] | None = None,
    implementation: str | None = None,
) -> Float[Array, "*batch seq heads head_dim"]:
    r"""Exact softmax attention with the sequence sharded over a ring of devices.

    $$\operatorname{out}_i = \sum_j \operatorname{softmax}_j\big(\text{scale}\; q_i \cdot k_j
    + \text{mask}_{ij}\big)\, v_j$$

    Each device keeps its block of queries; the key/value blocks travel round the ring
    (`lax.ppermute` inside `jax.shard_map`), one hop per step, while each device merges
    its partial results by log-sum-exp in float32. Steps whose blocks the mask rules out
    entirely are skipped; when the layout and mask hold values at trace time (a layout
    built outside `jax.jit`), shard offsets that no device needs are not sent at all
    ([`ringeqx.num_ring_steps`][]). The backward pass (a custom VJP) rings K/V again and sends the
    float32 dK/dV accumulators round with them, back to their owners.

    **Arguments:**

    - `q`: queries `[*batch, seq, heads, head_dim]` (BTNH, as `jax.nn.dot_product_attention`).
    - `k`, `v`: keys and values `[*batch, seq, kv_heads, head_dim]`; `heads` must be a
        multiple of `kv_heads` (GQA/MQA, without copying K/V heads).
    - `mask`: an [`ringeqx.AbstractMask`][] (default: `Full()`).
    - `segment_ids`: `int[*batch, seq]` document ids, for `Document()` masks; without a
        layout only (a layout carries its own).
    - `layout`: a [`ringeqx.Layout`][]; then q/k/v are in layout order (see
        `Layout.shard`) and the result is too, unless `order='original'`. Without one,
        contiguous shards are used (padded at the end where `seq` is not a multiple of
        the devices) and the input and output are in the original order. Either way
        nothing gathers the sequence (except `Layout.shard` for `order='original'` with
        a layout not in the original order): the output keeps the sequence sharding of
        `q`.
    - `mesh`: the device mesh (default: the one set by `jax.set_mesh`; with a single
        device and no mesh, a one-device ring). Batch axes are sharded over its axis
        `"batch"` when it has one.
    - `axis_name`: the mesh axis that forms the ring.
    - `scale`: logit scale (default `1 / sqrt(head_dim)`).
    - `kernel`: the per-device kernel: `"auto"`, a name (`"xla"`, `"pallas_gpu"`,
        `"pallas_tpu"`) or a kernel object; see [`ringeqx.select_kernel`][].
    - `device_type`: `"auto"` (the platform of the mesh's devices: an H100 or TPU mesh
        gets its Pallas kernel, also a mesh of compile-only devices from
        [`ringeqx.target_mesh`][]), `"cpu"`, `"gpu"` or `"tpu"`: picks the default
        kernel and its tiles; a device type other than the mesh's is an error.
    - `interpret`: run Pallas kernels chosen by name in the Pallas interpreter (CPU
        tests).
    - `config`: a [`ringeqx.RingConfig`][]: how K/V travel, including the Ulysses x ring
        hybrid over a second mesh axis (`ulysses_axis=`) and `mode="allgather"`.
    - `score_mod`: an optional [`ringeqx.AbstractScoreMod`][] applied to the logits
        (several: [`ringeqx.Chain`][]). Its parameters are constants here (no gradient).
    - `span_ids`: `int[*batch, seq]` span ids (-1 = none), for `BidirectionalSpans()`;
        without a layout only, like `segment_ids`.
    - `sinks`: optional attention-sink logits `float[heads]`: each joins every row's
        softmax denominator as a key of value zero, $\operatorname{out}_i \leftarrow
        \operatorname{out}_i\, e^{\ell_i - \operatorname{logaddexp}(\ell_i, z_h)}$ with
        the row's global log-sum-exp $\ell_i$. Exact and differentiable (in the sinks
        too: they are meant to be trained).
    - `order`: with `layout=`, the order q/k/v are in: `'layout'` (made by
        `layout.shard`; the result is in layout order) or `'original'` (ring_attention
        shards them and returns the result in the original order). Required when `seq`
        fits both (`seq_len == num_shards * capacity`, e.g. `Zigzag` with `seq`
        divisible by `2 * num_shards`); otherwise the length says which, and a given
        `order` must agree with it.

    `jax.nn.dot_product_attention`'s keyword names mean what they mean there, as masks
    and modifiers combined with `mask=` by `&` (its positional `bias` and `mask` are
    keywords here; the README's migration table lists every name):

    - `is_causal`: `True` adds `Causal()`.
    - `local_window_size`: `w` or `(left, right)`, integers >= 0: query `i` sees keys
        `i - left ... i + right` (`(w - 1, 0)` is `SlidingWindow(w)`); with `is_causal`,
        `right` is 0.
    - `query_seq_lengths`, `key_value_seq_lengths`: `int[*batch]` valid lengths per
        example; keys at or beyond the length are masked, and query rows beyond it are
        zero (as there). They travel as segment ids (or span ids, when the mask or
        `segment_ids=` use segments), so they need no `layout=`.
    - `bias`: one that broadcasts over the queries, `[1, heads or 1, 1, seq]`, becomes a
        score modifier (run before `score_mod`; a constant, no gradient); one constant
        along the keys (`[..., 1]`) leaves softmax unchanged and is dropped. A bias over
        queries and keys, or per example, and a boolean `mask` array are refused: they
        cannot be ring-sharded (the error says what to use).
    - `implementation`: refused; the kernel is chosen by `kernel=` and `device_type=`.

    A row that sees no key is zero here; `jax.nn.dot_product_attention` gives it the
    mean of all values (a uniform softmax over the masked logits).

    **Returns:** an array shaped and typed like `q`. Rows that attend to nothing are zero.

    **Example:**

    ```python
    mesh = jax.make_mesh((4,), ("sequence",))
    with jax.set_mesh(mesh):
        out = ringeqx.ring_attention(q, k, v, mask=ringeqx.Causal())
    ```

    ??? cite "Ring Attention"

        ```bibtex
        @article{liu2023ring,
          title={Ring Attention with Blockwise Transformers for Near-Infinite Context},
          author={Liu, Hao and Zaharia, Matei and Abbeel, Pieter},
          journal={arXiv:2310.01889},
          year={2023}
        }
        ```
    """
    compat = dict(
        is_causal=is_causal,
        local_window_size=local_window_size,
        bias=bias,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        implementation=implementation,
    )
    mask, score_mod, segment_ids, span_ids = translate(
        q, mask, score_mod, segment_ids, span_ids, layout, compat
    )
    q, k, v = check_ring_args(q, k, v, mask, scale, segment_ids, span_ids)
    _check_arguments(q, k, v, score_mod, sinks)
    mask = Full() if mask is None else mask
    config = RingConfig() if config is None else config
    mesh = _resolve_mesh(mesh, axis_name)
    kernel_obj = select_kernel(kernel, device_type, interpret=interpret, mesh=mesh)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    batch = math.prod(q.shape[:-3])
    q3, k3, v3 = (x.reshape((batch,) + x.shape[-3:]) for x in (q, k, v))
    if layout is None:
        lay, segment_ids = _contiguous(q, mesh.shape[axis_name], segment_ids, span_ids)
    else:
        lay = _check_layout(layout, q, mesh, axis_name, segment_ids, span_ids)
        lay = _flat_batch(lay)
    batch_axis = _batch_axis(mesh, q.shape[:-3])
    original = _input_order(layout, q.shape[-3], order) == "original"
    if original:
        q3, k3, v3 = (_shard(x, lay, mesh, batch_axis) for x in (q3, k3, v3))
    check_ids(mask, segment_ids, span_ids, layout)
    _check_ulysses(config, mesh, axis_name, batch_axis, q, k, lay)
    mask.check(lay.seq_len)
    st = _settings(kernel_obj, scale, axis_name, mesh.shape[axis_name], config, mask, lay)
    out = _shard_map(st, mesh, batch_axis, (q3, k3, v3), lay, mask, score_mod, sinks)
    if original:
        out = _unshard(out, lay, mesh, batch_axis)
    return out.reshape(q.shape)
