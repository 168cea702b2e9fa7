"""`ringeqx demo`: causal GQA ring attention, forward and backward, on a ring of (fake)
devices, in one process or several; its time, its memory per device (and on twice the
devices) and its error against `reference_attention`."""

import argparse
import time

from ._devices import device_platform, ring_mesh
from ._flags import address, common, index, indivisible, positive, seconds, seed
from ._output import mib, say, step
from ._programs import device_bytes, forward_backward, max_error, qkv


def demo(args: argparse.Namespace) -> int:
    """Causal GQA ring attention, forward and backward, on a ring of (fake) devices."""
    total = 6
    step(1, total, "starting JAX")
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import ringeqx

    platform = device_platform(args.device_type)
    mesh = ring_mesh(args.devices, platform)
    num_devices = mesh.shape["sequence"]
    if args.seq_len % num_devices:  # fewer devices than --devices, or another process's
        args.parser.error(indivisible(args.seq_len, num_devices))
    device = mesh.devices.flat[0]
    say(
        f"      JAX {jax.__version__}, ringeqx {ringeqx.__version__}; ring of "
        f"{num_devices} {device.platform} device(s) ({device.device_kind})"
    )
    mask = ringeqx.Causal()

    def ring(q, k, v):
        return ringeqx.ring_attention(q, k, v, mask=mask, device_type=args.device_type)

    def dense(q, k, v):
        return ringeqx.reference_attention(q, k, v, mask=mask)

    shape = (1, args.seq_len, args.heads, args.kv_heads, args.head_dim)
    step(
        2,
        total,
        f"making q [1, {args.seq_len}, {args.heads}, {args.head_dim}] and k, v "
        f"[1, {args.seq_len}, {args.kv_heads}, {args.head_dim}] (float32), sequence "
        f"sharded over the ring",
    )
    seq_sharding = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    arrays = qkv(jax.random.key(args.seed), *shape)
    arrays = tuple(jax.device_put(x, seq_sharding) for x in arrays)

    step(3, total, "compiling causal ring attention, forward + backward")
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = jax.jit(forward_backward(ring)).lower(*arrays).compile()
        compile_s = time.perf_counter() - start
        memory = device_bytes(compiled)
        say(f"      compiled in {compile_s:.1f} s")

        step(4, total, "running forward + backward")
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arrays))
        run_s = time.perf_counter() - start
    # Model FLOPs: a causal forward is half of 4 N^2 H D; the backward is 2.5 forwards.
    work = 3.5 * 2.0 * args.seq_len**2 * args.heads * args.head_dim
    say(f"      ran in {run_s:.2f} s ({work / run_s / 1e9:.1f} GFLOP/s over the ring)")

    # Compile only (nothing runs) on a ring twice as large, to show the per-device memory
    # halving: every array, inputs to gradients, stays sharded over the sequence.
    step(5, total, f"compiling the same program for {2 * num_devices} devices (memory only)")
    at_twice = _memory_at_twice(args, num_devices, ring)

    out_error, grad_error, small = _check_small(
        args, mesh, seq_sharding, ring, dense, shape[2:]
    )
    say("")
    say(
        f"causal GQA attention, {args.seq_len} tokens, {args.heads} query / "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, {num_devices} devices"
    )
    say(f"  compile                          {compile_s:8.2f} s")
    say(f"  forward + backward               {run_s:8.2f} s")
    _say_memory(memory, at_twice, num_devices)
    say(f"  max |out - reference|            {out_error:12.2e}  ({small} tokens)")
    say(f"  max |grad - reference|           {grad_error:12.2e}  ({small} tokens)")
    ok = out_error < 1e-3 and grad_error < 1e-2
    say("  OK" if ok else "  MISMATCH against the reference")
    return 0 if ok else 1


