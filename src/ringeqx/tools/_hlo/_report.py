"""The communication report: what a compiled program sends (read from its HLO), beside
the ring's analytic model and named hardware profiles."""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ..._numbers import as_int, as_number, check_positive, check_size
from ._parse import COLLECTIVES, check_hlo_type, check_kind, parse_collectives


class Hardware(eqx.Module):
    """Peak dense compute and one-direction link bandwidth of one accelerator.

    **Fields:**

    - `name`: a label.
    - `flops`: peak dense bf16 FLOP/s.
    - `bandwidth`: bytes/s one way on the link the ring uses.
    - `memory`: bytes of device memory (HBM) a program may use per JAX device, the
        default budget of [`ringeqx.tools.plan`][] (None where unknown).

    Compression changes only what travels (K/V are cast back before the kernel runs), so
    the compute side is always the bf16 peak.
    """

    name: str = eqx.field(static=True)
    flops: int | float = eqx.field(static=True, converter=as_number)
    bandwidth: int | float = eqx.field(static=True, converter=as_number)
    memory: int | None = eqx.field(static=True, default=None, converter=as_int)

    def __check_init__(self):
        check_positive("Hardware flops", self.flops)
        check_positive("Hardware bandwidth", self.bandwidth)
        if self.memory is not None:
            check_size("Hardware memory", self.memory)


_GIB = 2**30

# Memory per JAX device: A100/H100 80 GB, H200 141 GB; TPU v3 16 GiB per core (a JAX
# device), v4 32 GiB, v5p 95 GiB per chip. v5e and v6e: what their runtime lets a program
# have, below the published 16 and 32 GiB, so that a plan under it runs: a real v5e
# chip's `memory_stats()["bytes_limit"]`, which is also libtpu's compile-only "available
# HBM (15.75G)"; v6e's libtpu figure (31.25G), less 4 MiB for its rounding.
# The first five's FLOP rates and links are the Ring Attention paper's Table 2 constants;
# H100/H200 (SXM, NVLink 4: 900 GB/s both ways), v5p (ICI 4,800 Gbps per chip) and v6e
# are vendor peaks.
HARDWARE = {
    "a100-nvlink": Hardware("A100 NVLink", 312e12, 300e9, 80 * _GIB),
    "a100-infiniband": Hardware("A100 InfiniBand", 312e12, 12.5e9, 80 * _GIB),
    "tpu-v3": Hardware("TPU v3", 123e12, 112e9, 16 * _GIB),
    "tpu-v4": Hardware("TPU v4", 275e12, 268e9, 32 * _GIB),
    "tpu-v5e": Hardware("TPU v5e", 197e12, 186e9, 16_909_336_064),
    "tpu-v5p": Hardware("TPU v5p", 459e12, 600e9, 95 * _GIB),
    # v6e (Trillium): 918 TFLOP/s bf16, ICI 3,584 Gbps per chip, 32 GiB HBM.
    "tpu-v6e": Hardware("TPU v6e", 918e12, 448e9, int(31.25 * _GIB) - 4 * 2**20),
    "h100": Hardware("H100 NVLink", 989e12, 450e9, 80 * _GIB),
    "h200": Hardware("H200 NVLink", 989e12, 450e9, 141 * 10**9),
}


