"""Longest context that fits a per-device budget: LM training step on P = 1, 2, 4, 8 devices.

Run: `python benchmarks/long_context.py` (compile only, nothing runs; 8 fake CPU devices;
a few minutes on 2 cores). For each ring size P it finds, by bisection over the planner's
predictions, the longest sequence N (a multiple of `--step`) for which `ringeqx.tools.plan`
finds a `RingTransformerLM` training step (loss, gradients, Adam) that fits `--budget-mib`
per device, then compiles that plan and checks with `memory_analysis()` that it does fit.
Against it: dense attention (`jax.nn.dot_product_attention`, forward + backward, one
device, the LM's attention shape) alone, its longest N found by bisection over compiled
programs; a dense LM step needs more than its attention, so this bounds it from above.

The paper's claim is that context grows with the device count: longest(P) / longest(1)
should be close to P. Prints a Markdown report and saves `benchmarks/long_context.png`.
"""

import argparse
import os
import sys

from _devices import fake_cpu_devices


fake_cpu_devices(8)
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ringeqx as rx  # noqa: E402


MIB = 2**20
LM = dict(heads=4, dim=128, num_layers=2, vocab_size=512)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bisect(fits, step: int, hi: int) -> int:
    """The largest multiple of `step` in [step, hi] for which `fits` holds (0 if none);
    `fits` must be monotone."""
    lo_k, hi_k = 0, hi // step
    while lo_k < hi_k:
        mid = (lo_k + hi_k + 1) // 2
        if fits(mid * step):
            lo_k = mid
        else:
            hi_k = mid - 1
    return lo_k * step


def planned(n: int, p: int, budget: int) -> rx.tools.Plan | None:
    try:
        return rx.tools.plan(n, p, max_memory_usage=budget, **LM)
    except ValueError:
        return None


def dense_bytes(n: int) -> int:
    head_dim = LM["dim"] // LM["heads"]
    x = jax.ShapeDtypeStruct((1, n, LM["heads"], head_dim), jnp.float32)

    def fwd_bwd(q, k, v, d_out):
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(d_out)

    s = jax.jit(fwd_bwd).lower(x, x, x, x).compile().memory_analysis()
    return s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes


def plot(longest: dict, dense: int, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot."
    ps = sorted(longest)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ps, [longest[p] for p in ps], "o-", label="ring LM step, planned")
    ax.plot(ps, [longest[1] * p for p in ps], ":", color="gray", label="P x longest(1)")
    ax.axhline(dense, color="k", linestyle="--", label="dense attention alone, 1 device")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.set_xlabel("devices on the ring P")
    ax.set_ylabel("longest sequence N that fits")
    ax.set_title("Longest context within a fixed memory budget per device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"Plot: `{os.path.relpath(path)}`."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=256)
    parser.add_argument("--step", type=int, default=1024, help="N is a multiple of this")
    parser.add_argument(
        "--plot", default=os.path.join(os.path.dirname(__file__), "long_context.png")
    )
    args = parser.parse_args()
    budget = int(args.budget_mib * MIB)
    longest, rows = {}, []
    for p in (1, 2, 4, 8):
        n = bisect(lambda n: planned(n, p, budget) is not None, args.step, 2**24)
        plan = planned(n, p, budget)
        log(f"P={p}: longest N={n}, compiling its plan ...")
        compiled = rx.tools.measure_memory(plan)["total"]
        longest[p] = n
        rows.append((p, n, plan, compiled))
    log("dense attention ...")
    dense = bisect(lambda n: dense_bytes(n) <= budget, args.step, 2**17)
    lines = [
        f"## long context: longest N within {args.budget_mib:g} MiB per device, JAX "
        f"{jax.__version__}, {jax.devices()[0].platform} (fake devices, compile only)",
        "",
        f"`RingTransformerLM` training step (loss, gradients, Adam; vocab "
        f"{LM['vocab_size']}, dim {LM['dim']}, {LM['heads']} heads, {LM['num_layers']} "
        "layers, float32, causal), the planner's choice; N a multiple of "
        f"{args.step}. Command: `python benchmarks/long_context.py --budget-mib "
        f"{args.budget_mib:g}`.",
        "",
        "| P | longest N | longest(P) / longest(1) | plan (strategy, tiles, remat) | "
        "predicted MiB | compiled MiB |",
        "|---|---|---|---|---|---|",
    ]
    for p, n, plan, compiled in rows:
        lines.append(
            f"| {p} | {n} | {n / longest[1]:.2f} | {plan.strategy!r}, {plan.block_q}, "
            f"{plan.remat} | {plan.memory.total / MIB:.1f} | {compiled / MIB:.1f} |"
        )
    lines += [
        f"| dense attention alone, 1 device | {dense} | {dense / longest[1]:.2f} | - | - | "
        f"<= {args.budget_mib:g} |",
        "",
        plot(longest, dense, args.plot),
    ]
    print("\n".join(lines), flush=True)
    ok = all(compiled <= budget for *_, compiled in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
