"""`ringeqx report`: what one ring attention call communicates, read from its compiled
HLO beside the analytic cost model, and (`--profile`) where its time goes."""

import argparse
import os
from collections.abc import Callable

from ._devices import device_platform, ring_mesh
from ._flags import common, float_dtype, positive, writable_folder
from ._output import say


def report(args: argparse.Namespace) -> int:
    """`ringeqx report`: what one ring attention call sends, from its compiled HLO."""
    import jax
    import jax.numpy as jnp

    import ringeqx as rx

    mesh = ring_mesh(args.devices, device_platform(args.device_type))
    p = mesh.shape["sequence"]
    dtype = jnp.dtype(args.dtype)
    config = rx.RingConfig(
        compression_dtype=args.compression,
        grad_compression_dtype=args.grad_compression,
        communication_parallelism=args.parallelism,
        ring_buffer_size=args.ring_buffer_size,
        bidirectional=args.bidirectional,
    )
    mask = rx.Causal() if args.mask == "causal" else rx.Full()
    q = jax.ShapeDtypeStruct((args.seq_len, args.heads, args.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((args.seq_len, args.kv_heads, args.head_dim), dtype)

    def attention(q, k, v):
        return rx.ring_attention(q, k, v, mask=mask, mesh=mesh, config=config)

    def forward_backward(q, k, v):
        out, vjp = jax.vjp(attention, q, k, v)
        return vjp(out)

    sent = config.compression_dtype or dtype
    cost = rx.tools.RingCost(
        args.seq_len,
        p,
        args.heads,
        args.kv_heads,
        args.head_dim,
        jnp.dtype(sent).itemsize,
        jnp.dtype(config.grad_compression_dtype).itemsize,
    )
    fn = attention if args.forward_only else forward_backward
    say(
        f"ring attention {'forward' if args.forward_only else 'forward + backward'}, "
        f"{args.mask} mask, seq {args.seq_len} on {p} devices, {config}"
    )
    say(str(rx.tools.comm_report(jax.jit(fn), q, kv, kv, mesh=mesh, cost=cost)))
    if args.profile is not None:
        _profile_report(fn, q, kv, args.profile)
    return 0


def _profile_report(fn: Callable, q, kv, directory: str) -> None:
    """`ringeqx report --profile DIR`: run the program on random arrays of the reported
    shapes under the profiler; the XLA dump and the trace go under `DIR`."""
    import jax

    import ringeqx as rx

    keys = jax.random.split(jax.random.key(0), 3)
    arrays = [jax.random.normal(key, s.shape, s.dtype) for key, s in zip(keys, (q, kv, kv))]
    dump, trace = os.path.join(directory, "dump"), os.path.join(directory, "trace")
    say("")
    say(f"profile (XLA dump in {dump}, trace in {trace}):")
    say(str(rx.tools.profile_program(fn, *arrays, dump_dir=dump, trace_dir=trace)))


def transfer_misuse(args: argparse.Namespace) -> str | None:
    """`ringeqx report`'s transfer flags against the tokens per device (as
    `RingConfig.num_pieces`, in the flags' names)."""
    shard = -(-args.seq_len // args.devices)
    divisors = [d for d in range(1, shard + 1) if shard % d == 0]
    tokens = (
        f"the {shard} tokens per device (--seq-len {args.seq_len} over --devices "
        f"{args.devices})"
    )
    if args.ring_buffer_size is not None:
        flag, value = "--ring-buffer-size", args.ring_buffer_size
    else:
        flag, value = "--parallelism", args.parallelism
    if shard % value:
        return f"argument {flag}: must divide {tokens}, one of {divisors}; got {value}"
    pieces = shard // value if args.ring_buffer_size is not None else value
    if args.bidirectional and pieces == 1 and shard % 2:
        return (
            f"argument --bidirectional: sends half of each shard each way, so {tokens} "
            "must be even"
        )
    if args.bidirectional and pieces > 1 and pieces % 2:
        return (
            f"argument {flag}: with --bidirectional (half of the pieces each way), must "
            f"give an even number of pieces; got {value} ({pieces} pieces)"
        )
    if args.profile is not None:
        for where in (args.profile, *(os.path.join(args.profile, d) for d in ("dump", "trace"))):
            problem = writable_folder("--profile", where)
            if problem:
                return problem
    return None


def arguments(report_parser: argparse.ArgumentParser) -> None:
    common(report_parser, seq_len=8192, heads=8, kv_heads=2)
    report_parser.add_argument("--mask", choices=("causal", "full"), default="causal")
    report_parser.add_argument(
        "--dtype", type=float_dtype, default="bfloat16", help="q/k/v dtype"
    )
    report_parser.add_argument(
        "--compression", type=float_dtype, default=None, help="K/V wire dtype"
    )
    report_parser.add_argument(
        "--grad-compression", type=float_dtype, default="float32", help="dK/dV wire dtype"
    )
    report_parser.add_argument("--parallelism", type=positive, default=1)
    report_parser.add_argument("--ring-buffer-size", type=positive, default=None)
    report_parser.add_argument("--bidirectional", action="store_true")
    report_parser.add_argument(
        "--forward-only", action="store_true", help="the forward pass only"
    )
    report_parser.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="also run the call on random arrays under jax.profiler and print where its "
        "time goes (collectives, waiting, compute); the XLA dump goes to DIR/dump and the "
        "trace to DIR/trace (open with `xprof --logdir DIR/trace`)",
    )
    report_parser.set_defaults(run=report, parser=report_parser)