def _check_heads(heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise ValueError(
            f"`heads` must be a multiple of `kv_heads`; got heads={heads}, kv_heads={kv_heads}."
        )


def float_itemsize(name: str, dtype) -> int:
    """Bytes per element of the floating dtype `dtype` names; a ValueError naming
    `name` for anything else."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"`{name}` must be a floating dtype (jnp.bfloat16, jnp.float8_e4m3fn, ...); "
            f"got {dtype!r}."
        )
    return dt.itemsize


class RingCost(eqx.Module):
    r"""The ring's analytic cost per step and per device (the Ring Attention paper's
    model, extended to GQA and to the payload's dtype).

    With $c$ tokens per shard, $h$ query heads, $h_{kv}$ kv heads, head dim $d$ and $b$
    bytes per K/V element, one forward step computes $4 c^2 d h$ FLOPs (two matmuls) and
    sends K and V: $2 c d h_{kv} b$ bytes. Communication hides behind compute when
    $4 c^2 d h / F \ge 2 c d h_{kv} b / B$, that is for
    $c \ge \frac{h_{kv} b}{2h} \frac{F}{B}$: $F/B$ for multi-head attention in bf16
    (the paper's "minimal block size"), $1/g$ of it for GQA groups of $g$, half of it for
    fp8. The backward step computes about $10 c^2 d h$ FLOPs and sends K/V plus dK/dV.
    Masks that skip blocks (causal) lower the compute, not the traffic.

    **Fields:** `seq_len`, `num_devices`, `heads`, `kv_heads`, `head_dim`, `kv_bytes`
    (bytes per K/V element as sent), `grad_bytes` (bytes per dK/dV element as sent).
    """

    seq_len: int = eqx.field(static=True, converter=as_int)
    num_devices: int = eqx.field(static=True, converter=as_int)
    heads: int = eqx.field(static=True, converter=as_int)
    kv_heads: int = eqx.field(static=True, converter=as_int)
    head_dim: int = eqx.field(static=True, converter=as_int)
    kv_bytes: int | float = eqx.field(static=True, default=2, converter=as_number)
    grad_bytes: int | float = eqx.field(static=True, default=4, converter=as_number)

    def __check_init__(self):
        for name in ("seq_len", "num_devices", "heads", "kv_heads", "head_dim"):
            check_size(f"RingCost {name}", getattr(self, name))
        _check_heads(self.heads, self.kv_heads)
        check_positive("RingCost kv_bytes", self.kv_bytes)
        check_positive("RingCost grad_bytes", self.grad_bytes)

    @property
    def shard(self) -> int:
        return self.seq_len // self.num_devices

    def step_bytes(self, backward: bool = False) -> float:
        """Bytes one device sends per ring step (K and V; with dK and dV backward)."""
        kv = 2 * self.shard * self.kv_heads * self.head_dim
        return float(kv * (self.kv_bytes + (self.grad_bytes if backward else 0)))

    def step_flops(self, backward: bool = False) -> float:
        """FLOPs one device computes per ring step (no block skipped)."""
        return float((10 if backward else 4) * self.shard**2 * self.head_dim * self.heads)

    def intensity(self, backward: bool = False) -> float:
        """FLOPs per byte sent: compare with a chip's FLOP/s per byte/s."""
        return self.step_flops(backward) / self.step_bytes(backward)

    def min_shard(self, hw: Hardware, backward: bool = False) -> int:
        """The smallest tokens per shard whose compute hides the transfer on `hw`."""
        flops = hw.flops
        per_token_bytes = self.step_bytes(backward) / self.shard
        per_token2_flops = self.step_flops(backward) / self.shard**2
        return math.ceil(per_token_bytes * flops / (per_token2_flops * hw.bandwidth))

    def hides(self, hw: Hardware, backward: bool = False) -> bool:
        """Whether this shard's compute takes at least as long as its transfer on `hw`."""
        return self.shard >= self.min_shard(hw, backward)


def table2(
    heads: int = 1, kv_heads: int = 1, kv_dtype: DTypeLike = jnp.bfloat16
) -> dict[str, tuple[int, int]]:
    """The Ring Attention paper's Table 2, `{hardware: (min block, min sequence per
    device = 6 x block)}`, for `kv_heads` of `heads` and K/V sent in `kv_dtype`
    (the paper: multi-head, bf16)."""
    heads, kv_heads = check_size("heads", heads), check_size("kv_heads", kv_heads)
    _check_heads(heads, kv_heads)
    cost = RingCost(1, 1, heads, kv_heads, 1, float_itemsize("kv_dtype", kv_dtype))
    out = {}
    for key, hw in HARDWARE.items():
        block = cost.min_shard(hw)
        out[key] = (block, 6 * block)
    return out


class CollectiveRow(eqx.Module):
    """One row of a [`ringeqx.tools.CommReport`][]: a kind of collective with one dtype and
    shape and axis."""

    kind: str = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)
    axes: tuple[str, ...] = eqx.field(static=True)
    count: int = eqx.field(static=True)
    bytes_per_op: int = eqx.field(static=True)

    @property
    def bytes(self) -> int:
        """Bytes per device per call: `count * bytes_per_op`."""
        return self.count * self.bytes_per_op


class CommReport(eqx.Module):
    """What a compiled program communicates (see [`ringeqx.tools.comm_report`][])."""

    rows: tuple[CollectiveRow, ...] = eqx.field(static=True)
    cost: RingCost | None = eqx.field(static=True, default=None)

    def count(self, kind: str | None = None, dtype: str | None = None) -> int:
        """Executions per call of collectives of `kind` (and `dtype`)."""
        return sum(r.count for r in self._pick(kind, dtype))

    def bytes(self, kind: str | None = None, dtype: str | None = None) -> int:
        """Bytes per device per call of collectives of `kind` (and `dtype`)."""
        return sum(r.bytes for r in self._pick(kind, dtype))

    def _pick(self, kind, dtype):
        # A kind or dtype no program has would count 0 silently: refused instead.
        if kind is not None:
            check_kind(kind)
        if dtype is not None:
            check_hlo_type("dtype", dtype)
        return [r for r in self.rows if kind in (None, r.kind) and dtype in (None, r.dtype)]

    def __str__(self) -> str:
        lines = [
            f"{'collective':<20}{'dtype':<10}{'shape':<22}{'axis':<18}"
            f"{'count':>7}{'bytes/op':>12}{'bytes/call':>14}"
        ]
        for r in self.rows:
            lines.append(
                f"{r.kind:<20}{r.dtype:<10}{str(list(r.shape)):<22}"
                f"{','.join(r.axes) or '-':<18}{r.count:>7}{r.bytes_per_op:>12,}"
                f"{r.bytes:>14,}"
            )
        lines.append(f"{'total':<77}{self.count():>7}{'':>12}{self.bytes():>14,}")
        if self.cost is not None:
            c = self.cost
            lines.append("")
            lines.append(
                f"model: {c.shard} tokens per shard; forward step {c.step_bytes():,.0f} B, "
                f"{c.step_flops():,.0f} FLOP ({c.intensity():,.0f} FLOP/B); backward step "
                f"{c.step_bytes(True):,.0f} B, {c.step_flops(True):,.0f} FLOP "
                f"({c.intensity(True):,.0f} FLOP/B)"
            )
            lines.append(
                f"{'hardware':<18}{'FLOP/B':>8}{'fwd hides':>11}{'min shard':>11}"
                f"{'bwd hides':>11}{'min shard':>11}"
            )
            for hw in HARDWARE.values():
                lines.append(
                    f"{hw.name:<18}{hw.flops / hw.bandwidth:>8,.0f}"
                    f"{'yes' if c.hides(hw) else 'no':>11}{c.min_shard(hw):>11,}"
                    f"{'yes' if c.hides(hw, True) else 'no':>11}{c.min_shard(hw, True):>11,}"
                )
        return "\n".join(lines)


def _axes_of(attributes: str, mesh) -> tuple[str, ...]:
    """The mesh axes a collective runs over, from its source_target_pairs or replica
    groups (device ids are positions in `mesh.devices`, as under `shard_map`)."""
    if mesh is None:
        return ()
    names, shape = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    groups: list[list[int]] = []
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if named:
        # XLA's own factorisation of the devices, `mesh['axis_0'=1,'axis_1'=8] {'axis_1'}`
        # (newer XLA names the axes as the program's mesh does, `mesh['sequence'=4,
        # 'ulysses'=2] {'ulysses'}`): each group is the devices that vary along the
        # listed axes (row-major ids).
        axes = re.findall(r"'([^']*)'=(\d+)", named.group(1))
        sizes = [int(n) for _, n in axes]
        order = [a for a, _ in axes]
        listed = [order.index(a) for a in re.findall(r"'([^']*)'", named.group(2))]
        ids = np.moveaxis(
            np.arange(math.prod(sizes)).reshape(sizes),
            listed,
            list(range(len(sizes) - len(listed), len(sizes))),
        )
        groups = ids.reshape(-1, math.prod(sizes[k] for k in listed)).tolist()
    elif pairs:
        groups = [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    elif iota:
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(p) for p in iota.group(3).split(",")])
        out_shape = [int(d) for d in iota.group(1).split(",")]
        groups = ids.reshape(out_shape[0], -1).tolist()
    elif listed:
        groups = [
            [int(x) for x in g.split(",") if x]
            for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
        ]
    if not groups or max(max(g, default=0) for g in groups) >= math.prod(shape):
        return ()
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(g, shape))
        varying |= {a for a in range(len(shape)) if len(set(coords[a])) > 1}
    return tuple(names[a] for a in sorted(varying))


