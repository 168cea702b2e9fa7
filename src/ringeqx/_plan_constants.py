"""Calibrated counts of each term of the memory model (written by
`python benchmarks/plan_grid.py --calibrate`; do not edit by hand)."""

ATTENTION: dict[str, dict[str, float]] = {
    "p1-f16": {
        "q32": 0.0735,
        "residuals": 3.9117,
        "tile": 1.1879,
    },
    "p1-f32": {
        "q32": 3.5339,
        "residuals": 0.705,
        "tile": 4.7337,
    },
    "p2-f16": {
        "const": 0.1315,
        "in_flight": 0.3435,
        "residuals": 3.7761,
        "tile": 2.0018,
    },
    "p2-f32": {
        "q32": 0.1858,
        "residuals": 2.6735,
        "tile": 3.8145,
    },
    "pn-f16": {
        "const": 0.6571,
        "kv32_tiled": 8.1771,
        "q32_tiled": 5.2091,
        "tile": 3.2978,
    },
    "pn-f32": {
        "const": 0.2309,
        "in_flight": 1.0673,
        "q32_tiled": 6.0646,
        "tile": 4.3827,
    },
}
LM: dict[str, dict[str, float]] = {
    "lm": {
        "attention": 0.388,
        "const": -0.5159,
        "gradients": -1.5477,
        "in_flight": 0.2748,
        "logits": 2.1792,
        "mlp": 6.4811,
        "stream": 1.6203,
    },
}

# The largest under-prediction seen in calibration, rounded up with 2% to spare:
# the planner keeps this fraction of the budget free.
HEADROOM: dict[str, float] = {"attention": 0.24, "lm": 0.14}
