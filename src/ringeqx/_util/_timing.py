"""The one timing loop: the CLI's `bench`, `tune_block_sizes` and the benchmarks use it."""

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, *args, repeats: int, warmup: bool = True) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, each waited on with
    `jax.block_until_ready`; one untimed call first (compilation, caches) unless
    `warmup=False`."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer; got {repeats!r}.")
    if warmup:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
