"""`XlaKernel`: tiled flash attention in plain JAX; runs on every backend."""

import functools
from types import MappingProxyType
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._layout._tokens import TokenInfo
from .._util._numbers import as_int, shown
from ._base import AbstractAttentionKernel, Scores
from ._tiling import (
    Softmax,
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


def _logits(q2, k, qi, ki, score_mod, scale, groups: int, keys_first: bool = False):
    """Scaled (and modified) logits in float32, a query head's group folded into the rows:
    `[b, kv_heads, groups * bq, bk]`, or keys on the rows `[b, kv_heads, bk, groups * bq]`
    with `keys_first`; with the vjp of the modifier (applied in its own `[heads, q, k]`
    order; identity when there is none)."""
    spec = "bhqd,bhkd->bhkq" if keys_first else "bhqd,bhkd->bhqk"
    s = jnp.einsum(spec, q2, k, preferred_element_type=jnp.float32) * scale
    if score_mod is None:
        return s, lambda ds: ds
    b, kh = s.shape[:2]
    rows, bk = (s.shape[3], s.shape[2]) if keys_first else s.shape[2:]
    bq = rows // groups

    def mod(s):
        if keys_first:  # [b, kh, bk, (g, bq)] -> [b, kh, g, bq, bk] and back
            s = jnp.moveaxis(s.reshape(b, kh, bk, groups, bq), 2, -1)
            return jnp.moveaxis(modify(score_mod, s, qi, ki), -1, 2).reshape(b, kh, bk, rows)
        s = modify(score_mod, s.reshape(b, kh, groups, bq, bk), qi, ki)
        return s.reshape(b, kh, rows, bk)

    s, vjp = jax.vjp(mod, s)
    return s, lambda ds: vjp(ds)[0]


def _ungrouped(x: Array, length: int) -> Array:
    """Inverse of `grouped`: `[b, heads, length, *rest]`."""
    x = x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])
    return x[:, :, :length]


def _add_tile(x: Array, update: Array, index, block: int, axis: int) -> Array:
    """`x` with `update` added to its tile `index` (in place in a loop)."""
    old = take_tile(x, index, block, axis)
    return jax.lax.dynamic_update_slice_in_dim(x, old + update, index * block, axis)


def _tile_grads(q, k, v, d_out, lse, delta, qi, ki, mask, score_mod, scale, dense=False):
    """`(dq^T, dk, dv)` contributions of one `[b, kv_heads, groups, bq]` x `[b, kv_heads,
    bk]` tile, float32 (Flash Attention 2); `dq^T` is `[b, kv_heads, d, groups, bq]`.
    A `dense` tile (every pair attends) skips the elementwise mask.

    The tile is computed keys first, `[bk, groups * bq]` (a query head's group folded into
    the rows): every product then reads the large P and dS as they lie, and only the small
    K and dO tiles are transposed, where the queries-first order transposes P and dS (the
    profile in `benchmarks/LOG.md`)."""
    b, kh, g, bq, d = q.shape
    bk = k.shape[2]
    q2, do2, lse2, de2 = (x.reshape((b, kh, g * bq) + x.shape[4:]) for x in (q, d_out, lse, delta))
    s, mod_vjp = _logits(q2, k, qi, ki, score_mod, scale, g, keys_first=True)
    f32 = jnp.float32
    p = jnp.exp(s - lse2[:, :, None, :])
    if not dense:
        ok = pair_mask(mask, qi, ki, keys_first=True)[:, None, :, None, :]
        ok = jnp.broadcast_to(ok, (b, 1, bk, g, bq)).reshape(b, 1, bk, g * bq)
        p = jnp.where(ok, p, 0.0)
    dv = jnp.einsum("bhkq,bhqd->bhkd", p.astype(d_out.dtype), do2, preferred_element_type=f32)
    dp = jnp.einsum("bhkd,bhqd->bhkq", v, do2, preferred_element_type=f32)
    if not dense:
        # Masked pairs contribute exactly nothing, a non-finite K or V row included.
        dp = jnp.where(ok, dp, 0.0)
    ds = (mod_vjp(p * (dp - de2[:, :, None, :])) * scale).astype(q.dtype)
    if dense:  # every row attends every key: a non-finite one reaches them all as is
        dq_t = jnp.einsum("bhkd,bhkq->bhdq", k, ds, preferred_element_type=f32)
    else:
        k_finite, k_bad = _finite_rows(k)
        dq_t = jnp.einsum("bhkd,bhkq->bhdq", k_finite, ds, preferred_element_type=f32)
        attends_bad = jnp.any(ok & k_bad[..., None], axis=2)[:, :, None, :]
        dq_t = jnp.where(attends_bad, jnp.nan, dq_t)
    dk = jnp.einsum("bhkq,bhqd->bhkd", ds, q2, preferred_element_type=f32)
    return dq_t.reshape(b, kh, d, g, bq), dk, dv


def _pv(p: Array, v: Array) -> Array:
    return jnp.einsum("bhqk,bhkd->bhqd", p, v, preferred_element_type=jnp.float32)


