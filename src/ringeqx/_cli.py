"""The `ringeqx` command line: `ringeqx demo`, `ringeqx bench`, `ringeqx report` and
`ringeqx plan`.

JAX reads `XLA_FLAGS` once, when its backends start, so this module sets the fake CPU
device count first and imports JAX (and ringeqx, which imports JAX) only inside the
functions that run a command.
"""

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _force_host_devices(count: int) -> bool:
    """Ask XLA for `count` CPU devices unless the user already chose a count.

    Returns whether the flag was set here. Must run before JAX initialises a backend.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()
    return True


def _join_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process run (`jax.distributed.initialize`) when the flags ask to.

    Must run before anything touches devices. Without `--coordinator-address` on CPU,
    JAX may still detect a cluster itself (SLURM, TPU pods); with neither, nothing
    happens and the demo runs in this process alone. It says what it waits for, and
    gives up after `--timeout` seconds with the coordinator's address.
    """
    if args.coordinator_address is None and args.num_processes is None:
        return
    import threading

    import jax

    if args.device_type in ("auto", "cpu"):
        # Cross-process collectives between CPU devices go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = args.coordinator_address or "the coordinator JAX detects"
    n = args.num_processes
    if n is None:
        waiting = f"waiting for the other processes at {where}"
    elif args.process_id == 0:
        more = f"{n - 1} more process{'es' if n > 2 else ''}"
        waiting = f"process 0 of {n}: waiting for {more} at {where}"
    else:
        waiting = f"process {args.process_id} of {n}: joining process 0 at {where}"
    _say(f"      {waiting} (--timeout {args.timeout:g} s)...")

    def give_up() -> None:
        # JAX's own timeout aborts the process with a C++ stack trace; this comes first.
        print(
            f"ringeqx demo: error: not every process joined at {where} within --timeout "
            f"{args.timeout:g} s. Start each of the --num-processes with the same "
            "--coordinator-address and its own --process-id, or raise --timeout.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(args.timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address,
            num_processes=n,
            process_id=args.process_id,
            initialization_timeout=math.ceil(args.timeout) + 30,
        )
    except (ValueError, RuntimeError) as error:
        raise SystemExit(f"ringeqx demo: error: cannot join at {where}: {error}") from None
    finally:
        timer.cancel()
    args.devices = jax.device_count()  # the ring spans every process's devices
    _say(
        f"      process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices"
    )


def _say(message: str) -> None:
    print(message, flush=True)


def _step(index: int, total: int, message: str) -> None:
    _say(f"[{index}/{total}] {message}")


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def _temp_bytes(compiled: Any) -> int | None:
    """Per-device scratch memory of a compiled program (None where XLA does not say)."""
    stats = compiled.memory_analysis()
    return None if stats is None else int(stats.temp_size_in_bytes)


def _device_bytes(compiled: Any) -> tuple[int, int, int] | None:
    """Per-device `(arguments, outputs, temp)` bytes of a compiled program (None where
    XLA does not say)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (
        int(stats.argument_size_in_bytes),
        int(stats.output_size_in_bytes),
        int(stats.temp_size_in_bytes),
    )


def _memory_at_twice(args: argparse.Namespace, num_devices: int, ring) -> int | str:
    """What per-device memory becomes on a ring of twice the devices: measured by
    compiling the same program there (nothing runs), or why it could not be."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    platform = _platform(args.device_type)
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
        compiled = jax.jit(_forward_backward(ring)).lower(*structs).compile()
    found = _device_bytes(compiled)
    return "n/a (memory_analysis unavailable)" if found is None else sum(found)


