"""The front door: a call of `ring_attention` resolved once into a typed, immutable
`RingCall` (the ring's input, defined in `ringeqx._ring._settings`).

Every check of the arguments runs here, in one order:

1. the arrays: q/k/v converted to JAX arrays, then their ranks, dtypes and shapes;
2. the arguments: `jax.nn.dot_product_attention`'s names translated to masks and score
   modifiers, then the mask, the ids, the scale, the score modifier and the sinks
   ([`resolve_attention`][], shared with `reference_attention`);
3. the placement: the mesh and its axes, the kernel for the mesh's platform, the layout
   (given or contiguous) and the order of the inputs;
4. the ring: the ids the mask reads, the hybrid's axes, the mask against the sequence,
   and the ring's steps (early stop for bounded masks).

Nothing is checked twice and nothing reads an argument before it is converted.
"""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._kernels._base import AbstractAttentionKernel, Scores
from .._kernels._select import DeviceType, KernelName, select_kernel
from .._layout._layout import Layout, contiguous_layout
from .._masks._base import AbstractMask
from .._masks._positional import Full
from .._masks._reads import check_ids
from .._score_mods import AbstractScoreMod, check_sinks
from .._util._numbers import check_int32
from ._algorithm import run
from ._checks import as_qkv, check_mask_arg, check_qkv, check_scale
from ._comm import AllGather, RingConfig, as_ring_config
from ._compat import translate
from ._mesh import batch_axis, on_cpu, resolve_mesh, to_layout_order, to_original_order
from ._settings import RingCall, RingSettings
from ._steps import analytic_window, early_stop_error, ring_window


NO_COMPAT = dict(
    is_causal=False,
    local_window_size=None,
    bias=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    implementation=None,
)
"""`jax.nn.dot_product_attention`'s names, none given (`reference_attention` has none)."""


class Attention(eqx.Module):
    """What to compute, resolved and checked: the part of a call that dense attention
    (`reference_attention`) shares with the ring.

    `q`, `k`, `v` are JAX arrays as given (`[*batch, seq, heads, head_dim]`);
    `segment_ids`/`span_ids` include what `query_seq_lengths=` and friends add.
    """

    q: Float[Array, "*batch seq heads head_dim"]
    k: Float[Array, "*batch seq kv_heads head_dim"]
    v: Float[Array, "*batch seq kv_heads head_dim"]
    mask: AbstractMask
    score_mod: AbstractScoreMod | None
    sinks: Float[Array, " heads"] | None
    segment_ids: Int[Array, "*#batch seq"] | None
    span_ids: Int[Array, "*#batch seq"] | None
    scale: float = eqx.field(static=True)


def to_ring(call: RingCall, x: Array) -> Array:
    """`x` (shaped like q, k or v as given) as the ring takes it: `[batch, seq, heads,
    head_dim]` with one flat batch axis, in layout order."""
    x = x.reshape((math.prod(call.shape[:-3]),) + x.shape[-3:])
    if call.original:
        x = to_layout_order(x, call.layout, call.mesh, call.batch_axis)
    return x


def from_ring(call: RingCall, out: Array) -> Array:
    """The ring's result back in the caller's order and shape."""
    if call.original:
        out = to_original_order(out, call.layout, call.mesh, call.batch_axis)
    return out.reshape(call.shape)


