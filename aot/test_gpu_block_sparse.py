"""BlockSparse on PallasGpuKernel compiles for real GPUs (XLA's CUDA compiler through the
CUDA plugin, compile-only H100 and A100 meshes): alone, `&` Causal and `|` PrefixLM,
forward and `jax.grad` of the ring, down to PTX.

The ring's default layout is one run of consecutive positions per shard (`Runs`), so
every kernel tile is exact for BlockSparse's per-tile window when traced and the program
holds no run-time check: a host callback, which a compile-only GPU cannot lower. The
three masks are one program per GPU (compile cost is per program), and the checks read
what the compiler emitted: the scheduled HLO's Triton calls and the PTX's entry points.
"""

import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from ring_programs import block_sparse_mask

import ringeqx as rx


SEQ, BLOCK = 4 * 1024, 256
WHICH = ("alone", "and_causal", "or_prefix")
ENTRIES = (
    "ringeqx_gpu_flash_forward",
    "ringeqx_gpu_flash_backward_dq",
    "ringeqx_gpu_flash_backward_dkv",
)
_TRITON = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')
_NAME = re.compile(r'\bname = "(ringeqx_gpu_flash_\w+)"')


def _compile(mesh, dump: str):
    """`jax.grad` of the sum of the three masks' rings (bfloat16, 4 heads of 64),
    compiled with XLA's dump in `dump`: the compiled text and seconds taken."""
    masks = [block_sparse_mask(which, SEQ, BLOCK) for which in WHICH]

    def loss(q, k, v):
        total = 0.0
        for n, mask in enumerate(masks):
            with jax.named_scope(f"ring{n}"):
                out = rx.ring_attention(q, k, v, mask=mask, mesh=mesh)
                total = total + out.astype(jnp.float32).sum()
        return total

    spec = NamedSharding(mesh, P(None, "sequence"))
    x = jax.ShapeDtypeStruct((1, SEQ, 4, 64), jnp.bfloat16, sharding=spec)
    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x)
    compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
    return lowered.as_text(), compiled.as_text(), time.perf_counter() - start


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_block_sparse_ring_compiles_to_ptx(gpu):
    mesh = rx.tools.target_mesh(gpu, 8)
    assert isinstance(rx.select_kernel(mesh=mesh), rx.PallasGpuKernel)
    with tempfile.TemporaryDirectory() as dump:
        lowered, text, seconds = _compile(mesh, dump)
        ptx = "\n".join(path.read_text() for path in Path(dump).glob("*.ptx"))
    print(f"{gpu}: BlockSparse x {len(WHICH)} masks, fwd + grad, compiled in {seconds:.1f} s")
    # No run-time check: the tiles are exact when traced.
    assert "callback" not in lowered and "xla_python" not in text
    # Each ring runs its forward kernel (in the forward pass, for the residuals) and
    # both backward kernels: every mask's calls are in the scheduled program.
    calls = [line for line in text.splitlines() if _TRITON.search(line)]
    for n in range(len(WHICH)):
        names = {_NAME.search(line).group(1) for line in calls if f"ring{n}" in line}
        assert names == set(ENTRIES), (n, names)
    # And Triton compiled them: each is an entry point of the PTX.
    for entry in ENTRIES:
        assert re.search(rf"\.entry {entry}(__\d+)?\(", ptx), f"{entry} not in the PTX"
