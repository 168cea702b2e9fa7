"""Sliding-window attention on a ring that stops early, against plain causal attention.

With a contiguous layout (`Uniform`) a causal window of `W` tokens over shards of capacity
`C` needs `ceil((W - 1) / C) + 1` ring steps, not one per device. This script shows it
three ways for `W = 1024` over 16K tokens on 8 (fake CPU) devices:

- the schedule ([`ringeqx.num_ring_steps`][], [`ringeqx.tools.schedule`][]),
- the compiled program: trip counts of the loops that hold collective-permutes and the
  bytes they send (forward + backward), parsed from the HLO,
- forward + backward wall time, against the same call with `Causal()`.

Run: `python benchmarks/sliding_window.py` (defaults below; `--help` for options).
"""

import argparse
import math
import time

from _devices import fake_cpu_devices


fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import ringeqx as rx  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=512, help="XlaKernel block_q = block_kv")
    parser.add_argument("--reps", type=int, default=1, help="timed calls after a warm-up")
    args = parser.parse_args()

    p, n, w = args.devices, args.seq_len, args.window
    mesh = jax.make_mesh((p,), ("sequence",), axis_types=(AxisType.Auto,))
    kernel = rx.XlaKernel(block_q=args.block, block_kv=args.block)
    layout = rx.Uniform().layout(n, p)
    cap = layout.capacity
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (n, args.heads, args.head_dim)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    print(
        f"# ringeqx sliding window vs causal: {n} tokens, {p} devices (capacity {cap}), "
        f"window {w}, {args.heads} heads x {args.head_dim}, fp32, XlaKernel({args.block}), "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(f"bound: ceil(W / C) + 1 = {math.ceil(w / cap) + 1} ring steps")
    print()
    print(
        "| mask | ring steps (schedule) | tiles run (schedule) | ring steps (HLO, fwd) "
        "| permutes executed (fwd+bwd) | MiB sent per device (fwd+bwd) | compile s "
        "| fwd+bwd s |"
    )
    print("|---|---|---|---|---|---|---|---|")

    rows = {}
    for name, mask in (("sliding_window", rx.SlidingWindow(w)), ("causal", rx.Causal())):

        def loss(q, k, v, mask=mask):
            out = rx.ring_attention(q, k, v, mask=mask, mesh=mesh, kernel=kernel)
            return jnp.sum(out * ct)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        t0 = time.perf_counter()
        compiled = fn.lower(q, k, v).compile()
        compile_s = time.perf_counter() - t0
        ops, nbytes, _ = rx.tools.permute_stats(compiled.as_text())
        # Ring steps in the compiled forward: K and V blocks ([batch, heads, C, head_dim]
        # inside the device) each hop once per step after the first.
        fwd = jax.jit(
            lambda q, k, v, mask=mask: rx.ring_attention(
                q, k, v, mask=mask, mesh=mesh, kernel=kernel
            )
        )
        block = f"f32[1,{args.heads},{cap},{args.head_dim}]"
        kv_ops, _, _ = rx.tools.permute_stats(fwd.lower(q, k, v).compile().as_text(), block)
        hlo_steps = kv_ops // 2 + 1
        steps = rx.num_ring_steps(mask, layout)
        sched = rx.tools.schedule(layout, mask, kernel=kernel)
        jax.block_until_ready(compiled(q, k, v))  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - t0)
        best = min(times)
        rows[name] = dict(steps=steps, hlo_steps=hlo_steps, bytes=nbytes, time=best)
        print(
            f"| {name} | {steps} | {int(sched.total_tiles)} | {hlo_steps} | {ops} "
            f"| {nbytes / 2**20:.1f} | {compile_s:.1f} | {best:.2f} |"
        )

    win, causal = rows["sliding_window"], rows["causal"]
    print()
    print(
        f"sliding window: {win['steps']} ring steps (compiled: {win['hlo_steps']}), "
        f"causal: {causal['steps']} (compiled: {causal['hlo_steps']})"
    )
    print(f"communication: causal / window = {causal['bytes'] / win['bytes']:.2f}x")
    print(f"fwd+bwd time: causal / window = {causal['time'] / win['time']:.2f}x")
    bound = math.ceil(w / cap) + 1
    ok = win["steps"] <= bound and win["hlo_steps"] <= bound
    print(f"steps <= ceil(W / C) + 1: {ok}; speed-up >= 2x: {causal['time'] / win['time'] >= 2}")


if __name__ == "__main__":
    main()
