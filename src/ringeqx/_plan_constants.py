"""Calibrated counts of each term of the memory model, per family of compiler
(`cpu`: `python benchmarks/plan_grid.py --calibrate`; `tpu`, `gpu`: `python
benchmarks/plan_target_grid.py --fit`); do not edit by hand."""

ATTENTION: dict[str, dict[str, dict[str, float]]] = {
    "cpu": {
        "p1-f16": {
            "kv32": 1.1627,
            "q32": 2.1323,
            "q32_zigzag": 0.0664,
            "residuals": 2.071,
            "tile": 2.0158
        },
        "p1-f32": {
            "q32": 0.9303,
            "q32_tiled": 0.9303,
            "q32_zigzag": 0.4063,
            "residuals": 1.023,
            "tile": 3.4682
        },
        "p2-f16": {
            "const": 0.2778,
            "in_flight": 1.0873,
            "kv32": 0.1812,
            "kv32_tiled": 0.1812,
            "q32": 1.4222,
            "q32_tiled": 1.4222,
            "tile": 1.6818
        },
        "p2-f32": {
            "const": 0.449,
            "in_flight": 0.3076,
            "residuals": 1.4086,
            "tile": 3.1355
        },
        "p2d-f16": {
            "in_flight": 1.179,
            "q32": 2.5474,
            "tile": 3.2459
        },
        "p2d-f32": {
            "const": 7.7151,
            "in_flight": 0.6366,
            "kv32": 0.0796,
            "kv32_tiled": 0.0796,
            "q32": 1.3734,
            "q32_tiled": 1.3734,
            "tile": 2.9112
        },
        "pn-f16": {
            "const": 0.4537,
            "in_flight": 1.2731,
            "kv32": 0.2122,
            "kv32_tiled": 0.7161,
            "q32": 0.5084,
            "q32_tiled": 2.5239,
            "tile": 2.9805
        },
        "pn-f32": {
            "const": 0.3532,
            "in_flight": 0.499,
            "kv32_tiled": 2.8482,
            "q32_tiled": 2.6651,
            "residuals": 0.4535,
            "tile": 3.9368
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
            "const": -0.5788,
            "gradients": -1.412,
            "in_flight": 1.7184,
            "logits": 2.1324,
            "mlp": 6.6292,
            "stream": 1.6573
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
        "attention": 0.12,
        "lm": 0.14
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
