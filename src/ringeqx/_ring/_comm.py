"""Ring communication: configuration, and how K/V pieces and dK/dV travel round the ring."""

import warnings
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, PyTree

from .._layout._tokens import TokenInfo
from .._util._numbers import as_int
from . import _order as order


def _wire_dtype(name: str, default):
    """A converter to the dtype `d` names (None: `default`), with an error that names
    the field where `d` names no dtype (the dtype's kind is `__check_init__`'s)."""

    def convert(d):
        if d is None:
            return default
        try:
            return jnp.dtype(d)
        except TypeError:
            raise ValueError(
                f"RingConfig `{name}` must be a dtype ({_WIRE_NAMES}); got {d!r}, "
                "which names no dtype."
            ) from None

    return convert


_WIRE_NAMES = "jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32"


def _travels(dt) -> bool:
    """Whether the wire can carry `dt`: a floating dtype of whole bytes (its bits are
    sent as unsigned integers of its width; 4-bit floats have no such width)."""
    return jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).bits == 8 * dt.itemsize


def _needs_scale(dt) -> bool:
    """Narrow exponent ranges (float16, float8) get a per-block power-of-two scale;
    bfloat16 has float32's exponent range and needs none."""
    return dt is not None and bool(jnp.finfo(dt).max < jnp.finfo(jnp.bfloat16).max / 2)


