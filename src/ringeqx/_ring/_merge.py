"""The ring's float32 merge: the running softmax over the blocks a device has seen."""

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array


class RunningSum(NamedTuple):
    """The ring's running softmax over the blocks seen so far, unnormalised: `acc` is
    each block's output weighted by `exp(lse_i - top)`, `total` the sum of those
    weights, `top` the largest `lse_i` (float32). Normalised once, at the end (`done`),
    so a weight's rounding cancels in the division by the sum of the computed weights.
    Merging normalised pairs by their log-sum-exp (`out = o exp(lse - logaddexp)`, one
    merge a block) scaled every output by the rounding of `logaddexp`, an error that
    grows with |lse|: 2.8x (3 devices) and 3.4x (8) a dense float32 computation's
    error against float64 in `tests/test_precision.py` (issue 45)."""

    acc: Array
    total: Array
    top: Array

    @staticmethod
    def of(o: Array, lse: Array) -> "RunningSum":
        """The sum of one block: its output, weight 1 (0 where it saw nothing)."""
        seen = lse > -jnp.inf
        return RunningSum(o, seen.astype(jnp.float32), lse)

    def add(self, o: Array, lse: Array) -> "RunningSum":
        top = jnp.maximum(self.top, lse)
        safe = jnp.where(top == -jnp.inf, 0.0, top)
        old, new = jnp.exp(self.top - safe), jnp.exp(lse - safe)
        return RunningSum(
            self.acc * old[..., None] + o * new[..., None], self.total * old + new, top
        )

    def done(self) -> tuple[Array, Array]:
        """`(out, lse)`; rows that saw nothing give 0 and -inf."""
        seen = self.total > 0
        total = jnp.where(seen, self.total, 1.0)
        lse = jnp.where(seen, self.top + jnp.log(total), -jnp.inf)
        return self.acc / total[..., None], lse
