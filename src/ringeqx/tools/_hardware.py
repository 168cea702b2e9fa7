"""The hardware table, the one place a chip is described: each accelerator's peak compute,
link bandwidth and memory per device (read by the planner's default budgets, the ring's
cost model and the communication report), its kind (TPU or GPU), the name
[`ringeqx.tools.target_mesh`][] knows it by, and a GPU's figures for its compile-only
description. `TARGETS` and `_targets.TPUS` / `GPUS` are read from it, so that a new chip
is one row here."""

from types import MappingProxyType
from typing import Literal, NamedTuple

import equinox as eqx

from .._util._numbers import as_int, as_number, check_positive, check_size


class GpuFigures(NamedTuple):
    """A GPU's published figures, as the CUDA compiler needs them (its compile-only
    description, `_targets.gpu_target_config`)."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    shared_per_sm: int  # bytes
    shared_per_block_optin: int  # bytes
    fp32_lanes_per_sm: int


class Hardware(eqx.Module):
    """Peak dense compute and one-direction link bandwidth of one accelerator.

    **Fields:**

    - `name`: a label.
    - `flops`: peak dense bf16 FLOP/s.
    - `bandwidth`: bytes/s one way on the link the ring uses.
    - `memory`: bytes of device memory (HBM) a program may use per JAX device, the
        default budget of [`ringeqx.tools.plan`][] (None where unknown).
    - `kind`: `"tpu"` or `"gpu"`: which compiler's programs (and which Pallas kernel)
        the chip runs (None where unknown).
    - `target`: the generation [`ringeqx.tools.target_mesh`][] makes compile-only
        devices of (`"v5e"`, `"h100"`), or None where it makes none.
    - `gpu`: a GPU target's published figures, which its compile-only description is
        written from (None for a TPU, whose libtpu describes it by name).

    Compression changes only what travels (K/V are cast back before the kernel runs), so
    the compute side is always the bf16 peak.
    """

    name: str = eqx.field(static=True)
    flops: int | float = eqx.field(static=True, converter=as_number)
    bandwidth: int | float = eqx.field(static=True, converter=as_number)
    memory: int | None = eqx.field(static=True, default=None, converter=as_int)
    kind: Literal["tpu", "gpu"] | None = eqx.field(static=True, default=None)
    target: str | None = eqx.field(static=True, default=None)
    gpu: GpuFigures | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        check_positive("Hardware flops", self.flops)
        check_positive("Hardware bandwidth", self.bandwidth)
        if self.memory is not None:
            check_size("Hardware memory", self.memory)
        if self.kind not in (None, "tpu", "gpu"):
            raise ValueError(f"`Hardware kind` must be 'tpu', 'gpu' or None; got {self.kind!r}.")
        if self.gpu is not None and self.kind != "gpu":
            raise ValueError(
                f"`Hardware gpu` figures describe a GPU: `kind` must be 'gpu'; got {self.kind!r}."
            )
        if self.target is not None and (self.kind == "gpu") != (self.gpu is not None):
            # A GPU target's compile-only devices are written from its figures.
            raise ValueError(
                f"`Hardware target` {self.target!r} needs `gpu` figures exactly when `kind` "
                f"is 'gpu'; got kind={self.kind!r}, gpu={self.gpu!r}."
            )


_KIB, _MIB, _GB, _GIB = 1024, 1024**2, 10**9, 2**30

# NVIDIA's data sheets and CUDA programming guide (compute capability tables):
# H100 SXM5: 132 SMs, 1.98 GHz boost, 80 GB HBM3 at 3.35 TB/s, 50 MB L2, 228 KB shared
# memory per SM (227 KB per block opt-in), 128 FP32 lanes per SM.
# H200 SXM: the H100's die with 141 GB HBM3e at 4.8 TB/s.
# A100 SXM4 80GB: 108 SMs, 1.41 GHz boost, 2.039 TB/s, 40 MB L2, 164 KB shared per SM
# (163 KB per block opt-in), 64 FP32 lanes per SM.
_H100 = GpuFigures(
    "NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 80 * _GB, 3.35e12, 50 * _MIB,
    228 * _KIB, 227 * _KIB, 128,
)  # fmt: skip
_H200 = GpuFigures(
    "NVIDIA H200", (9, 0), 132, 1.98, 141 * _GB, 4.8e12, 50 * _MIB, 228 * _KIB, 227 * _KIB, 128
)  # fmt: skip
_A100 = GpuFigures(
    "NVIDIA A100-SXM4-80GB", (8, 0), 108, 1.41, 80 * _GB, 2.039e12, 40 * _MIB,
    164 * _KIB, 163 * _KIB, 64,
)  # fmt: skip


def _gpu(
    name: str, flops: float, bandwidth: float, figures: GpuFigures, target: str | None
) -> Hardware:
    """A GPU's row: its memory is its compile-only description's (what XLA is told), one
    figure, not two."""
    return Hardware(name, flops, bandwidth, figures.memory_bytes, "gpu", target, figures)


# Memory per JAX device: the GPUs' from their compile-only figures (A100/H100 80e9 bytes;
# 80 GiB here promised plans 7% past it), H200 141e9; TPU v3 16 GiB per core (a JAX
# device), v4 32 GiB, v5p 95 GiB per chip. v5e and v6e: what their runtime lets a
# program have, below the published 16 and 32 GiB, so that a plan under it runs: a real v5e chip's
# `memory_stats()["bytes_limit"]`, which is also libtpu's compile-only "available HBM (15.75G)";
# v6e's libtpu figure (31.25G), less 4 MiB for its rounding.
# The first five's FLOP rates and links are the Ring Attention paper's Table 2 constants;
# H100/H200 (SXM, NVLink 4: 900 GB/s both ways), v5p (ICI 4,800 Gbps per chip) and v6e
# are vendor peaks. Targets: the TPU generations libtpu describes by name (`"v5p"` for
# `v5p:XxYxZ` slices; not v3 or v4, whose chips it describes as two devices each) and
# the GPUs written from their figures (A100 once: its NVLink row).
HARDWARE = {
    "a100-nvlink": _gpu("A100 NVLink", 312e12, 300e9, _A100, "a100"),
    "a100-infiniband": _gpu("A100 InfiniBand", 312e12, 12.5e9, _A100, None),
    "tpu-v3": Hardware("TPU v3", 123e12, 112e9, 16 * _GIB, "tpu"),
    "tpu-v4": Hardware("TPU v4", 275e12, 268e9, 32 * _GIB, "tpu"),
    "tpu-v5e": Hardware("TPU v5e", 197e12, 186e9, 16_909_336_064, "tpu", "v5e"),
    "tpu-v5p": Hardware("TPU v5p", 459e12, 600e9, 95 * _GIB, "tpu", "v5p"),
    # v6e (Trillium): 918 TFLOP/s bf16, ICI 3,584 Gbps per chip, 32 GiB HBM.
    "tpu-v6e": Hardware("TPU v6e", 918e12, 448e9, int(31.25 * _GIB) - 4 * 2**20, "tpu", "v6e"),
    "h100": _gpu("H100 NVLink", 989e12, 450e9, _H100, "h100"),
    "h200": _gpu("H200 NVLink", 989e12, 450e9, _H200, "h200"),
}


def _targets() -> "MappingProxyType[str, str]":
    """Each target generation -> the key of its row, read from the table (a generation
    named twice would make `target` ambiguous: an internal error)."""
    found = {hw.target: key for key, hw in HARDWARE.items() if hw.target is not None}
    assert len(found) == sum(hw.target is not None for hw in HARDWARE.values()), found
    return MappingProxyType(found)


TARGETS = _targets()
"""A target generation (as [`ringeqx.tools.target_mesh`][] names it: `"v5e"`, `"h100"`)
-> its row's key in `HARDWARE` (the planner's device profile)."""
