"""The Mosaic (TPU) kernel bodies of `PallasTpuKernel`, forward and fused backward, and
the helpers they run on a tile."""

from collections.abc import Callable

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from ..._layout._tokens import TokenInfo
from ..._masks._base import DENSE, MASKED
from .._pallas import _leaves as leaves, _tiles as tiles


# A vreg is 8 sublanes x 128 lanes: the last two dims of a block are multiples of these.
LANES = 128
SUBLANES = 8


def _q_info(ref) -> TokenInfo:
    return tiles.token_info([ref[f, :, :1] for f in range(4)])


def _k_info(ref, cols=slice(None)) -> TokenInfo:
    return tiles.token_info([ref[f, :1, cols] for f in range(4)])


def lanes(x: Array) -> Array:
    """`[..., 1]` -> `[..., 128]`: per-row statistics (lse, delta, the running max and
    sum) broadcast along lanes."""
    return jnp.broadcast_to(x, x.shape[:-1] + (LANES,))


def _widen(x: Array, n: int) -> Array:
    """`[bq, 128]` per-row statistics (every lane equal) as `[bq, n]`: whole vregs
    tiled along lanes (splash attention's way), which costs no broadcast of a column;
    for `n` under 128 (head_dim 64) the first `n` lanes."""
    return jnp.tile(x, (1, n // LANES)) if n % LANES == 0 else x[:, :n]


def _prescaled(q_ref, scale: float) -> Array:
    """The query tile times the softmax scale, in its own dtype (splash attention's
    pre-scaled q): the logits then need no multiply over the `[bq, bk]` score tile, a
    VPU pass per tile, but one over the `[bq, d]` queries. The forward and the backward
    round the same way, so the backward's recomputed logits are the forward's."""
    return (q_ref[...].astype(jnp.float32) * scale).astype(q_ref.dtype)


def _when_runs(rebuild_mask: leaves.MaskReader, run_ref, tile, body: Callable[[bool], None]):
    """Run `body(dense)` where the tile table says tile `tile` runs: `body(False)` with
    the elementwise mask, `body(True)` where every pair attends (splash attention's
    full blocks; `XlaKernel`'s dense branch). A dense tile then costs no mask, no
    select and no non-finite guard over its `[block_q, block_kv]` scores."""
    pl.when(rebuild_mask.masked(run_ref, tile))(lambda: body(False))
    pl.when(rebuild_mask.dense(run_ref, tile))(lambda: body(True))


def _when_runs_in_pieces(rebuild_mask, run_ref, tile, k_ref, compute: int, body) -> None:
    """`body(dense, cols)` over the key tile in `k_ref`, `compute` key columns at a time
    (splash attention's `block_kv_compute`): the tile is copied in one DMA, and computed
    on in smaller pieces, whose score tiles and their siblings are that much smaller.
    A dense tile runs its pieces in one branch, unrolled, so that the scheduler overlaps
    one piece's softmax with the next one's matmuls (a branch a piece cost a v5e 12% at
    full attention); on a masked tile each piece takes its own branch from the table
    (`MaskReader.chunk`), so a wide tile on a mask's edge computes only the pieces where
    someone attends, and masks only those where not all do. Wide tiles then cost fewer
    grid steps (each about a microsecond on a v5e, whatever it computes) and no more
    work than narrow ones."""
    chunks = k_ref.shape[0] // compute
    if chunks == 1:
        _when_runs(rebuild_mask, run_ref, tile, lambda dense: body(dense, slice(None)))
        return
    pieces = [pl.ds(c * compute, compute) for c in range(chunks)]

    @pl.when(rebuild_mask.dense(run_ref, tile))
    def _():
        for cols in pieces:
            body(True, cols)

    @pl.when(rebuild_mask.masked(run_ref, tile))
    def _():
        for c, cols in enumerate(pieces):
            branch = rebuild_mask.chunk(run_ref, tile, c)
            pl.when(branch == MASKED)(lambda cols=cols: body(False, cols))
            pl.when(branch == DENSE)(lambda cols=cols: body(True, cols))


def forward_kernel(
    run_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    num_q: int,
    num_kv: int,
    block_kv_compute: int,
):
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask:-6]
    o_ref, lse_ref, m_ref, total_ref, acc_ref, q_scaled_ref = refs[-6:]
    b, h, i, j = (pl.program_id(a) for a in range(4))
    tile = (b * num_q + i) * num_kv + j
    mask, mod = rebuild_mask(mask_refs, run_ref, tile), rebuild_mod(mod_refs)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        q_scaled_ref[...] = _prescaled(q_ref, scale)

    def update(dense: bool, cols):
        qi, ki = _q_info(q_rec_ref), _k_info(k_rec_ref, cols)
        s, _ = tiles.logits(q_scaled_ref[...], k_ref[cols, :], qi, ki, mod, 1.0)
        # The running max and sum stay `[bq, 128]` along lanes (`_widen`).
        acc = tiles.Softmax(m_ref[...], total_ref[...], acc_ref[...])
        if dense:
            acc = acc.update(s, None, v_ref[cols, :], widen=_widen)
        else:
            s, v = tiles.nan_columns(s, v_ref[cols, :])
            acc = acc.update(s, tiles.allowed(mask, qi, ki), v, widen=_widen)
        m_ref[...] = acc.m
        total_ref[...] = acc.total
        acc_ref[...] = acc.acc

    _when_runs_in_pieces(rebuild_mask, run_ref, tile, k_ref, block_kv_compute, update)

    @pl.when(j == num_kv - 1)
    def _finish():
        out, lse = tiles.Softmax(m_ref[:, :1], total_ref[:, :1], acc_ref[...]).finish()
        o_ref[...] = out
        lse_ref[...] = lanes(lse)


def backward_kernel(
    run_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild_mask,
    rebuild_mod,
    num_mask: int,
    scale: float,
    num_q: int,
    num_kv: int,
    groups: int,
    block_kv_compute: int,
    carried: bool = False,
):
    """dQ, dK and dV in one pass over the tile pairs (a fused backward): each pair's
    probabilities and logit gradients are computed once, where a dQ kernel and a dK/dV
    kernel would each recompute QK^T and dO V^T (5 matmuls a pair instead of 7).

    The grid is `(batch, kv head, key tile, query head in the group, query tile)`: a
    key tile's dK and dV accumulate in VMEM over the query tiles of every head of its
    group; every query tile's dQ accumulates in a VMEM scratch of the call's rows
    (`QuerySplit` bounds them) over the key tiles, and is written at the last one,
    into an output of the call's rows alone: a dQ output aliased across calls, beside
    dK and dV carried, made libtpu fail ("Can't deep copy instruction") or never finish
    compiling inside the ring's `cond`."""
    # With `carried`, dK and dV so far (`QuerySplit`) come in before the outputs and
    # the accumulators start from them.
    mask_refs, mod_refs = refs[:num_mask], refs[num_mask : len(refs) - 6 - 2 * carried]
    dk_ref, dv_ref, dq_ref, dq_acc, dk_acc, dv_acc = refs[-6:]
    b, t, i = pl.program_id(0), pl.program_id(2), pl.program_id(4)
    g = pl.program_id(3)
    tile = (b * num_kv + t) * num_q + i
    mask, mod = rebuild_mask(mask_refs, run_ref, tile), rebuild_mod(mod_refs)
    block_q = q_ref.shape[0]
    rows = pl.ds(pl.multiple_of((g * num_q + i) * block_q, block_q), block_q)

    @pl.when((g == 0) & (i == 0))
    def _init_kv():
        if carried:
            dk_acc[...], dv_acc[...] = refs[-8][...], refs[-7][...]
        else:
            dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
            dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    # Whether or not the first key tile runs for these queries, their dQ starts here.
    @pl.when(t == 0)
    def _init_q():
        dq_acc[rows, :] = jnp.zeros((block_q, dq_acc.shape[1]), jnp.float32)

    def grads(dense: bool, cols):
        qi, ki = _q_info(q_rec_ref), _k_info(k_rec_ref, cols)
        q, k, d_out = _prescaled(q_ref, scale), k_ref[cols, :], do_ref[...]
        lse, delta = (_widen(r[...], k.shape[0]) for r in (lse_ref, delta_ref))
        p, ds, k_finite = tiles.tile_grads(
            q, k, v_ref[cols, :], d_out, lse, delta, qi, ki, None if dense else mask, mod, 1.0
        )
        ds_low = ds.astype(q.dtype)
        dv_acc[cols, :] += tiles.matmul_tn(p.astype(d_out.dtype), d_out)
        dk_acc[cols, :] += tiles.matmul_tn(ds_low, q)
        dq_acc[rows, :] += tiles.matmul(ds_low, k_finite)

    _when_runs_in_pieces(rebuild_mask, run_ref, tile, k_ref, block_kv_compute, grads)

    @pl.when(t == num_kv - 1)
    def _finish_q():
        dq_ref[...] = dq_acc[rows, :] * scale

    @pl.when((g == groups - 1) & (i == num_q - 1))
    def _finish_kv():
        dk_ref[...] = dk_acc[...]
        dv_ref[...] = dv_acc[...]

