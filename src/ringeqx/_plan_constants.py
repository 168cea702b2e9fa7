"""Calibrated counts of each term of the memory model (written by
`python benchmarks/plan_grid.py --calibrate`; do not edit by hand)."""

ATTENTION: dict[str, dict[str, float]] = {
    "p1-f16": {
        "q32": 0.0674,
        "residuals": 3.9204,
        "tile": 1.0209,
    },
    "p1-f32": {
        "const": 0.1491,
        "q32": 1.9641,
        "residuals": 1.0172,
        "tile": 3.4419,
    },
    "p2-f16": {
        "in_flight": 0.7556,
        "q32": 0.3926,
        "residuals": 2.6183,
        "tile": 2.0919,
    },
    "p2-f32": {
        "q32": 0.4686,
        "residuals": 1.8729,
        "tile": 3.2194,
    },
    "pn-f16": {
        "const": 0.6276,
        "kv32_tiled": 8.5217,
        "q32_tiled": 4.4497,
        "tile": 3.1284,
    },
    "pn-f32": {
        "const": 0.3375,
        "in_flight": 0.9,
        "q32_tiled": 3.9824,
        "tile": 3.746,
    },
}
LM: dict[str, dict[str, float]] = {
    "lm": {
        "attention": 0.3418,
        "const": -0.2819,
        "gradients": -1.7177,
        "in_flight": 0.24,
        "logits": 2.2163,
        "mlp": 6.6194,
        "stream": 1.6549,
    },
}

# The largest under-prediction seen in calibration, rounded up with 2% to spare:
# the planner keeps this fraction of the budget free.
HEADROOM: dict[str, float] = {"attention": 0.29, "lm": 0.16}
