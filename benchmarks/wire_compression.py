"""Error added by each wire compression of the ring, against the uncompressed float32 ring.

Causal GQA attention at N = 8K on 8 (fake CPU) devices, float32 inputs: outputs and q/k/v
gradients of the ring with K/V sent in bfloat16, float16, float8_e4m3fn and float8_e5m2
(the last three with a power-of-two scale per block) and with the backward ring's dK/dV sent
in bfloat16, each against the same ring sending float32 (which equals dense attention within
1e-5, tests/test_comm.py). Prints a markdown table of max |error| / max |reference| per
array, and the mean |error| / mean |reference|.

Run: `python benchmarks/wire_compression.py` (`--help` for options).
"""

import argparse
import time

from _devices import fake_cpu_devices


fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import ringeqx as rx  # noqa: E402


CONFIGS = [
    ("K/V bfloat16", rx.RingConfig(compression_dtype=jnp.bfloat16)),
    ("K/V float16 (scaled)", rx.RingConfig(compression_dtype=jnp.float16)),
    ("K/V float8_e4m3fn (scaled)", rx.RingConfig(compression_dtype=jnp.float8_e4m3fn)),
    ("K/V float8_e5m2 (scaled)", rx.RingConfig(compression_dtype=jnp.float8_e5m2)),
    ("dK/dV bfloat16", rx.RingConfig(grad_compression_dtype=jnp.bfloat16)),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=512, help="XlaKernel block_q = block_kv")
    args = parser.parse_args()
    start = time.perf_counter()
    mesh = jax.make_mesh((args.devices,), ("sequence",), axis_types=(AxisType.Auto,))
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    n, h, g, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    q = jax.random.normal(kq, (n, h, d), jnp.float32)
    k = jax.random.normal(kk, (n, g, d), jnp.float32)
    v = jax.random.normal(kv, (n, g, d), jnp.float32)
    ct = jax.random.normal(kc, (n, h, d), jnp.float32)
    kernel = rx.XlaKernel(args.block, args.block)

    def run(config):
        @jax.jit
        def f(q, k, v, ct):
            def attn(q, k, v):
                return rx.ring_attention(
                    q, k, v, mask=rx.Causal(), mesh=mesh, kernel=kernel, config=config
                )

            out, vjp = jax.vjp(attn, q, k, v)
            return (out, *vjp(ct))

        return jax.block_until_ready(f(q, k, v, ct))

    ref = run(rx.RingConfig())
    names = ("out", "dq", "dk", "dv")
    print(
        f"Causal, N = {n}, {args.devices} fake CPU devices, {h} heads, {g} kv heads, "
        f"head_dim {d}, float32 inputs (normal), error against the float32 ring.\n"
    )
    print("| compression | " + " | ".join(f"{x} max / mean rel." for x in names) + " |")
    print("|---|" + "---|" * len(names))
    for label, config in CONFIGS:
        got = run(config)
        cells = []
        for a, r in zip(got, ref):
            err = jnp.abs(a - r)
            finite = bool(jnp.all(jnp.isfinite(a)))
            max_rel = float(jnp.max(err) / jnp.max(jnp.abs(r)))
            mean_rel = float(jnp.mean(err) / jnp.mean(jnp.abs(r)))
            cells.append(f"{max_rel:.1e} / {mean_rel:.1e}" + ("" if finite else " (non-finite!)"))
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nTotal time: {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