def _memory_at_twice(args: argparse.Namespace, num_devices: int, ring) -> int | str:
    """What per-device memory becomes on a ring of twice the devices: measured by
    compiling the same program there (nothing runs), or why it could not be."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    platform = device_platform(args.device_type)
    devices = jax.devices(platform) if platform else jax.devices()
    twice = 2 * num_devices
    if len(devices) < twice:
        return (
            f"not measured (only {len(devices)} devices visible); every array stays "
            "sharded, so expect about half"
        )
    if args.seq_len % twice:
        return f"not measured (--seq-len is not a multiple of {twice})"
    mesh = Mesh(np.asarray(devices[:twice]), ("sequence",), axis_types=(AxisType.Auto,))
    seq = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    shapes = (
        (1, args.seq_len, args.heads, args.head_dim),
        (1, args.seq_len, args.kv_heads, args.head_dim),
        (1, args.seq_len, args.kv_heads, args.head_dim),
        (1, args.seq_len, args.heads, args.head_dim),
    )
    structs = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=seq) for s in shapes]
    with jax.set_mesh(mesh):
        compiled = jax.jit(forward_backward(ring)).lower(*structs).compile()
    found = device_bytes(compiled)
    return "n/a (memory_analysis unavailable)" if found is None else sum(found)


def _check_small(args, mesh, seq_sharding, ring, dense, heads_dims):
    """Step 6 of the demo: the ring against `reference_attention` on `--check-len`
    tokens. Returns `(output error, gradient error, tokens)`."""
    import jax

    small = min(args.check_len, args.seq_len)
    step(6, 6, f"checking against reference_attention at {small} tokens")
    small_arrays = qkv(jax.random.key(args.seed + 1), 1, small, *heads_dims)
    small_global = (
        tuple(jax.device_put(x, seq_sharding) for x in small_arrays)
        if small % mesh.shape["sequence"] == 0
        else small_arrays
    )
    with jax.set_mesh(mesh):
        got_out, got_grads = jax.jit(forward_backward(ring))(*small_global)
    want_out, want_grads = jax.jit(forward_backward(dense))(*small_arrays)
    out_error = max_error(got_out, want_out)
    grad_error = max(max_error(g, w) for g, w in zip(got_grads, want_grads))
    return out_error, grad_error, small


def _say_memory(memory, at_twice, num_devices: int) -> None:
    """The demo's memory lines: per device, and on twice the devices."""
    if memory is None:
        say("  memory per device                     n/a (memory_analysis unavailable)")
    else:
        arg_b, out_b, temp_b = memory
        say(
            f"  memory per device                {mib(sum(memory)):>12}  (arguments "
            f"{mib(arg_b)} + outputs {mib(out_b)} + temp {mib(temp_b)})"
        )
    if isinstance(at_twice, int) and memory is not None:
        at_twice = f"{mib(at_twice):>12}  ({at_twice / sum(memory):.2f}x)"
    say(f"  ... at 2x the devices ({2 * num_devices:>3})       {at_twice}")


def multiprocess_misuse(args: argparse.Namespace) -> str | None:
    if (args.num_processes is None) != (args.process_id is None):
        given, missing = ("--num-processes", "--process-id")
        if args.num_processes is None:
            given, missing = missing, given
        return f"argument {given}: needs {missing} too (each process has its own)"
    if args.process_id is not None and args.process_id >= args.num_processes:
        return (
            f"argument --process-id: must be in 0 .. {args.num_processes - 1} (--num-"
            f"processes {args.num_processes}); got {args.process_id}"
        )
    if args.coordinator_address is not None and args.num_processes is None:
        return "argument --coordinator-address: needs --num-processes and --process-id"
    return None


def arguments(demo_parser: argparse.ArgumentParser) -> None:
    common(demo_parser, seq_len=16384, heads=8, kv_heads=2)
    demo_parser.add_argument(
        "--check-len", type=positive, default=2048, help="tokens for the dense check"
    )
    demo_parser.add_argument("--seed", type=seed, default=0)
    multi = demo_parser.add_argument_group(
        "multi-process", "join a jax.distributed run (see docs/multi_host.md); the ring "
        "then spans every process's devices"
    )
    multi.add_argument(
        "--coordinator-address", type=address, default=None, metavar="HOST:PORT",
        help="process 0's address, e.g. 10.0.0.1:1234 (omit where JAX detects the "
        "cluster: SLURM, TPU pods)",
    )
    multi.add_argument("--num-processes", type=positive, default=None)
    multi.add_argument(
        "--process-id", type=index, default=None, help="0 .. num-processes - 1"
    )
    multi.add_argument(
        "--local-devices", type=positive, default=None,
        help="fake CPU devices in this process (default: --devices)",
    )
    multi.add_argument(
        "--timeout", type=seconds, default=60.0, metavar="SECONDS",
        help="how long to wait for every process to join (default: 60)",
    )
    demo_parser.set_defaults(run=demo, parser=demo_parser)
