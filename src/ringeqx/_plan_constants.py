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
        "p1-f16": {
            "kv32_tiled": 1.0395,
            "residuals": 1.0064,
            "tile": 0.4897
        },
        "p1-f32": {
            "q32": 1.9982,
            "residuals": 0.1473
        },
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
        "p1-f16": {
            "kv_rows_lanes": 4.0419,
            "rows_lanes": 3.3142
        },
        "p1-f32": {
            "kv_rows_lanes": 4.0958,
            "rows_lanes": 3.688
        },
        "p2-f16": {
            "const": 22.2515,
            "in_flight": 0.2136,
            "kv_rows_lanes": 4.3812,
            "rows_lanes": 5.4694
        },
        "p2-f32": {
            "const": 112.5969,
            "rows_lanes": 6.9966
        },
        "pn-f16": {
            "in_flight": 2.4915,
            "residuals": 2.5411,
            "rows_lanes": 3.7014
        },
        "pn-f32": {
            "residuals": 0.6833,
            "rows_lanes": 7.3017
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
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer_weights": 0.7734,
            "logits": 1.699,
            "mlp": 1.4894,
            "sequence": 1.2553,
            "stream": 2.1624,
            "weights": 0.0695
        },
        "lm-attention-p1": {
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "logits": 1.9537,
            "mlp": 0.4563,
            "sequence": 3.6255,
            "stream": 3.7119
        },
        "lm-block": {
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer_weights": 0.587,
            "logits": 1.3341,
            "mlp": 1.2841,
            "sequence": 2.05,
            "stream": 4.4157
        },
        "lm-block-p1": {
            "attention": 0.7854,
            "const": 53.0108,
            "embedding": 0.2556,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "logits": 1.9054,
            "stream": 1.2066
        },
        "lm-none": {
            "attention": 0.7854,
            "const": 53.0108,
            "embedding": 0.0904,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "logits": 1.793,
            "mlp": 2.4945,
            "sequence": 1.6216,
            "stream": 9.5379
        },
        "lm-none-p1": {
            "attention": 0.7854,
            "const": 53.0108,
            "embedding": 0.3288,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "logits": 1.9557,
            "mlp": 2.3158,
            "stream": 6.2034
        },
        "lm-scan-attention": {
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer": 1.7856,
            "layer_weights": 0.0869,
            "logits": 1.69,
            "mlp": 0.7658,
            "sequence": 0.0975,
            "stream": 5.0339,
            "weights": 0.113
        },
        "lm-scan-attention-p1": {
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer_weights": 1.1548,
            "logits": 1.8372,
            "mlp": 1.7011,
            "stream": 2.1969,
            "weights": 0.3417
        },
        "lm-scan-block": {
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer_weights": 1.047,
            "logits": 1.7817,
            "mlp": 0.1157,
            "sequence": 0.5898,
            "stream": 1.3181,
            "weights": 0.0261
        },
        "lm-scan-block-p1": {
            "attention": 0.7854,
            "const": 53.0108,
            "embedding": 0.2148,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer_weights": 1.325,
            "logits": 1.8373,
            "stream": 1.2816,
            "weights": 0.5988
        },
        "lm-scan-none": {
            "attention": 0.7854,
            "const": 53.0108,
            "embedding": 0.2101,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "layer": 0.3658,
            "logits": 1.6499,
            "mlp": 6.454,
            "sequence": 0.0203,
            "stream": 11.0087,
            "weights": 0.3049
        },
        "lm-scan-none-p1": {
            "attention": 0.7854,
            "const": 53.0108,
            "gradients": 0.1737,
            "in_flight": 1.4741,
            "logits": 1.9579,
            "mlp": 6.0937,
            "stream": 11.9272,
            "weights": 0.4037
        }
    },
    "tpu": {
        "lm-attention": {
            "const": 69.1634,
            "embedding": 0.1402,
            "head_weight": 0.9659,
            "logits": 1.2316,
            "mlp": 0.7512,
            "sequence": 3.5339,
            "stacked": 0.3431
        },
        "lm-attention-p1": {
            "const": 69.1634,
            "embedding": 0.1489,
            "head_weight": 7.8559,
            "layer_weights": 1.9124,
            "logits": 1.126,
            "mlp": 1.1425,
            "stream": 3.1747
        },
        "lm-block": {
            "const": 69.1634,
            "head_weight": 3.4223,
            "logits": 1.0664,
            "sequence": 3.6767,
            "weights": 0.0649
        },
        "lm-block-p1": {
            "const": 69.1634,
            "embedding": 0.3893,
            "head_weight": 7.6817,
            "layer": 0.4817,
            "logits": 1.0919,
            "mlp": 0.4246
        },
        "lm-none": {
            "const": 69.1634,
            "layer": 0.9013,
            "logits": 1.5504,
            "mlp": 1.4504,
            "sequence": 1.079,
            "stacked": 0.7818,
            "stream": 3.8472
        },
        "lm-none-p1": {
            "const": 69.1634,
            "embedding": 0.37,
            "logits": 0.9757,
            "mlp": 0.4043,
            "sequence": 8.1821,
            "stream": 4.5917
        },
        "lm-scan-attention": {
            "const": 69.1634,
            "head_weight": 1.1126,
            "layer": 2.3396,
            "layer_weights": 0.1899,
            "logits": 1.2933,
            "mlp": 2.0399,
            "sequence": 0.4239,
            "stacked": 0.0706,
            "stream": 5.2588,
            "weights": 0.1426
        },
        "lm-scan-attention-p1": {
            "const": 69.1634,
            "embedding": 1.6039,
            "head_weight": 18.3037,
            "layer": 2.3556,
            "logits": 0.8307,
            "mlp": 3.2052,
            "stacked": 2.9693,
            "stream": 0.6435
        },
        "lm-scan-block": {
            "const": 69.1634,
            "layer": 1.1716,
            "logits": 1.0166,
            "sequence": 2.0364,
            "stacked": 2.1428,
            "stream": 1.2244,
            "weights": 0.0172
        },
        "lm-scan-block-p1": {
            "const": 69.1634,
            "embedding": 1.2594,
            "head_weight": 3.048,
            "logits": 0.5364,
            "sequence": 9.1843,
            "stacked": 1.6035,
            "stream": 2.4383
        },
        "lm-scan-none": {
            "const": 69.1634,
            "head_weight": 1.5468,
            "layer": 8.9156,
            "logits": 2.0133,
            "mlp": 5.6016,
            "stacked": 2.8916,
            "stream": 7.0218
        },
        "lm-scan-none-p1": {
            "const": 69.1634,
            "head_weight": 4.4388,
            "layer": 12.0684,
            "logits": 0.9342,
            "mlp": 1.8173,
            "stacked": 2.1945,
            "stream": 29.6441
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
        "lm": 0.26
    },
    "tpu": {
        "attention": 0.23,
        "lm": 0.27
    }
}

# Per accelerator family, the widest LM (`dim`, MLP `hidden`) its fit held: the
# analytic planner refuses wider ones rather than extrapolate.
WIDTHS: dict[str, dict[str, int]] = {
    "gpu": {
        "dim": 8192,
        "hidden": 45056
    },
    "tpu": {
        "dim": 8192,
        "hidden": 45056
    }
}