def _ring_mesh(num_devices: int, platform: str | None):
    """A one-axis `("sequence",)` mesh over the first `num_devices` devices.

    Auto axes: `ring_attention` places the shards itself, and plain arrays are accepted.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    try:
        devices = jax.devices(platform) if platform else jax.devices()
    except RuntimeError as error:
        raise SystemExit(f"ringeqx: --device-type={platform}: {error}") from None
    if len(devices) < num_devices:
        _say(
            f"      only {len(devices)} {devices[0].platform} device(s) are visible; "
            f"using {len(devices)} instead of {num_devices}."
        )
        num_devices = len(devices)
    return Mesh(
        np.asarray(devices[:num_devices]), ("sequence",), axis_types=(AxisType.Auto,)
    )


def _platform(device_type: str) -> str | None:
    match device_type:
        case "auto":
            return None
        case "cpu" | "gpu" | "tpu":
            return device_type
        case _:
            raise ValueError(f"Unknown device type {device_type!r}.")


def _qkv(key, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int):
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32)
    d_out = jax.random.normal(kd, (batch, seq, heads, head_dim), jnp.float32)
    return q, k, v, d_out


def _forward_backward(attention: Callable):
    """`(q, k, v, d_out) -> (out, (dq, dk, dv))`: the output and its vjp at `d_out`."""
    import jax

    def run(q, k, v, d_out):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(d_out)

    return run


def _max_error(a, b) -> float:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    # In a multi-process run the ring's result spans every process: gather it first.
    a, b = (
        multihost_utils.process_allgather(x, tiled=True)
        if isinstance(x, jax.Array) and not x.is_fully_addressable
        else x
        for x in (a, b)
    )

    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _check_small(args, mesh, seq_sharding, ring, dense, heads_dims):
    """Step 6 of the demo: the ring against `reference_attention` on `--check-len`
    tokens. Returns `(output error, gradient error, tokens)`."""
    import jax

    small = min(args.check_len, args.seq_len)
    _step(6, 6, f"checking against reference_attention at {small} tokens")
    small_arrays = _qkv(jax.random.key(args.seed + 1), 1, small, *heads_dims)
    small_global = (
        tuple(jax.device_put(x, seq_sharding) for x in small_arrays)
        if small % mesh.shape["sequence"] == 0
        else small_arrays
    )
    with jax.set_mesh(mesh):
        got_out, got_grads = jax.jit(_forward_backward(ring))(*small_global)
    want_out, want_grads = jax.jit(_forward_backward(dense))(*small_arrays)
    out_error = _max_error(got_out, want_out)
    grad_error = max(_max_error(g, w) for g, w in zip(got_grads, want_grads))
    return out_error, grad_error, small


def _say_memory(memory, at_twice, num_devices: int) -> None:
    """The demo's memory lines: per device, and on twice the devices."""
    if memory is None:
        _say("  memory per device                     n/a (memory_analysis unavailable)")
    else:
        arg_b, out_b, temp_b = memory
        _say(
            f"  memory per device                {_mib(sum(memory)):>12}  (arguments "
            f"{_mib(arg_b)} + outputs {_mib(out_b)} + temp {_mib(temp_b)})"
        )
    if isinstance(at_twice, int) and memory is not None:
        at_twice = f"{_mib(at_twice):>12}  ({at_twice / sum(memory):.2f}x)"
    _say(f"  ... at 2x the devices ({2 * num_devices:>3})       {at_twice}")


