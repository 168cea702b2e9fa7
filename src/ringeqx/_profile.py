"""What a compiled program communicates, read from its HLO text."""

import math
import re


_BYTES = {
    "f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "pred": 1, "s8": 1, "u8": 1,
}


def permute_stats(hlo: str, shape: str = "") -> tuple[int, int, list[int]]:
    """`(ops, bytes, trips)` of the collective-permutes a compiled program executes: each
    op counted once per iteration of the while loops around it (XLA removes loops of one
    trip, so counting ops is what survives); `trips` are the trip counts of the loops that
    hold permutes. Bytes are per device. With `shape` (e.g. `"f32[1,2,2048,64]"`), only
    permutes of arrays of that shape count."""
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
    calls: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
    for name, lines in comps.items():
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
                calls[name].append((ref, n))
    mult = {name: 0 for name in comps}
    stack = [(entry, 1)]
    while stack:
        name, times = stack.pop()
        mult[name] += times
        stack += [(ref, times * n) for ref, n in calls.get(name, [])]
    ops, nbytes, trips = 0, 0, []
    for name, lines in comps.items():
        for line in lines:
            if re.search(r"\scollective-permute(-start)?\(", line):
                lhs = line.split("collective-permute")[0]
                if shape not in lhs:
                    continue
                size = sum(
                    _BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                    for dt, dims in re.findall(
                        r"\b(f32|s32|u32|bf16|f16|pred|s8|u8)\[([\d,]*)\]", lhs
                    )
                )
                ops += mult[name]
                nbytes += mult[name] * size
            body = re.search(r"body=%?([\w.\-]+)", line)
            trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            if body and trip and any("collective-permute" in x for x in comps[body.group(1)]):
                trips.append(int(trip.group(1)))
    return ops, nbytes, trips


_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")


def collectives(hlo: str) -> list[tuple[str, str]]:
    """Every collective op in a compiled program's HLO text, as `(kind, result)`: the kind
    (`"all-gather"`, `"all-reduce"`, `"all-to-all"`, `"reduce-scatter"`,
    `"collective-permute"`; async `-start` forms count once, `-done` not at all) and the
    result's type text (e.g. `"f32[1,128,4,64]"`), to tell activations from parameters."""
    found = []
    kinds = "|".join(_COLLECTIVES)
    for line in hlo.splitlines():
        m = re.search(rf"=\s*(.*?)\s({kinds})(?:-start)?\(", line)
        if m:
            found.append((m.group(2), m.group(1)))
    return found
