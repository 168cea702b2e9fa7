"""Striped shards: tokens dealt round-robin to the devices, `stripe` at a time."""

import math

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._layout._layout import Layout, layout_from_order
from .._layout._tokens import Runs
from .._util._numbers import as_int, shown
from ._base import AbstractShardingStrategy
from ._uniform import check_num_shards


@eqx.filter_jit
def _striped_layout(stripe: int, seq_len: int, num_shards: int, segment_ids, span_ids) -> Layout:
    capacity = stripe * math.ceil(seq_len / (stripe * num_shards))
    slot = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    shard = jnp.arange(num_shards, dtype=jnp.int32)[:, None]
    token = ((slot // stripe) * num_shards + shard) * stripe + slot % stripe
    order = jnp.where(token < seq_len, token, -1)
    # A run per stripe, the next `num_shards * stripe` positions on (one run per shard
    # on a single shard).
    if num_shards == 1:
        runs = Runs((0,), capacity)
    else:
        runs = Runs(range(0, capacity, stripe), capacity, stride=num_shards * stripe)
    return layout_from_order(
        order, seq_len, segment_ids=segment_ids, span_ids=span_ids, runs=runs
    )


class Striped(AbstractShardingStrategy):
    r"""Deal the tokens to the devices round-robin in stripes of `stripe` tokens.

    Token `t` goes to device `(t // stripe) % P`. Every device then holds tokens from the
    whole sequence, so under a causal mask every device does almost the same work at every
    ring step (the difference is one stripe per query). The price is that block skipping
    rarely applies: every shard spans every position.

    **Arguments:**

    - `stripe`: tokens per stripe (static). `stripe=1` is the layout of Striped
        Attention; a multiple of the kernel's block size keeps tiles dense.

    ??? cite "Striped Attention"

        ```bibtex
        @article{brandon2023striped,
          title={Striped Attention: Faster Ring Attention for Causal Transformers},
          author={Brandon, William and Nrusimha, Aniruddha and Qian, Kevin and
                  Ankner, Zachary and Jin, Tian and Song, Zhiye and Ragan-Kelley, Jonathan},
          journal={arXiv:2311.09431},
          year={2023}
        }
        ```
    """

    stripe: int = eqx.field(static=True, default=1, converter=as_int)

    def __check_init__(self):
        if not isinstance(self.stripe, int) or self.stripe < 1:
            raise ValueError(f"Striped `stripe` must be an integer >= 1; got {shown(self.stripe)}.")

    def layout(
        self,
        seq_len: int,
        num_shards: int,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        span_ids: Int[Array, "*batch seq"] | None = None,
    ) -> Layout:
        seq_len, num_shards = check_num_shards(seq_len, num_shards, segment_ids, span_ids)
        return _striped_layout(self.stripe, seq_len, num_shards, segment_ids, span_ids)
