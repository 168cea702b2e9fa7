"""The compile-backed planner on 2 H100s (XLA's CUDA compiler, Triton, compiles every
probe)."""

from plan_cases import ATTENTION, check_longest_context, check_plans

import ringeqx as rx


def test_plans_for_h100():
    check_plans("h100:2", 2)


def test_longest_context_on_h100():
    check_longest_context("h100:2")


def test_one_gpu():
    # A ring of one GPU: the model calibrated for it against the compiler (uncalibrated,
    # it predicted the arguments and outputs alone).
    p = rx.plan(65536, 1, target="h100:1", **ATTENTION)
    assert 0 < p.compiled.total <= p.max_memory_usage
    assert abs(p.memory.total / p.compiled.total - 1) <= 0.15, (p.memory, p.compiled)
