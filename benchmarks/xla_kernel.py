"""`XlaKernel` on one device against `jax.nn.dot_product_attention` (xla) and a matmul.

Run: `python benchmarks/xla_kernel.py [--seq-len 8192] [--reps 3]`. Prints, from one run:
the forward and forward+backward FLOP rates of `ring_attention` on a one-device ring (the
kernel alone does all the work) against a 4096 x 4096 float32 matmul, and forward+backward
times of both attentions. Under `taskset -c 0` every rate is one core's: the kernel's
efficiency with nothing else sharing its core.
"""

import argparse

import jax
import jax.numpy as jnp

import ringeqx as rx
from ringeqx._util._timing import median_seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block-q", type=int, default=None, help="default: XlaKernel()'s")
    parser.add_argument("--block-kv", type=int, default=None)
    args = parser.parse_args()
    n, h, d = args.seq_len, args.heads, args.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, n, h, d), jnp.float32) for key in keys)
    mesh = jax.make_mesh((1,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
    blocks = {"block_q": args.block_q, "block_kv": args.block_kv}
    kernel = rx.XlaKernel(**{name: b for name, b in blocks.items() if b is not None})

    def ours(q, k, v):
        return rx.ring_attention(q, k, v, mesh=mesh, kernel=kernel)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="xla")

    def fwd_bwd(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))

    a = jnp.ones((4096, 4096), jnp.float32)
    t_mm = median_seconds(jax.jit(lambda a: a @ a), a, repeats=args.reps)
    mm_rate = 2 * 4096**3 / t_mm
    t_fwd = median_seconds(jax.jit(ours), q, k, v, repeats=args.reps)
    t_ours = median_seconds(fwd_bwd(ours), q, k, v, repeats=args.reps)
    t_theirs = median_seconds(fwd_bwd(theirs), q, k, v, repeats=args.reps)
    rate = 4 * n * n * h * d / t_fwd
    print(f"## XlaKernel {kernel.block_q}x{kernel.block_kv} on one device: N={n}, {h} heads, "
          f"head_dim {d}, float32, median of {args.reps}\n")
    print("| measure | value |\n|---|---|")
    print(f"| 4096^2 float32 matmul | {mm_rate / 1e9:.1f} GFLOP/s |")
    print(f"| XlaKernel forward | {t_fwd:.3f} s, {rate / 1e9:.1f} GFLOP/s |")
    print(f"| XlaKernel forward+backward | {t_ours:.3f} s |")
    print(f"| jax.nn.dot_product_attention (xla) forward+backward | {t_theirs:.3f} s |")
    print(f"\nforward FLOP rate / matmul rate: {rate / mm_rate:.2f} (target >= 0.6: "
          f"{'PASS' if rate / mm_rate >= 0.6 else 'MISS'})")
    # Forward+backward does 3.5x the forward's matmul FLOPs (2 products per tile, then 5).
    both_rate = 3.5 * 4 * n * n * h * d / t_ours
    print(f"forward+backward FLOP rate / matmul rate: {both_rate / mm_rate:.2f} (reported)")
    print(f"fwd+bwd time, XlaKernel / dot_product_attention: {t_ours / t_theirs:.2f} (target < 1: "
          f"{'PASS' if t_ours < t_theirs else 'MISS'})")


if __name__ == "__main__":
    main()
