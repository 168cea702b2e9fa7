"""The compile-backed planner on a 4-chip TPU v5e slice (libtpu compiles every probe)."""

import pytest
from plan_cases import ATTENTION, check_longest_context, check_plans

import ringeqx as rx


def test_plans_for_v5e():
    check_plans("v5e:2x2", 4)


def test_longest_context_on_v5e():
    check_longest_context("v5e:2x2")


def test_one_chip_v5e():
    # A single-chip v5e: libtpu's own host layout for it, the budget its runtime allows
    # (a real chip's bytes_limit, below the published 16 GiB), and the model calibrated
    # for a ring of one against the compiler.
    p = rx.tools.plan(65536, 1, target="v5e:1x1", **ATTENTION)
    assert p.max_memory_usage == 16_909_336_064 and p.device == "tpu-v5e"
    assert 0 < p.compiled.total <= p.max_memory_usage
    assert abs(p.memory.total / p.compiled.total - 1) <= 0.15, (p.memory, p.compiled)


def test_a_kernel_out_of_vmem_is_an_error_not_a_length_that_does_not_fit(monkeypatch):
    # The kernels ask Mosaic for 1 MiB of scoped VMEM here, which no tile fits: libtpu
    # refuses them (RESOURCE_EXHAUSTED, as for HBM). The planner must say that a kernel
    # does not fit its tiles, not that the context is too long, which is what it said
    # of every RESOURCE_EXHAUSTED (and `longest_context` would have searched shorter).
    from ringeqx._kernels._mosaic import _calls

    monkeypatch.setattr(_calls, "_vmem_limit", lambda *a, **k: 2**20)
    with pytest.raises(ValueError, match="out of the chip's on-chip memory, not of HBM"):
        rx.tools.plan(8192, 1, target="v5e:1x1", **ATTENTION)
