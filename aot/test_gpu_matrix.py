"""Register spills of the Triton kernels, read from `ptxas` on the PTX that XLA's real
CUDA compiler emits for compile-only A100 (sm_80) and H100 (sm_90) meshes.

Spilled registers go to local memory (L1/L2): a kernel that spills is far slower than
the same kernel with tiles that fit. Interpret-mode tests cannot see this, so each
kernel (forward, dQ, dK/dV) is compiled here for the real targets and `ptxas -v` reads
its "bytes spill stores". Compile cost is per program, so each (GPU, dtype) compiles
one program holding every head_dim x GQA case.

Status: the 16-bit zero-spill assertion is a strict xfail until the default tiles are
chosen per dtype/head_dim (the table this test prints is the measurement to fix).
"""

import os
import re
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import ringeqx as rx


PTXAS = Path(jax.__file__).parents[1] / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
ARCH = {"a100": "sm_80", "h100": "sm_90a"}
ENTRIES = (
    "ringeqx_gpu_flash_forward",
    "ringeqx_gpu_flash_backward_dq",
    "ringeqx_gpu_flash_backward_dkv",
)
# Not tile multiples of the default 128 x 64 tiles.
SEQ = 300
HEAD_DIMS = (64, 128, 256)
GQA = ((4, 1), (2, 2))


def _records(length: int) -> rx.TokenInfo:
    pos = jnp.arange(length, dtype=jnp.int32)[None]
    return rx.TokenInfo(pos, pos // 97, jnp.full_like(pos, -1), pos < length - 3)


def _block_call(kernel, q, k, v):
    info = _records(q.shape[2])
    args = (info, info, rx.Causal(), None, 0.125)
    out, lse = kernel.forward(q, k, v, *args)
    delta = jnp.sum(out, axis=-1)
    return out, kernel.backward(q, k, v, lse, delta, out.astype(q.dtype), *args)


def _spills(gpu: str, dtype) -> dict[str, list[int]]:
    """`{entry: [spill store bytes of each compiled copy]}` of one program holding
    every head_dim x GQA case."""
    mesh = rx.target_mesh(gpu, 8)
    kernel = rx.PallasGpuKernel()
    cases = [(d, h, kh) for d in HEAD_DIMS for h, kh in GQA]
    sharding = NamedSharding(mesh, P())
    args = [
        [
            jax.ShapeDtypeStruct((1, h, SEQ, d), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((1, kh, SEQ, d), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((1, kh, SEQ, d), dtype, sharding=sharding),
        ]
        for d, h, kh in cases
    ]

    def program(args):
        return [_block_call(kernel, *qkv) for qkv in args]

    with tempfile.TemporaryDirectory() as dump:
        jax.jit(program).lower(args).compile(compiler_options={"xla_dump_to": dump})
        ptx = sorted(Path(dump).glob("*.ptx"))
        assert ptx, f"no PTX dumped for {gpu}"
        found: dict[str, list[int]] = {}
        for path in ptx:
            report = subprocess.run(
                [str(PTXAS), f"-arch={ARCH[gpu]}", "-v", str(path), "-o", os.devnull],
                capture_output=True, text=True, check=True,
            ).stderr
            for name, spill in re.findall(
                r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores",
                report, re.S,
            ):
                # XLA suffixes each copy of a kernel `__N`; other fusions are XLA's.
                base = re.sub(r"__\d+$", "", name)
                if base in ENTRIES:
                    found.setdefault(base, []).append(int(spill))
    for entry in ENTRIES:
        assert found.get(entry), f"{entry} not found in the PTX for {gpu}"
    return found


@pytest.mark.parametrize("gpu", ["a100", "h100"])
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            jnp.bfloat16,
            marks=pytest.mark.xfail(strict=True, reason="default tiles still spill"),
        ),
        pytest.param(
            jnp.float16,
            marks=pytest.mark.xfail(strict=True, reason="default tiles still spill"),
        ),
    ],
    ids=["bf16", "fp16"],
)
def test_16_bit_kernels_do_not_spill(gpu, dtype):
    found = _spills(gpu, dtype)
    print(gpu, jnp.dtype(dtype).name, {k: v for k, v in found.items()})
    assert all(max(found[e]) == 0 for e in ENTRIES), found


# At the default 128 x 64 tiles, head_dim 256 float32 asks Triton for 320 KiB of shared
# memory (H100 has 227 KiB per block): a compile error, not a spill, until the tiles
# are chosen per dtype/head_dim. (A100's 16-bit runs above fail likewise, not only
# by spilling: the reason strings there are too narrow.)
@pytest.mark.xfail(strict=True, reason="d=256 f32 exceeds shared memory at 128x64")
@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_float32_spill_table(gpu):
    found = _spills(gpu, jnp.float32)
    print(gpu, "float32", {k: v for k, v in found.items()})