def demo(args: argparse.Namespace) -> int:
    """Causal GQA ring attention, forward and backward, on a ring of (fake) devices."""
    total = 6
    _step(1, total, "starting JAX")
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import ringeqx

    platform = _platform(args.device_type)
    mesh = _ring_mesh(args.devices, platform)
    num_devices = mesh.shape["sequence"]
    if args.seq_len % num_devices:  # fewer devices than --devices, or another process's
        args.parser.error(_indivisible(args.seq_len, num_devices))
    device = mesh.devices.flat[0]
    _say(
        f"      JAX {jax.__version__}, ringeqx {ringeqx.__version__}; ring of "
        f"{num_devices} {device.platform} device(s) ({device.device_kind})"
    )
    mask = ringeqx.Causal()

    def ring(q, k, v):
        return ringeqx.ring_attention(q, k, v, mask=mask, device_type=args.device_type)

    def dense(q, k, v):
        return ringeqx.reference_attention(q, k, v, mask=mask)

    shape = (1, args.seq_len, args.heads, args.kv_heads, args.head_dim)
    _step(
        2,
        total,
        f"making q [1, {args.seq_len}, {args.heads}, {args.head_dim}] and k, v "
        f"[1, {args.seq_len}, {args.kv_heads}, {args.head_dim}] (float32), sequence "
        f"sharded over the ring",
    )
    seq_sharding = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    arrays = _qkv(jax.random.key(args.seed), *shape)
    arrays = tuple(jax.device_put(x, seq_sharding) for x in arrays)

    _step(3, total, "compiling causal ring attention, forward + backward")
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = jax.jit(_forward_backward(ring)).lower(*arrays).compile()
        compile_s = time.perf_counter() - start
        memory = _device_bytes(compiled)
        _say(f"      compiled in {compile_s:.1f} s")

        _step(4, total, "running forward + backward")
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arrays))
        run_s = time.perf_counter() - start
    # Model FLOPs: a causal forward is half of 4 N^2 H D; the backward is 2.5 forwards.
    work = 3.5 * 2.0 * args.seq_len**2 * args.heads * args.head_dim
    _say(f"      ran in {run_s:.2f} s ({work / run_s / 1e9:.1f} GFLOP/s over the ring)")

    # Compile only (nothing runs) on a ring twice as large, to show the per-device memory
    # halving: every array, inputs to gradients, stays sharded over the sequence.
    _step(5, total, f"compiling the same program for {2 * num_devices} devices (memory only)")
    at_twice = _memory_at_twice(args, num_devices, ring)

    out_error, grad_error, small = _check_small(
        args, mesh, seq_sharding, ring, dense, shape[2:]
    )
    _say("")
    _say(
        f"causal GQA attention, {args.seq_len} tokens, {args.heads} query / "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, {num_devices} devices"
    )
    _say(f"  compile                          {compile_s:8.2f} s")
    _say(f"  forward + backward               {run_s:8.2f} s")
    _say_memory(memory, at_twice, num_devices)
    _say(f"  max |out - reference|            {out_error:12.2e}  ({small} tokens)")
    _say(f"  max |grad - reference|           {grad_error:12.2e}  ({small} tokens)")
    ok = out_error < 1e-3 and grad_error < 1e-2
    _say("  OK" if ok else "  MISMATCH against the reference")
    return 0 if ok else 1