def resolve_attention(
    q, k, v, *, mask, segment_ids, layout, scale, score_mod, span_ids, sinks, compat: dict
) -> Attention:
    """Steps 1 and 2 of the module's order: the arrays, then the arguments."""
    q, k, v = as_qkv(q, k, v)
    check_qkv(q, k, v)
    mask, score_mod, segment_ids, span_ids = translate(
        q, mask, score_mod, segment_ids, span_ids, layout, compat, sinks
    )
    check_mask_arg(mask)
    check_int32("segment_ids", segment_ids)
    check_int32("span_ids", span_ids)
    check_scale(scale)
    if score_mod is not None:
        score_mod.check(q.shape[-2])
    check_sinks(sinks, q.shape[-2])
    mask = Full() if mask is None else mask
    check_ids(mask, segment_ids, span_ids, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return Attention(q, k, v, mask, score_mod, sinks, segment_ids, span_ids, scale)


def resolve_ring(
    a: Attention, *, layout, order, mesh, axis_name, kernel, device_type, interpret, config
) -> RingCall:
    """Steps 3 and 4: where the call runs, and the ring's settings."""
    config = as_ring_config(config)
    mesh = resolve_mesh(mesh, axis_name)
    kernel = select_kernel(kernel, device_type, interpret=interpret, mesh=mesh)
    num_shards = mesh.shape[axis_name]
    if layout is None:
        lay = _contiguous(a, num_shards)
    else:
        lay = _flat_batch(_check_layout(layout, a, num_shards, axis_name))
    original = input_order(layout, a.q.shape[-3], order) == "original"
    batch = batch_axis(mesh, a.q.shape[:-3])
    _check_ulysses(config, mesh, axis_name, batch, a, lay)
    a.mask.check(lay.seq_len)
    settings = _settings(kernel, axis_name, num_shards, config, a.mask, lay, on_cpu(mesh))
    scores = Scores(a.mask, a.score_mod, a.scale)
    return RingCall(scores, a.sinks, lay, settings, mesh, batch, original, a.q.shape)


def _contiguous(a: Attention, num_shards: int) -> Layout:
    """The contiguous layout of `q`'s sequence (no `layout=` given), the ids flattened
    to `[batch, seq]`."""
    batch_shape, seq = a.q.shape[:-3], a.q.shape[-3]
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

    # Contiguous shards in the original order: sharding them only pads the end, so
    # sequence-sharded inputs stay sharded (no device ever holds the whole sequence).
    return contiguous_layout(
        seq,
        num_shards,
        segment_ids=ids("segment_ids", a.segment_ids),
        span_ids=ids("span_ids", a.span_ids),
    )


def _check_layout(layout, a: Attention, num_shards: int, axis_name: str) -> Layout:
    """Check that an explicit `layout=` fits the ring and the batch of `q` (its order is
    checked by `input_order`)."""
    if not isinstance(layout, Layout):
        raise TypeError(
            "`layout` must be a ringeqx.Layout (made by a strategy's `layout(...)`) or "
            f"None; got {type(layout).__name__}."
        )
    batch_shape = a.q.shape[:-3]
    for name, ids_given in (("segment_ids", a.segment_ids), ("span_ids", a.span_ids)):
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


def input_order(layout: Layout | None, seq: int, order: str) -> str:
    """The order q/k/v of length `seq` are in: the one `order` states (`"original"`
    unless `"layout"` is passed), which must fit the length. Nothing is guessed from the
    length: arrays of one length are never read as the padded layout order of another."""
    order = "original" if order is None else order
    if order not in ("layout", "original"):
        raise ValueError(f"`order` must be 'original' or 'layout'; got {order!r}.")
    if layout is None:
        if order == "layout":
            raise ValueError(
                "`order='layout'` needs a `layout=`; without one q/k/v are in the "
                "original order (pass order='original', the default)."
            )
        return "original"
    want = layout.sharded_len if order == "layout" else layout.seq_len
    if seq != want:
        what = "num_shards * capacity" if order == "layout" else "the layout's seq_len"
        hint = {
            ("original", layout.sharded_len): " They have the layout-order length: pass "
            "`order='layout'` if they were made by `layout.shard`.",
            ("layout", layout.seq_len): " They have the original length: drop "
            "`order='layout'` (ring_attention then shards them itself).",
        }.get((order, seq), "")
        raise ValueError(
            f"With `order={order!r}`, q/k/v must have seq = {what} = {want}; got seq "
            f"{seq}.{hint}"
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


def _settings(kernel, axis_name, num_shards, config, mask, lay, ordered) -> RingSettings:
    """The static settings of the ring: how many steps it takes, from which start (the
    block rule's window when the layout and mask are concrete, else the bounds';
    allgather mode: one step over the gathered K/V). `ordered`: on a CPU mesh (the ring's
    collectives then carry a token, `ringeqx._ring._order`)."""
    if config.mode == "allgather":
        return RingSettings(kernel, axis_name, num_shards, 1, config, ordered=ordered)
    _check_early_stop(mask, lay)
    if config.balance is not None:
        # The traded shards are not the layout's: the ring runs all its steps.
        return RingSettings(kernel, axis_name, num_shards, num_shards, config, ordered=ordered)
    num_ahead, num_steps = ring_window(mask, lay)
    return RingSettings(
        kernel, axis_name, num_shards, num_steps, config, num_ahead, ordered=ordered
    )


def _check_ulysses(config: RingConfig, mesh, axis_name, batch, a: Attention, lay: Layout):
    """The hybrid's checks: its axis is a second mesh axis that divides the heads, the kv
    heads and the tokens per ring shard."""
    u = config.ulysses_axis
    if u is None:
        return
    if u not in mesh.axis_names or u in (axis_name, batch):
        raise ValueError(
            f"RingConfig `ulysses_axis` {u!r} must be a mesh axis other than the ring axis "
            f"{axis_name!r} and the batch axis; the mesh has axes {tuple(mesh.axis_names)}."
        )
    size, heads, kv_heads = mesh.shape[u], a.q.shape[-2], a.k.shape[-2]
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
    config: RingConfig | AllGather | None = None,
    score_mod: AbstractScoreMod | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
    sinks: Float[Array, " heads"] | None = None,
    order: Literal["original", "layout"] = "original",
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
    - `layout`: a [`ringeqx.Layout`][]: where each token lives on the ring. q/k/v and
        the result are in the caller's original order unless `order='layout'`. Without
        one, contiguous shards are used (padded at the end where `seq` is not a multiple
        of the devices). Either way nothing gathers the sequence (except the reordering
        of q/k/v in the original order for a layout not in the original order): the
        output keeps the sequence sharding of `q`.
    - `mesh`: the device mesh (default: the one set by `jax.set_mesh`; with a single
        device and no mesh, a one-device ring). Batch axes are sharded over its axis
        `"batch"` when it has one.
    - `axis_name`: the mesh axis that forms the ring.
    - `scale`: logit scale (default `1 / sqrt(head_dim)`).
    - `kernel`: the per-device kernel: `"auto"`, a name (`"xla"`, `"pallas_gpu"`,
        `"pallas_tpu"`) or a kernel object; see [`ringeqx.select_kernel`][].
    - `device_type`: `"auto"` (the platform of the mesh's devices: an H100 or TPU mesh
        gets its Pallas kernel, also a mesh of compile-only devices from
        [`ringeqx.tools.target_mesh`][]), `"cpu"`, `"gpu"` or `"tpu"`: picks the default
        kernel and its tiles; a device type other than the mesh's is an error.
    - `interpret`: run Pallas kernels chosen by name in the Pallas interpreter (CPU
        tests).
    - `config`: a [`ringeqx.RingConfig`][]: how K/V travel, including the Ulysses x ring
        hybrid over a second mesh axis (`ulysses_axis=`); or [`ringeqx.AllGather`][]:
        K/V gathered once instead of passed round the ring.
    - `score_mod`: an optional [`ringeqx.AbstractScoreMod`][] applied to the logits
        (several: [`ringeqx.Chain`][]). Its floating parameters (ALiBi slopes, a softcap
        given as an array, a modifier's own fields) are trainable: their gradient is
        exact, on every kernel; differentiating them adds one pass over each ring step's
        tiles to the backward, and nothing when they are not differentiated.
    - `span_ids`: `int[*batch, seq]` span ids (-1 = none), for `BidirectionalSpans()`;
        without a layout only, like `segment_ids`.
    - `sinks`: optional attention-sink logits `float[heads]`: each joins every row's
        softmax denominator as a key of value zero, $\operatorname{out}_i \leftarrow
        \operatorname{out}_i\, e^{\ell_i - \operatorname{logaddexp}(\ell_i, z_h)}$ with
        the row's global log-sum-exp $\ell_i$. Exact and differentiable (in the sinks
        too: they are meant to be trained).
    - `order`: the order q/k/v are in: `'original'` (the default: ring_attention
        shards them by the layout and returns the result in the original order) or,
        with `layout=`, `'layout'` (made by `layout.shard`, `seq = num_shards *
        capacity`; the result is in layout order too, which is how a model keeps its
        activations sharded between layers). The length must be the order's; it is
        never guessed from the length. `None` means `'original'`.

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
        score modifier (run before `score_mod`, and trainable: its gradient is exact);
        one constant along the keys (`[..., 1]`) leaves softmax unchanged (its gradient
        is zero) and is dropped, unless `sinks=` are given: it shifts the keys against
        them, so it is kept (as `[1, heads or 1, 1, 1]`; per query or per example it is
        refused). A bias over
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
    a = resolve_attention(
        q,
        k,
        v,
        mask=mask,
        segment_ids=segment_ids,
        layout=layout,
        scale=scale,
        score_mod=score_mod,
        span_ids=span_ids,
        sinks=sinks,
        compat=compat,
    )
    call = resolve_ring(
        a,
        layout=layout,
        order=order,
        mesh=mesh,
        axis_name=axis_name,
        kernel=kernel,
        device_type=device_type,
        interpret=interpret,
        config=config,
    )
    out = run(call, tuple(to_ring(call, x) for x in (a.q, a.k, a.v)))
    return from_ring(call, out)
