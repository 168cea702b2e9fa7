"""Calibrated counts of each term of the memory model (written by
`python benchmarks/plan_grid.py --calibrate`; do not edit by hand)."""

ATTENTION: dict[str, dict[str, float]] = {
    "p1-f16": {
        "kv32_tiled": 3.904,
        "q32": 6.0172,
        "tile": 1.2279,
    },
    "p1-f32": {
        "q32": 2.689,
        "residuals": 0.8964,
        "tile": 4.8038,
    },
    "p2-f16": {
        "const": 0.14,
        "in_flight": 0.3453,
        "residuals": 3.7714,
        "tile": 1.9999,
    },
    "p2-f32": {
        "q32": 0.366,
        "residuals": 2.6466,
        "tile": 3.7981,
    },
    "pn-f16": {
        "const": 0.6761,
        "in_flight": 0.8213,
        "residuals": 3.3534,
        "tile": 3.4019,
    },
    "pn-f32": {
        "in_flight": 1.0909,
        "q32_tiled": 5.7231,
        "tile": 5.6316,
        "tile_single": 4.7513,
    },
}
LM: dict[str, dict[str, float]] = {
    "lm": {
        "attention": 0.33,
        "const": -0.3793,
        "gradients": -1.5799,
        "in_flight": 0.2487,
        "logits": 2.1908,
        "mlp": 6.5461,
        "stream": 1.6365,
    },
}

# The largest under-prediction seen in calibration, rounded up with 2% to spare:
# the planner keeps this fraction of the budget free.
HEADROOM: dict[str, float] = {"attention": 0.23, "lm": 0.14}
