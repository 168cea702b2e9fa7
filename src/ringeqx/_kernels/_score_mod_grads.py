"""The score modifier's gradient pass: the gradient of the attention with respect to the
modifier's array leaves, which the ring's backward runs whatever the kernel (the Pallas
kernels cannot differentiate a user's modifier inside Triton or Mosaic)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .._layout._tokens import TokenInfo
from .._score_mods import AbstractScoreMod
from ._base import Scores
from ._tiling import (
    grouped,
    info_tiles,
    modify,
    pad_axis,
    pair_mask,
    pick,
    take_tile,
    tile_loop,
    tile_sizes,
    which_branch,
)


def score_mod_grads(
    q: Float[Array, "batch heads q_len head_dim"],
    k: Float[Array, "batch kv_heads kv_len head_dim"],
    v: Float[Array, "batch kv_heads kv_len head_dim"],
    lse: Float[Array, "batch heads q_len"],
    delta: Float[Array, "batch heads q_len"],
    d_out: Float[Array, "batch heads q_len head_dim"],
    q_info: TokenInfo,
    kv_info: TokenInfo,
    scores: Scores,
    diff: PyTree[bool],
    *,
    block_q: int = 256,
    block_kv: int = 256,
) -> AbstractScoreMod:
    r"""This block's share of the gradient of the attention with respect to the array
    leaves of the score modifier, float32, tile by tile.

    `diff` says which leaves of `scores.score_mod` are differentiated (a filter spec, as
    for `eqx.partition`). With the global `lse` and `delta` (as for
    [`ringeqx.AbstractAttentionKernel.backward`][]), each `block_q x block_kv` tile forms
    $dS = P \circ (dO\,V^\top - \delta)$, the gradient of the modified logits, and the
    modifier's own VJP turns it into the gradient of its leaves: exact for any modifier,
    under any kernel (the Pallas kernels, which cannot differentiate a user's modifier
    inside Triton or Mosaic, use it too). Pairs the mask rules out get no gradient, and
    their logits are zeroed before the modifier sees them, so a non-finite key there
    cannot reach the leaves. Memory is one tile of scores at a time; the tiles the mask's
    block rule rules out are skipped.

    **Returns:** the modifier with its differentiated leaves replaced by their
    gradients (float32) and None elsewhere (`eqx.partition`'s first half).
    """
    mask, scale = scores.mask, scores.scale
    params, rest = eqx.partition(scores.score_mod, diff)
    f32 = jnp.float32
    with jax.named_scope("ringeqx_score_mod_grads"):
        q_len, kh, kv_len = q.shape[2], k.shape[1], k.shape[2]
        bq, nq = tile_sizes(block_q, q_len)
        bk, nk = tile_sizes(block_kv, kv_len)
        q_tiles, k_tiles = info_tiles(q_info, nq, bq), info_tiles(kv_info, nk, bk)
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        qs_in = [grouped(x, kh, nq * bq) for x in (q, d_out, lse_safe, delta)]
        k, v = (pad_axis(x, 2, nk * bk) for x in (k, v))

        def tile(i, j, grads):
            q_blk, do_blk, l_blk, de_blk = (take_tile(x, i, bq, 3) for x in qs_in)
            k_blk, v_blk = take_tile(k, j, bk, 2), take_tile(v, j, bk, 2)
            qi, ki = pick(q_tiles.info, i), pick(k_tiles.info, j)
            b, _, g, _, d = q_blk.shape
            q2, do2 = (x.reshape(b, kh, g * bq, d) for x in (q_blk, do_blk))
            lse2, de2 = (x.reshape(b, kh, g * bq, 1) for x in (l_blk, de_blk))
            ok = pair_mask(mask, qi, ki)[:, None, None]
            ok = jnp.broadcast_to(ok, (b, 1, g, bq, bk)).reshape(b, 1, g * bq, bk)
            raw = jnp.einsum("bhqd,bhkd->bhqk", q2, k_blk, preferred_element_type=f32) * scale
            raw = jnp.where(ok, raw, 0.0)

            def logits(p):
                mod = eqx.combine(p, rest)
                s = modify(mod, raw.reshape(b, kh, g, bq, bk), qi, ki)
                return s.reshape(raw.shape)

            s, vjp = jax.vjp(logits, params)
            p = jnp.where(ok, jnp.exp(s - lse2), 0.0)
            dp = jnp.einsum("bhqd,bhkd->bhqk", do2, v_blk, preferred_element_type=f32)
            ds = jnp.where(ok, p * (dp - de2), 0.0)
            (new,) = vjp(ds)
            return jax.tree.map(lambda a, b: a + b.astype(f32), grads, new)

        def q_tile(i, grads):
            def kv_step(grads, j):
                run = which_branch(mask, q_tiles, k_tiles, i, j) > 0
                return jax.lax.cond(run, functools.partial(tile, i, j), lambda g: g, grads), None

            grads, _ = jax.lax.scan(kv_step, grads, jnp.arange(nk))
            return grads

        zero = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), f32), params)
        return tile_loop(nq, q_tile, zero)
