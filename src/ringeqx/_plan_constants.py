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
            "attention": 0.7594,
            "const": 49.8042,
            "gradients": 0.2159,
            "in_flight": 1.5425,
            "layer_weights": 0.731,
            "logits": 1.692,
            "mlp": 1.4877,
            "sequence": 1.3172,
            "stream": 2.1314,
            "weights": 0.0668
        },
        "lm-block": {
            "attention": 0.7594,
            "const": 49.8042,
            "gradients": 0.2159,
            "in_flight": 1.5425,
            "layer_weights": 0.5341,
            "logits": 1.3281,
            "mlp": 1.2973,
            "sequence": 2.1368,
            "stream": 4.2727
        },
        "lm-none": {
            "attention": 0.7594,
            "const": 49.8042,
            "embedding": 0.0808,
            "gradients": 0.2159,
            "in_flight": 1.5425,
            "logits": 1.795,
            "mlp": 2.4803,
            "sequence": 1.6862,
            "stream": 9.4115
        },
        "lm-scan-attention": {
            "attention": 0.7594,
            "const": 49.8042,
            "gradients": 0.2159,
            "in_flight": 1.5425,
            "layer": 1.755,
            "layer_weights": 0.0389,
            "logits": 1.6828,
            "mlp": 0.7678,
            "sequence": 0.1962,
            "stream": 4.9819,
            "weights": 0.1121
        },
        "lm-scan-block": {
            "attention": 0.7594,
            "const": 49.8042,
            "gradients": 0.2159,
            "in_flight": 1.5425,
            "layer_weights": 1.0059,
            "logits": 1.7757,
            "mlp": 0.1183,
            "sequence": 0.6431,
            "stream": 1.2674,
            "weights": 0.0246
        },
        "lm-scan-none": {
            "attention": 0.7594,
            "const": 49.8042,
            "embedding": 0.194,
            "gradients": 0.2159,
            "in_flight": 1.5425,
            "layer": 0.3275,
            "logits": 1.6542,
            "mlp": 6.4531,
            "sequence": 0.0983,
            "stream": 10.9969,
            "weights": 0.2976
        }
    },
    "tpu": {
        "lm-attention": {
            "const": 105.6842,
            "embedding": 0.1366,
            "head_weight": 0.9731,
            "logits": 1.2183,
            "mlp": 0.7685,
            "sequence": 3.4923,
            "stacked": 0.3304
        },
        "lm-block": {
            "const": 105.6842,
            "head_weight": 3.4346,
            "logits": 1.0556,
            "sequence": 3.6603,
            "weights": 0.0625
        },
        "lm-none": {
            "const": 105.6842,
            "layer": 0.9157,
            "logits": 1.5437,
            "mlp": 1.4268,
            "sequence": 0.975,
            "stacked": 0.7308,
            "stream": 4.1415
        },
        "lm-scan-attention": {
            "const": 105.6842,
            "head_weight": 1.1145,
            "layer": 2.2151,
            "layer_weights": 0.1366,
            "logits": 1.2842,
            "mlp": 2.0748,
            "sequence": 0.5304,
            "stacked": 0.0887,
            "stream": 5.1055,
            "weights": 0.1446
        },
        "lm-scan-block": {
            "const": 105.6842,
            "layer": 1.2103,
            "logits": 1.0048,
            "sequence": 1.9999,
            "stacked": 2.0917,
            "stream": 1.2326,
            "weights": 0.0203
        },
        "lm-scan-none": {
            "const": 105.6842,
            "head_weight": 1.5784,
            "layer": 8.8373,
            "logits": 2.0101,
            "mlp": 5.6277,
            "stacked": 2.8801,
            "stream": 6.9247
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
