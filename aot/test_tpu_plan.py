"""The compile-backed planner on a 4-chip TPU v5e slice (libtpu compiles every probe)."""

from plan_cases import check_longest_context, check_plans


def test_plans_for_v5e():
    check_plans("v5e:2x2", 4)


def test_longest_context_on_v5e():
    check_longest_context("v5e:2x2")
