"""Calibrated counts of each term of the memory model, per family of compiler
(`cpu`: `python benchmarks/plan_grid.py --calibrate`; `tpu`, `gpu`: `python
benchmarks/plan_target_grid.py --fit`); do not edit by hand."""

ATTENTION: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {
        "p1-f16": {
            "q32": 0.0674,
            "residuals": 3.9204,
            "tile": 1.0209
        },
        "p1-f32": {
            "const": 0.1491,
            "q32": 1.9641,
            "residuals": 1.0172,
            "tile": 3.4419
        },
        "p2-f16": {
            "in_flight": 0.7556,
            "q32": 0.3926,
            "residuals": 2.6183,
            "tile": 2.0919
        },
        "p2-f32": {
            "const": 0.3121,
            "in_flight": 0.184,
            "residuals": 1.4794,
            "tile": 3.9004
        },
        "p2d-f16": {
            "in_flight": 1.5575,
            "q32": 6.3271,
            "tile": 3.1236
        },
        "p2d-f32": {
            "const": 0.3433,
            "in_flight": 0.3194,
            "residuals": 2.3187,
            "tile": 3.8996
        },
        "pn-f16": {
            "const": 0.6276,
            "kv32_tiled": 8.5217,
            "q32_tiled": 4.4497,
            "tile": 3.1284
        },
        "pn-f32": {
            "const": 0.3375,
            "in_flight": 0.9,
            "q32_tiled": 3.9824,
            "tile": 3.746
        }
    },
    "gpu": {
        "p2-f16": {
            "in_flight": 0.3848,
            "residuals": 2.1597,
            "tile": 14.8475
        },
        "p2-f32": {
            "in_flight": 0.2521,
            "residuals": 1.5222
        },
        "pn-f16": {
            "in_flight": 0.4821,
            "q32_zigzag": 0.0334,
            "residuals": 2.2541,
            "tile": 1.7105
        },
        "pn-f32": {
            "in_flight": 0.2203,
            "residuals": 1.8264
        }
    },
    "tpu": {
        "p2-f16": {
            "in_flight": 1.8717,
            "residuals": 2.5889
        },
        "p2-f32": {
            "const": 136.3662,
            "q32": 6.1736,
            "tile": 9.545
        },
        "pn-f16": {
            "const": 17.9643,
            "in_flight": 2.1416,
            "q32_zigzag": 1.725,
            "residuals": 4.8668
        },
        "pn-f32": {
            "q32": 11.2658
        }
    }
}
LM: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {
        "lm": {
            "attention": 0.1338,
            "const": -0.2857,
            "gradients": -1.6921,
            "in_flight": 0.4513,
            "logits": 2.2113,
            "mlp": 6.768,
            "stream": 1.692
        }
    },
    "gpu": {
        "lm-attention": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "layer": 1.2529,
            "layer_weights": 0.4984,
            "logits": 1.7211,
            "mlp": 2.462,
            "stream": 0.0768,
            "weights": 0.2067
        },
        "lm-block": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "logits": 1.7211,
            "mlp": 2.132,
            "stream": 2.1729,
            "weights": 0.2572
        },
        "lm-none": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "logits": 1.7211,
            "stream": 22.5314
        },
        "lm-scan-attention": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "layer": 1.3548,
            "logits": 1.7211,
            "mlp": 0.4617,
            "stream": 6.4463,
            "weights": 0.2195
        },
        "lm-scan-block": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "layer": 1.4403,
            "layer_weights": 1.1019,
            "logits": 1.7211,
            "stream": 1.585
        },
        "lm-scan-none": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "logits": 1.7211,
            "mlp": 8.1281,
            "stream": 3.8871,
            "weights": 0.7165
        }
    },
    "tpu": {
        "lm-attention": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "layer": 1.2529,
            "layer_weights": 0.4984,
            "logits": 1.7211,
            "mlp": 2.462,
            "stream": 0.0768,
            "weights": 0.2067
        },
        "lm-block": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "logits": 1.7211,
            "mlp": 2.132,
            "stream": 2.1729,
            "weights": 0.2572
        },
        "lm-none": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "logits": 1.7211,
            "stream": 22.5314
        },
        "lm-scan-attention": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "layer": 1.3548,
            "logits": 1.7211,
            "mlp": 0.4617,
            "stream": 6.4463,
            "weights": 0.2195
        },
        "lm-scan-block": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "layer": 1.4403,
            "layer_weights": 1.1019,
            "logits": 1.7211,
            "stream": 1.585
        },
        "lm-scan-none": {
            "attention": 0.4988,
            "const": 89.8672,
            "gradients": 0.0903,
            "in_flight": 2.8066,
            "logits": 1.7211,
            "mlp": 8.1281,
            "stream": 3.8871,
            "weights": 0.7165
        }
    }
}

# Per family, the largest under-prediction seen in calibration, rounded up with 2%
# to spare: the planner keeps this fraction of the budget free.
HEADROOM: dict[str, dict[str, float]] = {
    "cpu": {
        "attention": 0.1,
        "lm": 0.16
    },
    "gpu": {
        "attention": 0.07,
        "lm": 0.19
    },
    "tpu": {
        "attention": 0.86,
        "lm": 0.07
    }
}
