"""The planner's answers for one TPU v5e chip, checked by running them on a real one.

Two halves, on two machines:

```
# here, in the jax[tpu] venv (libtpu, compile-only "v5e:1x1"): the planner's answers
python benchmarks/calibration/plan_on_chip.py --plan  # -> plan_on_chip_v5e.json, beside it
python benchmarks/calibration/plan_on_chip.py --plan "attention 8:2 longest"  # one case again
# on a machine with one real TPU v5e chip: each answer compiled there and run
python benchmarks/calibration/plan_on_chip.py  # prints the table; --out FILE saves it
```

`--plan` asks [`ringeqx.tools.longest_context`][] for the longest context of ring attention
and of a `RingTransformerLM` training step on `"v5e:1x1"` (a single-chip v5e, as Cloud
TPU rents it), and [`ringeqx.tools.plan`][] for fixed lengths under each remat policy, and
saves each answer: the length, the remat, the analytic model's bytes and the compiler's.

On the chip, every saved program (and, for each longest context, the first length the
search refused) is planned again with the real chip standing in for the compile-only one,
compiled, given zero-filled arrays of its argument shapes and run three times (each
call's outputs freed before the next, as a training loop frees them), each in a process
of its own. The table compares the compile-only bytes with the real chip's compile
(`memory_analysis()`), next to what the runtime lets a program have (`bytes_limit`), says
whether it ran, and gives the allocator's peak of buffers (`peak_bytes_in_use`: the
arguments and outputs; the program's temporaries are not in it) and the step's time.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import ringeqx as rx
from ringeqx.tools import _targets
from ringeqx.tools._planner import _compiled as _plan_check


TARGET = "v5e:1x1"
SAVED = Path(__file__).with_name("plan_on_chip_v5e.json")
_GIB = 2**30

ATTENTION = dict(heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
# A 0.3B-parameter LM (Adam state included, 5 GiB), Llama-like proportions.
LM = dict(heads=16, kv_heads=8, dim=2048, num_layers=4, vocab_size=32000, hidden=5632)

# name -> (problem, remat, fixed seq_len or None for the longest context)
CASES = {
    "attention longest": (ATTENTION, None, None),
    # A quarter of the heads: past 240K tokens, where the TPU kernel runs as several calls.
    "attention 8:2 longest": (dict(ATTENTION, heads=8, kv_heads=2), None, None),
    "attention 64K": (ATTENTION, None, 65536),
    "lm longest, remat block": (LM, "block", None),
    "lm 8K, remat none": (LM, "none", 8192),
    "lm 8K, remat attention": (LM, "attention", 8192),
    "lm 8K, remat block": (LM, "block", 8192),
}


def _kwargs(problem: dict, remat) -> dict:
    kw = dict(problem)
    kw["dtype"] = jnp.dtype(kw.get("dtype", "float32"))
    if remat is not None:
        kw["remat"] = remat
    return kw


def _answer(plan: rx.tools.Plan) -> dict:
    c = plan.compiled
    return {
        "seq_len": plan.seq_len,
        "remat": plan.remat,
        "model": plan.memory.total,
        "compiled": {"arguments": c.arguments, "outputs": c.outputs, "temp": c.temp,
                     "total": c.total, "seconds": round(c.seconds, 1)},
    }  # fmt: skip


def plan_all(names: list[str]) -> dict:
    """The compile-only answers for `TARGET` (run where libtpu is installed), of the
    cases `names` (all if empty), the saved answers of the others kept."""
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"--plan: unknown cases {unknown}; expected some of {list(CASES)}")
    out = {"target": TARGET, "jax": jax.__version__, "cases": {}}
    if names and SAVED.exists():
        out["cases"] = json.loads(SAVED.read_text())["cases"]
    for name, (problem, remat, seq_len) in CASES.items():
        if names and name not in names:
            continue
        start = time.perf_counter()
        if seq_len is None:
            search = rx.tools.longest_context(TARGET, **_kwargs(problem, remat), log=None)
            entry = _answer(search.plan)
            refused = [n for n, _, ok in search.probes if not ok and n > search.plan.seq_len]
            entry["refused"] = min(refused) if refused else None
        else:
            entry = _answer(rx.tools.plan(seq_len, 1, target=TARGET, **_kwargs(problem, remat)))
        entry["search_seconds"] = round(time.perf_counter() - start, 1)
        out["cases"][name] = entry
        print(f"{name}: {entry}", flush=True)
    return out


def _use_attached_chip() -> None:
    """Let `TARGET` name the attached chip, so that a plan compiles (and can run) on it."""
    devices = jax.devices()
    if devices[0].platform != "tpu" or devices[0].device_kind != "TPU v5 lite":
        raise SystemExit(f"needs a TPU v5e chip; JAX has {devices[0].device_kind!r}")
    _targets._tpu_devices = lambda name: tuple(devices[:1])


def _zeros(spec):
    sharding = getattr(spec, "sharding", None)
    return jnp.zeros(spec.shape, spec.dtype, device=sharding)


def run_one(name: str, seq_len: int) -> dict:
    """Plan `name` at `seq_len` on the attached chip, compile it, run it three times."""
    _use_attached_chip()
    problem, remat, _ = CASES[name]
    # No budget: the refused lengths are compiled and tried too (the remat is pinned and
    # a target's tiles are its kernel's own, so this is the program the search compiled).
    try:
        plan = rx.tools.plan(
            seq_len, 1, target=TARGET, max_memory_usage=2**40, **_kwargs(problem, remat)
        )
    except rx.tools.NoFit as e:  # the real chip's compiler refused it: a result here
        return {"case": name, "seq_len": seq_len, "remat": remat, "model": None, "ran": False,
                "error": f"refused: {' '.join(str(e).split())[:600]}", "peak": None,
                "bytes_limit": None}  # fmt: skip
    mesh, layout = _plan_check._mesh(plan), _plan_check._layout(plan)
    lm = plan.kind == "lm"
    build = _plan_check._lm_program if lm else _plan_check._attention_program
    step, specs = build(plan, mesh, layout)
    chip = jax.devices()[0]
    result = {"case": name, "seq_len": seq_len, "remat": plan.remat, "model": plan.memory.total,
              "chip": chip.device_kind}  # fmt: skip
    try:
        start = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1, 2) if lm else ()).lower(*specs).compile()
        result["compile_seconds"] = round(time.perf_counter() - start, 1)
        stats = compiled.memory_analysis()
        result["chip_compiled"] = (
            stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes + stats.temp_size_in_bytes
        )  # fmt: skip
        args = jax.tree.map(_zeros, specs)
        before = chip.memory_stats()
        keys = ("bytes_in_use", "largest_free_block_bytes")
        result["before_run"] = {k: before.get(k) for k in keys}
        times, out = [], None
        for _ in range(3):
            # The last call's outputs go first, as a training loop lets them: kept, they
            # are a second set of outputs the program never planned for.
            out = None
            start = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
            if lm:  # the step donated params and Adam state: feed its outputs back
                params, m, v, count = out[1]
                args = (params, m, v, count, *args[4:])
        result["step_ms"] = round(1e3 * sorted(times[1:])[0], 2)
        result["ran"] = True
    except Exception as e:  # the real chip's refusal is a result here
        result["ran"] = False
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
    stats = chip.memory_stats()
    result["peak"] = stats.get("peak_bytes_in_use")
    result["bytes_limit"] = stats.get("bytes_limit")
    return result


def _row(entry: dict, saved: dict | None) -> str:
    gib = lambda b: "" if b is None else f"{b / _GIB:.2f}"  # noqa: E731
    compiled = None if saved is None else saved["compiled"]["total"]
    ran = "yes" if entry["ran"] else f"no ({entry['error'][:60]})"
    return (
        f"| {entry['case']} | {entry['seq_len']:,} | {entry['remat']} | {gib(entry['model'])} "
        f"| {gib(compiled)} | {gib(entry.get('chip_compiled'))} | {gib(entry['peak'])} "
        f"| {gib(entry['bytes_limit'])} | {ran} | {entry.get('step_ms', '')} |"
    )


def run_all(out_path: str | None, probe: list[str] | None) -> int:
    saved = json.loads(SAVED.read_text())
    runs = []
    for name, entry in saved["cases"].items():
        runs.append((name, entry["seq_len"], entry))
        if entry.get("refused"):
            runs.append((name, entry["refused"], None))
    if probe:  # one case at other lengths, instead
        runs = [(probe[0], int(n), None) for n in probe[1:]]
    print(f"# The planner's {TARGET} answers (compile-only, jax {saved['jax']}) run on a chip")
    # This process never opens the chip: only one process at a time can hold it.
    print(f"jax {jax.__version__}; each row a process of its own\n")
    print("| case | tokens | remat | model GiB | compile-only GiB | chip compile GiB "
          "| chip buffers peak GiB | chip limit GiB | ran | step ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    results, failures = [], 0
    for name, seq_len, entry in runs:
        cmd = [sys.executable, __file__, "--run", name, str(seq_len)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            print(f"| {name} | {seq_len:,} | failed: {done.stderr.strip()[-300:]} |")
            failures += 1
            continue
        result = json.loads(lines[-1])
        results.append(result)
        print(_row(result, entry), flush=True)
        if not result["ran"]:
            print(f"<!-- {result['error']}; before the run: {result.get('before_run')} -->")
        # A planned length must run; a refused one is only reported.
        failures += entry is not None and not result["ran"]
    if out_path:
        Path(out_path).write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", nargs="*", metavar="CASE",
                        help="compile-only answers (these cases; all without) -> JSON")  # fmt: skip
    parser.add_argument("--run", nargs=2, metavar=("CASE", "SEQ_LEN"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="on the chip: save the results as JSON here")
    parser.add_argument("--probe", nargs="+", metavar="ARG",
                        help="on the chip: CASE then lengths to run it at, instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.plan is not None:
        SAVED.write_text(json.dumps(plan_all(args.plan), indent=1) + "\n")
        return 0
    if args.run:
        print(json.dumps(run_one(args.run[0], int(args.run[1]))))
        return 0
    return run_all(args.out, args.probe)


if __name__ == "__main__":
    sys.exit(main())
