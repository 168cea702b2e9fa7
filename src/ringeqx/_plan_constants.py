"""Calibrated counts of each term of the memory model (written by
`python benchmarks/plan_grid.py --calibrate`; do not edit by hand)."""

ATTENTION: dict[str, dict[str, float]] = {}
LM: dict[str, dict[str, float]] = {}
