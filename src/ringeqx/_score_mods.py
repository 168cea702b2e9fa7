"""Score modifiers: functions applied to the attention logits before the softmax."""

import abc

import equinox as eqx
from jaxtyping import Array, Float

from ._tokens import TokenInfo


class AbstractScoreMod(eqx.Module):
    """Changes the scaled logits `s = scale * q . k` before masking and softmax.

    Kernels apply it tile by tile, forward and backward (the backward differentiates
    through it with `jax.vjp`), so any smooth elementwise function of the logit, the
    positions and the head index is exact under the ring. The modifier's own array fields
    are not trained through the ring (they are treated as constants).
    """

    @abc.abstractmethod
    def __call__(
        self,
        scores: Float[Array, "*batch heads q k"],
        q: TokenInfo,
        k: TokenInfo,
    ) -> Float[Array, "*batch heads q k"]:
        """Return modified logits.

        **Arguments:**

        - `scores`: float32 logits, query heads on axis -3 (head `h` uses key/value head
            `h // (heads // kv_heads)`).
        - `q`, `k`: token records broadcastable against `scores` (shapes
            `[*batch, 1, q, 1]` and `[*batch, 1, 1, k]`).
        """
