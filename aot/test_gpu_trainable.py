"""Trainable score modifiers (their gradients: the ring's extra XLA pass
beside the Triton kernels), compiled by XLA's CUDA compiler for 4 H100s."""

from ring_programs import compile_trainable

import ringeqx as rx


def test_trainable_modifier_grads_compile_for_h100():
    mesh = rx.tools.target_mesh("h100", 4)
    assert isinstance(rx.select_kernel(mesh=mesh), rx.PallasGpuKernel)
    compile_trainable(mesh)