def _describe(names, sizes) -> str:
    return "(" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes)) + ")"


def _program_mesh(compiled, mesh, given: bool):
    """`mesh` if the compiled program runs on it, else: an error if the caller `given`
    it, None (no axis names) if it is only the ambient `jax.set_mesh` one.

    Collectives name devices by their position in the program's devices, so a mesh of
    another size, or of other axes, would name the wrong axes (or none) silently."""
    if not given and mesh is None:
        return None
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(
            "`mesh` must be a jax.sharding.Mesh (the one the program runs on) or None; "
            f"got {type(mesh).__name__}."
        )
    names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    if not shardings:
        return mesh
    devices = max(len(s.device_set) for s in shardings)
    named = {
        (tuple(s.mesh.axis_names), tuple(s.mesh.axis_sizes))
        for s in shardings
        if isinstance(s, jax.sharding.NamedSharding)
    }
    if devices == math.prod(sizes) and (not named or (names, sizes) in named):
        return mesh
    if not given:
        return None
    runs_on = f"{devices} device{'s' if devices > 1 else ''}"
    if named:
        runs_on += " with axes " + " or ".join(_describe(*n) for n in sorted(named))
    raise ValueError(
        f"`mesh` must be the mesh the program runs on ({runs_on}); got a mesh of "
        f"{math.prod(sizes)} devices with axes {_describe(names, sizes)}."
    )


