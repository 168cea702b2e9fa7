"""The longest trainable context per cluster and model, answered by each target's
compiler (`ringeqx.tools.longest_context`), written into `docs/longest_context.md`.

Every row is a search over compiles (one compile a probe) on compile-only devices, so it
needs the target's compiler in the running environment: libtpu (`jax[tpu]`) for TPU
rows, the CUDA plugin (`jax[cuda12]`) for GPU rows; rows of the other kind are left for
a run in the other environment. Results accumulate in
`benchmarks/calibration/longest_context_table.json` (a row already there is not searched again;
`--redo` searches it again) and the docs table is rewritten from all of them.

    python benchmarks/calibration/longest_context_table.py --rows attention  # TPU venv, GPU venv
    python benchmarks/calibration/longest_context_table.py --rows 8b --targets v5p:2x2x2
    python benchmarks/calibration/longest_context_table.py --rows 8b-mixed --targets v5p:2x2x2 \
        --start-per-chip 65536
"""

import argparse
import json
import os
import re
import time
from pathlib import Path


os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx.tools._planner._problem import target_chips  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).with_name("longest_context_table.json")
DOC = ROOT / "docs" / "longest_context.md"

# Llama-3 shapes. "8b" and "70b" are float32 GELU LMs (the LM's first block): two
# matrices of 1.5x Llama's SwiGLU width (14336 for 8B, 28672 for 70B), as many
# parameters. "8b-mixed" is Llama-3-8B as Llama builds it and as it is trained: SwiGLU of
# 14336, RMSNorm without bias, rope_theta 500000 (`ringeqx.nn.LLAMA3_8B`), under
# `Precision.mixed()` (float32 parameters and Adam state, bfloat16 compute). The LMs'
# layers are scanned (`scan_layers=True`: one layer compiled, one layer's working memory
# in the backward).
MODELS = {
    "attention": dict(heads=32, kv_heads=8, head_dim=128),
    "8b": dict(
        heads=32, kv_heads=8, dim=4096, num_layers=32, vocab_size=128256, hidden=21504,
        scan_layers=True,
    ),
    "8b-mixed": dict(config=rx.nn.LLAMA3_8B, precision="mixed", scan_layers=True),
    "70b": dict(
        heads=64, kv_heads=8, dim=8192, num_layers=80, vocab_size=128256, hidden=43008,
        scan_layers=True,
    ),
}
TARGETS = ("v5p:2x2x2", "v5p:4x4x4", "v5p:4x8x8", "h100:8", "v5e:4x4", "v6e:4x4", "a100:8")
_START, _END = "<!-- longest-context table: start -->", "<!-- longest-context table: end -->"


def _platform(target: str) -> str:
    return "tpu" if target.startswith("v") else "gpu"


def _available(target: str) -> bool:
    """Whether this environment has the target's compiler."""
    try:
        rx.tools.target_mesh(target)
    except (ImportError, ValueError, RuntimeError):
        return False
    return True


def search(target: str, model: str, start_per_chip: int | None = None) -> dict:
    kw = dict(MODELS[model])
    if start_per_chip is not None:  # the first length tried: tokens a chip, times the chips
        kw["start"] = start_per_chip * target_chips(target)
    if model == "attention":
        kw["dtype"] = jnp.bfloat16
    start = time.perf_counter()
    try:
        found = rx.tools.longest_context(target, **kw, log=lambda s: print(f"  {s}", flush=True))
    except rx.tools.NoFit as e:  # the model's state alone exceeds a chip: no context fits
        assert e.before_compile, e
        return {
            "target": target,
            "model": model,
            "chips": target_chips(target),
            "seq_len": 0,
            "gib_per_chip": e.total / 2**30,
            "budget_gib": e.budget / 2**30,
            "remat": "-",
            "probes": 0,
            "wall_seconds": time.perf_counter() - start,
            "jax": jax.__version__,
        }
    p = found.plan
    return {
        "target": target,
        "model": model,
        "chips": p.num_devices * p.batch_devices,
        "seq_len": p.seq_len,
        "gib_per_chip": p.compiled.total / 2**30,
        "budget_gib": p.max_memory_usage / 2**30,
        "remat": p.remat,
        "probes": len(found.probes),
        "wall_seconds": time.perf_counter() - start,
        "jax": jax.__version__,
    }


def _tokens(n: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % (size // 8) == 0:
            return f"{n / size:g}{unit}"
    return f"{n:,}"


def render(rows: list[dict]) -> str:
    lines = [
        "| target | chips | model | longest context | GiB per chip (budget) | remat | "
        "compiles | search time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {t: i for i, t in enumerate(TARGETS)}
    def key(r):
        return list(MODELS).index(r["model"]), order.get(r["target"], 99)

    for r in sorted(rows, key=key):
        model = r["model"]
        if r["seq_len"] == 0:
            lines.append(
                f"| {r['target']} | {r['chips']} | {model} | none: parameters and Adam "
                f"state alone take {r['gib_per_chip']:.1f} GiB per chip | "
                f"{r['gib_per_chip']:.1f} ({r['budget_gib']:.0f}) | - | 0 | "
                f"{r['wall_seconds']:.0f} s |"
            )
            continue
        lines.append(
            f"| {r['target']} | {r['chips']} | {model} | {_tokens(r['seq_len'])} "
            f"({r['seq_len']:,}) | {r['gib_per_chip']:.1f} ({r['budget_gib']:.0f}) | "
            f"{r['remat']} | {r['probes']} | {r['wall_seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines)


def write_doc(rows: list[dict]) -> None:
    text = DOC.read_text()
    table = f"{_START}\n{render(rows)}\n{_END}"
    DOC.write_text(re.sub(re.escape(_START) + ".*?" + re.escape(_END), table, text, flags=re.S))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--redo", action="store_true", help="search rows already recorded")
    parser.add_argument(
        "--start-per-chip", type=int, default=None,
        help="first length tried, in tokens a chip (default: longest_context's 16 units)",
    )  # fmt: skip
    args = parser.parse_args()
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    done = {(r["target"], r["model"]) for r in rows}
    for model in args.rows:
        for target in args.targets:
            if (target, model) in done and not args.redo:
                continue
            if not _available(target):
                print(f"{target}: no {_platform(target)} compiler here; left for its venv")
                continue
            print(f"{target} {model}:", flush=True)
            row = search(target, model, args.start_per_chip)
            # Read again: another run (the other platform's venv) may have added rows.
            rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
            rows = [r for r in rows if (r["target"], r["model"]) != (target, model)] + [row]
            RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
            write_doc(rows)
            print(f"  -> {_tokens(row['seq_len'])} in {row['wall_seconds']:.0f} s", flush=True)
    write_doc(rows)


if __name__ == "__main__":
    main()
