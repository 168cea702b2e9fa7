"""`tune_block_sizes`: time candidate tiles of a kernel on the present device."""

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._masks._positional import Full
from .._score_mods import AbstractScoreMod
from .._util._timing import median_seconds
from ._base import AbstractAttentionKernel, Scores


def _problem(
    batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, mask, score_mod, backward
):
    """One ring step's inputs `(q, k, v, d_out)`, tokens at positions `0, 1, ...` of one
    segment, and `step(kernel, q, k, v, d_out)`: the kernel's forward (and backward)."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (batch, heads, q_len, head_dim), dtype)
    k = jax.random.normal(kk, (batch, kv_heads, kv_len, head_dim), dtype)
    v = jax.random.normal(kv, (batch, kv_heads, kv_len, head_dim), dtype)
    d_out = jax.random.normal(kd, q.shape, dtype)

    def info(length: int) -> TokenInfo:
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        return TokenInfo(pos, jnp.zeros_like(pos), jnp.full_like(pos, -1), pos >= 0)

    q_info, kv_info = info(q_len), info(kv_len)
    scores = Scores(mask, score_mod, 1.0 / math.sqrt(head_dim))

    def step(kernel, q, k, v, d_out):
        out, lse = kernel.forward(q, k, v, q_info, kv_info, scores)
        if not backward:
            return out, lse
        delta = jnp.sum(out * d_out.astype(jnp.float32), axis=-1)
        return kernel.backward(q, k, v, lse, delta, d_out, q_info, kv_info, scores)

    return step, (q, k, v, d_out)


def tune_block_sizes(
    kernel: AbstractAttentionKernel,
    *,
    heads: int,
    q_len: int,
    head_dim: int,
    kv_heads: int | None = None,
    kv_len: int | None = None,
    batch: int = 1,
    dtype: DTypeLike = jnp.bfloat16,
    mask: AbstractMask | None = None,
    score_mod: AbstractScoreMod | None = None,
    candidates: Sequence[tuple[int, int]] | None = None,
    backward: bool = True,
    repeats: int = 3,
) -> tuple[AbstractAttentionKernel, dict[tuple[int, int], float]]:
    """Time `kernel` with each candidate `(block_q, block_kv)` on the present device and
    return the fastest.

    The problem is one ring step on one device: `q` `[batch, heads, q_len, head_dim]`
    against K/V `[batch, kv_heads, kv_len, head_dim]`, tokens at positions `0, 1, ...`
    of one segment. Each candidate is compiled once, then timed `repeats` times (the
    median counts); `backward=True` times the forward and the backward together, which
    is what a training step pays.

    **Arguments:**

    - `kernel`: the kernel to tune (its other settings, such as `interpret`, are kept;
        its tiles are replaced with `dataclasses.replace`).
    - `heads`, `q_len`, `head_dim`, `kv_heads` (default `heads`), `kv_len` (default
        `q_len`), `batch`, `dtype`: the problem.
    - `mask`, `score_mod`: as in [`ringeqx.ring_attention`][] (default `Full()`).
    - `candidates`: `(block_q, block_kv)` pairs (default: the kernel's own
        `tile_candidates()`).
        A candidate the kernel rejects is an error, not skipped.
    - `backward`: also time the backward.
    - `repeats`: timed runs per candidate, >= 1.

    **Returns:** `(best, timings)`: the kernel with the fastest tiles, and the median
    seconds of every candidate.

    **Example:**

    ```python
    kernel, timings = ringeqx.tune_block_sizes(
        ringeqx.PallasGpuKernel(), heads=32, kv_heads=8, q_len=8192, head_dim=128
    )
    ```
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be an integer >= 1; got {repeats!r}.")
    candidates = kernel.tile_candidates() if candidates is None else list(candidates)
    if not candidates:
        raise ValueError(
            "`candidates` must hold at least one (block_q, block_kv) pair."
        )
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = q_len if kv_len is None else kv_len
    mask = Full() if mask is None else mask
    kernels = {
        (bq, bk): dataclasses.replace(kernel, block_q=bq, block_kv=bk)
        for bq, bk in candidates
    }

    step, arrays = _problem(
        batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, mask, score_mod, backward
    )
    timings = {}
    for blocks, candidate in kernels.items():
        fn = jax.jit(lambda *args, kernel=candidate: step(kernel, *args))
        timings[blocks] = median_seconds(fn, *arrays, repeats=repeats)
    best = min(timings, key=timings.__getitem__)
    return kernels[best], timings
