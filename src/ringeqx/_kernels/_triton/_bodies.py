"""The Triton (GPU) kernel bodies of `PallasGpuKernel`: the forward, dQ and dK/dV."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._layout._tokens import TokenInfo
from .._pallas import _tiles as tiles


# Each record row is loaded from its ref on its own: slicing a loaded `[4, block]` value
# would be a `slice`, which Triton's lowering does not have.
def _q_info(ref, rows=slice(None)) -> TokenInfo:
    return tiles.token_info([ref[f, rows][:, None] for f in range(4)])


def _k_info(ref, cols=slice(None)) -> TokenInfo:
    return tiles.token_info([ref[f, cols][None, :] for f in range(4)])



def forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    q_rec_ref,
    k_rec_ref,
    run_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    block_kv: int,
    num_kv: int,
):
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask:-2]
    o_ref, lse_ref = refs[-2:]
    score_mod = rebuild_mod(mod_refs)
    q = q_ref[...]
    qi = _q_info(q_rec_ref)

    def body(j, acc):
        kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        ki = _k_info(k_rec_ref, kv)

        def update(acc):
            mask = rebuild_mask(mask_refs, run_ref, j)
            s, _ = tiles.logits(q, k_ref[kv, :], qi, ki, score_mod, scale)
            s, v = tiles.nan_columns(s, v_ref[kv, :])
            return acc.update(s, tiles.allowed(mask, qi, ki), v)

        return jax.lax.cond(rebuild_mask.runs(run_ref, j), update, lambda acc: acc, acc)

    init = tiles.Softmax.init(q.shape[0], q.shape[1])
    out, lse = jax.lax.fori_loop(0, num_kv, body, init).finish()
    o_ref[...] = out
    lse_ref[...] = lse[:, 0]


def dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    run_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    block_kv: int,
    num_kv: int,
):
    mask_refs, mod_refs, dq_ref = refs[:num_mask], refs[num_mask:-1], refs[-1]
    score_mod = rebuild_mod(mod_refs)
    q, d_out = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    qi = _q_info(q_rec_ref)

    def body(j, dq):
        kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        ki = _k_info(k_rec_ref, kv)

        def grads(dq):
            mask = rebuild_mask(mask_refs, run_ref, j)
            k = k_ref[kv, :]
            _, ds, k_finite = tiles.tile_grads(
                q, k, v_ref[kv, :], d_out, lse, delta, qi, ki, mask, score_mod, scale
            )
            return dq + tiles.matmul(ds.astype(k.dtype), k_finite)

        return jax.lax.cond(rebuild_mask.runs(run_ref, j), grads, lambda dq: dq, dq)

    dq_ref[...] = jax.lax.fori_loop(0, num_kv, body, jnp.zeros(q.shape, jnp.float32))


def dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    run_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    block_q: int,
    num_q: int,
    groups: int,
):
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask:-2]
    dk_ref, dv_ref = refs[-2:]
    k, v = k_ref[...], v_ref[...]
    ki = _k_info(k_rec_ref)

    def body(t, carry):
        # One loop over (query head of this kv head's group, query tile).
        # lax's div/rem of nonnegative ints: jnp's floor division lowers to a `rem`
        # of mixed int and bool operands, which Triton's lowering rejects.
        g, i = jax.lax.div(t, num_q), jax.lax.rem(t, num_q)
        qb = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        qi = _q_info(q_rec_ref, qb)

        def grads(carry):
            dk, dv = carry
            # The refs hold the modifier rows of this kv head's `groups` query heads.
            mod = rebuild_mod(mod_refs, g)
            mask = rebuild_mask(mask_refs, run_ref, i)
            q, d_out = q_ref[g, qb, :], do_ref[g, qb, :]
            lse, delta = lse_ref[g, qb][:, None], delta_ref[g, qb][:, None]
            p, ds, _ = tiles.tile_grads(
                q, k, v, d_out, lse, delta, qi, ki, mask, mod, scale
            )
            dv = dv + tiles.matmul_tn(p.astype(d_out.dtype), d_out)
            dk = dk + tiles.matmul_tn(ds.astype(q.dtype), q)
            return dk, dv

        return jax.lax.cond(rebuild_mask.runs(run_ref, i), grads, lambda c: c, carry)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, groups * num_q, body, (zero, zero))
    dk_ref[...] = dk
    dv_ref[...] = dv

