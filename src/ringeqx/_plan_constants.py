"""Calibrated counts of each term of the memory model (written by
`python benchmarks/plan_grid.py --calibrate`; do not edit by hand)."""

ATTENTION: dict[str, dict[str, float]] = {
    'p1-f16': {
        'const': 0.0372,
        'residuals': 3.9809,
    },
    'p1-f32': {
        'const': 0.2101,
        'residuals': 1.7498,
        'tile': 4.5892,
    },
    'p2-f16': {
        'in_flight': 0.429,
        'residuals': 3.5959,
        'tile': 2.4234,
    },
    'p2-f32': {
        'in_flight': 0.4726,
        'residuals': 2.112,
    },
    'pn-f16': {
        'const': 0.5802,
        'in_flight': 0.8802,
        'residuals': 3.3077,
        'tile': 3.3439,
    },
    'pn-f32': {
        'const': 0.0608,
        'kv32_tiled': 8.4157,
        'q32_tiled': 5.8713,
        'tile': 5.6077,
    },
}
LM: dict[str, dict[str, float]] = {
    'lm': {
        'attention': 0.0258,
        'in_flight': 0.9182,
        'logits': 2.337,
        'mlp': 6.8659,
    },
}

# The largest under-prediction seen in calibration, rounded up with 2% to spare:
# the planner keeps this fraction of the budget free.
HEADROOM: dict[str, float] = {'attention': 0.17, 'lm': 0.18}