def bench(args: argparse.Namespace) -> int:
    """Time ringeqx alone at one size (`benchmarks/ring_vs_dense.py` compares)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    import ringeqx
    from ringeqx._util._timing import median_seconds

    platform = _platform(args.device_type)
    mesh = _ring_mesh(args.devices, platform)
    num_devices = mesh.shape["sequence"]
    if args.seq_len % num_devices:  # fewer devices than --devices, or another process's
        args.parser.error(_indivisible(args.seq_len, num_devices))
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
        for x in _qkv(
            jax.random.key(0), 1, args.seq_len, args.heads, args.kv_heads, args.head_dim
        )
    )
    _say(
        f"ringeqx ring attention: {args.seq_len} tokens, {args.heads} query / "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, float32, {num_devices} "
        f"{mesh.devices.flat[0].platform} devices, median of {args.reps}"
    )
    header = ("mask", "forward s", "fwd+bwd s", "fwd GFLOP/s", "temp")
    _say(f"{header[0]:<8} " + " ".join(f"{h:>12}" for h in header[1:]))
    full_flops = 4.0 * args.seq_len**2 * args.heads * args.head_dim
    for name, mask in (("full", ringeqx.Full()), ("causal", ringeqx.Causal())):

        def ring(q, k, v, mask=mask):
            return ringeqx.ring_attention(
                q, k, v, mask=mask, kernel=kernel, device_type=args.device_type
            )

        flops = full_flops / (2 if name == "causal" else 1)
        with jax.set_mesh(mesh):
            fwd = jax.jit(ring).lower(q, k, v).compile()
            both = jax.jit(_forward_backward(ring)).lower(q, k, v, d_out).compile()
            fwd_s = median_seconds(fwd, q, k, v, repeats=args.reps)
            both_s = median_seconds(both, q, k, v, d_out, repeats=args.reps)
        temp = _temp_bytes(both)
        temp_text = "n/a" if temp is None else _mib(temp)
        _say(
            f"{name:<8} {fwd_s:>12.3f} {both_s:>12.3f} "
            f"{flops / fwd_s / 1e9:>12.1f} {temp_text:>12}"
        )
    _say(
        "\nThis times ringeqx only. For the comparison with the `ringattention` "
        "package and dense attention, with target ratios, run:\n"
        "  python benchmarks/ring_vs_dense.py   (or: nox -s bench)"
    )
    return 0


def report(args: argparse.Namespace) -> int:
    """`ringeqx report`: what one ring attention call sends, from its compiled HLO."""
    import jax
    import jax.numpy as jnp

    import ringeqx as rx

    mesh = _ring_mesh(args.devices, _platform(args.device_type))
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
    _say(
        f"ring attention {'forward' if args.forward_only else 'forward + backward'}, "
        f"{args.mask} mask, seq {args.seq_len} on {p} devices, {config}"
    )
    _say(str(rx.tools.comm_report(jax.jit(fn), q, kv, kv, mesh=mesh, cost=cost)))
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
    _say("")
    _say(f"profile (XLA dump in {dump}, trace in {trace}):")
    _say(str(rx.tools.profile_program(fn, *arrays, dump_dir=dump, trace_dir=trace)))


def generate(args: argparse.Namespace) -> int:
    """`ringeqx generate`: ring prefill and exact decoding on a small LM with random
    weights (the machinery, not a trained model), checked against one device."""
    import jax
    import numpy as np

    import ringeqx as rx

    mesh = _ring_mesh(args.devices, _platform(args.device_type))
    p = mesh.shape["sequence"]
    strategy = rx.Zigzag() if args.strategy == "zigzag" else rx.Uniform()
    mask = rx.SlidingWindow(args.window) if args.window else rx.Causal()
    model = rx.nn.RingTransformerLM(
        args.vocab,
        args.heads * args.head_dim,
        args.heads,
        args.layers,
        num_kv_heads=args.kv_heads,
        attention=rx.nn.AttentionOptions(mask=mask, sinks=True),
        key=jax.random.key(args.seed),
    )
    prompt = jax.random.randint(jax.random.key(args.seed + 1), (args.seq_len,), 0, args.vocab)
    _say(
        f"random {args.layers}-layer LM (vocab {args.vocab}, {args.heads} query / "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, {type(mask).__name__}); "
        f"prompt of {args.seq_len} tokens, {args.strategy} prefill on {p} device(s)"
    )

    def run(key):
        return rx.generate(
            model,
            prompt,
            args.steps,
            key,
            temperature=args.temperature,
            top_k=args.top_k,
            strategy=strategy,
            mesh=mesh,
            return_logits=True,
        )

    start = time.perf_counter()
    jax.block_until_ready(run(jax.random.key(args.seed + 2)))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens, logits = jax.block_until_ready(run(jax.random.key(args.seed + 3)))
    run_s = time.perf_counter() - start
    _say(f"  compile + first run              {compile_s:8.2f} s")
    _say(f"  prefill + {args.steps} decode steps       {run_s:8.2f} s")
    _say(f"  generated                        {np.asarray(tokens).tolist()}")
    # The same logits from the whole sequence on one device, without a cache.
    one = jax.sharding.Mesh(np.asarray(mesh.devices.flat[:1]), ("sequence",))
    full = np.concatenate([np.asarray(prompt), np.asarray(tokens)[:-1]])
    with jax.set_mesh(one):
        dense = jax.jit(lambda m, t: m(t, mesh=one))(model, full)
    error = _max_error(np.asarray(dense)[args.seq_len - 1 :], logits)
    _say(f"  max |logits - one-device full recomputation|  {error:.2e}")
    ok = error < 1e-3
    _say("  OK" if ok else "  MISMATCH against the full recomputation")
    return 0 if ok else 1


# `ringeqx.tools.plan`'s arguments, as `ringeqx plan` spells them.
_PLAN_FLAGS = (
    (r"max_memory_usage=([\d.,]+) MiB", r"--max-memory-mib \1"),
    (r"\bmax_memory_usage\b", "--max-memory-mib"),
    (r"\bseq_len=", "--seq-len "),
    (r"\bnum_devices=", "--devices "),
    (r"`batch_devices \* num_devices`", "--devices"),
    (r"`remat`", "--remat"),
    (r"`scan_layers=True`", "--scan-layers"),
)


def _in_flags(message: str) -> str:
    """A message of `ringeqx.tools.plan` with its argument names replaced by the flags."""
    for pattern, flag in _PLAN_FLAGS:
        message = re.sub(pattern, flag, message)
    return message


def plan(args: argparse.Namespace) -> int:
    """`ringeqx plan`: the memory plan of a problem, as a table or as JSON."""
    import json

    import ringeqx as rx

    masks = {
        "causal": rx.Causal(),
        "full": rx.Full(),
        "documents": rx.Causal() & rx.Document(),
        "window": rx.SlidingWindow(args.window),
    }
    lm = {}
    if args.dim is not None:
        lm = dict(
            dim=args.dim, num_layers=args.layers, vocab_size=args.vocab_size, hidden=args.hidden,
            scan_layers=args.scan_layers,
        )  # fmt: skip
    budget = None if args.max_memory_mib is None else int(args.max_memory_mib * 2**20)
    problem = dict(
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=None if lm else args.head_dim,
        batch=args.batch,
        dtype=args.dtype,
        mask=masks[args.mask],
        max_memory_usage=budget,
        remat=args.remat,
        **lm,
    )
    try:
        if args.longest:
            found = rx.tools.longest_context(args.target, **problem, log=_say)
            result = found.plan
            _say(f"longest --seq-len on {args.target}: {result.seq_len:,} tokens "
                 f"({len(found.probes)} compiles, {found.seconds:.0f} s)")
        else:
            device = {} if args.target is not None else {"device": args.profile}
            result = rx.tools.plan(
                args.seq_len, args.devices, **problem, target=args.target, **device
            )
    except (ValueError, ImportError) as error:
        _say(f"ringeqx plan: {_in_flags(str(error))}")
        return 1
    _say(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


# Argument types: their errors become `ringeqx CMD: error: argument --FLAG: ...` (exit
# status 2, no traceback). Each raises ArgumentTypeError, never ValueError, which argparse
# would report under the function's own name.


def _integer(text: str, least: int, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        expected = f">= {least}" if most is None else f"in {least} .. {most}"
        raise argparse.ArgumentTypeError(f"must be an integer {expected}; got {text!r}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _tokens(text: str) -> int:
    """A token count, with an optional binary suffix: `128K` = 131072, `1M` = 2**20."""
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not (digits.isdigit() and int(digits) > 0):
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1, optionally with K or M (128K, 1M); got {text!r}"
        )
    return int(digits) * scale


def _target(text: str) -> str:
    """A cluster `ringeqx.tools.target_mesh` knows: `v5p:4x4x4`, `h100:8`."""
    try:
        _target_chips(text)
    except ValueError as error:
        message = str(error).replace("`target` must be", "must be")
        raise argparse.ArgumentTypeError(message.replace("`target` ", "")) from None
    return text


def _index(text: str) -> int:
    return _integer(text, 0)


def _seed(text: str) -> int:
    return _integer(text, 0, 2**32 - 1)


def _number(text: str, kind: str, zero: bool = False, note: str = "") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise argparse.ArgumentTypeError(
            f"must be a finite {kind} {'>=' if zero else '>'} 0{note}; got {text!r}"
        )
    return value


def _budget_mib(text: str) -> float:
    value = _number(text, "number of MiB")
    if value * 2**20 < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte (in MiB); got {text!r}")
    return value


def _seconds(text: str) -> float:
    return _number(text, "number of seconds")


def _temperature(text: str) -> float:
    return _number(text, "number", zero=True, note=" (0 for greedy decoding)")


def _float_dtype(text: str) -> str:
    # Names, not jnp.dtype: argument errors come before JAX is imported.
    names = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
    if text not in names:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}; got {text!r}")
    return text


def _address(text: str) -> str:
    host, colon, port = text.rpartition(":")
    if not (host and colon and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT, with a port in 1 .. 65535 (e.g. 10.0.0.1:1234); got {text!r}"
        )
    return text


def _writable_folder(flag: str, path: str) -> str | None:
    """Make the folder `path` (and its parents) and check that files can be written
    there; what went wrong, naming `flag`, or None. Before anything runs: a profiler
    that fails on its output folder leaves JAX unable to profile again."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        found = os.path.exists(path) and not os.path.isdir(path)
        why = "a file, not a folder" if found else error.strerror or str(error)
        return (
            f"argument {flag}: must be a folder that files can be written to; got "
            f"{path!r} ({why})"
        )
    return None


