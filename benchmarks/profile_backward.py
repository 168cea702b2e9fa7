"""Where the time of ring attention's forward+backward goes: a `jax.profiler` trace, summed
per compiled op and grouped by what the op does.

Run: `python benchmarks/profile_backward.py` (8 fake CPU devices, N = 8192, 4 heads x 64,
float32, q/k/v sharded over the ring, the full mask by default). It compiles the
forward+backward of `ringeqx.ring_attention` and, for comparison, its forward alone; runs
each once to warm up, then `--reps` times inside `jax.profiler.trace(--trace-dir)`. The
trace directory is what XProf / TensorBoard's profile plugin open (`xprof --logdir
--trace-dir`); the script also reads the Perfetto copy of the trace and prints a Markdown
report:

- per op kind (matmul, copy/transpose, exponential and other elementwise, reduction,
  collective-permute, control flow), the time summed over the devices' threads and its
  share, for the forward and for the forward+backward;
- the matmuls one by one: their shapes (from the compiled HLO), count, time and rate
  against a same-run 4096 x 4096 matmul;
- the backward's own time (forward+backward minus forward).

Times are summed over the 8 devices' host threads, which share the machine's cores: read
the shares, not the absolute numbers.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile


_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-q", type=int, default=256)
    parser.add_argument("--block-kv", type=int, default=256)
    parser.add_argument("--causal", action="store_true", help="the causal mask")
    parser.add_argument("--top", type=int, default=12, help="matmul rows to print")
    parser.add_argument(
        "--trace-dir", default=None, help="where the trace goes (default: a temp dir)"
    )
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:])
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_FLAG}={ARGS.devices}"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx._timing import median_seconds  # noqa: E402


# Control-flow and runtime events contain the ops' own events: they are not counted.
_CONTAINERS = re.compile(r"^(while|cond|conditional|call)(\.\d+)?$|Thunk|Slinky|^\$")
_FUSION = re.compile(r"^%?([\w.\-]+) = (\S+) fusion\(.*calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^%?([\w.\-]+) .*\{$")
_DEF = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (\S+) ")
_DOT = re.compile(
    r"= (\S+) (?:dot|convolution)\(%?([\w.\-]+), %?([\w.\-]+)\)"
    r"(?:.*lhs_contracting_dims=\{([\d,]*)\})?"
)


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


def _fusion_kinds(hlo: str) -> tuple[dict[str, str], dict[str, str]]:
    """Op name -> kind, and matmul op name -> `lhs x rhs -> out` shapes, from the HLO."""
    bodies: dict[str, list[str]] = collections.defaultdict(list)
    current = None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line.strip())
        if header and not line.startswith(" "):
            current = header.group(1)
        elif current:
            bodies[current].append(line.strip())
    kinds, shapes = {}, {}
    for lines in bodies.values():
        for line in lines:
            fusion = _FUSION.match(line.removeprefix("ROOT "))
            name = _DEF.match(line)
            if not (fusion or name):
                continue
            body = bodies.get(fusion.group(3), []) if fusion else [line]
            op = fusion.group(1) if fusion else name.group(1)
            dot = _dot_text(body, None if fusion else lines)
            kinds[op] = "matmul" if dot else _kind_of(" ".join(body))
            if dot:
                shapes[op] = dot
    return kinds, shapes


def _kind_of(text: str) -> str:
    for kind, ops in (
        ("collective-permute", ("collective-permute",)),
        ("exponential / log", (" exponential(", " log(")),
        ("reduction", (" reduce(", " reduce-window(")),
        ("copy / transpose", (" transpose(", " copy(")),
        ("slice / update", ("dynamic-slice(", "dynamic-update-slice(", " pad(", " slice(")),
    ):
        if any(op in text for op in ops):
            return kind
    return "other elementwise"


def _op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """Summed duration (s) and count of each op event in the newest Perfetto trace."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    data = json.load(gzip.open(max(paths, key=os.path.getmtime)))
    events = data["traceEvents"] if isinstance(data, dict) else data
    times, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not _CONTAINERS.search(e["name"]):
            times[e["name"]] += e.get("dur", 0) / 1e6
            counts[e["name"]] += 1
    return times, counts


