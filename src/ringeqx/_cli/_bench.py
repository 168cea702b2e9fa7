"""`ringeqx bench`: ringeqx alone, timed at one size (`benchmarks/ring_vs_dense.py`
compares it with others)."""

import argparse
from typing import Any

from ._devices import device_platform, ring_mesh
from ._flags import common, indivisible, positive
from ._output import mib, say
from ._programs import forward_backward, qkv, temp_bytes


def bench(args: argparse.Namespace) -> int:
    """Time ringeqx alone at one size (`benchmarks/ring_vs_dense.py` compares)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import ringeqx
    from ringeqx._util._timing import median_seconds

    platform = device_platform(args.device_type)
    mesh = ring_mesh(args.devices, platform)
    num_devices = mesh.shape["sequence"]
    if args.seq_len % num_devices:  # fewer devices than --devices, or another process's
        args.parser.error(indivisible(args.seq_len, num_devices))
    # Tile sizes given on the command line mean the XLA kernel; otherwise `device_type`
    # picks the kernel (and its default tiles).
    kernel: Any = "auto"
    if args.block_q is not None or args.block_kv is not None:
        kernel = ringeqx.XlaKernel(
            **{
                name: value
                for name, value in (
                    ("block_q", args.block_q),
                    ("block_kv", args.block_kv),
                )
                if value is not None
            }
        )
    seq_sharding = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    q, k, v, d_out = (
        jax.device_put(x, seq_sharding)
        for x in qkv(
            jax.random.key(0), 1, args.seq_len, args.heads, args.kv_heads, args.head_dim
        )
    )
    say(
        f"ringeqx ring attention: {args.seq_len} tokens, {args.heads} query / "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, float32, {num_devices} "
        f"{mesh.devices.flat[0].platform} devices, median of {args.reps}"
    )
    header = ("mask", "forward s", "fwd+bwd s", "fwd GFLOP/s", "temp")
    say(f"{header[0]:<8} " + " ".join(f"{h:>12}" for h in header[1:]))
    full_flops = 4.0 * args.seq_len**2 * args.heads * args.head_dim
    for name, mask in (("full", ringeqx.Full()), ("causal", ringeqx.Causal())):

        def ring(q, k, v, mask=mask):
            return ringeqx.ring_attention(
                q, k, v, mask=mask, kernel=kernel, device_type=args.device_type
            )

        flops = full_flops / (2 if name == "causal" else 1)
        with jax.set_mesh(mesh):
            fwd = jax.jit(ring).lower(q, k, v).compile()
            both = jax.jit(forward_backward(ring)).lower(q, k, v, d_out).compile()
            fwd_s = median_seconds(fwd, q, k, v, repeats=args.reps)
            both_s = median_seconds(both, q, k, v, d_out, repeats=args.reps)
        temp = temp_bytes(both)
        temp_text = "n/a" if temp is None else mib(temp)
        say(
            f"{name:<8} {fwd_s:>12.3f} {both_s:>12.3f} "
            f"{flops / fwd_s / 1e9:>12.1f} {temp_text:>12}"
        )
    say(
        "\nThis times ringeqx only. For the comparison with the `ringattention` "
        "package and dense attention, with target ratios, run:\n"
        "  python benchmarks/ring_vs_dense.py   (or: nox -s bench)"
    )
    return 0


def arguments(bench_parser: argparse.ArgumentParser) -> None:
    common(bench_parser, seq_len=8192, heads=4, kv_heads=4)
    bench_parser.add_argument("--reps", type=positive, default=3)
    bench_parser.add_argument("--block-q", type=positive, default=None)
    bench_parser.add_argument("--block-kv", type=positive, default=None)
    bench_parser.set_defaults(run=bench, parser=bench_parser)
