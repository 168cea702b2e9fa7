"""What the ring costs beyond its kernel calls, and how busy the cores are.

Run: `python benchmarks/ring_overhead.py` (8 fake CPU devices, N = 8192, 4 heads x 64,
float32, q/k/v sharded over the ring, full mask, `XlaKernel()`). Three forward+backward
programs, timed in alternation (medians of `--reps` rounds):

- `ring`: `ringeqx.ring_attention` as a user calls it (`jax.vjp`);
- `kernels only`: on each device, the same kernel calls (`num_devices` forwards, then
  `num_devices` backwards, each on the device's own shard) with no communication at all;
- `kernels + K/V permutes`: the same, with K and V sent one step round the ring before
  each call, and dK/dV with them in the backward (the ring's traffic without its
  bookkeeping: no merges, no token records, no skip conditions).

Each call depends on the one before it (a scalar of its result enters the next call's
keys), so that XLA can neither hoist the calls out of their loop nor merge them.

For each it prints the wall time, the process's CPU time (`getrusage`, user + system)
and the cores kept busy (CPU time / wall time), and the matmul FLOP rate per busy core
against a 4096 x 4096 float32 matmul on one core (the process pinned to one core for it).
"""

import argparse
import os
import resource
import sys
import time

from _devices import fake_cpu_devices


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:])
fake_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx._layout._tokens import TokenInfo  # noqa: E402
from ringeqx._util._timing import median_seconds  # noqa: E402


def _ring(mesh, kernel):
    def attend(q, k, v):
        return rx.ring_attention(q, k, v, mesh=mesh, kernel=kernel)

    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    return run


def _kernels(mesh, kernel, permute: bool):
    """The ring's kernel calls on each device's own shard, optionally with K/V (and
    dK/dV) permuted one step before each call."""
    p = mesh.shape["sequence"]
    pairs = [(i, (i + 1) % p) for i in range(p)]
    mask = rx.Full()

    def send(x):
        return jax.lax.ppermute(x, "sequence", pairs) if permute else x

    def local(q, k, v, d_out):
        q, k, v, d_out = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, d_out))
        scale = q.shape[-1] ** -0.5
        pos = jax.lax.axis_index("sequence") * q.shape[2] + jnp.arange(q.shape[2])[None]
        info = TokenInfo(pos, 0 * pos, 0 * pos - 1, pos >= 0)
        scores = rx.Scores(mask, None, scale)

        def forward(carry, _):
            k, v, c, _, _ = carry
            out, lse = kernel.forward(q, k + c * 1e-9, v, info, info, scores)
            return (send(k), send(v), c + out[0, 0, 0, 0], out, lse), None

        zero = jnp.zeros_like(q)
        init = (k, v, jnp.zeros((), q.dtype), zero, zero[..., 0])
        (k, v, c, out, lse), _ = jax.lax.scan(forward, init, None, length=p)
        delta = jnp.sum(out * d_out, axis=-1)

        def backward(carry, _):
            k, v, dk, dv, dq, c = carry
            grads = kernel.backward(
                q, k + c * 1e-9, v, lse, delta, d_out, info, info, scores
            )
            dq, dk, dv = dq + grads[0], dk + grads[1], dv + grads[2]
            return (send(k), send(v), send(dk), send(dv), dq, c + grads[0][0, 0, 0, 0]), None

        zero_kv = jnp.zeros_like(k)
        init = (k, v, zero_kv, zero_kv, zero, c)
        (_, _, dk, dv, dq, _), _ = jax.lax.scan(backward, init, None, length=p)
        return tuple(jnp.swapaxes(x, 1, 2) for x in (out, dq, dk, dv))

    spec = PartitionSpec(None, "sequence")
    return jax.shard_map(
        local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4, check_vma=False
    )


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one_core_matmul_rate(reps: int) -> float:
    """FLOP/s of a 4096 x 4096 float32 matmul with every thread of the process (XLA's
    pools included) pinned to one core."""
    n = 4096
    a = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
    compiled = jax.jit(jnp.matmul).lower(a, a).compile()
    cores = os.sched_getaffinity(0)
    threads = [int(t) for t in os.listdir("/proc/self/task")]
    for t in threads:
        os.sched_setaffinity(t, {min(cores)})
    try:
        return 2 * n**3 / median_seconds(compiled, a, a, repeats=reps)
    finally:
        for t in threads:
            os.sched_setaffinity(t, cores)


def main(args) -> int:
    devices = np.asarray(jax.devices()[: args.devices])
    mesh = jax.sharding.Mesh(devices, ("sequence",), axis_types=(AxisType.Auto,))
    n, h, d, p = args.seq_len, args.heads, args.head_dim, args.devices
    kernel = rx.XlaKernel()
    seq = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    keys = jax.random.split(jax.random.key(0), 4)
    arrays = tuple(
        jax.device_put(jax.random.normal(key, (1, n, h, d), jnp.float32), seq) for key in keys
    )
    programs = {
        "ring (`ring_attention`, fwd+bwd)": _ring(mesh, kernel),
        "kernels only": _kernels(mesh, kernel, permute=False),
        "kernels + K/V permutes": _kernels(mesh, kernel, permute=True),
    }
    compiled = {}
    with jax.set_mesh(mesh):
        for name, fn in programs.items():
            print(f"compiling {name} ...", file=sys.stderr, flush=True)
            compiled[name] = jax.jit(fn).lower(*arrays).compile()
    for fn in compiled.values():
        jax.block_until_ready(fn(*arrays))
    walls = {name: [] for name in compiled}
    cpus = {name: [] for name in compiled}
    for _ in range(args.reps):
        for name, fn in compiled.items():
            cpu, start = _cpu_seconds(), time.perf_counter()
            jax.block_until_ready(fn(*arrays))
            walls[name].append(time.perf_counter() - start)
            cpus[name].append(_cpu_seconds() - cpu)
    one_core = _one_core_matmul_rate(args.reps)
    # Matmul FLOPs of forward+backward: 2 products per tile forward, 5 backward.
    flops = 3.5 * 4.0 * n * n * h * d
    ring_wall = float(np.median(walls[next(iter(walls))]))
    print(
        f"## ring_overhead: N={n}, heads={h}, head_dim={d}, float32, {p} fake CPU devices "
        f"on {os.cpu_count()} cores, full mask, XlaKernel({kernel.block_q}, "
        f"{kernel.block_kv}), median of {args.reps} rounds in alternation\n"
    )
    print(
        "| program | wall s | CPU s | cores busy | wall / ring | matmul GFLOP/s per busy core "
        "| of one core's 4096^2 rate |\n|---|---|---|---|---|---|---|"
    )
    for name in compiled:
        wall, cpu = float(np.median(walls[name])), float(np.median(cpus[name]))
        per_core = flops / cpu
        print(
            f"| {name} | {wall:.3f} | {cpu:.3f} | {cpu / wall:.2f} | {wall / ring_wall:.3f} "
            f"| {per_core / 1e9:.1f} | {per_core / one_core:.2f} |"
        )
    print(
        f"\n4096 x 4096 float32 matmul, process pinned to one core: {one_core / 1e9:.1f} "
        "GFLOP/s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