class RingConfig(eqx.Module):
    """How the ring communicates. Every setting gives the exact answer up to the rounding
    of the compressed dtypes; without compression, exactly the default ring's answer.

    **Arguments:**

    - `compression_dtype`: if set (`jnp.bfloat16`, `jnp.float16`, `jnp.float8_e4m3fn`,
        `jnp.float8_e5m2`), K/V travel between devices in this dtype and are cast back to
        their own dtype on arrival; the device's own block is used exactly. float16 and
        float8 carry a power-of-two scale per (batch, kv head) block, so that finite values
        never overflow to inf/NaN (and small ones lose less to underflow). None (the
        default) sends K/V as they are.
    - `grad_compression_dtype`: the dtype the backward ring's dK/dV accumulators travel in
        (`float32`, the default, is exact; `bfloat16`, `float16` and the float8 types are
        scaled as above). The final hop home is always float32.
    - `communication_parallelism`: `n`: each step's K/V transfer (and dK/dV's) goes as `n`
        separate collective-permutes, split over the shard's tokens, so that a scheduler
        can overlap one piece's transfer with other work. Compute is not split per piece:
        pieces that travel the same way come from one shard and are joined before the
        kernel runs. Must divide the tokens per shard.
    - `ring_buffer_size`: the same split given as tokens per transfer (`n = capacity /
        ring_buffer_size`). When both are given, `ring_buffer_size` wins.
    - `bidirectional`: half of the pieces (at least one each way) travel `+1` round the
        ring and half `-1`, using both directions of the links; each device runs the kernel
        once per direction per step, on the half-shard that came each way. The number of
        pieces must then be 1 (it becomes 2) or even.
    - `ulysses_axis`: the name of a second mesh axis of size $U$ for the Ulysses x ring
        hybrid (None, the default: the ring alone). q/k/v are then sharded over the
        sequence on both axes, the ring axis major (`PartitionSpec(batch, (axis_name,
        ulysses_axis))`); on each device an all-to-all over `ulysses_axis` trades the
        sequence split for a head split, so that every device holds one whole ring shard
        of $1/U$ of the heads (heads and kv heads in contiguous chunks, so that GQA groups
        stay together); the ring then runs over `axis_name` on those heads, and a second
        all-to-all brings the output back. The ring's K/V bytes per device fall by $U$
        (a $U$-times shorter ring of $U$-times larger shards of $1/U$ of the heads), at
        the price of four all-to-alls (q, k, v in; the output back). `heads` and
        `kv_heads` must both be multiples of $U$, and the tokens per ring shard (the
        layout's `capacity`) too. Score modifiers see their own heads
        (`AbstractScoreMod.for_heads`); sinks apply after the output is back.
    - `mode`: deprecated: `"allgather"` is [`ringeqx.AllGather`][] (a
        `DeprecationWarning`), which takes only the fields that apply to it.
        `"ring"` (the default) passes K/V round the ring, one shard per step.
        `"allgather"` gathers all K/V (and their token records) on every device once,
        with one `all_gather` over the ring axis, then runs the kernel once over the whole
        sequence (the mask's block rule still skips tiles); the backward pass
        reduce-scatters dK/dV. It needs memory for the whole sequence's K/V per device
        and does not overlap the transfer with compute, but sends each shard once, in one
        collective. The knobs of the ring's transfers do not apply to it:
        `compression_dtype`, `grad_compression_dtype`, `communication_parallelism`,
        `ring_buffer_size` and `bidirectional` must be left at their defaults (an error
        otherwise). It combines with `ulysses_axis` (the gather then runs on each
        device's heads).
    - `balance`: `"zigzag"` evens out causal work on any layout, the default contiguous
        one included: inside the ring each device trades halves of its shard with two
        others (two collective-permutes per array, never a gather), so that it holds
        chunks `i` and `2P - 1 - i` of the `2P` chunks of the sequence, as
        [`ringeqx.Zigzag`][] places them, and the output is traded back. Under a causal
        mask every device then does the same work at every step, instead of device
        `P - 1` doing all of its steps while device 0 skips most. The token records
        travel with the tokens, so every mask stays exact; the ring runs all its steps
        (the window early stop assumes contiguous shards). Needs an even number of
        tokens per shard. None (the default): no trade.

    The checks that need the shard size (divisibility) run at trace time.
    """

    compression_dtype: DTypeLike | None = eqx.field(
        static=True, default=None, converter=_wire_dtype("compression_dtype", None)
    )
    grad_compression_dtype: DTypeLike = eqx.field(
        static=True,
        default=jnp.float32,
        converter=_wire_dtype("grad_compression_dtype", jnp.dtype(jnp.float32)),
    )
    communication_parallelism: int = eqx.field(static=True, default=1, converter=as_int)
    ring_buffer_size: int | None = eqx.field(static=True, default=None, converter=as_int)
    bidirectional: bool = eqx.field(
        static=True, default=False, converter=lambda b: bool(b) if isinstance(b, np.bool_) else b
    )
    ulysses_axis: str | None = eqx.field(static=True, default=None)
    mode: Literal["ring", "allgather"] = eqx.field(static=True, default="ring")
    balance: Literal["zigzag"] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        for name in ("compression_dtype", "grad_compression_dtype"):
            dt = getattr(self, name)
            if dt is not None and not _travels(dt):
                raise ValueError(
                    f"RingConfig `{name}` must be a floating dtype of whole bytes "
                    f"({_WIRE_NAMES}){' or None' if name == 'compression_dtype' else ''}; "
                    f"got {dt!r}."
                )
        if not isinstance(self.bidirectional, bool):
            raise ValueError(
                "RingConfig `bidirectional` must be True or False; got "
                f"{self.bidirectional!r}."
            )
        n = self.communication_parallelism
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"RingConfig `communication_parallelism` must be a positive int; got {n!r}."
            )
        t = self.ring_buffer_size
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise ValueError(
                f"RingConfig `ring_buffer_size` must be a positive int or None; got {t!r}."
            )
        if self.ulysses_axis is not None and not isinstance(self.ulysses_axis, str):
            raise ValueError(
                "RingConfig `ulysses_axis` must be a mesh axis name (str) or None; got "
                f"{self.ulysses_axis!r}."
            )
        self._check_mode()
        if self.balance not in (None, "zigzag"):
            raise ValueError(
                f"RingConfig `balance` must be None or 'zigzag'; got {self.balance!r}."
            )

    def _check_mode(self):
        if self.mode not in ("ring", "allgather"):
            raise ValueError(f"RingConfig `mode` must be 'ring' or 'allgather'; got {self.mode!r}.")
        if self.mode == "ring":
            return
        warnings.warn(
            "RingConfig(mode='allgather') is deprecated: pass "
            "`config=ringeqx.AllGather(ulysses_axis=..., balance=...)`.",
            DeprecationWarning,
            stacklevel=4,
        )
        defaults = RingConfig()
        ignored = [
            name
            for name in (
                "compression_dtype",
                "grad_compression_dtype",
                "communication_parallelism",
                "ring_buffer_size",
                "bidirectional",
            )
            if getattr(self, name) != getattr(defaults, name)
        ]
        if ignored:
            raise ValueError(
                "RingConfig `mode='allgather'` gathers K/V in one collective, so the ring's "
                f"transfer settings do not apply to it; got {', '.join(ignored)} set. Leave "
                "them at their defaults, or use mode='ring'."
            )

    def num_pieces(self, capacity: int) -> int:
        """How many pieces each shard's transfer is split into, for shards of `capacity`
        tokens. Raises (at trace time) on values that do not divide."""
        divisors = [d for d in range(1, capacity + 1) if capacity % d == 0]
        if self.ring_buffer_size is not None:
            t = self.ring_buffer_size
            if capacity % t != 0:
                raise ValueError(
                    f"RingConfig `ring_buffer_size` must divide the {capacity} tokens per "
                    f"shard; got {t}. Expected one of {divisors}."
                )
            n, name, got = capacity // t, "ring_buffer_size", t
        else:
            n = self.communication_parallelism
            if capacity % n != 0:
                raise ValueError(
                    f"RingConfig `communication_parallelism` must divide the {capacity} "
                    f"tokens per shard; got {n}. Expected one of {divisors}."
                )
            name, got = "communication_parallelism", n
        if self.bidirectional:
            if n == 1:
                if capacity % 2 != 0:
                    raise ValueError(
                        "RingConfig `bidirectional=True` sends half of each shard each "
                        f"way, so the {capacity} tokens per shard must be even."
                    )
                n = 2
            elif n % 2 != 0:
                even = [d for d in divisors if d % 2 == 0]
                raise ValueError(
                    f"RingConfig `bidirectional=True` sends half of the pieces each way, "
                    f"so `{name}` must give an even number of pieces; got {name}={got} "
                    f"({n} pieces). Expected a number of pieces in {even}."
                )
        return n