def _finite_rows(x: Array) -> tuple[Array, Array]:
    """`x` `[b, h, k, d]` with its non-finite rows zeroed, and where they were `[b, h, k]`."""
    bad = ~jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(bad[..., None], 0, x), bad


def _attends(ok: Array, bad: Array) -> Array:
    """`[b, h, rows, 1]`: the query rows (`ok` is `[b, 1, rows, bk]`) that attend one of
    the `bad` key rows."""
    return jnp.any(ok & bad[:, :, None, :], axis=-1)[..., None]


def _masked_pv(p: Array, v: Array, ok: Array) -> Array:
    """`p @ v` in which masked pairs contribute exactly nothing. Their probabilities are
    already 0, but 0 * NaN is NaN: value rows that are not finite are zeroed, and NaN is
    given back only to the query rows that attend them."""
    v_finite, bad = _finite_rows(v)
    return jnp.where(_attends(ok, bad), jnp.nan, _pv(p, v_finite))


# Default tiles `(block_q, block_kv)` per device type, the kernel's only definition of
# them. XLA wants big tiles on an accelerator (fewer loop steps); on the CPU 256 x 256 is
# as fast through the ring and holds less (docs/design.md). The fields' defaults are
# the CPU's.
_DEVICE_TILES = MappingProxyType({"cpu": (256, 256), "gpu": (512, 1024), "tpu": (512, 1024)})


def xla_kernel(device: Literal["cpu", "gpu", "tpu"]) -> "XlaKernel":
    """`XlaKernel` with its default tiles on `device` devices (what
    [`ringeqx.select_kernel`][] gives for `"xla"`)."""
    block_q, block_kv = _DEVICE_TILES[device]
    return XlaKernel(block_q=block_q, block_kv=block_kv)


