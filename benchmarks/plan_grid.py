"""The memory planner against XLA: predicted against compiled bytes per device over a grid.

Run: `python benchmarks/plan_grid.py` (compile only, nothing runs; 8 fake CPU devices).
For each configuration of the grid (N from 2K to 64K, P = 1, 2, 4, 8, masks, remat
policies, attention alone and an LM training step) it makes a plan with the knobs fixed,
compiles the planned program (`ringeqx.measure_memory`) and prints the predicted and the
compiled per-device totals and their relative error (goal: within 15%). Then, for each
configuration, it asks the planner for a plan under a budget (the compiled bytes of the
configuration at a middle setting) and checks that the planned program compiles under it.

`--calibrate` instead fits the model's constants (one count per term and regime, by
non-negative least squares on relative error) on a seeded random sample of
configurations and writes them to `src/ringeqx/_plan_constants.py`: first the attention
model, then, with it, the LM's.
"""

import argparse
import os
import random
import sys
import time


_DEVICE_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_FLAG}=8").strip()
# LLVM at -O0 (as the tests): compiles ~1/3 faster; buffer assignment, and so
# memory_analysis, is decided before code generation and does not change.
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx import _plan, _plan_model  # noqa: E402


MIB = 2**20
CONSTANTS = os.path.join(os.path.dirname(__file__), "..", "src", "ringeqx", "_plan_constants.py")
MASKS = {
    "causal": rx.Causal(),
    "full": rx.Full(),
    "window": rx.SlidingWindow(1024),
    "documents": rx.Causal() & rx.Document(),
}
HEADS = [(4, 4, 64), (8, 2, 64), (2, 1, 128)]
# (vocab, dim, layers, heads, kv_heads): at most 2 layers, since an LM step takes about a
# minute to compile on 2 cores and the per-layer terms scale with the layer count.
MODELS = [(512, 128, 2, 4, 4), (2048, 256, 2, 8, 2), (4096, 128, 1, 4, 4), (256, 64, 1, 2, 2)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def attention_config(rng: random.Random, lengths) -> dict:
    h, kh, d = rng.choice(HEADS)
    return dict(
        seq_len=rng.choice(lengths),
        num_devices=rng.choice([1, 2, 4, 8]),
        heads=h,
        kv_heads=kh,
        head_dim=d,
        batch=rng.choice([1, 2]),
        dtype=rng.choice(["float32", "bfloat16"]),
        mask=rng.choice(list(MASKS)),
        block_size=rng.choice([64, 128, 256, 512]),
    )


def lm_config(rng: random.Random, lengths) -> dict:
    vocab, dim, layers, h, kh = rng.choice(MODELS)
    return dict(
        seq_len=rng.choice(lengths),
        num_devices=rng.choice([1, 2, 4, 8]),
        heads=h,
        kv_heads=kh,
        vocab_size=vocab,
        dim=dim,
        num_layers=layers,
        mask=rng.choice(["causal", "documents", "window"]),
        block_size=rng.choice([128, 256]),
        remat=rng.choice(["none", "attention", "block"]),
    )


def make_plan(cfg: dict, budget: int = 2**44) -> rx.Plan:
    kwargs = dict(cfg, mask=MASKS[cfg["mask"]])
    return rx.plan(max_memory_usage=budget, **kwargs)


def measured_row(cfg: dict) -> dict:
    plan = make_plan(cfg)
    features, regime, io = _plan_model.terms(_plan.plan_problem(plan))
    start = time.perf_counter()
    measured = rx.measure_memory(plan)
    seconds = time.perf_counter() - start
    return dict(
        cfg=cfg,
        features=features,
        regime=regime,
        io=io,
        measured=measured,
        predicted=plan.memory.total,
        seconds=seconds,
    )


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per regime, the counts that minimise the relative error of the total (NNLS)."""
    from scipy.optimize import nnls

    out = {}
    for regime in sorted({r["regime"] for r in rows}):
        group = [r for r in rows if r["regime"] == regime]
        names = sorted(group[0]["features"])
        a = np.array([[r["features"][n] for n in names] for r in group], dtype=np.float64)
        b = np.array([r["measured"]["total"] - r["io"] for r in group], dtype=np.float64)
        w = 1.0 / np.array([r["measured"]["total"] for r in group], dtype=np.float64)
        coef, _ = nnls(a * w[:, None], b * w)
        out[regime] = {n: round(float(c), 4) for n, c in zip(names, coef) if c > 0}
        pred = a @ coef + np.array([r["io"] for r in group])
        err = pred / np.array([r["measured"]["total"] for r in group]) - 1
        log(f"  {regime}: {len(group)} points, error {err.min():+.3f} .. {err.max():+.3f}")
    return out


def write_constants(attention: dict, lm: dict) -> None:
    def block(name, table):
        lines = [f"{name}: dict[str, dict[str, float]] = {{"]
        for regime, coef in table.items():
            lines.append(f"    {regime!r}: {{")
            lines += [f"        {k!r}: {v!r}," for k, v in coef.items()]
            lines.append("    },")
        return lines + ["}"]

    text = [
        '"""Calibrated counts of each term of the memory model (written by',
        '`python benchmarks/plan_grid.py --calibrate`; do not edit by hand)."""',
        "",
        *block("ATTENTION", attention),
        *block("LM", lm),
        "",
    ]
    with open(CONSTANTS, "w") as f:
        f.write("\n".join(text))


def calibrate(args) -> int:
    rng = random.Random(args.seed)
    lengths = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    rows = []
    for i in range(args.attention_points):
        cfg = attention_config(rng, lengths)
        log(f"[attention {i + 1}/{args.attention_points}] {cfg}")
        rows.append(measured_row(cfg))
    if rows:
        attention = fit(rows)
        _plan_model.ATTENTION.clear()
        _plan_model.ATTENTION.update(attention)
        write_constants(attention, {})
    else:  # --attention-points 0: keep the attention constants, fit the LM's
        attention = dict(_plan_model.ATTENTION)
    lm_rows = []
    for i in range(args.lm_points):
        cfg = lm_config(rng, lengths)
        log(f"[lm {i + 1}/{args.lm_points}] {cfg}")
        lm_rows.append(measured_row(cfg))
    write_constants(attention, fit(lm_rows))
    log(f"wrote {os.path.relpath(CONSTANTS)}")
    return 0


def grid(args) -> list[dict]:
    """The validation grid: every N, P and mask for attention (both dtypes, tiles 256),
    and every N, P and remat policy for the LM (causal; documents and windows at 8K)."""
    out = []
    for n in args.lengths:
        for p in (1, 2, 4, 8):
            for mask in ("causal", "documents", "window", "full"):
                dtype = "bfloat16" if (n // 2048 + p) % 2 else "float32"
                out.append(
                    dict(
                        seq_len=n,
                        num_devices=p,
                        heads=8,
                        kv_heads=2,
                        head_dim=64,
                        dtype=dtype,
                        mask=mask,
                        block_size=256,
                    )
                )
            for remat in ("none", "attention", "block"):
                out.append(
                    dict(
                        seq_len=n,
                        num_devices=p,
                        heads=4,
                        kv_heads=4,
                        vocab_size=2048,
                        dim=256,
                        num_layers=2,
                        mask="causal",
                        block_size=256,
                        remat=remat,
                    )
                )
    return out


def budget_check(cfg: dict, row: dict) -> tuple[int, int, str]:
    """The planner's own choice under the configuration's compiled bytes: its program
    must compile under that budget."""
    budget = row["measured"]["total"]
    free = {k: v for k, v in cfg.items() if k not in ("block_size", "remat")}
    try:
        plan = make_plan(free, budget)
    except ValueError:
        return budget, 0, "no plan"
    measured = rx.measure_memory(plan)["total"]
    return budget, measured, f"{plan.remat}/{plan.block_q}"


def validate(args) -> int:
    cfgs = grid(args)
    lines = [
        "| kind | N | P | mask | dtype / remat | predicted MiB | compiled MiB | error | "
        "planned under budget (choice: compiled / budget MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors, ok = [], 0
    for i, cfg in enumerate(cfgs):
        log(f"[{i + 1}/{len(cfgs)}] {cfg}")
        row = measured_row(cfg)
        err = row["predicted"] / row["measured"]["total"] - 1
        errors.append(err)
        budget, used, choice = budget_check(cfg, row)
        ok += used <= budget
        kind = "lm" if "vocab_size" in cfg else "attention"
        knob = cfg.get("remat") or cfg.get("dtype")
        lines.append(
            f"| {kind} | {cfg['seq_len']} | {cfg['num_devices']} | {cfg['mask']} | {knob} | "
            f"{row['predicted'] / MIB:.1f} | {row['measured']['total'] / MIB:.1f} | "
            f"{err:+.1%} | {choice}: {used / MIB:.1f} / {budget / MIB:.1f} "
            f"{'PASS' if used <= budget else 'MISS'} |"
        )
    worst = max(abs(e) for e in errors)
    lines += [
        "",
        f"{len(cfgs)} configurations: |error| <= {worst:.1%} (mean {np.mean(errors):+.1%}), "
        f"{'PASS' if worst <= 0.15 else 'MISS'} (goal 15%); planned program under its "
        f"budget in {ok}/{len(cfgs)}.",
    ]
    print("\n".join(lines), flush=True)
    return 0 if worst <= 0.15 and ok == len(cfgs) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-points", type=int, default=80)
    parser.add_argument("--lm-points", type=int, default=24)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    args = parser.parse_args()
    jnp.zeros(())  # start the backend with the fake devices
    return calibrate(args) if args.calibrate else validate(args)


if __name__ == "__main__":
    sys.exit(main())