def _profile(compiled, arrays, reps: int, trace_dir: str):
    jax.block_until_ready(compiled(*arrays))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(reps):
            jax.block_until_ready(compiled(*arrays))
    times, counts = _op_times(trace_dir)
    kinds, shapes = _fusion_kinds(compiled.as_text())
    by_kind = collections.Counter()
    for name, t in times.items():
        kind = "waiting at a collective" if name == "Rendezvous" else kinds.get(name)
        by_kind[kind or "other elementwise"] += t / reps
    matmuls = [
        (shapes[name], counts[name] / reps, times[name] / reps)
        for name in times
        if kinds.get(name) == "matmul" and name in shapes
    ]
    return by_kind, sorted(matmuls, key=lambda m: -m[2])


def _flops(shape_text: str) -> float:
    """FLOPs of one matmul: 2 x output elements x the contracted size."""
    dims = [[int(d) for d in m.split(",") if d] for m in re.findall(r"\[([\d,]*)\]", shape_text)]
    contract = re.search(r"contract ([\d,]*)\)", shape_text)
    axes = [int(a) for a in contract.group(1).split(",") if a] if contract else []
    if len(dims) < 3:  # an operand's shape was not found in the HLO
        return 0.0
    lhs, out = dims[0], dims[2]
    return 2.0 * float(np.prod(out)) * float(np.prod([lhs[a] for a in axes]))


def _programs(mesh):
    seq = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    shape = (1, ARGS.seq_len, ARGS.heads, ARGS.head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    arrays = [jax.device_put(jax.random.normal(k, shape), seq) for k in keys]
    kernel = rx.XlaKernel(ARGS.block_q, ARGS.block_kv)
    mask = rx.Causal() if ARGS.causal else rx.Full()

    def attend(q, k, v):
        return rx.ring_attention(q, k, v, mask=mask, mesh=mesh, kernel=kernel)

    def both(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    forward = jax.jit(attend).lower(*arrays[:3]).compile()
    return forward, jax.jit(both).lower(*arrays).compile(), arrays


def _kind_table(fwd: collections.Counter, both: collections.Counter) -> list[str]:
    rows = [
        "| op kind | forward s | share | forward+backward s | share | backward s |",
        "|---|---|---|---|---|---|",
    ]
    f_total, b_total = sum(fwd.values()), sum(both.values())
    for kind in sorted(set(fwd) | set(both), key=lambda k: -both[k]):
        rows.append(
            f"| {kind} | {fwd[kind]:.3f} | {fwd[kind] / f_total:.0%} | {both[kind]:.3f} | "
            f"{both[kind] / b_total:.0%} | {both[kind] - fwd[kind]:.3f} |"
        )
    rows.append(f"| **all ops** | {f_total:.3f} | | {b_total:.3f} | | {b_total - f_total:.3f} |")
    return rows


def main() -> int:
    devices = np.asarray(jax.devices()[: ARGS.devices])
    mesh = Mesh(devices, ("sequence",), axis_types=(AxisType.Auto,))
    forward, both, arrays = _programs(mesh)
    trace_dir = ARGS.trace_dir or tempfile.mkdtemp(prefix="ringeqx-trace-")
    fwd_kinds, _ = _profile(forward, arrays[:3], ARGS.reps, os.path.join(trace_dir, "fwd"))
    both_kinds, matmuls = _profile(both, arrays, ARGS.reps, os.path.join(trace_dir, "both"))
    a = jnp.ones((4096, 4096), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm_rate = 2 * 4096**3 / median_seconds(mm, a, repeats=3)
    mask = "causal" if ARGS.causal else "full"
    report = [
        f"## profile: ring attention forward+backward, N={ARGS.seq_len}, {ARGS.heads} heads x "
        f"{ARGS.head_dim}, float32, {mask} mask, {ARGS.devices} fake CPU devices, "
        f"XlaKernel({ARGS.block_q}, {ARGS.block_kv}), {ARGS.reps} runs",
        "",
        f"Trace (XProf / TensorBoard): `{trace_dir}`. Op time per run, summed over the "
        "devices' threads:",
        "",
        *_kind_table(fwd_kinds, both_kinds),
        "",
        f"Matmuls of the forward+backward (4096 x 4096 matmul in this run: "
        f"{mm_rate / 1e9:.1f} GFLOP/s on one thread of work):",
        "",
        "| shapes | per run | s per run | GFLOP/s (summed threads) |",
        "|---|---|---|---|",
    ]
    for shape_text, count, seconds in matmuls[: ARGS.top]:
        rate = _flops(shape_text) * count / seconds / 1e9 if seconds else 0.0
        report.append(f"| `{shape_text}` | {count:.0f} | {seconds:.3f} | {rate:.1f} |")
    print("\n".join(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
