"""The ring's analytic cost (the Ring Attention paper's model): FLOPs and bytes per ring
step, and the shortest shard whose compute hides its transfer on each chip."""

import math

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._util._numbers import as_int, as_number, check_positive, check_size
from ._hardware import HARDWARE, Hardware


def _check_heads(heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise ValueError(
            f"`heads` must be a multiple of `kv_heads`; got heads={heads}, kv_heads={kv_heads}."
        )


def float_itemsize(name: str, dtype) -> int:
    """Bytes per element of the floating dtype `dtype` names; a ValueError naming
    `name` for anything else."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"`{name}` must be a floating dtype (jnp.bfloat16, jnp.float8_e4m3fn, ...); "
            f"got {dtype!r}."
        )
    return dt.itemsize


class RingCost(eqx.Module):
    r"""The ring's analytic cost per step and per device (the Ring Attention paper's
    model, extended to GQA and to the payload's dtype).

    With $c$ tokens per shard, $h$ query heads, $h_{kv}$ kv heads, head dim $d$ and $b$
    bytes per K/V element, one forward step computes $4 c^2 d h$ FLOPs (two matmuls) and
    sends K and V: $2 c d h_{kv} b$ bytes. Communication hides behind compute when
    $4 c^2 d h / F \ge 2 c d h_{kv} b / B$, that is for
    $c \ge \frac{h_{kv} b}{2h} \frac{F}{B}$: $F/B$ for multi-head attention in bf16
    (the paper's "minimal block size"), $1/g$ of it for GQA groups of $g$, half of it for
    fp8. The backward step computes about $10 c^2 d h$ FLOPs and sends K/V plus dK/dV.
    Masks that skip blocks (causal) lower the compute, not the traffic.

    **Fields:** `seq_len`, `num_devices`, `heads`, `kv_heads`, `head_dim`, `kv_bytes`
    (bytes per K/V element as sent), `grad_bytes` (bytes per dK/dV element as sent).
    """

    seq_len: int = eqx.field(static=True, converter=as_int)
    num_devices: int = eqx.field(static=True, converter=as_int)
    heads: int = eqx.field(static=True, converter=as_int)
    kv_heads: int = eqx.field(static=True, converter=as_int)
    head_dim: int = eqx.field(static=True, converter=as_int)
    kv_bytes: int | float = eqx.field(static=True, default=2, converter=as_number)
    grad_bytes: int | float = eqx.field(static=True, default=4, converter=as_number)

    def __check_init__(self):
        for name in ("seq_len", "num_devices", "heads", "kv_heads", "head_dim"):
            check_size(f"RingCost {name}", getattr(self, name))
        _check_heads(self.heads, self.kv_heads)
        check_positive("RingCost kv_bytes", self.kv_bytes)
        check_positive("RingCost grad_bytes", self.grad_bytes)

    @property
    def shard(self) -> int:
        return self.seq_len // self.num_devices

    def step_bytes(self, backward: bool = False) -> float:
        """Bytes one device sends per ring step (K and V; with dK and dV backward)."""
        kv = 2 * self.shard * self.kv_heads * self.head_dim
        return float(kv * (self.kv_bytes + (self.grad_bytes if backward else 0)))

    def step_flops(self, backward: bool = False) -> float:
        """FLOPs one device computes per ring step (no block skipped)."""
        return float((10 if backward else 4) * self.shard**2 * self.head_dim * self.heads)

    def intensity(self, backward: bool = False) -> float:
        """FLOPs per byte sent: compare with a chip's FLOP/s per byte/s."""
        return self.step_flops(backward) / self.step_bytes(backward)

    def min_shard(self, hw: Hardware, backward: bool = False) -> int:
        """The smallest tokens per shard whose compute hides the transfer on `hw`."""
        flops = hw.flops
        per_token_bytes = self.step_bytes(backward) / self.shard
        per_token2_flops = self.step_flops(backward) / self.shard**2
        return math.ceil(per_token_bytes * flops / (per_token2_flops * hw.bandwidth))

    def hides(self, hw: Hardware, backward: bool = False) -> bool:
        """Whether this shard's compute takes at least as long as its transfer on `hw`."""
        return self.shard >= self.min_shard(hw, backward)


def table2(
    heads: int = 1, kv_heads: int = 1, kv_dtype: DTypeLike = jnp.bfloat16
) -> dict[str, tuple[int, int]]:
    """The Ring Attention paper's Table 2, `{hardware: (min block, min sequence per
    device = 6 x block)}`, for `kv_heads` of `heads` and K/V sent in `kv_dtype`
    (the paper: multi-head, bf16)."""
    heads, kv_heads = check_size("heads", heads), check_size("kv_heads", kv_heads)
    _check_heads(heads, kv_heads)
    cost = RingCost(1, 1, heads, kv_heads, 1, float_itemsize("kv_dtype", kv_dtype))
    out = {}
    for key, hw in HARDWARE.items():
        block = cost.min_shard(hw)
        out[key] = (block, 6 * block)
    return out