# Device profiles of `ringeqx plan --profile` (the keys of ringeqx.tools.HARDWARE, written here
# so that parsing imports no JAX; tests/test_cli.py checks they agree).
PROFILES = (
    "a100-nvlink",
    "a100-infiniband",
    "tpu-v3",
    "tpu-v4",
    "tpu-v5e",
    "tpu-v5p",
    "tpu-v6e",
    "h100",
    "h200",
)


def _common(sub: argparse.ArgumentParser, seq_len: int, heads: int, kv_heads: int):
    """The problem and the ring, which every command takes."""
    sub.add_argument("--seq-len", type=_tokens, default=seq_len, help="tokens (128K, 1M)")
    sub.add_argument("--heads", type=_positive, default=heads, help="query heads")
    sub.add_argument(
        "--kv-heads", type=_positive, default=kv_heads, help="key/value heads"
    )
    sub.add_argument("--head-dim", type=_positive, default=64)
    sub.add_argument(
        "--devices", type=_positive, default=8, help="ring size (fake CPU devices)"
    )
    sub.add_argument(
        "--device-type",
        choices=("auto", "cpu", "gpu", "tpu"),
        default="auto",
        help="which devices; ring_attention picks its kernel for them",
    )


def _demo_arguments(demo_parser: argparse.ArgumentParser) -> None:
    _common(demo_parser, seq_len=16384, heads=8, kv_heads=2)
    demo_parser.add_argument(
        "--check-len", type=_positive, default=2048, help="tokens for the dense check"
    )
    demo_parser.add_argument("--seed", type=_seed, default=0)
    multi = demo_parser.add_argument_group(
        "multi-process", "join a jax.distributed run (see docs/multi_host.md); the ring "
        "then spans every process's devices"
    )
    multi.add_argument(
        "--coordinator-address", type=_address, default=None, metavar="HOST:PORT",
        help="process 0's address, e.g. 10.0.0.1:1234 (omit where JAX detects the "
        "cluster: SLURM, TPU pods)",
    )
    multi.add_argument("--num-processes", type=_positive, default=None)
    multi.add_argument(
        "--process-id", type=_index, default=None, help="0 .. num-processes - 1"
    )
    multi.add_argument(
        "--local-devices", type=_positive, default=None,
        help="fake CPU devices in this process (default: --devices)",
    )
    multi.add_argument(
        "--timeout", type=_seconds, default=60.0, metavar="SECONDS",
        help="how long to wait for every process to join (default: 60)",
    )
    demo_parser.set_defaults(run=demo, parser=demo_parser)


