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
        "const": 0.3121,
        "in_flight": 0.184,
        "residuals": 1.4794,
        "tile": 3.9004,
    },
    "p2d-f16": {
        "in_flight": 1.5575,
        "q32": 6.3271,
        "tile": 3.1236,
    },
    "p2d-f32": {
        "const": 0.3433,
        "in_flight": 0.3194,
        "residuals": 2.3187,
        "tile": 3.8996,
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
        "attention": 0.1338,
        "const": -0.2857,
        "gradients": -1.6921,
        "in_flight": 0.4513,
        "logits": 2.2113,
        "mlp": 6.768,
        "stream": 1.692,
    },
}

# The largest under-prediction seen in calibration, rounded up with 2% to spare:
# the planner keeps this fraction of the budget free.
HEADROOM: dict[str, float] = {"attention": 0.1, "lm": 0.16}
