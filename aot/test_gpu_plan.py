"""The compile-backed planner on 2 H100s (XLA's CUDA compiler, Triton, compiles every
probe)."""

import pytest
from plan_cases import ATTENTION, check_longest_context, check_plans

import ringeqx as rx


def test_plans_for_h100():
    check_plans("h100:2", 2)


def test_longest_context_on_h100():
    check_longest_context("h100:2")


def test_one_gpu():
    # A ring of one GPU: the model calibrated for it against the compiler (uncalibrated,
    # it predicted the arguments and outputs alone).
    p = rx.tools.plan(65536, 1, target="h100:1", **ATTENTION)
    assert 0 < p.compiled.total <= p.max_memory_usage
    assert abs(p.memory.total / p.compiled.total - 1) <= 0.15, (p.memory, p.compiled)


def test_a_kernel_out_of_shared_memory_is_an_error_not_a_length_that_does_not_fit(
    monkeypatch,
):
    # 512 x 512 tiles at head_dim 128 ask Triton for more shared memory than an H100 has
    # (227 KiB): the CUDA compiler refuses them with RESOURCE_EXHAUSTED, as it refuses a
    # program larger than HBM. The planner must say that a kernel does not fit its tiles
    # (it said "Shorten the sequence", and `longest_context` would have searched shorter).
    from ringeqx._kernels._triton import _kernel as _pallas_gpu

    huge = _pallas_gpu._L(512, 512, 8, 2)
    tuned = dict(_pallas_gpu._TUNED)
    tuned[16, 128] = _pallas_gpu._kinds(huge, huge, huge)
    monkeypatch.setattr(_pallas_gpu, "_TUNED", tuned)
    with pytest.raises(ValueError, match="on-chip memory, not of HBM") as refused:
        rx.tools.plan(8192, 1, target="h100:1", **ATTENTION)
    assert "Shared memory size limit exceeded" in str(refused.value)
