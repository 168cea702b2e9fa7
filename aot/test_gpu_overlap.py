"""The ring's schedule on compile-only H100s, read with `ring_overlap`.

XLA's GPU scheduler combines a step's permutes into one collective-permute. Each ring
step starts it before the step's Triton kernel (in the backward, the dK/dV of the
previous step's blocks travel with the K/V, one step behind) and holds what it delivers
behind an optimization barrier with the kernel's results, so in the forward and the
backward loop bodies every permute must enclose a kernel.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from ring_programs import lowered_ring_grad

import ringeqx as rx


PER_GPU = 4096
SEQ = 8 * PER_GPU
_SEGMENTS = jnp.asarray((np.arange(SEQ) // 3000)[None], jnp.int32)
CASES = [
    ("causal_d64", rx.Causal(), 64, {}),
    (
        "causal_document_alibi_fp8_wire_d128",
        rx.Causal() & rx.Document(),
        128,
        {
            "score_mod": rx.ALiBi(0.5 ** jnp.arange(1, 9, dtype=jnp.float32)),
            "segment_ids": _SEGMENTS,
            "config": rx.RingConfig(compression_dtype=jnp.float8_e4m3fn),
        },
    ),
]


@pytest.mark.parametrize("name, mask, head_dim, ring", CASES, ids=[c[0] for c in CASES])
def test_every_ring_hop_encloses_a_kernel_on_h100(name, mask, head_dim, ring):
    mesh = rx.tools.target_mesh("h100", 8)
    lowered = lowered_ring_grad(
        mesh, mask, seq=SEQ, heads=8, kv_heads=2, head_dim=head_dim, **ring
    )
    report = rx.tools.ring_overlap(lowered.compile())
    print(name, report, sep="\n")
    assert {p.direction for p in report.permutes} == {"forward", "backward"}, str(report)
    # The backward's hop carries the float32 dK/dV with K/V.
    assert any(
        p.direction == "backward" and ("f32", (1, 2, PER_GPU, head_dim)) in p.arrays
        for p in report.permutes
    ), str(report)
    assert report.all_overlap, str(report)
