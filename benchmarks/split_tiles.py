"""Issue 12's "tile sizes for the backward separate from the forward's", measured.

Run: `python benchmarks/split_tiles.py [--causal] [--pairs 512x256/256x256 ...]`. Each pair
is `FORWARDxTILES/BACKWARDxTILES`: an experiment-only kernel runs `XlaKernel`'s forward with
the first tiles and its backward with the second, through `ringeqx.ring_attention` (8 fake
CPU devices, N = 8192, 4 heads x 64, float32, q/k/v sharded over the ring). The first pair
is the baseline; all are timed in alternation (medians of `--reps` rounds), forward and
forward+backward, with the per-device temp memory of the compiled forward+backward.
"""

import argparse
import sys

from _devices import fake_cpu_devices


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=["256x256/256x256", "512x256/256x256", "512x512/256x256", "1024x256/256x256"],
    )
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:])
fake_cpu_devices(ARGS.devices)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx._kernels._base import AbstractAttentionKernel  # noqa: E402
from ringeqx._util._timing import median_seconds  # noqa: E402


class _SplitTiles(AbstractAttentionKernel):
    """`XlaKernel`'s forward with one pair of tiles and its backward with another
    (experiment only)."""

    fwd: rx.XlaKernel
    bwd: rx.XlaKernel
    block_q: int = eqx.field(static=True)
    block_kv: int = eqx.field(static=True)

    def tile_candidates(self):
        return [(self.block_q, self.block_kv)]

    def devices(self):
        return frozenset({"cpu", "gpu", "tpu"})

    def forward(self, *args):
        return self.fwd.forward(*args)

    def backward(self, *args):
        return self.bwd.backward(*args)


def _kernel(pair: str) -> _SplitTiles:
    try:
        fwd, bwd = (tuple(int(x) for x in half.split("x")) for half in pair.split("/"))
    except ValueError:
        raise SystemExit(f"`--pairs` entries look like 512x256/256x256; got {pair!r}.")
    return _SplitTiles(rx.XlaKernel(*fwd), rx.XlaKernel(*bwd), *fwd)


def main(args) -> int:
    devices = np.asarray(jax.devices()[: args.devices])
    mesh = jax.sharding.Mesh(devices, ("sequence",), axis_types=(AxisType.Auto,))
    n = args.seq_len
    seq = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    keys = jax.random.split(jax.random.key(0), 4)
    arrays = tuple(
        jax.device_put(jax.random.normal(key, (1, n, 4, 64), jnp.float32), seq) for key in keys
    )
    mask = rx.Causal() if args.causal else rx.Full()
    compiled = {}
    with jax.set_mesh(mesh):
        for pair in args.pairs:
            kernel = _kernel(pair)

            def fwd(q, k, v, kernel=kernel):
                return rx.ring_attention(q, k, v, mask=mask, mesh=mesh, kernel=kernel)

            def both(q, k, v, d_out, fwd=fwd):
                out, vjp = jax.vjp(fwd, q, k, v)
                return out, vjp(d_out)

            print(f"compiling {pair} ...", file=sys.stderr, flush=True)
            compiled[pair] = (
                jax.jit(fwd).lower(*arrays[:3]).compile(),
                jax.jit(both).lower(*arrays).compile(),
            )
    times = {pair: ([], []) for pair in compiled}
    for fwd, both in compiled.values():
        jax.block_until_ready(fwd(*arrays[:3]))
        jax.block_until_ready(both(*arrays))
    for _ in range(args.reps):
        for pair, (fwd, both) in compiled.items():
            times[pair][0].append(median_seconds(fwd, *arrays[:3], repeats=1, warmup=False))
            times[pair][1].append(median_seconds(both, *arrays, repeats=1, warmup=False))
    print(
        f"## split_tiles: N={n}, 4 heads x 64, float32, {args.devices} fake CPU devices, "
        f"{'causal' if args.causal else 'full'} mask, median of {args.reps} rounds in "
        "alternation\n"
    )
    print(
        "| forward tiles / backward tiles | forward s | fwd+bwd s | fwd+bwd / first | "
        "temp MiB/device (fwd+bwd) |\n|---|---|---|---|---|"
    )
    base = float(np.median(times[args.pairs[0]][1]))
    for pair, (t_fwd, t_both) in times.items():
        temp = compiled[pair][1].memory_analysis().temp_size_in_bytes / 2**20
        both = float(np.median(t_both))
        print(
            f"| {pair} | {np.median(t_fwd):.3f} | {both:.3f} | {both / base:.3f} | {temp:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
