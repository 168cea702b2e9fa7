"""Where a compiled program's time goes: compile it with a per-compile XLA dump, run it
under `jax.profiler.trace`, and read the trace file the profiler writes (no TensorBoard or
XProf needed) into time in collectives, in compute and waiting."""

import collections
import functools
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ..._util._timing import median_seconds
from ._parse import COLLECTIVES


# The op kinds of compute, in the order they are tried on an op's (fused) HLO text.
_COMPUTE_KINDS = (
    ("exponential / log", (" exponential(", " log(")),
    ("reduction", (" reduce(", " reduce-window(")),
    ("copy / transpose", (" transpose(", " copy(")),
    ("slice / update", ("dynamic-slice(", "dynamic-update-slice(", " pad(", " slice(")),
)
# Ops that contain other ops' events: counting them would count their body twice.
_CONTROL_FLOW = ("while", "conditional", "call")
_FUSION = re.compile(r"^%?([\w.\-]+) = .*? fusion\(.*calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^%?([\w.\-]+) .*\{$")
_DEF = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (\S+) ")
_OPCODE = re.compile(r"^%?([\w.\-]+) = .*?\s([a-z][a-z0-9\-]*)\(")
_DOT = re.compile(
    r"= (\S+) (?:dot|convolution)\(%?([\w.\-]+), %?([\w.\-]+)\)"
    r"(?:.*lhs_contracting_dims=\{([\d,]*)\})?"
)
# The thread-level event that runs one device's program on XLA:CPU.
_PROGRAM = "ThunkExecutor::Execute"
# Inside a collective on XLA:CPU: the thread waits here for the other participants.
_RENDEZVOUS = "Rendezvous"


def _dot_text(lines: list[str], context: list[str] | None = None) -> str | None:
    """`lhs x rhs -> out (contract lhs dims)` of the first dot among `lines`, if any;
    operand shapes are looked up in `context` (default: `lines`)."""
    defined = dict(m.groups() for m in map(_DEF.match, context or lines) if m)
    for line in lines:
        dot = _DOT.search(line)
        if dot:
            out, lhs, rhs, contract = dot.groups()
            return (
                f"{defined.get(lhs, '?')} x {defined.get(rhs, '?')} -> {out} "
                f"(contract {contract or ''})"
            )
    return None


def _kind_of(opcode: str, text: str) -> str:
    """The kind of one op from its opcode and its (fused) HLO text."""
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return base
    if opcode in _CONTROL_FLOW:
        return "control flow"
    for kind, ops in _COMPUTE_KINDS:
        if any(op in text for op in ops):
            return kind
    return "other elementwise"


def _bodies(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    bodies: dict[str, list[str]] = collections.defaultdict(list)
    current = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line.strip())
        if header and not line.startswith(" "):
            current = header.group(1)
        elif current:
            bodies[current].append(line.strip().removeprefix("ROOT "))
    return bodies


def op_kinds(hlo: str) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Read a compiled program's HLO text: op name -> kind (`"matmul"`, a collective such
    as `"collective-permute"`, `"control flow"`, `"exponential / log"`, ...), op name ->
    opcode, and matmul op name -> `lhs x rhs -> out` shapes."""
    bodies = _bodies(hlo)
    kinds, opcodes, shapes = {}, {}, {}
    for lines in bodies.values():
        for line in lines:
            op = _OPCODE.match(line)
            if not op:
                continue
            name, opcode = op.groups()
            fusion = _FUSION.match(line) if opcode == "fusion" else None
            body = bodies.get(fusion.group(2), []) if fusion else [line]
            dot = _dot_text(body, None if fusion else lines)
            kinds[name] = "matmul" if dot else _kind_of(opcode, " ".join(body))
            opcodes[name] = opcode
            if dot:
                shapes[name] = dot
    return kinds, opcodes, shapes


def trace_file(trace_dir: str) -> str:
    """The newest `*.trace.json.gz` that `jax.profiler.trace(trace_dir)` wrote."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"No `*.trace.json.gz` under {trace_dir!r}.")
    return max(paths, key=os.path.getmtime)