def comm_report(fn, *args, mesh=None, cost: RingCost | None = None, **kwargs) -> CommReport:
    """Compile `fn(*args, **kwargs)` and list what it communicates.

    Reads the compiled program's HLO and lists each collective (collective-permute,
    all-to-all, all-gather, all-reduce, reduce-scatter) with how many times it runs per
    call (ops inside while loops counted once per trip), its dtype, shape and bytes per
    device, and the mesh axis it runs over. With `cost`, the ring's analytic model and
    the hardware profiles are printed beside it.

    **Arguments:**

    - `fn`: a function (jitted or not) of `args`.
    - `args`, `kwargs`: its arguments (arrays or `jax.ShapeDtypeStruct`s).
    - `mesh`: the mesh the program runs on, to name the axis of each collective
        (default: the one set by `jax.set_mesh`, if the program runs on it). A mesh of
        another number of devices, or of other axes, is an error.
    - `cost`: an optional [`ringeqx.tools.RingCost`][] for the model columns.

    **Returns:** a [`ringeqx.tools.CommReport`][]; `print` it for a table, or read `rows`,
    `count(kind)` and `bytes(kind)`.

    **Example:**

    ```python
    report = ringeqx.tools.comm_report(jax.jit(attention), q, k, v, mesh=mesh)
    print(report)
    ```
    """
    given = mesh is not None
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        mesh = None if abstract.empty else abstract
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args, **kwargs).compile()
    mesh = _program_mesh(compiled, mesh, given)
    hlo = compiled.as_text()
    merged: dict[tuple, list[int]] = {}
    for c in parse_collectives(hlo):
        arrays = c.arrays
        dtype = arrays[0][0] if arrays else "?"
        shape = max(arrays, key=lambda a: math.prod(a[1]))[1] if arrays else ()
        key = (c.kind, dtype, shape, _axes_of(c.attributes, mesh), c.nbytes)
        merged.setdefault(key, [0])[0] += c.count
    order = {k: i for i, k in enumerate(COLLECTIVES)}
    rows = tuple(
        CollectiveRow(kind, dtype, shape, axes, n[0], nbytes)
        for (kind, dtype, shape, axes, nbytes), n in sorted(
            merged.items(), key=lambda kv: (order[kv[0][0]], -kv[0][4] * kv[1][0])
        )
    )
    return CommReport(rows, cost)