def _bench_arguments(bench_parser: argparse.ArgumentParser) -> None:
    _common(bench_parser, seq_len=8192, heads=4, kv_heads=4)
    bench_parser.add_argument("--reps", type=_positive, default=3)
    bench_parser.add_argument("--block-q", type=_positive, default=None)
    bench_parser.add_argument("--block-kv", type=_positive, default=None)
    bench_parser.set_defaults(run=bench, parser=bench_parser)


def _report_arguments(report_parser: argparse.ArgumentParser) -> None:
    _common(report_parser, seq_len=8192, heads=8, kv_heads=2)
    report_parser.add_argument("--mask", choices=("causal", "full"), default="causal")
    report_parser.add_argument(
        "--dtype", type=_float_dtype, default="bfloat16", help="q/k/v dtype"
    )
    report_parser.add_argument(
        "--compression", type=_float_dtype, default=None, help="K/V wire dtype"
    )
    report_parser.add_argument(
        "--grad-compression", type=_float_dtype, default="float32", help="dK/dV wire dtype"
    )
    report_parser.add_argument("--parallelism", type=_positive, default=1)
    report_parser.add_argument("--ring-buffer-size", type=_positive, default=None)
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


def _generate_arguments(generate_parser: argparse.ArgumentParser) -> None:
    _common(generate_parser, seq_len=256, heads=4, kv_heads=2)
    generate_parser.add_argument("--steps", type=_positive, default=16, help="new tokens")
    generate_parser.add_argument("--layers", type=_positive, default=2)
    generate_parser.add_argument("--vocab", type=_positive, default=256)
    generate_parser.add_argument("--strategy", choices=("zigzag", "uniform"), default="zigzag")
    generate_parser.add_argument(
        "--window", type=_positive, default=None, help="sliding window (default: causal)"
    )
    generate_parser.add_argument(
        "--temperature", type=_temperature, default=0.0, help="0 = greedy"
    )
    generate_parser.add_argument("--top-k", type=_positive, default=None)
    generate_parser.add_argument("--seed", type=_seed, default=0)
    generate_parser.set_defaults(run=generate, parser=generate_parser)


