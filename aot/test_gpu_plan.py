"""The compile-backed planner on 2 H100s (XLA's CUDA compiler, Triton, compiles every
probe)."""

from plan_cases import check_longest_context, check_plans


def test_plans_for_h100():
    check_plans("h100:2", 2)


def test_longest_context_on_h100():
    check_longest_context("h100:2")
