"""One decode step of attention over a sequence-sharded KV cache.

Every device already holds the new token's query (it is computed from the replicated
hidden state: no send is needed), attends to its own slots of the cache with the ring's
kernel, and the partial results `(out, lse)` are merged exactly across the ring axis by
one max and one sum reduction: `log P` steps of a reduction tree, not `P - 1` hops.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from .._kernels._base import AbstractAttentionKernel, Scores
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._ring._mesh import place
from .._score_mods import AbstractScoreMod, apply_sinks


def merge_across(
    out: Float[Array, "*rows head_dim"], lse: Float[Array, "*rows"], axis_name: str
) -> tuple[Float[Array, "*rows head_dim"], Float[Array, "*rows"]]:
    r"""The log-sum-exp merge of every device's partial result, inside `shard_map`.

    With $m = \max_d \ell_d$ (one `pmax`) and $w_d = e^{\ell_d - m}$, the result is
    $\sum_d w_d\, o_d / \sum_d w_d$ and $\ell = m + \log \sum_d w_d$; numerator and
    denominator travel in one `psum`. Rows that see no key anywhere give zeros and
    `-inf`, never NaN.
    """
    m = jax.lax.pmax(lse, axis_name)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - safe)[..., None]
    total = jax.lax.psum(jnp.concatenate([out * w, w], axis=-1), axis_name)
    den = total[..., -1]
    merged = total[..., :-1] / jnp.where(den > 0, den, 1.0)[..., None]
    lse = jnp.where(den > 0, safe + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    return merged, lse


def _write(keys, values, k, v, slot, axis_name: str):
    """Write `k`, `v` `[kv_heads, head_dim]` at global `slot` of this device's cache
    `[kv_heads, C, head_dim]` if the device owns the slot: one slot is read and written
    (in place), not the whole cache."""
    c = keys.shape[1]
    local = slot - jax.lax.axis_index(axis_name) * c
    mine = (local >= 0) & (local < c)
    local = jnp.clip(local, 0, c - 1)

    def put(cache, new):
        old = jax.lax.dynamic_slice_in_dim(cache, local, 1, axis=1)
        new = jnp.where(mine, new[:, None].astype(cache.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(cache, new, local, axis=1)

    return put(keys, k), put(values, v)


# Compiled as one program: called outside `jit` (a notebook's `model.decode`), the
# shard_map would otherwise run op by op, each op its own small compile (measured: a
# 2-layer LM's prefill and one decode step took 41 s of compiles on the CPU mesh).
@eqx.filter_jit
def decode_attention(
    q: Float[Array, "heads head_dim"],
    k: Float[Array, "kv_heads head_dim"],
    v: Float[Array, "kv_heads head_dim"],
    keys: Float[Array, "kv_heads slots head_dim"],
    values: Float[Array, "kv_heads slots head_dim"],
    query: TokenInfo,
    records: TokenInfo,
    slot: Int[Array, ""],
    *,
    mask: AbstractMask,
    score_mod: AbstractScoreMod | None,
    sinks: Float[Array, " heads"] | None,
    kernel: AbstractAttentionKernel,
    scale: float,
    mesh,
    axis_name: str,
) -> tuple[
    Float[Array, "heads head_dim"],
    Float[Array, "kv_heads slots head_dim"],
    Float[Array, "kv_heads slots head_dim"],
]:
    """Write the new token's `k`, `v` at `slot` of the cache (on the device that owns the
    slot) and attend `q` to the whole cache; `records` already hold the new token at
    `slot`, and `query` are its records (scalars).

    **Returns:** `(out, keys, values)`: the attention output (typed like `q`, sinks
    applied) and the updated cache arrays, still sharded over `axis_name`.
    """
    cache_spec = PartitionSpec(None, axis_name)

    def local(q, k, v, keys, values, query, records, slot, scores):
        keys, values = _write(keys, values, k, v, slot, axis_name)
        c = keys.shape[1]
        start = jax.lax.axis_index(axis_name) * c
        q_info = jax.tree.map(lambda x: x.reshape(1, 1), query)
        # The records come in whole (replicated, which keeps them replicated in a decode
        # loop: finding a free slot then needs no collective) and each device reads its own.
        kv_info = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, c)[None], records)
        out, lse = kernel.forward(
            q[None, :, None], keys[None], values[None], q_info, kv_info, scores
        )
        out, lse = merge_across(out[0, :, 0], lse[0, :, 0], axis_name)
        return out, lse, keys, values

    replicated = PartitionSpec()
    q, k, v, query, records, slot = place((q, k, v, query, records, slot), mesh, replicated)
    keys, values = place((keys, values), mesh, cache_spec)
    out, lse, keys, values = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(replicated,) * 3 + (cache_spec, cache_spec) + (replicated,) * 4,
        out_specs=(replicated, replicated, cache_spec, cache_spec),
        check_vma=False,
    )(q, k, v, keys, values, query, records, slot, Scores(mask, score_mod, scale))
    if sinks is not None:
        out = apply_sinks(out[None], lse[None], sinks)[0]
    return out.astype(q.dtype), keys, values


def error_if_together(tree, pred: Bool[Array, ""], msg: str, mesh):
    """`eqx.error_if(tree, pred, msg)` raised on every device of `mesh` at once.

    At the top level of a sharded program, XLA runs a host callback on one device and
    sends its result to the others, so a failing check there leaves the others waiting
    (XLA:CPU aborts the process after its rendezvous timeout). Inside `shard_map`, with
    `pred` the same everywhere (replicated), each device makes its own check and all
    raise together, as the ring's own run-time checks do.
    """
    return errors_if_together(tree, [(pred, msg)], mesh)


@eqx.filter_jit  # as decode_attention: one program, not op by op
def errors_if_together(tree, checks: list[tuple[Bool[Array, ""], str]], mesh):
    """As `error_if_together`, for several `(pred, msg)` checks in one host callback:
    the message of the first failing one is raised."""
    preds = jnp.stack([jnp.asarray(pred) for pred, _ in checks])
    msgs = [msg for _, msg in checks]
    replicated = PartitionSpec()
    tree, preds = place((tree, preds), mesh, replicated)

    def check(tree, preds):
        index = jnp.argmax(preds)  # the first True
        return eqx.branched_error_if(tree, jnp.any(preds), index, msgs)

    return jax.shard_map(
        check,
        mesh=mesh,
        in_specs=(replicated, replicated),
        out_specs=replicated,
        check_vma=False,
    )(tree, preds)
