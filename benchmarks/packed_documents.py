"""Packed short documents: the ring sends only the shard offsets the mask allows.

With documents much shorter than a shard, each device needs its own shard and at most
its neighbours; the ring reads that off the mask's block rule on the shards when the
layout is concrete at trace time, and runs only those steps (no K/V hop for the others;
`ringeqx.num_ring_steps` reports them). This script compares, on 8 fake CPU devices,
`Document() & Causal()` over packed documents of 256-512 tokens:

- reduced: the layout closed over (concrete), so the ring runs `num_ring_steps` steps;
- full: the same layout passed to the jitted function as an argument (traced), so only
  the mask's static bounds count (none here) and the full ring runs, skipping the
  compute of masked steps but still sending every hop.

It prints the steps, the collective-permute bytes per device (forward + backward, from
the compiled HLO) and the forward + backward time (medians of alternating runs in one
process), with their ratios, for a contiguous (`Uniform`) and a `Zigzag` layout.

Run: `python benchmarks/packed_documents.py` (defaults below; `--help` for options).
"""

import argparse

from _devices import fake_cpu_devices


fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx._util._timing import median_seconds  # noqa: E402


def _segments(n: int, low: int, high: int) -> jax.Array:
    """Documents of random lengths in [low, high], packed to n tokens."""
    lengths = np.random.default_rng(0).integers(low, high + 1, size=n // low + 1)
    return jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[:n], jnp.int32)


def _programs(layout, mask, mesh, kernel, q, k, v, ct):
    """Compiled fwd+bwd with the layout concrete (reduced) and traced (full ring)."""

    def loss(q, k, v, layout):
        out = rx.ring_attention(
            q, k, v, mask=mask, layout=layout, order="original", mesh=mesh, kernel=kernel
        )
        return jnp.sum(out * ct)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    reduced = jax.jit(lambda q, k, v: grad(q, k, v, layout)).lower(q, k, v).compile()
    full = jax.jit(grad).lower(q, k, v, layout).compile()
    return (reduced, (q, k, v)), (full, (q, k, v, layout))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--doc-min", type=int, default=256)
    parser.add_argument("--doc-max", type=int, default=512)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=256, help="XlaKernel block_q = block_kv")
    parser.add_argument("--reps", type=int, default=5, help="alternating timed runs")
    args = parser.parse_args()

    p, n = args.devices, args.seq_len
    mesh = jax.make_mesh((p,), ("sequence",), axis_types=(AxisType.Auto,))
    kernel = rx.XlaKernel(block_q=args.block, block_kv=args.block)
    seg = _segments(n, args.doc_min, args.doc_max)
    mask = rx.Document() & rx.Causal()
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (n, args.heads, args.head_dim)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    print(
        f"# ringeqx packed documents: {n} tokens, {p} devices, documents of "
        f"{args.doc_min}-{args.doc_max} tokens, Document() & Causal(), {args.heads} heads x "
        f"{args.head_dim}, fp32, XlaKernel({args.block}), jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {args.reps} alternating runs"
    )
    print()
    print(
        "| layout | ring | steps | permutes (fwd+bwd) | MiB sent per device (fwd+bwd) "
        "| fwd+bwd s (median) |"
    )
    print("|---|---|---|---|---|---|")
    ratios = []
    for strategy in (rx.Uniform(), rx.Zigzag()):
        layout = strategy.layout(n, p, segment_ids=seg)
        progs = _programs(layout, mask, mesh, kernel, q, k, v, ct)
        stats = [rx.tools.permute_stats(c.as_text()) for c, _ in progs]
        for c, a in progs:  # warm-up
            jax.block_until_ready(c(*a))
        times = ([], [])
        for _ in range(args.reps):
            for t, (c, a) in zip(times, progs):
                t.append(median_seconds(c, *a, repeats=1, warmup=False))
        medians = [float(np.median(t)) for t in times]
        steps = (rx.num_ring_steps(mask, layout), p)
        name = type(strategy).__name__
        for ring, s, (ops, nbytes, _), sec in zip(("reduced", "full"), steps, stats, medians):
            print(f"| {name} | {ring} | {s} | {ops} | {nbytes / 2**20:.2f} | {sec:.3f} |")
        ratios.append((name, stats[1][1] / stats[0][1], medians[1] / medians[0]))
    print()
    for name, nbytes, sec in ratios:
        print(f"{name}: bytes full / reduced = {nbytes:.2f}x, time full / reduced = {sec:.2f}x")


if __name__ == "__main__":
    main()
