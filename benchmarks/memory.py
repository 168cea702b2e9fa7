"""Per-device memory of ring attention and of a small LM training step, against N and P.

Run: `python benchmarks/memory.py` (compiles only, nothing runs: a few minutes on 2 CPU
cores). It fakes 8 CPU devices and reads `memory_analysis()` of compiled programs: per
device, arguments + outputs + temporaries. Inputs are sharded `P(None, "sequence")`, as a
sequence-parallel model holds them; ring attention is called without `layout=` (the
default contiguous path). It prints a Markdown report:

1. ring attention forward+backward (causal, batch 1, 4 heads, head_dim 64, float32) for
   N in `--lengths` and P = 1, 2, 4, 8 devices, beside dense
   `jax.nn.dot_product_attention` on one device;
2. a small `RingTransformerLM` training step (loss + gradients) at P = 8 for N, 2N, 4N,
   8N and at P = 4 for `--fixed-len`, with memory per token per device (flat when memory
   is O(N/P));
3. the ratios the issue asks for, with PASS/MISS: memory growth per doubling of N at P = 8
   (<= 2.1x) and the change from P = 4 to P = 8 at N = 16K (<= 0.55x).

It saves the plot of per-device memory against N to `benchmarks/memory.png` (needs
matplotlib; skipped with a note where it is missing).
"""

import argparse
import math
import os
import sys

from _devices import fake_cpu_devices


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768]
    )
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--lm-lengths",
        type=int,
        nargs="+",
        default=[8192, 16384, 32768, 65536],
        help="N, 2N, 4N, ... of the LM training step (doublings)",
    )
    parser.add_argument(
        "--fixed-len", type=int, default=16384, help="N of the P = 4 -> 8 ratios"
    )
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "memory.png"))
    return parser.parse_args(argv)


ARGS = _parse(sys.argv[1:])
fake_cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import ringeqx as rx  # noqa: E402


MIB = 2**20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def per_device(compiled) -> float:
    """Arguments + outputs + temporaries of one device, in MiB."""
    s = compiled.memory_analysis()
    return (s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes) / MIB


def ring_mesh(p: int) -> Mesh:
    devices = np.asarray(jax.devices()[:p])
    return Mesh(devices, ("sequence",), axis_types=(AxisType.Auto,))


def attention_memory(n: int, p: int) -> float:
    mesh = ring_mesh(p)
    seq = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    x = jax.ShapeDtypeStruct((1, n, ARGS.heads, ARGS.head_dim), jnp.float32, sharding=seq)

    def fwd_bwd(q, k, v, d_out):
        def f(q, k, v):
            return rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=mesh)

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)

    return per_device(jax.jit(fwd_bwd).lower(x, x, x, x).compile())


def dense_memory(n: int) -> float:
    x = jax.ShapeDtypeStruct((1, n, ARGS.heads, ARGS.head_dim), jnp.float32)

    def fwd_bwd(q, k, v, d_out):
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)

    return per_device(jax.jit(fwd_bwd).lower(x, x, x, x).compile())


def lm_memory(n: int, p: int) -> float:
    """One training step (mean loss and parameter gradients) of a 2-layer LM, tokens and
    labels sharded over the ring."""
    mesh = ring_mesh(p)
    model = rx.nn.RingTransformerLM(
        vocab_size=512, dim=128, num_heads=4, num_layers=2, key=jax.random.key(0)
    )
    params, static = eqx.partition(model, eqx.is_array)
    seq = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    tokens = jax.ShapeDtypeStruct((1, n), jnp.int32, sharding=seq)

    def step(params, tokens, labels):
        def loss(params):
            model = eqx.combine(params, static)
            return jnp.mean(jax.vmap(lambda t, y: model.loss(t, y, mesh=mesh))(tokens, labels))

        return jax.value_and_grad(loss)(params)

    return per_device(jax.jit(step).lower(params, tokens, tokens).compile())


