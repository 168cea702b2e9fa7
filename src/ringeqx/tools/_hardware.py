"""The hardware table: each accelerator's peak compute, link bandwidth and memory per
device, read by the planner (default budgets), the ring's cost model and the
communication report."""

import equinox as eqx

from .._util._numbers import as_int, as_number, check_positive, check_size
from ._targets import GPUS


class Hardware(eqx.Module):
    """Peak dense compute and one-direction link bandwidth of one accelerator.

    **Fields:**

    - `name`: a label.
    - `flops`: peak dense bf16 FLOP/s.
    - `bandwidth`: bytes/s one way on the link the ring uses.
    - `memory`: bytes of device memory (HBM) a program may use per JAX device, the
        default budget of [`ringeqx.tools.plan`][] (None where unknown).

    Compression changes only what travels (K/V are cast back before the kernel runs), so
    the compute side is always the bf16 peak.
    """

    name: str = eqx.field(static=True)
    flops: int | float = eqx.field(static=True, converter=as_number)
    bandwidth: int | float = eqx.field(static=True, converter=as_number)
    memory: int | None = eqx.field(static=True, default=None, converter=as_int)

    def __check_init__(self):
        check_positive("Hardware flops", self.flops)
        check_positive("Hardware bandwidth", self.bandwidth)
        if self.memory is not None:
            check_size("Hardware memory", self.memory)


_GIB = 2**30

# Memory per JAX device: the GPUs' from their compile-only descriptions (`_targets.GPUS`, what XLA
# is told: A100/H100 80e9 bytes; 80 GiB here promised plans 7% past it), H200 141e9; TPU v3 16 GiB
# per core (a JAX device), v4 32 GiB, v5p 95 GiB per chip. v5e and v6e: what their runtime lets a
# program have, below the published 16 and 32 GiB, so that a plan under it runs: a real v5e chip's
# `memory_stats()["bytes_limit"]`, which is also libtpu's compile-only "available HBM (15.75G)";
# v6e's libtpu figure (31.25G), less 4 MiB for its rounding.
# The first five's FLOP rates and links are the Ring Attention paper's Table 2 constants;
# H100/H200 (SXM, NVLink 4: 900 GB/s both ways), v5p (ICI 4,800 Gbps per chip) and v6e
# are vendor peaks.
HARDWARE = {
    "a100-nvlink": Hardware("A100 NVLink", 312e12, 300e9, GPUS["a100"].memory_bytes),
    "a100-infiniband": Hardware("A100 InfiniBand", 312e12, 12.5e9, GPUS["a100"].memory_bytes),
    "tpu-v3": Hardware("TPU v3", 123e12, 112e9, 16 * _GIB),
    "tpu-v4": Hardware("TPU v4", 275e12, 268e9, 32 * _GIB),
    "tpu-v5e": Hardware("TPU v5e", 197e12, 186e9, 16_909_336_064),
    "tpu-v5p": Hardware("TPU v5p", 459e12, 600e9, 95 * _GIB),
    # v6e (Trillium): 918 TFLOP/s bf16, ICI 3,584 Gbps per chip, 32 GiB HBM.
    "tpu-v6e": Hardware("TPU v6e", 918e12, 448e9, int(31.25 * _GIB) - 4 * 2**20),
    "h100": Hardware("H100 NVLink", 989e12, 450e9, GPUS["h100"].memory_bytes),
    "h200": Hardware("H200 NVLink", 989e12, 450e9, GPUS["h200"].memory_bytes),
}
