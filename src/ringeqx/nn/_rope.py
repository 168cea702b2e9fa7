"""Rotary position embeddings at arbitrary (layout) positions."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_rope(
    x: Float[Array, "seq heads head_dim"],
    positions: Int[Array, " seq"],
    theta: float = 10000.0,
) -> Float[Array, "seq heads head_dim"]:
    """Rotate pairs of features by angles `position * theta^(-2i / head_dim)`.

    Positions come from the layout, so a token gets the same rotation wherever a strategy
    puts it. The rotation is computed in float32 and cast back to `x.dtype`.

    ??? cite "RoFormer"

        ```bibtex
        @article{su2021roformer,
          title={RoFormer: Enhanced Transformer with Rotary Position Embedding},
          author={Su, Jianlin and Lu, Yu and Pan, Shengfeng and Murtadha, Ahmed and Wen,
                  Bo and Liu, Yunfeng},
          journal={arXiv:2104.09864},
          year={2021}
        }
        ```
    """
    head_dim = x.shape[-1]
    if head_dim % 2 != 0:
        raise ValueError(f"Rotary embeddings need an even head_dim; got head_dim={head_dim}.")
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
