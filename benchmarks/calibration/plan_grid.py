"""The memory planner against XLA: predicted against compiled bytes per device over a grid.

Run: `python benchmarks/calibration/plan_grid.py` (compile only, nothing runs; 8 fake CPU devices).
For each configuration of the grid (N from 2K to 64K, P = 1, 2, 4, 8, masks, remat
policies, attention alone and an LM training step) it makes a plan with the knobs fixed,
compiles the planned program (`ringeqx.tools.measure_memory`) and prints the predicted and the
compiled per-device totals and their relative error (goal: within 15%). Then, for each
configuration, it asks the planner for its own plan under a budget 15% above the
configuration's compiled bytes and checks that the planned program compiles under it.

`--calibrate attention` / `--calibrate lm` instead measure a seeded random sample of
configurations (`--points`, `--seed`) into
`benchmarks/calibration/plan_calibration_{kind}.json`, and
`--remeasure` compiles the saved sample again (after a kernel change) and refits;
`--tightest` plans an LM under each mask at the smallest budget the planner accepts and
compiles it (the budget promise);
`--refit` (which `--calibrate` runs at its end) fits the model's constants on the saved
measurements (one count per term and regime, by non-negative least squares on relative
error; the attention model first, then the LM's, whose features include the attention
model's prediction) and writes them to `src/ringeqx/tools/_planner/_constants.py`, with the
planner's headroom (the largest under-prediction seen, plus 2%).
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path


# `_devices` is shared with the other benchmarks, one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _devices import fake_cpu_devices  # noqa: E402


fake_cpu_devices(8)
# LLVM at -O0 (as the tests): compiles ~1/3 faster; buffer assignment, and so
# memory_analysis, is decided before code generation and does not change.
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _constants import CONSTANTS, write_constants  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx.tools._planner import _analytic, _model as _plan_model  # noqa: E402


MIB = 2**20
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


def attention_config(rng: random.Random, lengths, masks=None, devices=None) -> dict:
    h, kh, d = rng.choice(HEADS)
    return dict(
        seq_len=rng.choice(lengths),
        num_devices=rng.choice(devices or [1, 2, 4, 8]),
        heads=h,
        kv_heads=kh,
        head_dim=d,
        batch=rng.choice([1, 2]),
        dtype=rng.choice(["float32", "bfloat16"]),
        mask=rng.choice(masks or list(MASKS)),
        block_size=rng.choice([64, 128, 256, 512]),
    )


def lm_config(rng: random.Random, lengths, blocks=None) -> dict:
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
        block_size=rng.choice(blocks or [128, 256]),
        remat=rng.choice(["none", "attention", "block"]),
    )


def make_plan(cfg: dict, budget: int = 2**44) -> rx.tools.Plan:
    kwargs = dict(cfg, mask=MASKS[cfg["mask"]])
    return rx.tools.plan(max_memory_usage=budget, **kwargs)


def measured_row(cfg: dict) -> dict:
    plan = make_plan(cfg)
    features, regime, io = _plan_model.terms(_analytic.plan_problem(plan))
    start = time.perf_counter()
    measured = rx.tools.measure_memory(plan)
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


def fit(
    rows: list[dict], signed: tuple[str, ...] = ()
) -> tuple[dict[str, dict[str, float]], float]:
    """Per regime, the counts that minimise the relative error of the total, each
    non-negative but those of the `signed` terms (bounded least squares), and the
    largest under-prediction over all rows (the planner's headroom)."""
    from scipy.optimize import lsq_linear

    out, under = {}, 0.0
    for regime in sorted({r["regime"] for r in rows}):
        group = [r for r in rows if r["regime"] == regime]
        names = sorted(group[0]["features"])
        a = np.array([[r["features"][n] for n in names] for r in group], dtype=np.float64)
        b = np.array([r["measured"]["total"] - r["io"] for r in group], dtype=np.float64)
        w = 1.0 / np.array([r["measured"]["total"] for r in group], dtype=np.float64)
        lower = [-np.inf if n in signed else 0.0 for n in names]
        coef = lsq_linear(a * w[:, None], b * w, bounds=(lower, np.inf), method="bvls").x
        out[regime] = {n: round(float(c), 4) for n, c in zip(names, coef) if round(c, 4)}
        pred = a @ coef + np.array([r["io"] for r in group])
        err = pred / np.array([r["measured"]["total"] for r in group]) - 1
        under = max(under, float(np.max(1 / (1 + err) - 1)))
        log(f"  {regime}: {len(group)} points, error {err.min():+.3f} .. {err.max():+.3f}")
    return out, under


def _headroom(under: float) -> float:
    return round(float(np.ceil(under * 100) / 100 + 0.02), 2)


def _save(path: str, rows: list[dict]) -> None:
    import json

    keep = [{"cfg": r["cfg"], "measured": r["measured"]} for r in rows]
    with open(path, "w") as f:
        json.dump(keep, f, indent=1)


def _refit_rows(path: str) -> list[dict]:
    """Measured rows from `path`, their features recomputed with the present constants."""
    import json

    with open(path) as f:
        saved = json.load(f)
    rows = []
    for r in saved:
        features, regime, io = _plan_model.terms(_analytic.plan_problem(make_plan(r["cfg"])))
        rows.append(dict(r, features=features, regime=regime, io=io))
    return rows


def calibrate(args) -> int:
    """Measure a seeded sample of `args.kind` configurations into its JSON file."""
    rng = random.Random(args.seed)
    lengths = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    rows = []
    if args.append and os.path.exists(_data_path(args.kind)):
        rows = _refit_rows(_data_path(args.kind))
    lengths = args.calibration_lengths or lengths
    for i in range(args.points):
        if args.kind == "attention":
            cfg = attention_config(rng, lengths, args.calibration_masks, args.calibration_devices)
        else:
            cfg = lm_config(rng, lengths, args.calibration_blocks)
        log(f"[{args.kind} {i + 1}/{args.points}] {cfg}")
        rows.append(measured_row(cfg))
        _save(_data_path(args.kind), rows)
    return refit(args)


def tightest(args) -> int:
    """The planner's promise at its tightest: for an LM (2 layers, dim 128) under each
    mask, at 128 and 1024 tokens on 8 devices, the smallest budget the planner accepts
    (bisected) and what the planned step compiles to against it."""
    lm = dict(heads=4, kv_heads=4, dim=128, num_layers=2, vocab_size=512)
    worst = 0.0
    for n in (128, 1024):
        for name in ("causal", "documents", "window"):
            kw = dict(lm, mask=MASKS[name] if name != "window" else rx.SlidingWindow(64))
            lo, hi = 1, 2**36
            while hi - lo > max(1, lo // 1000):
                mid = (lo + hi) // 2
                try:
                    rx.tools.plan(n, 8, max_memory_usage=mid, **kw)
                    hi = mid
                except ValueError:
                    lo = mid
            p = rx.tools.plan(n, 8, max_memory_usage=hi, **kw)
            total = rx.tools.measure_memory(p)["total"]
            worst = max(worst, total / hi)
            print(f"N={n:5d} {name:9s}: tightest budget {hi / MIB:7.2f} MiB, predicted "
                  f"{p.memory.total / MIB:7.2f}, compiled {total / MIB:7.2f} MiB = "
                  f"{total / hi:.3f}x the budget", flush=True)  # fmt: skip
    print(f"worst: {worst:.3f}x the budget ({'kept' if worst <= 1 else 'BROKEN'})")
    return 0 if worst <= 1 else 1


def remeasure(args) -> int:
    """Measure every saved configuration again (after a change to what the programs
    allocate, such as a kernel's), then refit."""
    import json

    for kind in ("attention", "lm"):
        with open(_data_path(kind)) as f:
            saved = json.load(f)
        rows = []
        for i, r in enumerate(saved):
            log(f"[{kind} {i + 1}/{len(saved)}] {r['cfg']}")
            rows.append(measured_row(r["cfg"]))
            _save(_data_path(kind), rows + saved[i + 1 :])
    return refit(args)


def _data_path(kind: str) -> str:
    return os.path.join(os.path.dirname(__file__), f"plan_calibration_{kind}.json")


def refit(args) -> int:
    """Fit the constants on the saved measurements (attention first, then the LM's, whose
    features include the attention model's prediction) and write them."""
    headroom = _plan_model.HEADROOM.setdefault("cpu", {})
    if os.path.exists(_data_path("attention")):
        attention, under = fit(_refit_rows(_data_path("attention")))
        headroom["attention"] = _headroom(under)
        _plan_model.ATTENTION["cpu"] = attention
    if os.path.exists(_data_path("lm")):
        # Signed gradients: XLA reuses parameter-sized buffers (gradients, Adam's
        # temporaries) for activations once these are large, which a negative count of
        # them expresses. Every other count is non-negative: a free sign let the fit on
        # the skipped-tile kernel give attention's temporaries -0.6, which made larger
        # tiles look smaller to the planner.
        lm, under = fit(_refit_rows(_data_path("lm")), signed=("gradients", "const"))
        headroom["lm"] = _headroom(under)
        _plan_model.LM["cpu"] = lm
    write_constants("cpu")
    log(f"wrote {os.path.relpath(CONSTANTS)}")
    return 0


def grid(args) -> list[dict]:
    """The validation grid: for every N and P, attention (GQA 8/2 heads, tiles 256) under
    one mask and dtype (each in turn); for every LM length and P, an LM step (one remat
    policy in turn; causal)."""
    out = []
    masks, dtypes = ("causal", "documents", "window", "full"), ("float32", "bfloat16")
    remats = ("none", "attention", "block")
    for j, p in enumerate((1, 2, 4, 8)):
        for i, n in enumerate(args.lengths if "attention" in args.kinds else ()):
            out.append(
                dict(
                    seq_len=n,
                    num_devices=p,
                    heads=8,
                    kv_heads=2,
                    head_dim=64,
                    dtype=dtypes[(i + j) % 2],
                    mask=masks[(i + j) % 4],
                    block_size=256,
                )
            )
        for i, n in enumerate(args.lm_lengths if "lm" in args.kinds else ()):
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
                    remat=remats[(i + j) % 3],
                )
            )
    return out


