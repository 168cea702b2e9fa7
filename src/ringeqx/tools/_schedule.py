"""`schedule`: the work each device does at each ring step, as the ring will run it."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._kernels._base import AbstractAttentionKernel
from .._kernels._select import KernelName, select_kernel
from .._kernels._tiling import tile_info
from .._layout._layout import Layout
from .._layout._tokens import BlockSummary, TokenInfo
from .._masks._base import AbstractMask, block_rule
from .._ring._steps import ring_window


def _ratio(work: Float[Array, "steps shards"]) -> Float[Array, ""]:
    total = jnp.sum(jnp.mean(work, axis=1))
    return jnp.where(
        total > 0, jnp.sum(jnp.max(work, axis=1)) / jnp.where(total > 0, total, 1.0), 1.0
    )


class Schedule(eqx.Module):
    """What every device does at every ring step, for one layout and mask.

    At ring step `s`, device `i` holds its own queries and the keys/values of shard
    `(i + a - s) mod P`, where `a` is 0 unless the ring starts `a` shards ahead (a
    two-sided window; any layout whose needed shards lie ahead). The step runs only if
    the mask's block rule allows the two shards; then the kernel runs a `block_q x
    block_kv` tile only if the block rule allows the two tiles. A layout with batch axes
    is summed over them (the ring processes the whole batch of a device together).

    **Fields:**

    - `tiles_run`: `int32[steps, shards]`, kernel tiles computed.
    - `tiles_skipped`: `int32[steps, shards]`, tiles skipped (whole skipped steps included).
    - `pairs`: `float32[steps, shards]`, unmasked query-key pairs of valid tokens: the
        useful work (float32, exact below 2^24 per entry).

    `steps` is [`ringeqx.num_ring_steps`][]: for a concrete layout, only the steps whose
    shard offsets the block rule allows somewhere (packed short documents, windows,
    block-sparse tables need few); all `P` for a causal mask or a traced layout without
    bounded-window masks.
    """

    tiles_run: Int[Array, "steps shards"]
    tiles_skipped: Int[Array, "steps shards"]
    pairs: Float[Array, "steps shards"]

    @property
    def imbalance(self) -> Float[Array, ""]:
        r"""Useful work on the slowest device over the mean, step by step:

        $$\frac{\sum_s \max_i \text{pairs}_{s,i}}{\sum_s \operatorname{mean}_i
        \text{pairs}_{s,i}}$$

        The ring moves in lockstep (each step waits for the K/V of the previous device),
        so a step lasts as long as its busiest device: the numerator is the critical path
        and the denominator the perfectly balanced time. 1.0 is perfect; `P` is the worst.
        """
        return _ratio(self.pairs)

    @property
    def tile_imbalance(self) -> Float[Array, ""]:
        """`imbalance` counted in kernel tiles run, which is what the kernel's time
        follows when tiles are dense."""
        return _ratio(self.tiles_run.astype(jnp.float32))

    @property
    def critical_path(self) -> Int[Array, ""]:
        """Tiles on the critical path: the sum over steps of the busiest device's tiles."""
        return jnp.sum(jnp.max(self.tiles_run, axis=1))

    @property
    def total_tiles(self) -> Int[Array, ""]:
        """Tiles run by all devices at all steps."""
        return jnp.sum(self.tiles_run)


def schedule(
    layout: Layout,
    mask: AbstractMask,
    *,
    kernel: KernelName | AbstractAttentionKernel = "auto",
) -> Schedule:
    """Count, without running attention, the work of every device at every ring step.

    It follows the ring exactly: the steps of [`ringeqx.num_ring_steps`][] (the ring
    sends nothing for the shard offsets that no device needs, and neither step nor its
    hop appears here), the same
    step skip (the mask's block rule on per-shard summaries) and the kernel's own tiles,
    `block_q x block_kv` (tiles larger than a shard shrink to it).

    **Arguments:**

    - `layout`: a [`ringeqx.Layout`][] (batch axes are summed over).
    - `mask`: the attention mask.
    - `kernel`: the kernel whose tiles are counted: an
        [`ringeqx.AbstractAttentionKernel`][] (used as it is, on any device, so a TPU
        kernel's schedule can be planned on a laptop), or a name that
        [`ringeqx.select_kernel`][] resolves for the present device, as
        [`ringeqx.ring_attention`][] does (default `"auto"`: the ring's own default).
        Its tiles are the ones its `tiles` gives for bfloat16 at head_dim 128 (a
        `PallasGpuKernel` leaves them to a table by dtype and head_dim).

    **Returns:** a [`ringeqx.tools.Schedule`][]; see its `imbalance` and `critical_path`.

    **Example:**

    ```python
    layout = ringeqx.Zigzag().layout(8192, 8)
    s = ringeqx.tools.schedule(layout, ringeqx.Causal(), kernel=ringeqx.PallasTpuKernel())
    print(s.imbalance, s.critical_path)
    ```
    """
    if not isinstance(kernel, AbstractAttentionKernel):
        kernel = select_kernel(kernel)
    # The window is read here, outside the jit below, where a concrete layout still has
    # its values: the ring sees them the same way.
    ahead, steps = ring_window(mask, layout)
    # A kernel's tiles may depend on the dtype and head_dim (`PallasGpuKernel`'s table),
    # which a layout does not have: count the forward's for bfloat16 at head_dim 128.
    block_q, block_kv = kernel.tiles(jnp.bfloat16, 128)
    return _schedule(layout, mask, block_q, block_kv, ahead, steps)


@eqx.filter_jit
def _schedule(
    layout: Layout, mask: AbstractMask, block_q: int, block_kv: int, ahead: int, steps: int
) -> Schedule:
    num_shards, capacity = layout.num_shards, layout.capacity
    info = layout.token_info()
    # [*batch, shards * capacity] -> [shards, batch, capacity]
    info = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, num_shards, capacity), 0, 1), info)

    over_shard = jax.vmap(lambda i: BlockSummary.of(i))
    shard_sum = over_shard(info)
    pairwise = jax.vmap(jax.vmap(lambda q, k: block_rule(mask, q, k), (None, 0)), (0, None))
    step_ok = pairwise(shard_sum, shard_sum)  # [q shard, kv shard]

    bq, bk = min(block_q, capacity), min(block_kv, capacity)
    nq, nk = math.ceil(capacity / bq), math.ceil(capacity / bk)
    over_tile = jax.vmap(jax.vmap(lambda i: BlockSummary.of(i)))
    q_sum = over_tile(tile_info(info, nq, bq, axis=1))  # [shards, nq]
    k_sum = over_tile(tile_info(info, nk, bk, axis=1))  # [shards, nk]

    def flat(s: BlockSummary) -> BlockSummary:
        return jax.tree.map(lambda x: x.reshape(-1), s)

    tile_ok = pairwise(flat(q_sum), flat(k_sum)).reshape(num_shards, nq, num_shards, nk)
    tile_ok = tile_ok & step_ok[:, None, :, None]
    tiles = jnp.sum(tile_ok, axis=(1, 3), dtype=jnp.int32)  # [q shard, kv shard]

    keys = jax.tree.map(lambda x: x[:, :, None, :], info)  # [shards, batch, 1, capacity]

    def shard_pairs(q_info: TokenInfo) -> Float[Array, " shards"]:
        # q_info: [batch, capacity] -> queries [1, batch, capacity, 1] vs keys
        # [shards, batch, 1, capacity]
        q = jax.tree.map(lambda x: x[None, :, :, None], q_info)
        ok = mask.allows(q, keys) & q.valid & keys.valid
        rows = jnp.sum(ok, axis=-1, dtype=jnp.int32).astype(jnp.float32)
        return jnp.sum(rows, axis=(1, 2))

    pairs = jax.lax.map(shard_pairs, info)  # [q shard, kv shard]

    # Device i starts `ahead` shards ahead and meets shard i + ahead - s at step s.
    dev = jnp.arange(num_shards)[None, :]
    src = (dev + ahead - jnp.arange(steps)[:, None]) % num_shards
    run = tiles[dev, src]
    return Schedule(tiles_run=run, tiles_skipped=nq * nk - run, pairs=pairs[dev, src])
