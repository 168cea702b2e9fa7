"""Compile long-context causal GQA ring attention, forward + backward, for a TPU slice.

Runs the real TPU compiler (libtpu) on compile-only devices (`ringeqx.tools.target_mesh`), so
it needs `jax[tpu]` but no TPU. Prints the compile time, per-chip memory, whether the
scheduled HLO gathers anything, how many Mosaic kernels it calls and how many of the
ring's permutes enclose one (`ringeqx.tools.ring_overlap`).

    python benchmarks/aot_long_context.py --target v5p:4x4x4 --seq-len 1048576
"""

import argparse
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import ringeqx as rx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5p:4x4x4", help="TPU slice, e.g. v6e:4x4")
    parser.add_argument("--seq-len", type=int, default=2**20)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    a = parser.parse_args()

    mesh = rx.tools.target_mesh(a.target)
    sharded = NamedSharding(mesh, P(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, a.seq_len, a.heads, a.head_dim), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct(
        (1, a.seq_len, a.kv_heads, a.head_dim), jnp.bfloat16, sharding=sharded
    )

    def loss(q, k, v):
        # kernel="auto": the mesh's TPUs pick PallasTpuKernel.
        out = rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=mesh)
        return out.astype(jnp.float32).sum()

    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    start = time.perf_counter()
    compiled = program.lower(q, kv, kv).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    m = compiled.memory_analysis()
    gib = 2.0**30
    total = (
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    print(f"target {a.target} ({mesh.devices.size} chips, {mesh.devices.flat[0].device_kind})")
    print(
        f"seq_len {a.seq_len}, heads {a.heads}, kv_heads {a.kv_heads}, head_dim "
        f"{a.head_dim}, bfloat16, causal, forward + backward"
    )
    print(f"compile time: {seconds:.1f} s")
    print(
        f"per chip: arguments {m.argument_size_in_bytes / gib:.3f} GiB, outputs "
        f"{m.output_size_in_bytes / gib:.3f} GiB, temp {m.temp_size_in_bytes / gib:.3f} "
        f"GiB, total {total / gib:.3f} GiB"
    )
    print(f"all-gather in HLO: {'all-gather' in text}")
    mosaic = text.count('custom_call_target="tpu_custom_call"')
    print(f"Mosaic custom calls: {mosaic}")
    report = rx.tools.ring_overlap(text)
    enclosing = sum(p.overlaps for p in report.permutes)
    print(f"ring permutes enclosing a kernel: {enclosing} of {len(report.permutes)}")


if __name__ == "__main__":
    main()