def budget_check(cfg: dict, row: dict) -> tuple[int, int, str]:
    """The planner's own choice under a budget 15% above the configuration's compiled
    bytes: its program must compile under that budget."""
    budget = int(row["measured"]["total"] * 1.15)
    free = {k: v for k, v in cfg.items() if k not in ("block_size", "remat")}
    try:
        plan = make_plan(free, budget)
    except ValueError:
        return budget, 0, "no plan"
    same = plan.block_q == cfg["block_size"] and plan.remat == cfg.get("remat", "none")
    measured = row["measured"] if same else rx.tools.measure_memory(plan)
    return budget, measured["total"], f"{plan.remat}/{plan.block_q}"


def _budget_cell(choice: str, used: int, budget: int) -> str:
    if choice == "no plan":
        return f"no plan within {budget / MIB:.1f}"
    result = "PASS" if used <= budget else "MISS"
    return f"{choice}: {used / MIB:.1f} / {budget / MIB:.1f} {result}"


def validate(args) -> int:
    cfgs = grid(args)
    lines = [
        "| kind | N | P | mask | dtype / remat | predicted MiB | compiled MiB | error | "
        "planned under budget (choice: compiled / budget MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    errors, ok, planned = [], 0, 0
    for i, cfg in enumerate(cfgs):
        log(f"[{i + 1}/{len(cfgs)}] {cfg}")
        row = measured_row(cfg)
        err = row["predicted"] / row["measured"]["total"] - 1
        errors.append(err)
        budget, used, choice = budget_check(cfg, row)
        planned += choice != "no plan"
        ok += choice != "no plan" and used <= budget
        kind = "lm" if "vocab_size" in cfg else "attention"
        knob = cfg.get("remat") or cfg.get("dtype")
        lines.append(
            f"| {kind} | {cfg['seq_len']} | {cfg['num_devices']} | {cfg['mask']} | {knob} | "
            f"{row['predicted'] / MIB:.1f} | {row['measured']['total'] / MIB:.1f} | "
            f"{err:+.1%} | {_budget_cell(choice, used, budget)} |"
        )
    worst = max(abs(e) for e in errors)
    lines += [
        "",
        f"{len(cfgs)} configurations: |error| <= {worst:.1%} (mean {np.mean(errors):+.1%}), "
        f"{'PASS' if worst <= 0.15 else 'MISS'} (goal 15%); planned program under its "
        f"budget in {ok}/{planned} planned ({len(cfgs) - planned} without a plan).",
    ]
    print("\n".join(lines), flush=True)
    return 0 if worst <= 0.15 and ok == planned else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--calibrate",
        choices=("attention", "lm"),
        default=None,
        dest="kind",
        help="measure a sample of this kind into plan_calibration_KIND.json (beside this script), "
        "then refit",
    )
    parser.add_argument("--refit", action="store_true", help="refit on the saved data")
    parser.add_argument(
        "--remeasure", action="store_true", help="measure the saved sample again, then refit"
    )
    parser.add_argument(
        "--tightest", action="store_true", help="plans at their tightest budget, compiled"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--points", type=int, default=80)
    parser.add_argument("--append", action="store_true", help="add to the saved sample")
    parser.add_argument(
        "--calibration-lengths",
        type=int,
        nargs="+",
        default=None,
        help="N to sample from (default 1K .. 64K)",
    )
    parser.add_argument(
        "--calibration-masks", nargs="+", choices=list(MASKS), default=None, help="attention only"
    )
    parser.add_argument(
        "--calibration-devices", type=int, nargs="+", default=None, help="attention only"
    )
    parser.add_argument(
        "--calibration-blocks", type=int, nargs="+", default=None, help="LM only (default 128 256)"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536])
    parser.add_argument("--lm-lengths", type=int, nargs="+", default=[2048, 65536])
    parser.add_argument(
        "--kinds", nargs="+", choices=("attention", "lm"), default=["attention", "lm"]
    )
    args = parser.parse_args()
    jnp.zeros(())  # start the backend with the fake devices
    if args.refit:
        return refit(args)
    if args.remeasure:
        return remeasure(args)
    if args.tightest:
        return tightest(args)
    return calibrate(args) if args.kind else validate(args)


if __name__ == "__main__":
    sys.exit(main())
