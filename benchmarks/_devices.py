"""Fake CPU devices for the benchmarks, asked for before JAX initialises."""

import os


_FLAG = "--xla_force_host_platform_device_count"


def fake_cpu_devices(count: int) -> None:
    """Ask XLA:CPU for `count` devices unless `XLA_FLAGS` already sets a count. Call it
    before the first `import jax`: the flag is read once, when JAX starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
