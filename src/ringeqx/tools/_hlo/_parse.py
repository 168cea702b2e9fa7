"""What a compiled program communicates, read from its HLO text: one parser, used by
`permute_stats` and `comm_report`."""

import math
import re
from typing import NamedTuple


COLLECTIVES = (
    "collective-permute",
    "all-to-all",
    "all-gather",
    "all-reduce",
    "reduce-scatter",
)

_KIND = re.compile(rf"\s({'|'.join(COLLECTIVES)})(-start)?\(")
# Every HLO array type: f32, bf16, s16, u64, pred, f8e4m3fn, f8e5m2, c64, ...
HLO_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+)?[a-z]*)\[([\d,]*)\]")


_HLO_TYPE = re.compile(r"pred|[suf]\d+|bf16|c\d+|f8e\d+m\d+\w*|f4e\d+m\d+\w*")


def check_hlo_type(name: str, hlo_type) -> None:
    """Raise unless `hlo_type` is an HLO element type name (`f32`, `bf16`, `s32`,
    `f8e4m3fn`, `pred`, ...): a name no program has would match nothing silently."""
    if not (isinstance(hlo_type, str) and _HLO_TYPE.fullmatch(hlo_type)):
        raise ValueError(
            f"`{name}` must be an HLO element type name such as 'f32', 'bf16', 's32', "
            f"'u16' or 'f8e4m3fn' (as HLO writes them, not NumPy's); got {hlo_type!r}."
        )


def check_kind(kind) -> None:
    """Raise unless `kind` is a collective this package reads (`COLLECTIVES`)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"`kind` must be one of {COLLECTIVES} or None; got {kind!r}.")


def dtype_bytes(hlo_type: str) -> float:
    """Bytes per element of an HLO element type (`f32` 4, `bf16` 2, `f8e4m3fn` 1, `pred`
    1, `s4` 0.5): the width is the first number in the name."""
    if hlo_type == "pred":
        return 1.0
    bits = re.search(r"\d+", hlo_type)
    if bits is None:
        raise ValueError(f"Unknown HLO element type {hlo_type!r}.")
    return int(bits.group()) / 8


class HloCollective(NamedTuple):
    """One collective op of a compiled program."""

    kind: str
    # The arrays it moves, e.g. `(("f32", (1, 2, 8, 5)),)`.
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    # Bytes per device of one execution: the result (for async `-start` ops, the largest
    # array of the tuple, which is the result).
    nbytes: int
    # Executions per call: the product of the trip counts of the loops around it.
    count: int
    # The trip counts of those loops, outermost first.
    trips: tuple[int, ...]
    # The innermost loop body around it (None outside loops).
    loop: str | None
    # The text after the op's name: replica_groups / source_target_pairs live there.
    attributes: str
    # The left-hand side, for filtering by shape.
    lhs: str


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """`({computation: its instruction lines}, entry computation)`."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif cur is not None and line.startswith(" "):
            comps[cur].append(line)
    return comps, entry


def module(hlo) -> tuple[dict[str, list[str]], str]:
    """`computations(hlo)`, or an error unless `hlo` is the text of an HLO module: a
    program's collectives cannot be read from anything else, and reading them from
    other text (StableHLO, a compiled object, a file name) would find none silently."""
    if not isinstance(hlo, str):
        raise TypeError(
            "`hlo` must be the text of a compiled HLO module "
            f"(`jax.jit(f).lower(...).compile().as_text()`); got a {type(hlo).__name__}."
        )
    comps, entry = computations(hlo)
    if entry is None:
        raise ValueError(
            "`hlo` must be the text of a compiled HLO module "
            "(`jax.jit(f).lower(...).compile().as_text()`); it has no ENTRY computation "
            f"(starts {hlo[:60]!r})."
        )
    return comps, entry


