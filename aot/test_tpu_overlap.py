"""The ring's schedule on a compile-only TPU v5p slice, read with `ring_overlap`, and the
Pallas kernels' declared cost against the model FLOPs.

Every ring step starts its hops (K/V with their records, and in the backward the dK/dV
of the previous step's blocks, one step behind) before the step's kernel and holds what
they deliver behind an optimization barrier with the kernel's results, so the kernel is
the work XLA's scheduler hides them behind. The check reads the scheduled loop bodies:
every collective-permute start..done in the forward and the backward body must enclose
a Mosaic kernel, for the cases the issue measured exposed (4K tokens per chip).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from ring_programs import lowered_ring_grad

import ringeqx as rx


PER_CHIP = 4096
SEQ = 4 * PER_CHIP
_SEGMENTS = jnp.asarray((np.arange(SEQ) // 3000)[None], jnp.int32)
# (name, mask, head_dim, more ring_attention arguments)
CASES = [
    ("causal_d64", rx.Causal(), 64, {}),
    ("full_softcap_d128", rx.Full(), 128, {"score_mod": rx.Softcap(30.0)}),
    (
        "causal_document_alibi_d64",
        rx.Causal() & rx.Document(),
        64,
        {
            "score_mod": rx.ALiBi(0.5 ** jnp.arange(1, 9, dtype=jnp.float32)),
            "segment_ids": _SEGMENTS,
        },
    ),
    ("prefix_lm_d64", rx.PrefixLM(1000), 64, {}),
    # Scaled float8 wires both ways: K/V bits, their scales and the records, then dK/dV
    # likewise (each stacked into one array, five permutes in all).
    # Two directions, half a shard each, one after the other in every step.
    ("bidirectional_d64", rx.Causal(), 64, {"config": rx.RingConfig(bidirectional=True)}),
    ("fp8_wires_d128", rx.Causal(), 128, {
        "config": rx.RingConfig(
            compression_dtype=jnp.float8_e4m3fn, grad_compression_dtype=jnp.float8_e4m3fn
        )
    }),
]


@pytest.mark.parametrize("name, mask, head_dim, ring", CASES, ids=[c[0] for c in CASES])
def test_every_ring_hop_encloses_a_kernel(name, mask, head_dim, ring):
    mesh = rx.tools.target_mesh("v5p", "2x2x1")
    lowered = lowered_ring_grad(
        mesh, mask, seq=SEQ, heads=8, kv_heads=2, head_dim=head_dim, **ring
    )
    report = rx.tools.ring_overlap(lowered.compile())
    print(name, report, sep="\n")
    directions = {p.direction for p in report.permutes}
    assert directions == {"forward", "backward"}, str(report)
    # K/V travel in the loop bodies (as they are, or as float8 bits stacked) ...
    n = PER_CHIP // 2 if "bidirectional" in name else PER_CHIP
    kv = (("bf16", (1, 2, n, head_dim)), ("u8", (2, 1, 2, n, head_dim)))
    assert any(a in kv for p in report.permutes for a in p.arrays), str(report)
    # ... and so do dK/dV in the backward's (float32, or float8 bits).
    dkv = (("f32", (1, 2, n, head_dim)), ("u8", (2, 1, 2, n, head_dim)))
    assert any(
        p.direction == "backward" and a in dkv for p in report.permutes for a in p.arrays
    ), str(report)
    assert report.all_overlap, str(report)


def test_declared_kernel_cost_is_the_model_flops():
    # One chip, one forward + backward of a block: no loop, so XLA's cost analysis
    # counts each kernel once.
    device = rx.tools.target_mesh("v5p", "2x2x1").devices.flat[0]
    mesh = Mesh(np.array([device]), ("x",))
    b, h, kh, n, d = 1, 8, 2, 2048, 128
    kernel = rx.PallasTpuKernel()
    pos = jnp.arange(n, dtype=jnp.int32)[None]

    def block(q, k, v):
        info = rx.TokenInfo(pos, jnp.zeros_like(pos), jnp.full_like(pos, -1), pos >= 0)
        args = (info, info, rx.Scores(rx.Full(), None, 0.125))
        out, lse = kernel.forward(q, k, v, *args)
        delta = jnp.sum(out, axis=-1)
        return out, kernel.backward(q, k, v, lse, delta, out.astype(q.dtype), *args)

    spec = NamedSharding(mesh, P())
    q = jax.ShapeDtypeStruct((b, h, n, d), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((b, kh, n, d), jnp.bfloat16, sharding=spec)
    with jax.set_mesh(mesh):  # Mosaic reads the TPU generation from the mesh
        compiled = jax.jit(block).lower(q, kv, kv).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # Forward 2 matmuls; the fused backward 5 (QK^T, dO V^T, P^T dO, dS^T Q, dS K).
    model = (4 + 10) * b * h * n * n * d
    print("declared", cost["flops"], "model", model)
    assert abs(cost["flops"] - model) / model < 0.10