def trace_events(path: str) -> tuple[list[dict], dict[tuple, str]]:
    """The complete (`"ph": "X"`) events of a trace file, and (pid, tid) -> thread name."""
    with gzip.open(path) as file:
        data = json.load(file)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        (e.get("pid"), e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    return [e for e in events if e.get("ph") == "X"], names


def op_times(path: str) -> tuple[collections.Counter, collections.Counter]:
    """Summed duration (s) and count of each event name in a trace file."""
    times, counts = collections.Counter(), collections.Counter()
    for e in trace_events(path)[0]:
        times[e["name"]] += e.get("dur", 0) / 1e6
        counts[e["name"]] += 1
    return times, counts


class ThreadTime(eqx.Module):
    """Seconds per call on one host thread that ran device programs (see
    [`ringeqx.tools.ProgramProfile`][])."""

    thread: str
    total: float
    collective: float
    waiting: float
    compute: float


class ProgramProfile(eqx.Module):
    """Where one compiled program's time went (see [`ringeqx.tools.profile_program`][]).

    Every time is in seconds per call, summed over the threads that ran the devices'
    programs, except `wall`. `collective` and `compute` map an op kind to its time;
    `collective_count` maps a collective kind to its executions per call (all devices).
    """

    wall: float
    total: float
    collective: dict[str, float]
    collective_count: dict[str, float]
    waiting: float
    compute: dict[str, float]
    threads: tuple[ThreadTime, ...]
    repeats: int
    dump_dir: str
    trace_dir: str
    trace_file: str
    hlo: str = eqx.field(repr=False)

    @property
    def collective_seconds(self) -> float:
        """Time in collectives, all kinds (includes `waiting`)."""
        return sum(self.collective.values())

    @property
    def compute_seconds(self) -> float:
        """Time in compute ops, all kinds."""
        return sum(self.compute.values())

    def __str__(self) -> str:
        total = self.total or 1.0
        lines = [
            f"wall time per call: {self.wall * 1e3:.3f} ms (median of {self.repeats}, not traced)",
            f"per call, summed over {len(self.threads)} device threads: "
            f"{self.total * 1e3:.3f} ms in programs",
            f"{'kind':<32}{'ms':>10}{'share':>8}{'count':>8}",
        ]
        rows = [
            (f"collective: {k}", t, self.collective_count.get(k))
            for k, t in sorted(self.collective.items(), key=lambda kt: -kt[1])
        ]
        rows += [("  of which waiting", self.waiting, None)]
        rows += [
            (f"compute: {k}", t, None)
            for k, t in sorted(self.compute.items(), key=lambda kt: -kt[1])
        ]
        other = self.total - self.collective_seconds - self.compute_seconds
        rows += [("other (control flow, runtime)", other, None)]
        for label, t, count in rows:
            shown = "" if count is None else f"{count:.0f}"
            lines.append(f"{label:<32}{t * 1e3:>10.3f}{t / total:>8.0%}{shown:>8}")
        lines.append(f"{'thread':<32}{'total':>10}{'collect.':>10}{'waiting':>10}{'compute':>10}")
        for i, t in enumerate(self.threads):
            lines.append(
                f"{f'thread {i}':<32}{t.total * 1e3:>10.3f}{t.collective * 1e3:>10.3f}"
                f"{t.waiting * 1e3:>10.3f}{t.compute * 1e3:>10.3f}"
            )
        lines.append(f"XLA dump: {self.dump_dir}")
        lines.append(f"trace: {self.trace_dir} (xprof --logdir / tensorboard --logdir)")
        return "\n".join(lines)


def _outermost(events: list[dict]) -> list[dict]:
    """The events of one thread not nested in another event of the list."""
    kept, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= end:
            kept.append(e)
            end = e["ts"] + e.get("dur", 0)
    return kept


def _thread_times(events: list[dict], kinds: dict[str, str], opcodes: dict[str, str]):
    """(total, collective by kind, collective counts, waiting, compute by kind) in
    seconds of one thread's events."""
    collective, counts, compute = (collections.Counter() for _ in range(3))
    waiting = 0.0
    # The time the thread spent in device programs: the union of XLA:CPU's program
    # events and of the HLO ops' own events. Ops can run outside a program event (a
    # program resumed on another thread after a collective), and backends without that
    # event have only the ops.
    programs = [e for e in events if e["name"] == _PROGRAM or e["name"] in kinds]
    total = sum(e.get("dur", 0) for e in _outermost(programs)) / 1e6
    for e in events:
        seconds = e.get("dur", 0) / 1e6
        kind = kinds.get(e["name"])
        if e["name"] == _RENDEZVOUS:
            waiting += seconds
        elif kind in COLLECTIVES:
            collective[kind] += seconds
            counts[kind] += 1
            if opcodes[e["name"]].endswith("-done"):  # blocked on an async collective
                waiting += seconds
        elif kind is not None and kind != "control flow":
            compute[kind] += seconds
    return total, collective, counts, waiting, compute


def summarize_trace(path: str, hlo: str, repeats: int) -> dict[str, Any]:
    """Read a trace file of `repeats` calls of the program whose HLO is `hlo`: the
    fields of a [`ringeqx.tools.ProgramProfile`][] that come from the trace, per call."""
    kinds, opcodes, _ = op_kinds(hlo)
    events, names = trace_events(path)
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    collective, counts, compute = (collections.Counter() for _ in range(3))
    threads, waiting, total = [], 0.0, 0.0
    for key, thread_events in sorted(by_thread.items(), key=lambda kv: names.get(kv[0], "")):
        t, coll, count, wait, comp = _thread_times(thread_events, kinds, opcodes)
        if not t:  # a thread that ran no device program (Python, the profiler)
            continue
        collective.update(coll)
        counts.update(count)
        compute.update(comp)
        waiting, total = waiting + wait, total + t
        threads.append(
            ThreadTime(
                names.get(key, str(key)),
                t / repeats,
                sum(coll.values()) / repeats,
                wait / repeats,
                sum(comp.values()) / repeats,
            )
        )
    return dict(
        total=total / repeats,
        collective={k: v / repeats for k, v in collective.items()},
        collective_count={k: v / repeats for k, v in counts.items()},
        waiting=waiting / repeats,
        compute={k: v / repeats for k, v in compute.items()},
        threads=tuple(threads),
    )


def _writable_folder(name: str, path: str) -> str:
    """`path`, made a folder that files can be written to, or a ValueError naming `name`.

    Checked before anything runs: `jax.profiler` cannot stop a trace it failed to write
    (its session stays open), and then no later profile can start in this process. XLA
    only logs a dump it cannot write."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(
            f"`{name}` must be a folder that files can be written to; got {path!r} "
            f"({error.strerror or error})."
        ) from None
    return path


def profile_program(
    fn: Callable,
    *args,
    dump_dir: str | None = None,
    trace_dir: str | None = None,
    repeats: int = 3,
    compiler_options: dict[str, Any] | None = None,
    **kwargs,
) -> ProgramProfile:
    """Compile `fn(*args, **kwargs)` with an XLA dump, time it, and trace it with
    `jax.profiler`: where its time goes, without any process-wide flag.

    The dump is asked for per compile (`compiler_options={"xla_dump_to": dump_dir,
    "xla_dump_hlo_as_text": True}`, so `XLA_FLAGS` and other programs are untouched); it
    holds the HLO before and after optimisation (`*.before_optimizations.txt`,
    `*after_optimizations.txt`). The program runs once to warm up, `repeats` times timed,
    then `repeats` times inside `jax.profiler.trace(trace_dir)`. The trace directory opens
    in XProf (`xprof --logdir TRACE_DIR`) or TensorBoard's profile plugin
    (`tensorboard --logdir TRACE_DIR`); the summary is read from the `*.trace.json.gz` the
    profiler writes there, so neither needs to be installed.

    What the summary counts, on each host thread that ran a device's program (XLA:CPU
    runs each fake device's program on a thread of its pool, named
    `tf_XLAPjRtCpuClient/...`; a thread is not tied to one device):

    - **total**: the thread's `ThunkExecutor::Execute` events (the programs), outermost
      only; on a thread without them (other backends' traces, which this reading has not
      been checked against), its outermost op events.
    - **collective**, per kind (`collective-permute`, `all-to-all`, `all-gather`,
      `all-reduce`, `reduce-scatter`): the events of ops whose HLO opcode is that
      collective (or its `-start` / `-done`).
    - **waiting**: the `Rendezvous` events inside collectives, where a thread waits for
      the other participants to arrive (on XLA:CPU most of a collective's time), plus
      `*-done` ops of asynchronous collectives. A part of the collective time.
    - **compute**: the events of every other op of the compiled HLO, by kind (`matmul`,
      `exponential / log`, `reduction`, `copy / transpose`, `slice / update`, `other
      elementwise`); control flow (`while`, `conditional`, `call`) is not counted, as
      its events contain its body's.

    So `collective + compute <= total` on each thread; the rest is control flow and the
    runtime between ops. The threads share the machine's cores: on fake CPU devices read
    the shares, not the absolute times.

    **Arguments:**

    - `fn`: the function (jitted or not); `*args` and `**kwargs` are its arguments
      (`kwargs` are closed over, not traced).
    - `dump_dir`, `trace_dir`: where the XLA dump and the trace go (default: new temporary
      directories).
    - `repeats`: the timed and the traced calls.
    - `compiler_options`: more per-compile XLA options, merged over the dump options.

    **Returns:** a [`ringeqx.tools.ProgramProfile`][]; `print` it for a table.

    **Example:**

    ```python
    profile = ringeqx.tools.profile_program(attend, q, k, v, trace_dir="/tmp/ring-trace")
    print(profile)
    profile.collective["collective-permute"], profile.waiting
    ```
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer; got {repeats!r}.")
    dump_dir = _writable_folder("dump_dir", dump_dir or tempfile.mkdtemp(prefix="ringeqx-dump-"))
    trace_dir = _writable_folder(
        "trace_dir", trace_dir or tempfile.mkdtemp(prefix="ringeqx-trace-")
    )
    options = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True}
    options.update(compiler_options or {})
    lowered = jax.jit(functools.partial(fn, **kwargs)).lower(*args)
    compiled = lowered.compile(compiler_options=options)
    wall = median_seconds(compiled, *args, repeats=repeats)
    with jax.profiler.trace(trace_dir):
        for _ in range(repeats):
            jax.block_until_ready(compiled(*args))
    path = trace_file(trace_dir)
    hlo = compiled.as_text()
    return ProgramProfile(
        wall=wall,
        repeats=repeats,
        dump_dir=dump_dir,
        trace_dir=trace_dir,
        trace_file=path,
        hlo=hlo,
        **summarize_trace(path, hlo, repeats),
    )
