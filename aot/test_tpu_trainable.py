"""Trainable score modifiers (their gradients: the ring's extra XLA pass
beside the Pallas kernels), compiled by libtpu for a 4-chip v5e slice."""

from ring_programs import compile_trainable

import ringeqx as rx


def test_trainable_modifier_grads_compile_for_v5e():
    mesh = rx.tools.target_mesh("v5e", "2x2")
    assert isinstance(rx.select_kernel(mesh=mesh), rx.PallasTpuKernel)
    compile_trainable(mesh)
