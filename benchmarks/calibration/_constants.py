"""Writes `src/ringeqx/tools/_planner/_constants.py` from the memory model's present tables
(every family), for `plan_grid.py` (the CPU's counts) and `plan_target_grid.py` (TPU's, GPU's)."""

import json
from pathlib import Path

from ringeqx.tools._planner import _model as _plan_model


SRC = Path(__file__).resolve().parents[2] / "src"
CONSTANTS = SRC / "ringeqx" / "tools" / "_planner" / "_constants.py"


def write_constants(family: str) -> None:
    """Write `family`'s tables from the model's present ones; the other families' are
    read from the file as it is now (another run may have refitted them meanwhile)."""
    now: dict = {}
    exec(CONSTANTS.read_text(), now)
    tables = {}
    for name in ("ATTENTION", "LM", "HEADROOM", "WIDTHS"):
        tables[name] = dict(now.get(name, {}))
        if family in getattr(_plan_model, name):
            tables[name][family] = getattr(_plan_model, name)[family]

    def table(name: str, kind: str) -> str:
        return f"{name}: {kind} = " + json.dumps(tables[name], indent=4, sort_keys=True)

    nested = "dict[str, dict[str, dict[str, float]]]"
    text = [
        '"""Calibrated counts of each term of the memory model, per family of compiler',
        "(`cpu`: `python benchmarks/calibration/plan_grid.py --calibrate`; `tpu`, `gpu`: `python",
        'benchmarks/calibration/plan_target_grid.py --fit`); do not edit by hand."""',
        "",
        table("ATTENTION", nested),
        table("LM", nested),
        "",
        "# Per family, the largest under-prediction seen in calibration, rounded up with 2%",
        "# to spare, of each kind (`attention`, `lm`; on accelerators `lm-p1`, an LM step on",
        "# one chip): the planner keeps this fraction of the budget free.",
        table("HEADROOM", "dict[str, dict[str, float]]"),
        "",
        "# Per accelerator family, the widest LM (`dim`, MLP `hidden`) its fit held: the",
        "# analytic planner refuses wider ones rather than extrapolate.",
        table("WIDTHS", "dict[str, dict[str, int]]"),
        "",
    ]
    CONSTANTS.write_text("\n".join(text))