def _plan_arguments(plan_parser: argparse.ArgumentParser) -> None:
    _common(plan_parser, seq_len=65536, heads=8, kv_heads=2)
    plan_parser.add_argument(
        "--mask", choices=("causal", "full", "documents", "window"), default="causal"
    )
    plan_parser.add_argument("--window", type=_positive, default=4096, help="for --mask window")
    plan_parser.add_argument(
        "--dtype", type=_float_dtype, default="float32", help="q/k/v dtype (attention)"
    )
    plan_parser.add_argument("--batch", type=_positive, default=1)
    plan_parser.add_argument(
        "--dim", type=_positive, default=None, help="LM width (plans an LM training step)"
    )
    plan_parser.add_argument("--layers", type=_positive, default=4, help="LM layers")
    plan_parser.add_argument("--vocab-size", type=_positive, default=32000)
    plan_parser.add_argument(
        "--profile",
        choices=("cpu", *PROFILES),
        default=None,
        help="device profile: its memory is the default budget, its tiles the ones tried "
        "(default h100, or the --target's; cpu has no memory size: give --max-memory-mib)",
    )
    plan_parser.add_argument(
        "--max-memory-mib",
        type=_budget_mib,
        default=None,
        help="budget per device in MiB (default: the profile's memory; TPU v5e/v6e: what "
        "their runtime allows, 15.75/31.25 GiB)",
    )
    plan_parser.add_argument("--hidden", type=_positive, default=None, help="LM MLP width")
    plan_parser.add_argument(
        "--remat", choices=("none", "attention", "block"), default=None, help="fix the remat"
    )
    plan_parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="the LM's layers stacked and scanned (RingTransformerLM(scan_layers=True))",
    )
    plan_parser.add_argument(
        "--target",
        type=_target,
        default=None,
        help="answer with this cluster's compiler: a TPU slice (v5p:4x4x4) or GPUs "
        "(h100:8); --devices defaults to its chips, --profile to its chip",
    )
    plan_parser.add_argument(
        "--longest",
        action="store_true",
        help="with --target: search the longest --seq-len that fits (one compile a probe)",
    )
    plan_parser.add_argument("--json", action="store_true", help="print JSON")
    # None: the target's, or else 8 devices and the h100 profile (see `_plan_defaults`).
    plan_parser.set_defaults(run=plan, parser=plan_parser, devices=None, profile=None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringeqx",
        description="Exact ring attention for JAX. On CPU, the commands fake --devices "
        "devices through XLA_FLAGS (unless XLA_FLAGS already sets a device count).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _demo_arguments(
        commands.add_parser(
            "demo",
            help="causal GQA ring attention, forward + backward, checked against dense",
            description="Causal GQA ring attention, forward and backward, on a ring of "
            "(fake) devices: prints compile and run time, memory per device (and what "
            "it becomes on twice the devices), and the error against dense attention "
            "on a smaller copy of the problem.",
        )
    )
    _bench_arguments(
        commands.add_parser(
            "bench",
            help="time ringeqx forward and forward+backward at one size",
            description="Time ringeqx (full and causal masks) at one size. The "
            "comparison with the ringattention package and dense attention is "
            "benchmarks/ring_vs_dense.py.",
        )
    )
    _report_arguments(
        commands.add_parser(
            "report",
            help="what ring attention communicates: collectives from the compiled HLO, "
            "the analytic model and hardware profiles",
            description="Compile one ring attention call (no arrays are allocated) and "
            "list its collectives (count per call, dtype, bytes per device, mesh axis), "
            "the ring's bytes and FLOPs per step, and per hardware profile whether the "
            "transfer hides behind compute and the smallest shard that hides it.",
        )
    )
    _generate_arguments(
        commands.add_parser(
            "generate",
            help="ring prefill and exact KV-cache decoding on a small random LM",
            description="Generate tokens with a small language model of random weights "
            "(it shows the machinery; nothing is downloaded): the prompt runs through the "
            "ring into a sequence-sharded KV cache, each decode step merges the devices' "
            "partial attention by one max and one sum reduction, and the logits are "
            "checked against the whole sequence recomputed on one device.",
        )
    )
    _plan_arguments(
        commands.add_parser(
            "plan",
            help="the memory plan of ring attention or an LM training step: tiles, "
            "remat, strategy and predicted bytes per device",
            description="Plan ring attention (or, with --dim, a RingTransformerLM "
            "training step) within a memory budget per device: ringeqx.tools.plan, printed "
            "as a table or as JSON. Nothing is compiled.",
        )
    )
    return parser


