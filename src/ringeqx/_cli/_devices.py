"""The devices a command runs on: the fake CPU device count (set before JAX starts), a
multi-process run's joining, and the one-axis ring mesh."""

import argparse
import math
import os
import sys

from ._output import say


_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(count: int) -> bool:
    """Ask XLA for `count` CPU devices unless the user already chose a count.

    Returns whether the flag was set here. Must run before JAX initialises a backend.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()
    return True


def join_distributed(args: argparse.Namespace) -> None:
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
    say(f"      {waiting} (--timeout {args.timeout:g} s)...")

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
    say(
        f"      process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices"
    )


def ring_mesh(num_devices: int, platform: str | None):
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
        say(
            f"      only {len(devices)} {devices[0].platform} device(s) are visible; "
            f"using {len(devices)} instead of {num_devices}."
        )
        num_devices = len(devices)
    return Mesh(
        np.asarray(devices[:num_devices]), ("sequence",), axis_types=(AxisType.Auto,)
    )


def device_platform(device_type: str) -> str | None:
    match device_type:
        case "auto":
            return None
        case "cpu" | "gpu" | "tpu":
            return device_type
        case _:
            raise ValueError(f"Unknown device type {device_type!r}.")
