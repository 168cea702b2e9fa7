"""Where the time of ring attention's forward+backward goes: a `jax.profiler` trace, summed
per compiled op and grouped by what the op does.

Run: `python benchmarks/profile_backward.py` (8 fake CPU devices, N = 8192, 4 heads x 64,
float32, q/k/v sharded over the ring, the full mask by default). It profiles the
forward+backward of `ringeqx.ring_attention` and, for comparison, its forward alone, each
with `ringeqx.tools.profile_program` (one warm-up run, then `--reps` timed and `--reps` traced
runs inside `jax.profiler.trace(--trace-dir)`), which also reads the trace file the
profiler writes. The trace directory is what XProf / TensorBoard's profile plugin open
(`xprof --logdir TRACE_DIR`). The script prints a Markdown report:

- per op kind (matmul, copy/transpose, exponential and other elementwise, reduction,
  collective-permute apart from waiting at a collective), the time summed over the
  devices' threads and its share, for the forward and for the forward+backward;
- the matmuls one by one: their shapes (from the compiled HLO), count, time and rate
  against a same-run 4096 x 4096 matmul;
- the backward's own time (forward+backward minus forward).

Times are summed over the 8 devices' host threads, which share the machine's cores: read
the shares, not the absolute numbers.
"""

import argparse
import collections
import os
import re
import sys
import tempfile

from _devices import fake_cpu_devices


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
fake_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx._util._timing import median_seconds  # noqa: E402
from ringeqx.tools._hlo._trace import op_kinds, op_times  # noqa: E402


def _profile(fn, arrays, reps: int, trace_dir: str):
    """Op time per run by kind, and the matmuls one by one, from `rx.tools.profile_program`."""
    profile = rx.tools.profile_program(fn, *arrays, trace_dir=trace_dir, repeats=reps)
    by_kind = collections.Counter(profile.compute)
    for kind, seconds in profile.collective.items():
        by_kind[kind] += seconds
    # The collectives' time includes waiting at them: shown apart.
    by_kind["collective-permute"] -= profile.waiting
    by_kind["waiting at a collective"] = profile.waiting
    times, counts = op_times(profile.trace_file)
    kinds, _, shapes = op_kinds(profile.hlo)
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

    return attend, both, arrays


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