def _misuse(args: argparse.Namespace) -> str | None:
    """What is wrong with flags that are each fine alone (None if nothing), in their
    names; checked before JAX is imported."""
    if args.heads % args.kv_heads:
        return (
            f"argument --heads: must be a multiple of --kv-heads ({args.kv_heads}); got "
            f"{args.heads}"
        )
    match args.command:
        case "demo" | "bench":
            ring = args.devices
            if args.command == "demo" and args.num_processes and args.local_devices:
                ring = args.num_processes * args.local_devices  # the global ring
            elif args.command == "demo" and args.num_processes:
                ring = None  # known once the processes have joined (see `_ring_mesh`)
            if ring and args.seq_len % ring:
                return _indivisible(args.seq_len, ring)
            if args.command == "demo":
                return _multiprocess_misuse(args)
        case "report":
            return _transfer_misuse(args)
        case "generate":
            if args.top_k is not None and args.top_k > args.vocab:
                return (
                    f"argument --top-k: must be at most --vocab ({args.vocab}); got "
                    f"{args.top_k}"
                )
        case "plan":
            if args.longest and args.target is None:
                return "argument --longest: needs --target (each probe is a compile for it)"
            if args.target is not None:
                chips = _target_chips(args.target)
                if args.devices not in (None, chips):
                    return (
                        f"argument --devices: must be the {chips} chips of --target "
                        f"{args.target} (or left out); got {args.devices}"
                    )
            if args.profile == "cpu" and args.max_memory_mib is None:
                return (
                    "argument --profile: --profile cpu needs --max-memory-mib (the CPU "
                    "profile has no memory size)"
                )
            if args.scan_layers and args.dim is None:
                return "argument --scan-layers: needs --dim (an LM plan; attention has no layers)"
            if args.dim is not None and args.dim % args.heads:
                return (
                    f"argument --dim: must be a multiple of --heads ({args.heads}), the "
                    f"LM's width split over its heads; got {args.dim}"
                )
    return None


def _indivisible(seq_len: int, ring: int) -> str:
    return (
        f"argument --seq-len: must be a multiple of the ring's {ring} devices (each holds "
        f"an equal shard); got {seq_len}"
    )


def _multiprocess_misuse(args: argparse.Namespace) -> str | None:
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


def _transfer_misuse(args: argparse.Namespace) -> str | None:
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
            problem = _writable_folder("--profile", where)
            if problem:
                return problem
    return None


def _target_chips(target: str) -> int:
    """The chips `target` names (importing JAX, but starting no backend)."""
    from .tools._planner._problem import target_chips

    return target_chips(target)


def _plan_defaults(args: argparse.Namespace) -> None:
    """`ringeqx plan`'s defaults that depend on `--target`: its chips and its profile
    (a plan from the model alone: 8 devices, the h100 profile). A GPU target's compiler
    registers without a driver only when told before JAX starts."""
    if args.target is None:
        args.devices = 8 if args.devices is None else args.devices
        args.profile = "h100" if args.profile is None else args.profile
        return
    args.devices = _target_chips(args.target)
    if not args.target.startswith("v"):
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ringeqx` script and of `python -m ringeqx`."""
    args = _parser().parse_args(argv)
    problem = _misuse(args)
    if problem is not None:
        args.parser.error(problem)
    if args.command == "plan":
        _plan_defaults(args)
    # The demo also compiles for twice the devices, to show per-device memory halving;
    # in a multi-process run each process has `--local-devices` of its own.
    local = getattr(args, "local_devices", None)
    _force_host_devices(local or (2 * args.devices if args.command == "demo" else args.devices))
    if args.command == "demo":
        _join_distributed(args)
    return args.run(args)
