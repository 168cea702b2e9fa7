"""Tiling maths shared by every kernel and by `schedule`: padding, token-record tiles and
the online-softmax update.

Nothing here imports Pallas: `XlaKernel` and `schedule` use it as they are, and
`_pallas/_tiles.py` re-exports it for the Pallas kernels.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._layout._tokens import TokenInfo


# Row order of the int32 token records that the Pallas kernels receive, and the value a
# padding slot gets in each (an invalid token of no segment and no span).
RECORD_FIELDS = ("positions", "segments", "spans", "valid")
RECORD_FILL = (0, -1, -1, 0)

# `a @ b`: contract the last axis of `a` with the first of `b`.
_NN = (((1,), (0,)), ((), ()))


def pad_axis(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    """`x` padded at the end of `axis` to `size` with `value`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_info(info: TokenInfo, length: int) -> TokenInfo:
    """Records padded along their last axis to `length`, padding slots invalid."""
    return TokenInfo(
        *(
            pad_axis(getattr(info, name), -1, length, fill)
            for name, fill in zip(RECORD_FIELDS, RECORD_FILL)
        )
    )


def tile_info(info: TokenInfo, num: int, block: int, axis: int) -> TokenInfo:
    """`[*lead, len]` records -> `num` tiles of `block` tokens, padding slots invalid,
    with the tile axis moved to `axis` (`[*lead, num, block]` before the move)."""

    def tile(x):
        x = x.reshape(x.shape[:-1] + (num, block))
        return jnp.moveaxis(x, -2, axis)

    return jax.tree.map(tile, pad_info(info, num * block))


def matmul(a: Array, b: Array) -> Array:
    """`a @ b` in float32."""
    return jax.lax.dot_general(a, b, _NN, preferred_element_type=jnp.float32)


class Softmax(eqx.Module):
    """Online softmax state of a query tile: running max `m` and running sum `total`
    (both `[..., bq, 1]`, or `[bq, 128]` along lanes in the Mosaic kernel: `update`'s
    `widen`), and the unnormalised output `acc` (`[..., bq, d]`), all float32."""

    m: Array
    total: Array
    acc: Array

    @staticmethod
    def init(block_q: int, head_dim: int) -> "Softmax":
        zero = jnp.zeros((block_q, 1), jnp.float32)
        return Softmax(
            zero - jnp.inf, zero, jnp.zeros((block_q, head_dim), jnp.float32)
        )

    def update(
        self,
        s: Array,
        ok: Array | None,
        v: Array,
        pv: Callable[[Array, Array], Array] = matmul,
        widen: Callable[[Array, int], Array] | None = None,
    ) -> "Softmax":
        """Fold in a tile of logits `s` (`[..., bq, bk]`; `ok` marks attending pairs,
        None where all do) and values `v`; `pv(p, v)` gives the float32 `[..., bq, d]`
        product (`p @ v` for one head). With `widen`, `m` and `total` are kept as they
        come (a TPU kernel's `[bq, 128]`, every lane equal) and `widen(x, n)` gives
        them `n` columns wide (tiled vregs instead of a broadcast column)."""
        if ok is not None:
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(self.m, jnp.max(s, axis=-1, keepdims=True))
        # Rows that have seen nothing keep m = -inf; exponentiate against 0 instead.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        wide = widen or (lambda x, _: x)
        p = jnp.exp(s - wide(m_safe, s.shape[-1]))
        alpha = jnp.exp(self.m - m_safe)
        total = self.total * alpha + jnp.sum(p, axis=-1, keepdims=True)
        acc = self.acc * wide(alpha, self.acc.shape[-1]) + pv(p.astype(v.dtype), v)
        return Softmax(m_new, total, acc)

    def finish(self) -> tuple[Array, Array]:
        """`(out [..., bq, d], lse [..., bq, 1])`; rows that saw nothing give 0 and
        -inf."""
        seen = self.total > 0
        total = jnp.where(seen, self.total, 1.0)
        return self.acc / total, jnp.where(seen, self.m + jnp.log(total), -jnp.inf)
