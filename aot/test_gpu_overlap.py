"""The ring's schedule on compile-only H100s, read with `ring_overlap`.

Measured (benchmarks/RESULTS.md): XLA's GPU scheduler combines a step's permutes into one
collective-permute; in the forward loop body it encloses the step's Triton kernel, in the
backward body (K/V with the float32 dK/dV) it does not yet. This file asserts the forward
property and that the backward's permute is found; making the backward's overlap is open.
"""

from ring_programs import lowered_ring_grad

import ringeqx as rx


def test_forward_hop_encloses_its_kernel_on_h100():
    mesh = rx.target_mesh("h100", 8)
    seq = 8 * 4096

    lowered = lowered_ring_grad(
        mesh, rx.Causal(), seq=seq, heads=8, kv_heads=2, head_dim=64
    )
    compiled = lowered.compile()
    report = rx.ring_overlap(compiled)
    print(report)
    forward = [p for p in report.permutes if p.direction == "forward"]
    backward = [p for p in report.permutes if p.direction == "backward"]
    kv_shape = ("bf16", (1, 2, 4096, 64))
    assert forward and all(kv_shape in p.arrays for p in forward)
    assert all(p.overlaps for p in forward)
    # The backward carries the float32 dK/dV home with K/V.
    assert any(("f32", (1, 2, 4096, 64)) in p.arrays for p in backward)
