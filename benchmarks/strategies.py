"""Balance of the sharding strategies, and causal forward+backward time, Zigzag vs Uniform.

Run: `python benchmarks/strategies.py` (about 3 minutes on 2 CPU cores). It fakes
`--devices` CPU devices and prints a Markdown report:

1. causal attention over N tokens: the imbalance (useful pairs, and kernel tiles), the
   critical path and the total of kernel tiles of `Uniform`, `Zigzag` and `Striped`, from
   `ringeqx.tools.schedule`;
2. the same for packed documents with long-tailed (log-normal, seeded) lengths under
   causal + document masks: `Uniform`, `Zigzag`, `Striped(stripe=chunk)` and
   `WorkBalanced(chunk=chunk)`, with the time `WorkBalanced` takes to place them;
3. the causal forward+backward median time of `Uniform` and `Zigzag` on the fake devices,
   beside the critical path from the schedule. On a CPU the fake devices share the cores,
   so the total work decides the time; on real devices the critical path does.

Imbalance is `sum_s max_i work[s, i] / sum_s mean_i work[s, i]` over ring steps `s` and
devices `i` (`Schedule.imbalance`; `Schedule.tile_imbalance` counts kernel tiles).
"""

import argparse
import statistics
import sys
import time

from _devices import fake_cpu_devices


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--block", type=int, default=512, help="XlaKernel block (causal)")
    parser.add_argument(
        "--chunk", type=int, default=64, help="block and WorkBalanced chunk (documents)"
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of document lengths"
    )
    parser.add_argument("--skip-timing", action="store_true")
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:])
fake_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import ringeqx as rx  # noqa: E402


def _row(name, schedule, extra=""):
    s = schedule
    return (
        f"| {name} | {float(s.imbalance):.3f} | {float(s.tile_imbalance):.3f} | "
        f"{int(s.critical_path)} | {int(s.total_tiles)} |{extra}"
    )


HEADER = (
    "| strategy | imbalance (pairs) | imbalance (tiles) | critical path (tiles) | total tiles |"
)


def causal_balance(n, p, block):
    print(f"## 1. Causal, N = {n}, {p} devices, tiles {block} x {block}\n")
    print(HEADER)
    print("|---|---|---|---|---|")
    for name, strategy in [
        ("Uniform", rx.Uniform()),
        ("Zigzag", rx.Zigzag()),
        ("Striped", rx.Striped()),
    ]:
        layout = strategy.layout(n, p)
        print(_row(name, rx.tools.schedule(layout, rx.Causal(), kernel=rx.XlaKernel(block, block))))
    print()


def document_balance(n, p, chunk, seeds):
    print(
        f"## 2. Packed documents, causal + document, N = {n}, {p} devices, tiles "
        f"{chunk} x {chunk}\n"
    )
    print("Document lengths ~ lognormal(5.0, 1.3), packed until N tokens.\n")
    mask = rx.Causal() & rx.Document()
    print("| seed | documents (median / max length) | " + HEADER[2:] + " placement time |")
    print("|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        rng = np.random.default_rng(seed)
        lengths = np.maximum(1, rng.lognormal(5.0, 1.3, size=4 * n // 100).astype(int))
        ids = np.repeat(np.arange(len(lengths)), lengths)[:n]
        docs = np.bincount(ids)
        about = f"{len(docs)} ({int(np.median(docs))} / {docs.max()})"
        seg = jnp.asarray(ids, jnp.int32)
        for name, strategy in [
            ("Uniform", rx.Uniform()),
            ("Zigzag", rx.Zigzag()),
            (f"Striped(stripe={chunk})", rx.Striped(stripe=chunk)),
            (f"WorkBalanced(chunk={chunk})", rx.WorkBalanced(chunk=chunk)),
        ]:
            jax.block_until_ready(strategy.layout(n, p, segment_ids=seg))  # compile
            start = time.perf_counter()
            layout = jax.block_until_ready(strategy.layout(n, p, segment_ids=seg))
            took = time.perf_counter() - start
            s = rx.tools.schedule(layout, mask, kernel=rx.XlaKernel(chunk, chunk))
            print(f"| {seed} | {about} " + _row(name, s, f" {took * 1e3:.0f} ms |"))
    print()


def causal_timing(n, p, heads, head_dim, block, reps):
    print(
        f"## 3. Causal forward+backward on {p} fake CPU devices, N = {n}, {heads} heads, "
        f"head_dim {head_dim}, float32, XlaKernel({block}, {block}), median of {reps}\n"
    )
    print(
        "The two strategies run alternately (Uniform, Zigzag, Uniform, ...), so that load "
        "from other jobs falls on both.\n"
    )
    mesh = jax.make_mesh((p,), ("sequence",), axis_types=(AxisType.Auto,))
    kernel = rx.XlaKernel(block_q=block, block_kv=block)
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(x, (n, heads, head_dim)) for x in (kq, kk, kv, kc))

    def prepare(strategy):
        layout = strategy.layout(n, p)
        args = tuple(layout.shard(x) for x in (q, k, v, ct))

        @jax.jit
        def step(q, k, v, ct):
            def loss(q, k, v):
                out = rx.ring_attention(
                    q,
                    k,
                    v,
                    mask=rx.Causal(),
                    layout=layout,
                    order="layout",
                    mesh=mesh,
                    kernel=kernel,
                )
                return jnp.sum(out * ct)

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        jax.block_until_ready(step(*args))  # compile and warm up
        return layout, step, args

    runs = {name: prepare(s) for name, s in [("Uniform", rx.Uniform()), ("Zigzag", rx.Zigzag())]}
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, (_, step, args) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times[name].append(time.perf_counter() - start)
    print("| strategy | fwd+bwd median (s) | critical path (tiles) | total tiles |")
    print("|---|---|---|---|")
    for name, (layout, _, _) in runs.items():
        s = rx.tools.schedule(layout, rx.Causal(), kernel=rx.XlaKernel(block, block))
        ts = times[name]
        print(
            f"| {name} | {statistics.median(ts):.2f} (runs: {', '.join(f'{t:.2f}' for t in ts)})"
            f" | {int(s.critical_path)} | {int(s.total_tiles)} |"
        )
    print()


def main():
    print(f"# ringeqx strategies benchmark (jax {jax.__version__}, {jax.devices()[0].platform})\n")
    begin = time.perf_counter()
    causal_balance(ARGS.seq_len, ARGS.devices, ARGS.block)
    document_balance(ARGS.seq_len, ARGS.devices, ARGS.chunk, ARGS.seeds)
    if not ARGS.skip_timing:
        causal_timing(ARGS.seq_len, ARGS.devices, ARGS.heads, ARGS.head_dim, ARGS.block, ARGS.reps)
    print(f"Total benchmark time: {time.perf_counter() - begin:.0f} s.")


if __name__ == "__main__":
    main()