def called_computations(lines: list[str]) -> list[tuple[str, int]]:
    """`(computation, trips)` for every computation these lines call: a while body's
    `known_trip_count`, 1 for everything else."""
    calls = []
    for line in lines:
        trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
        body = re.search(r"body=%?([\w.\-]+)", line)
        refs = re.findall(
            r"(?:condition|body|calls|to_apply|true_computation|false_computation)"
            r"=%?([\w.\-]+)",
            line,
        )
        for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
            refs += [r.strip().lstrip("%") for r in group.split(",")]
        for ref in refs:
            n = int(trip.group(1)) if trip and body and ref == body.group(1) else 1
            calls.append((ref, n))
    return calls


def _executions(comps: dict[str, list[str]], entry: str | None) -> dict[str, list]:
    """`[(times, trips, loop), ...]` per computation, one per path from the entry."""
    calls = {name: called_computations(lines) for name, lines in comps.items()}
    seen: dict[str, list] = {name: [] for name in comps}
    stack = [(entry, 1, (), None)]
    while stack:
        name, times, trips, loop = stack.pop()
        if name not in seen:
            continue
        seen[name].append((times, trips, loop))
        stack += [
            (ref, times * n, trips + (n,), ref) if n > 1 else (ref, times, trips, loop)
            for ref, n in calls.get(name, [])
        ]
    return seen


def _op(line: str):
    """`(kind, arrays, nbytes, attributes, lhs)` of an instruction line that is a
    collective (see `HloCollective`), else None."""
    op = _KIND.search(line)
    if op is None:
        return None
    lhs, rhs = line[: op.start()], line[op.end() :]
    arrays = tuple(
        (dt, tuple(int(d) for d in dims.split(",") if d))
        for dt, dims in HLO_ARRAY.findall(lhs)
    )
    sizes = [dtype_bytes(dt) * math.prod(shape) for dt, shape in arrays]
    nbytes = int(max(sizes) if op.group(2) else sum(sizes)) if sizes else 0
    return op.group(1), arrays, nbytes, rhs, lhs


def parse_collectives(hlo: str) -> list[HloCollective]:
    """Every collective op of a compiled program's HLO text, each with how many times it
    runs per call: XLA removes loops of one trip, so ops in a while body count once per
    iteration of every loop around them (`known_trip_count` in the backend config)."""
    comps, entry = module(hlo)
    seen = _executions(comps, entry)
    out = []
    for name, lines in comps.items():
        for found in filter(None, map(_op, lines)):
            kind, arrays, nbytes, rhs, lhs = found
            for times, trips, loop in seen[name]:
                out.append(HloCollective(kind, arrays, nbytes, times, trips, loop, rhs, lhs))
    return out


def permute_stats(hlo: str, shape: str = "") -> tuple[int, int, list[int]]:
    """`(ops, bytes, trips)` of the collective-permutes a compiled program executes: each
    op counted once per iteration of the while loops around it (XLA removes loops of one
    trip, so counting ops is what survives); `trips` are the trip counts of the loops that
    hold permutes. Bytes are per device, for every element type (`f32`, `bf16`, `s16`,
    `u64`, `f8e4m3fn`, ...). With `shape` (e.g. `"f32[1,2,2048,64]"`), only permutes of
    arrays of that shape count."""
    ops, nbytes, loops = 0, 0, {}
    for c in parse_collectives(hlo):
        if c.kind != "collective-permute":
            continue
        if c.loop is not None:
            loops[c.loop] = c.trips[-1]
        if shape in c.lhs:
            ops += c.count
            nbytes += c.count * c.nbytes
    return ops, nbytes, list(loops.values())


def collectives(hlo: str) -> list[tuple[str, str]]:
    """Every collective op in a compiled program's HLO text, once each (no execution
    counts: see `parse_collectives`), as `(kind, result)`: the kind (one of
    `COLLECTIVES`; async `-start` forms count once, `-done` not at all) and the result's
    type text (e.g. `"f32[1,128,4,64]{3,2,1,0}"`), to tell activations from parameters."""
    comps, _ = module(hlo)
    return [
        (found[0], found[4].split("=", 1)[1].strip())
        for lines in comps.values()
        for found in filter(None, map(_op, lines))
    ]
