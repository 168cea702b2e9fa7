"""The communication report: what a compiled program sends (read from its HLO), beside
the ring's analytic model and named hardware profiles."""

import math
import re

import equinox as eqx
import jax
import numpy as np

from .._cost import RingCost
from .._hardware import HARDWARE
from ._parse import COLLECTIVES, check_hlo_type, check_kind, parse_collectives


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
