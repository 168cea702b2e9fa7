"""Whether a compiled ring hides its transfers: for every asynchronous collective-permute
in a while-loop body of the scheduled HLO, which kernels the compiler placed between its
start and its done. Read from the text the compiler emitted (the parser is
`_profile`'s), so a program without the property cannot pass."""

import re

import equinox as eqx
import jax

from ._parse import HLO_ARRAY, called_computations, module


# A Pallas kernel as it reaches the scheduled HLO: Mosaic on TPU, Triton on GPU.
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")
_KERNEL = re.compile(
    r'custom_call_target="(?:' + "|".join(re.escape(t) for t in KERNEL_TARGETS) + ')"'
)
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_START = re.compile(r"\scollective-permute-start\(")
_DONE = re.compile(r"\scollective-permute-done\(%?([\w.\-]+)\)")
# GPU: XLA may wrap a permute in an async computation (`async-start(...), calls=%c`).
_ASYNC_START = re.compile(r"\sasync-start\(.*calls=%?([\w.\-]+)")
_ASYNC_DONE = re.compile(r"\sasync-done\(%?([\w.\-]+)\)")
_WHILE = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")
_TRIP = re.compile(r'known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class PermuteOverlap(eqx.Module):
    """One collective-permute of a loop body: what it moves and which kernels run while
    it is in flight.

    **Fields:**

    - `start`, `done`: the instruction names (`done` is None when the body holds no
        done for this start).
    - `arrays`: what it delivers, as `(element type, shape)`, e.g.
        `(("bf16", (1, 2, 4096, 64)),)`.
    - `kernels`: the names of the kernel custom-calls scheduled between start and done,
        directly or inside a called computation (a `conditional`'s branches, a fusion,
        an async wrapper), in schedule order.
    - `direction`: `"backward"` if the permute comes from a transposed (VJP) program
        (`transpose(` in its `op_name`), else `"forward"`.
    """

    start: str = eqx.field(static=True)
    done: str | None = eqx.field(static=True)
    arrays: tuple[tuple[str, tuple[int, ...]], ...] = eqx.field(static=True)
    kernels: tuple[str, ...] = eqx.field(static=True)
    direction: str = eqx.field(static=True)

    @property
    def overlaps(self) -> bool:
        """Whether at least one kernel runs while this permute is in flight."""
        return len(self.kernels) > 0


class LoopOverlap(eqx.Module):
    """The permutes of one while-loop body (a ring's `lax.scan`), in schedule order.

    **Fields:**

    - `body`: the body computation's name.
    - `trips`: its `known_trip_count` (None when the compiler did not record one).
    - `kernels`: how many kernel custom-calls the body runs, directly or nested.
    - `permutes`: a `PermuteOverlap` per collective-permute-start in the body.
    """

    body: str = eqx.field(static=True)
    trips: int | None = eqx.field(static=True)
    kernels: int = eqx.field(static=True)
    permutes: tuple[PermuteOverlap, ...] = eqx.field(static=True)

    @property
    def overlapping(self) -> int:
        """How many of the body's permutes enclose a kernel."""
        return sum(p.overlaps for p in self.permutes)


class OverlapReport(eqx.Module):
    """What `ring_overlap` found: one `LoopOverlap` per while-loop body that holds a
    collective-permute (loops without one, e.g. the kernels' own, are left out).

    `str(report)` is a table: loop body, direction, permutes found, permutes that
    enclose a kernel, and the shapes of those that do not.
    """

    loops: tuple[LoopOverlap, ...] = eqx.field(static=True)

    @property
    def permutes(self) -> tuple[PermuteOverlap, ...]:
        """Every permute of every loop body."""
        return tuple(p for loop in self.loops for p in loop.permutes)

    @property
    def all_overlap(self) -> bool:
        """Whether permutes were found and every one encloses a kernel."""
        return bool(self.permutes) and all(p.overlaps for p in self.permutes)

    def __str__(self) -> str:
        rows = ["body | trips | kernels | direction | permutes | overlapping | exposed"]
        for loop in self.loops:
            for direction in sorted({p.direction for p in loop.permutes}):
                ps = [p for p in loop.permutes if p.direction == direction]
                exposed = sorted(
                    {f"{dt}{list(s)}" for p in ps if not p.overlaps for dt, s in p.arrays}
                )
                rows.append(
                    f"{loop.body} | {loop.trips} | {loop.kernels} | {direction} | "
                    f"{len(ps)} | {sum(p.overlaps for p in ps)} | {' '.join(exposed)}"
                )
        return "\n".join(rows)


def _name(line: str) -> str | None:
    m = _NAME.match(line)
    return m.group(1) if m else None


def _kernel_names(comps: dict[str, list[str]]) -> dict[str, tuple[str, ...]]:
    """The kernel custom-calls each computation runs, through every computation it
    calls (fusions, conditionals, async wrappers, nested loops)."""
    memo: dict[str, tuple[str, ...]] = {}

    def visit(name: str, active: frozenset) -> tuple[str, ...]:
        if name in memo:
            return memo[name]
        if name in active or name not in comps:
            return ()
        found: list[str] = []
        for line in comps[name]:
            found += _line_kernels(line, lambda ref: visit(ref, active | {name}))
        memo[name] = tuple(found)
        return memo[name]

    for name in comps:
        visit(name, frozenset())
    return memo


def _line_kernels(line: str, called) -> list[str]:
    """The kernels one instruction runs: itself, or those of the computations it calls."""
    if _KERNEL.search(line):
        return [_name(line) or "custom-call"]
    out: list[str] = []
    for ref, _ in called_computations([line]):
        out += called(ref)
    return out


def _delivered(line: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """`(type, shape)` of the arrays a done (or async-done) line's result holds."""
    lhs = line.split("=", 1)[1]
    lhs = lhs[: lhs.find("collective-permute-done(")] if "collective-permute-done(" in lhs else lhs
    lhs = lhs[: lhs.find("async-done(")] if "async-done(" in lhs else lhs
    return tuple(
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in HLO_ARRAY.findall(lhs)
    )


def _body_permutes(
    lines: list[str], comps: dict[str, list[str]], kernels: dict[str, tuple[str, ...]]
) -> list[PermuteOverlap]:
    """Pair every permute start of a body with its done, in schedule order (a scheduled
    module prints each computation's instructions in the order they run)."""
    starts: dict[str, int] = {}
    dones: dict[str, int] = {}
    for i, line in enumerate(lines):
        name = _name(line)
        if name is None:
            continue
        if _START.search(line):
            starts[name] = i
        elif (m := _ASYNC_START.search(line)) and any(
            "collective-permute" in c for c in comps.get(m.group(1), [])
        ):
            starts[name] = i
        elif (m := _DONE.search(line) or _ASYNC_DONE.search(line)) and m.group(1) in starts:
            dones[m.group(1)] = i
    per_line = [
        tuple(_line_kernels(line, lambda ref: kernels.get(ref, ()))) for line in lines
    ]
    out = []
    for name, i in starts.items():
        j = dones.get(name)
        # A done before its start (or none in the body) means the transfer crosses the
        # loop's back edge: it is in flight from the start to the end of the body and,
        # in the next iteration, from the body's top to the done.
        if j is None:
            span = list(range(i + 1, len(lines)))
        elif j > i:
            span = list(range(i + 1, j))
        else:
            span = list(range(i + 1, len(lines))) + list(range(j))
        op = _OP_NAME.search(lines[i])
        direction = "backward" if op and "transpose(" in op.group(1) else "forward"
        out.append(
            PermuteOverlap(
                start=name,
                done=None if j is None else _name(lines[j]),
                arrays=_delivered(lines[j]) if j is not None else (),
                kernels=tuple(k for s in span for k in per_line[s]),
                direction=direction,
            )
        )
    return out


def ring_overlap(compiled: str | jax.stages.Compiled) -> OverlapReport:
    """Which kernels each ring hop hides behind, read from a compiled program's
    scheduled HLO.

    A ring step sends K/V (and, in the backward, the dK/dV accumulators) to the next
    device with an asynchronous `collective-permute-start` ... `collective-permute-done`
    pair, and the transfer is hidden when the step's kernel runs between the two. For
    every while-loop body of the program (a `lax.scan` of the ring) this lists each
    permute with the Pallas kernels (Mosaic `tpu_custom_call`, Triton
    `__gpu$xla.gpu.triton`) the compiler scheduled between its start and its done,
    directly or inside a `conditional`, fusion or async computation. Permutes that XLA
    wraps in `async-start`/`async-done` (GPU) count the same.

    **Arguments:**

    - `compiled`: a compiled program (`jax.jit(f).lower(...).compile()`) or the text of
        a scheduled HLO module (`compiled.as_text()`).

    **Returns:**

    An `OverlapReport`; `report.all_overlap` says whether permutes were found and every
    one encloses a kernel, and `print(report)` shows the table.

    !!! Example

        ```python
        compiled = jax.jit(jax.grad(loss)).lower(q, k, v).compile()
        report = ringeqx.tools.ring_overlap(compiled)
        print(report)
        assert report.all_overlap
        ```

    The text must be the scheduled one (`is_scheduled=true`): before scheduling, the
    order of instructions says nothing about when they run.
    """
    if isinstance(compiled, jax.stages.Compiled):
        compiled = compiled.as_text()
    if not isinstance(compiled, str):
        raise TypeError(
            "`compiled` must be a compiled program (`jax.jit(f).lower(...).compile()`) or "
            f"its HLO text; got a {type(compiled).__name__}."
        )
    # Text that is not an HLO module (StableHLO, a file name) would show no permutes.
    comps, _ = module(compiled)
    kernels = _kernel_names(comps)
    bodies: dict[str, int | None] = {}
    for lines in comps.values():
        for line in lines:
            if m := _WHILE.search(line):
                trip = _TRIP.search(line)
                bodies[m.group(1)] = int(trip.group(1)) if trip else None
    loops = []
    for body, trips in bodies.items():
        permutes = _body_permutes(comps.get(body, []), comps, kernels)
        if permutes:
            loops.append(
                LoopOverlap(
                    body=body,
                    trips=trips,
                    kernels=len(kernels.get(body, ())),
                    permutes=tuple(permutes),
                )
            )
    return OverlapReport(loops=tuple(loops))