def ratio_rows(name: str, by_n: dict, fixed_n: int, by_p: dict) -> list[tuple]:
    lengths = sorted(by_n)
    rows = [
        (f"{name}, P=8: N={a} -> {b}", by_n[b] / by_n[a], 2.1)
        for a, b in zip(lengths, lengths[1:])
    ]
    rows.append((f"{name}, N={fixed_n}: P=4 -> 8", by_p[8] / by_p[4], 0.55))
    return rows


def plot(attn: dict, dense: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot."
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in (1, 2, 4, 8):
        ns = sorted(n for (n, q) in attn if q == p)
        ax.plot(ns, [attn[n, p] for n in ns], "o-", label=f"ring, P={p}")
    ns = sorted(dense)
    ax.plot(ns, [dense[n] for n in ns], "k--s", label="dense (1 device)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("MiB per device (args + outputs + temp)")
    ax.set_title("Causal attention forward+backward, 4 heads x 64, float32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"Plot: `{os.path.relpath(path)}`."


def main() -> int:
    attn, dense = {}, {}
    for n in ARGS.lengths:
        for p in (1, 2, 4, 8):
            log(f"attention N={n} P={p} ...")
            attn[n, p] = attention_memory(n, p)
        log(f"dense N={n} ...")
        dense[n] = dense_memory(n)
    fixed = ARGS.fixed_len
    for p in (4, 8):
        if (fixed, p) not in attn:
            attn[fixed, p] = attention_memory(fixed, p)
    lm, lm_fixed = {}, ARGS.fixed_len
    for n in sorted(set(ARGS.lm_lengths) | {lm_fixed}):
        log(f"LM step N={n} P=8 ...")
        lm[n, 8] = lm_memory(n, 8)
    log(f"LM step N={lm_fixed} P=4 ...")
    lm[lm_fixed, 4] = lm_memory(lm_fixed, 4)

    report = [
        f"## memory: per-device MiB (arguments + outputs + temp), JAX {jax.__version__}, "
        f"{jax.devices()[0].platform} (fake devices, compile only)",
        "",
        f"Ring attention forward+backward, causal, batch 1, {ARGS.heads} heads x "
        f"{ARGS.head_dim}, float32, inputs sharded `P(None, 'sequence')`, no `layout=`:",
        "",
        "| N | P=1 | P=2 | P=4 | P=8 | dense (1 device) |",
        "|---|---|---|---|---|---|",
    ]
    for n in ARGS.lengths:
        cells = " | ".join(f"{attn[n, p]:.1f}" for p in (1, 2, 4, 8))
        report.append(f"| {n} | {cells} | {dense[n]:.1f} |")
    report += [
        "",
        "LM training step (vocab 512, dim 128, 4 heads, 2 layers; loss + gradients), "
        "tokens and labels sharded:",
        "",
        "| N | P | MiB per device | KiB per token per device |",
        "|---|---|---|---|",
    ]
    for (n, p), mib in lm.items():
        report.append(f"| {n} | {p} | {mib:.1f} | {1024 * mib / (n // p):.1f} |")
    at8 = {n: attn[n, 8] for n in ARGS.lengths if n >= min(ARGS.lm_lengths)}
    rows = ratio_rows("attention", at8, fixed, {p: attn[fixed, p] for p in (4, 8)})
    rows += ratio_rows(
        "LM step",
        {n: lm[n, 8] for n in ARGS.lm_lengths},
        lm_fixed,
        {p: lm[lm_fixed, p] for p in (4, 8)},
    )
    report += ["", "| ratio | value | goal | result |", "|---|---|---|---|"]
    for name, value, goal in rows:
        report.append(
            f"| {name} | {value:.3f} | <= {goal} | {'PASS' if value <= goal else 'MISS'} |"
        )
    lengths = sorted(ARGS.lm_lengths)
    growth = lm[lengths[-1], 8] / lm[lengths[0], 8]
    doublings = math.log2(lengths[-1] / lengths[0])
    report += [
        "",
        f"LM step, P=8, N={lengths[0]} -> {lengths[-1]}: {growth:.3f}x in {doublings:.0f} "
        f"doublings, {growth ** (1 / doublings):.3f}x per doubling on average.",
    ]
    report += ["", plot(attn, dense, ARGS.plot)]
    print("\n".join(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
