"""Resolve the `kernel=` argument of `ring_attention` to a kernel object."""

from typing import Literal

from ._base import AbstractAttentionKernel
from ._xla import XlaKernel


KernelName = Literal["auto", "xla"]


def select_kernel(kernel: KernelName | AbstractAttentionKernel) -> AbstractAttentionKernel:
    """Return the kernel object for `kernel` (a name or an `AbstractAttentionKernel`)."""
    if isinstance(kernel, AbstractAttentionKernel):
        return kernel
    match kernel:
        case "auto" | "xla":
            return XlaKernel()
        case _:
            raise ValueError(
                "`kernel` must be 'auto', 'xla' or an AbstractAttentionKernel; "
                f"got {kernel!r}."
            )