class XlaKernel(AbstractAttentionKernel):
    """Flash attention tiled in `block_q x block_kv` tiles, written in plain JAX.

    Per device, memory holds one `[heads, block_q, block_kv]` tile of scores at a time,
    never the whole `[q_len, kv_len]` matrix. Each tile takes one of three branches
    (`lax.switch`, a real branch on CPU, GPU and TPU): skipped where the mask's block rule
    rules it out, dense (no elementwise mask at all) where its `must_attend` rule says
    every pair attends, masked elementwise otherwise. GQA is native: query
    heads are grouped by their key/value head, so K/V are never copied.

    **Arguments:**

    - `block_q`, `block_kv`: tile sizes (static). Blocks larger than the sequence shrink to
        it; other lengths are padded and the padding masked.

    ??? cite "Flash Attention 2"

        ```bibtex
        @article{dao2023flashattention2,
          title={FlashAttention-2: Faster Attention with Better Parallelism and Work
                 Partitioning},
          author={Dao, Tri},
          journal={arXiv:2307.08691},
          year={2023}
        }
        ```
    """

    block_q: int = eqx.field(static=True, default=_DEVICE_TILES["cpu"][0], converter=as_int)
    block_kv: int = eqx.field(static=True, default=_DEVICE_TILES["cpu"][1], converter=as_int)

    def tile_candidates(self) -> list[tuple[int, int]]:
        sizes = (256, 512, 1024)
        return [(bq, bk) for bq in sizes for bk in sizes]

    def __check_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"XlaKernel `{name}` must be an integer >= 1; got {shown(value)}.")

    def devices(self) -> frozenset[str]:
        return frozenset({"cpu", "gpu", "tpu"})

    def forward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
    ) -> tuple[Float[Array, "batch heads q_len head_dim"], Float[Array, "batch heads q_len"]]:
        mask, score_mod, scale = scores.mask, scores.score_mod, scores.scale
        with jax.named_scope("ringeqx_xla_forward"):
            q_len, kh = q.shape[2], k.shape[1]
            bq, nq = tile_sizes(self.block_q, q_len)
            bk, nk = tile_sizes(self.block_kv, k.shape[2])
            q_tiles, k_tiles = info_tiles(q_info, nq, bq), info_tiles(kv_info, nk, bk)
            qi, ki = q_tiles.info, k_tiles.info
            # Tiles are sliced where they lie (no tiled copies of q, k, v or out).
            qg = grouped(q, kh, nq * bq)
            k, v = (pad_axis(x, 2, nk * bk) for x in (k, v))

            def q_tile(i, out_lse):
                q_blk, qi_blk = take_tile(qg, i, bq, 3), pick(qi, i)
                # A query head's group is folded into the rows: `[b, kv_heads, g * bq, d]`.
                b, _, g, _, d = q_blk.shape
                q2 = q_blk.reshape(b, kh, g * bq, d)
                # Derive the carry from the inputs so that it has their sharding type.
                zero = jnp.zeros_like(q2[..., :1], jnp.float32)
                init = Softmax(zero - jnp.inf, zero, jnp.zeros_like(q2, jnp.float32))

                def kv_step(acc, j):
                    ki_blk = pick(ki, j)

                    def update(acc, dense: bool):
                        # Sliced inside the branch: a skipped tile copies nothing.
                        k_blk, v_blk = take_tile(k, j, bk, 2), take_tile(v, j, bk, 2)
                        s, _ = _logits(q2, k_blk, qi_blk, ki_blk, score_mod, scale, g)
                        if dense:
                            return acc.update(s, None, v_blk, _pv)
                        ok = pair_mask(mask, qi_blk, ki_blk)[:, None, None]
                        ok = jnp.broadcast_to(ok, (b, 1, g, bq, bk)).reshape(b, 1, g * bq, bk)
                        pv = functools.partial(_masked_pv, ok=ok)
                        return acc.update(s, ok, v_blk, pv)

                    branches = (lambda c: c, functools.partial(update, dense=False))
                    branches += (functools.partial(update, dense=True),)
                    index = which_branch(mask, q_tiles, k_tiles, i, j)
                    return jax.lax.switch(index, branches, acc), None

                acc, _ = jax.lax.scan(kv_step, init, jnp.arange(nk))
                o, lse = acc.finish()
                out, lse_all = out_lse
                update = jax.lax.dynamic_update_slice_in_dim
                return (
                    update(out, o.reshape(q_blk.shape), i * bq, 3),
                    update(lse_all, lse.reshape(q_blk.shape[:-1]), i * bq, 3),
                )

            out = jnp.zeros_like(qg, jnp.float32)
            out, lse = tile_loop(nq, q_tile, (out, out[..., 0]))
            return _ungrouped(out, q_len), _ungrouped(lse, q_len)

    def backward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        lse: Float[Array, "batch heads q_len"],
        delta: Float[Array, "batch heads q_len"],
        d_out: Float[Array, "batch heads q_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
    ]:
        mask, score_mod, scale = scores.mask, scores.score_mod, scores.scale
        with jax.named_scope("ringeqx_xla_backward"):
            q_len, kh, kv_len = q.shape[2], k.shape[1], k.shape[2]
            bq, nq = tile_sizes(self.block_q, q_len)
            bk, nk = tile_sizes(self.block_kv, kv_len)
            q_tiles, k_tiles = info_tiles(q_info, nq, bq), info_tiles(kv_info, nk, bk)
            qi, ki = q_tiles.info, k_tiles.info
            lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
            # Tiles are sliced where they lie, and gradients are added into their tiles.
            qs_in = [grouped(x, kh, nq * bq) for x in (q, d_out, lse_safe, delta)]
            k, v = (pad_axis(x, 2, nk * bk) for x in (k, v))

            def kv_tile(j, grads_all):
                k_blk, v_blk, ki_blk = take_tile(k, j, bk, 2), take_tile(v, j, bk, 2), pick(ki, j)

                def q_step(carry, i):
                    dq_all, dk, dv = carry

                    def grads(dense: bool):
                        # Sliced inside the branch: a skipped tile copies nothing.
                        q_blk, do_blk, l_blk, de_blk = (take_tile(x, i, bq, 3) for x in qs_in)
                        tiles = (q_blk, k_blk, v_blk, do_blk, l_blk, de_blk)
                        args = (pick(qi, i), ki_blk, mask, score_mod, scale, dense)
                        return _tile_grads(*tiles, *args)

                    def skip():
                        # Zeros shaped like a dQ^T tile, derived from the carry so that
                        # they share its sharding type.
                        zero_q = jnp.zeros_like(dq_all[..., :bq])
                        return zero_q, jnp.zeros_like(dk), jnp.zeros_like(dv)

                    branches = (skip, functools.partial(grads, False))
                    branches += (functools.partial(grads, True),)
                    index = which_branch(mask, q_tiles, k_tiles, i, j)
                    dq_t, dk_t, dv_t = jax.lax.switch(index, branches)
                    return (_add_tile(dq_all, dq_t, i, bq, 4), dk + dk_t, dv + dv_t), None

                dq_all, dk_all, dv_all = grads_all
                zero_kv = jnp.zeros_like(k_blk, jnp.float32)
                init = (dq_all, zero_kv, zero_kv)
                (dq_all, dk, dv), _ = jax.lax.scan(q_step, init, jnp.arange(nq))
                update = jax.lax.dynamic_update_slice_in_dim
                return dq_all, update(dk_all, dk, j * bk, 2), update(dv_all, dv, j * bk, 2)

            dk0 = jnp.zeros_like(k, jnp.float32)
            # dQ is accumulated as the tiles give it, `[b, kv_heads, d, groups, q]`.
            dq_t = jnp.zeros_like(jnp.moveaxis(qs_in[0], -1, 2), jnp.float32)
            dq_t, dk, dv = tile_loop(nk, kv_tile, (dq_t, dk0, dk0))
            return (
                _ungrouped(jnp.moveaxis(dq_t, 2, -1), q_len),
                dk[:, :, :kv_len],
                dv[:, :, :kv_len],
            )