class AllGather(eqx.Module):
    """Attention over K/V gathered whole, instead of passed round the ring: the
    `config=` of [`ringeqx.ring_attention`][] (and of the `nn` layers) for the
    all-gather mode.

    K, V and their token records are gathered on every device once, with one
    `all_gather` over the ring axis; the kernel then runs once over the whole sequence
    (the mask's block rule still skips tiles), and the backward pass reduce-scatters
    dK/dV. It needs memory for the whole sequence's K/V per device and does not overlap
    the transfer with compute, but sends each shard once, in one collective. None of
    [`ringeqx.RingConfig`][]'s transfer settings apply to it, so it has none.

    **Arguments:**

    - `ulysses_axis`: as [`ringeqx.RingConfig`][]'s: the gather then runs on each
        device's heads of the Ulysses x ring hybrid.
    - `balance`: as [`ringeqx.RingConfig`][]'s (`"zigzag"` or None): under a causal mask
        every device then does the same work.
    """

    ulysses_axis: str | None = eqx.field(static=True, default=None)
    balance: Literal["zigzag"] | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.ulysses_axis is not None and not isinstance(self.ulysses_axis, str):
            raise ValueError(
                "AllGather `ulysses_axis` must be a mesh axis name (str) or None; got "
                f"{self.ulysses_axis!r}."
            )
        if self.balance not in (None, "zigzag"):
            raise ValueError(f"AllGather `balance` must be None or 'zigzag'; got {self.balance!r}.")

    def ring_config(self) -> RingConfig:
        """This choice as the ring runs it: a `RingConfig` in all-gather mode."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return RingConfig(
                ulysses_axis=self.ulysses_axis, balance=self.balance, mode="allgather"
            )


def as_ring_config(config: "RingConfig | AllGather | None") -> RingConfig:
    """`config=` as the ring runs it (None: the default ring)."""
    if config is None:
        return RingConfig()
    if isinstance(config, AllGather):
        return config.ring_config()
    if not isinstance(config, RingConfig):
        raise TypeError(
            "`config` must be a ringeqx.RingConfig, a ringeqx.AllGather or None; got "
            f"{type(config).__name__}."
        )
    return config


def shift(tree: PyTree, axis_name: str, num_shards: int, offset: int) -> PyTree:
    """Send every array of `tree` from device `i` to device `(i + offset) % num_shards`."""
    offset %= num_shards
    if offset == 0:
        return tree
    perm = [(i, (i + offset) % num_shards) for i in range(num_shards)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _pack(x, dt):
    """`x` -> what travels: raw bits of `x` in `dt` (and a float32 scale per block, the
    leading two axes, for float16/float8). Sent as bits: otherwise XLA may move the
    narrowing convert past the transfer (it does on CPU) and send the wide dtype after all."""
    if dt is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dt:
        return x, None
    bits = jnp.dtype(f"uint{8 * jnp.dtype(dt).itemsize}")
    if not _needs_scale(dt):
        return jax.lax.bitcast_convert_type(x.astype(dt), bits), None
    xf = x.astype(jnp.float32)
    axes = tuple(range(2, x.ndim))
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    fmax = float(jnp.finfo(dt).max)
    # A power of two, so that scaling is exact and only the cast rounds; the largest
    # value lands in (fmax / 2, fmax], never past it (float8_e4m3fn has no inf: past its
    # max a cast gives NaN).
    scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.where(amax > 0, amax, fmax) / fmax)))
    scale = jnp.where(amax / scale > fmax, scale * 2, scale)
    y = (xf / scale).astype(dt)
    return jax.lax.bitcast_convert_type(y, bits), scale


class _Leaf(NamedTuple):
    """Where one leaf travels in the wire: `kind` `"records"` (a TokenInfo packed into
    one integer array, wire array `index`), `"packed"` (floating bits in `wire_dtype`,
    row `row` of the stacked wire array `index`; its scale, if any, the same row of
    wire array `index + 1`) or `"as_is"` (wire array `index`)."""

    kind: str
    index: int
    dtype: jnp.dtype
    wire_dtype: jnp.dtype | None = None
    row: int = 0
    scaled: bool = False
    # A TokenInfo's static `runs` claim, which holds for every shard alike.
    runs: object = None


def _is_records(x) -> bool:
    return isinstance(x, TokenInfo)


def to_wire(tree: PyTree, dtype) -> tuple[list, tuple]:
    """`tree` -> `(wire, layout)`: the arrays that travel and the static layout `from_wire`
    rebuilds `tree` from. As few arrays as possible travel, because XLA's TPU scheduler
    keeps at most five permutes in flight over a kernel (measured): a TokenInfo goes as
    one `[4, *shape]` integer array, and floating leaves compressed to `dtype` as the
    raw bits of one stacked array per shape (and one stacked array of their scales,
    where the dtype needs one); stacking costs nothing there, since the cast writes them
    anyway. Uncompressed leaves go as they are. The cost: all four record rows travel
    even when the mask reads fewer (16 bytes a token, against K/V's `4 kv_heads
    head_dim` at bfloat16), where separate arrays let XLA drop the unread ones.
    `RingPlan.send` puts the wire behind an optimization barrier, so that XLA can neither
    split a stacked array into several permutes nor move the cast past the transfer."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_records)
    wire: list = []
    kinds: list = [None] * len(leaves)
    stacks: dict = {}
    for i, x in enumerate(leaves):
        if _is_records(x):
            ints = jnp.result_type(x.positions, x.segments, x.spans)
            parts = (x.positions, x.segments, x.spans, x.valid)
            kinds[i] = _Leaf("records", len(wire), jnp.dtype(ints), runs=x.runs)
            wire.append(jnp.stack([a.astype(ints) for a in parts]))
            continue
        bits, scale = _pack(x, dtype)
        if bits.dtype == x.dtype:
            kinds[i] = _Leaf("as_is", len(wire), jnp.dtype(x.dtype))
            wire.append(x)
        else:
            stacks.setdefault((bits.shape, bits.dtype), []).append((i, bits, scale))
    for rows in stacks.values():
        scaled = rows[0][2] is not None
        for row, (i, _, _) in enumerate(rows):
            kinds[i] = _Leaf(
                "packed", len(wire), jnp.dtype(leaves[i].dtype), jnp.dtype(dtype), row, scaled
            )
        wire.append(jnp.stack([bits for _, bits, _ in rows]))
        if scaled:
            wire.append(jnp.stack([scale for _, _, scale in rows]))
    return wire, (treedef, tuple(kinds))


def from_wire(wire: list, layout: tuple) -> PyTree:
    """The inverse of `to_wire`, on the arrays received."""
    treedef, kinds = layout
    leaves = []
    for kind in kinds:
        w = wire[kind.index]
        if kind.kind == "records":
            leaves.append(TokenInfo(w[0], w[1], w[2], w[3] != 0, kind.runs))
        elif kind.kind == "as_is":
            leaves.append(w)
        else:
            y = jax.lax.bitcast_convert_type(w[kind.row], kind.wire_dtype)
            if kind.scaled:
                y = y.astype(jnp.float32) * wire[kind.index + 1][kind.row]
            leaves.append(y.astype(kind.dtype))
    return jax.tree.unflatten(treedef, leaves)


class RingPlan:
    """How one ring call moves its blocks: static, built at trace time.

    The shard (a pytree whose arrays have a token axis, given by `axes`) is cut along its
    tokens into `num_pieces` pieces, grouped by direction: group 0 travels `+1` (device `i`
    receives from `i - 1`), group 1 (bidirectional only) travels `-1`. At step `s` (of
    `num_steps`) device `i` holds group 0 of shard `i + num_ahead - s` and group 1 of
    shard `i + b + s`, with `b = 0` for the full ring and `num_ahead - num_steps + 1` for
    an early-stopped one: either way each group of every shard it must meet is met once.
    """

    def __init__(
        self, config: RingConfig, axis_name, num_shards, num_ahead, num_steps, capacity, ordered
    ):
        self.config = config
        # On a CPU mesh (`ordered`) every collective is tied to the previous one by a
        # token (`ringeqx._ring._order`), which the methods thread; elsewhere it is None.
        self.ordered = ordered
        self.axis_name = axis_name
        self.num_shards = num_shards
        self.num_pieces = config.num_pieces(capacity)
        self.directions = (1, -1) if config.bidirectional else (1,)
        full = num_steps >= num_shards
        # Shard offset (relative to the device) held at step 0, per group.
        self.starts = tuple(
            num_ahead if d == 1 else (0 if full else num_ahead - num_steps + 1)
            for d in self.directions
        )
        self.num_steps = num_steps

    def _split(self, tree, axes, n):
        if n == 1:
            return [tree]
        return [
            jax.tree.map(lambda a, x, i=i: jnp.split(x, n, axis=a)[i], axes, tree) for i in range(n)
        ]

    @staticmethod
    def _join(pieces, axes):
        if len(pieces) == 1:
            return pieces[0]
        return jax.tree.map(lambda a, *ps: jnp.concatenate(ps, axis=a), axes, *pieces)

    def _shift(self, tree, offset: int, token):
        """`shift`, and on a CPU mesh in the token's chain: `(tree, token)`."""
        if token is None:
            return shift(tree, self.axis_name, self.num_shards, offset), None
        offset %= self.num_shards
        if offset == 0:
            return tree, token
        perm = [(i, (i + offset) % self.num_shards) for i in range(self.num_shards)]
        return order.ppermute(tree, self.axis_name, perm, token)

    def start(self, tree, axes, token=None) -> tuple[tuple, Array | None]:
        """The device's own shard -> the groups it holds at step 0 (sent as the steps
        send, records packed), and the token."""
        groups = self._split(tree, axes, len(self.directions))
        out = []
        for g, o in zip(groups, self.starts):
            wire, layout = to_wire(g, None)
            wire, token = self._shift(wire, -o, token)
            out.append(from_wire(wire, layout))
        return tuple(out), token

    def send(self, group, index: int, axes, dtype, hold=(), token=None):
        """Start the hop of group `index` (direction `self.directions[index]`): `(wire,
        layouts, hold, token)`, the arrays it delivers (`num_pieces / len(directions)`
        permutes per array, floating arrays sent in `dtype`, records packed, see
        `to_wire`), what `receive` needs to rebuild the group, `hold` back and the token
        (on a CPU mesh: read from the hop's last permute; else None).

        `hold` passes through one optimization barrier with what is sent: the ring step
        passes the kernel's inputs (and what it has computed so far), so that the
        packing is done before the kernel and the permutes can start with it. The step
        then holds the wire behind a second barrier with the kernel's results, so that
        nothing but the kernel can be scheduled while the transfer is in flight."""
        offset = self.directions[index]
        pieces = self._split(group, axes, self.num_pieces // len(self.directions))
        sent, layouts = zip(*(to_wire(piece, dtype) for piece in pieces))
        sent, hold = jax.lax.optimization_barrier((list(sent), hold))
        if token is None:
            wire = [shift(w, self.axis_name, self.num_shards, offset) for w in sent]
        else:
            wire, token = self._shift(sent, offset, token)
        return wire, layouts, hold, token

    def receive(self, wire: list, layouts: tuple, axes):
        """The group one `send` delivers."""
        return self._join([from_wire(w, layout) for w, layout in zip(wire, layouts)], axes)

    def home(self, groups: tuple, axes, token=None):
        """After the last step, send each group to the device that owns it (float32, one
        permute per group and array) and join the groups; and the token."""
        back = []
        for g, o, d in zip(groups, self.starts, self.directions):
            g, token = self._shift(g, o - d * (self.num_steps - 1), token)
            back.append(g)
        return self._join(back, axes), token
