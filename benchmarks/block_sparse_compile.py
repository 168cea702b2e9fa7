"""Compile time of one BlockSparse ring (forward + `jax.grad`) against its block size.

The Pallas kernels give each pair of tiles the window of BlockSparse's map that the
tile's positions can meet, `(block_q / block_size + 1) x (block_kv / block_size + 1)`
entries packed into int32 words (`BlockSparse.tile_local`), and every word costs the
kernel a select per pair of tokens, unrolled in its body. So the compiler's work grows
with the words: at Mosaic's default 512 x 1024 tiles the tests' `block_size=4` map is
1037 words a tile, and a single ring with it does not compile in 10 minutes for TPU v5e
or v5p; at `block_size=64` (5 words) it compiles in seconds. The Triton kernels
(128 x 64 tiles, 18 words at `block_size=4`) take ~6 minutes on H100.

Runs the real compiler on compile-only devices (`ringeqx.tools.target_mesh`; needs `jax[tpu]`
or `jax[cuda12]`, no accelerator). Each block size is compiled in a process of its own
under `--timeout` seconds, so one that does not finish is reported and the next runs.

    python benchmarks/block_sparse_compile.py --target v5e --size 2x2 --block-sizes 64 32 16
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/block_sparse_compile.py \
        --target h100 --size 4 --block-sizes 64 16 4 --tiles 128 64
"""

import argparse
import math
import resource
import subprocess
import sys
import time


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _words(block: int, block_size: int, blocks: int) -> int:
    return min(blocks, math.ceil((block - 1) / block_size) + 1)


def compile_one(target: str, size: str, block_size: int, shard_len: int, tiles) -> None:
    """Compile the ring of one BlockSparse mask and print one line of results."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ringeqx as rx

    mesh = rx.tools.target_mesh(target, int(size) if size.isdigit() else size)
    seq = mesh.devices.size * shard_len
    blocks = -(-seq // block_size)
    i, j = np.indices((blocks, blocks))
    # An irregular map with the diagonal on (tests/helpers.py's block_pattern).
    mask = rx.BlockSparse(jnp.asarray(((i * 3 + j * 5) % 7 < 3) | (i == j)), block_size)
    kernel = rx.select_kernel(mesh=mesh)  # kernel="auto"'s choice for the mesh
    if tiles:
        kernel = type(kernel)(block_q=tiles[0], block_kv=tiles[1])
    if kernel.block_q is None or kernel.block_kv is None:
        window = "tiles from the kernel's table"
    else:
        rows = _words(kernel.block_q, block_size, blocks)
        cols = _words(kernel.block_kv, block_size, blocks)
        window = f"window {rows}x{cols} = {math.ceil(rows * cols / 32)} words"

    def loss(q, k, v):
        out = rx.ring_attention(q, k, v, mask=mask, mesh=mesh, kernel=kernel)
        return out.astype(jnp.float32).sum()

    spec = NamedSharding(mesh, P(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, seq, 4, 64), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.bfloat16, sharding=spec)
    start, cpu = time.perf_counter(), _cpu_seconds()
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    print(
        f"{target} {type(kernel).__name__}({kernel.block_q}x{kernel.block_kv}) "
        f"block_size {block_size}: {window}, compile {time.perf_counter() - start:.1f} s wall, "
        f"{_cpu_seconds() - cpu:.1f} s CPU",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e", help="v5e, v5p, v6e, h100, a100, ...")
    parser.add_argument("--size", default="2x2", help="TPU slice or GPU count")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[64, 32, 16])
    parser.add_argument("--shard-len", type=int, default=1100, help="tokens per device")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per compile")
    parser.add_argument("--tiles", type=int, nargs=2, metavar=("BLOCK_Q", "BLOCK_KV"),
                        help="the kernel's tiles (default: the mesh's kernel's own)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child's job
    a = parser.parse_args()
    if a.one is not None:
        compile_one(a.target, a.size, a.one, a.shard_len, a.tiles)
        return
    for block_size in a.block_sizes:
        command = [sys.executable, __file__, "--target", a.target, "--size", a.size,
                   "--shard-len", str(a.shard_len), "--one", str(block_size)]
        command += ["--tiles", *map(str, a.tiles)] if a.tiles else []
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"{a.target} block_size {block_size}: not compiled in {a.timeout:.0f} s",
                  flush=True)
            continue
        lines = [line for line in done.stdout.splitlines() if "block_size" in line]
        print(lines[-1] if lines else done.stderr.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
