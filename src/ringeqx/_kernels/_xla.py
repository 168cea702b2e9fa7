"""`XlaKernel`: tiled flash attention in plain JAX; runs on every backend."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._masks import AbstractMask, block_rule
from .._numbers import as_int
from .._score_mods import AbstractScoreMod
from .._tokens import BlockSummary, TokenInfo
from ._base import AbstractAttentionKernel


def _pad_axis(x: Array, axis: int, size: int, value=0) -> Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _tile_info(info: TokenInfo, num: int, block: int) -> TokenInfo:
    """`[batch, len]` records -> `[num, batch, block]`, padding slots invalid."""

    def tile(x, fill):
        x = _pad_axis(x, 1, num * block, fill)
        return jnp.swapaxes(x.reshape(x.shape[0], num, block), 0, 1)

    return TokenInfo(
        tile(info.positions, 0),
        tile(info.segments, -1),
        tile(info.spans, -1),
        tile(info.valid, False),
    )


def _pair_mask(mask: AbstractMask, qi: TokenInfo, ki: TokenInfo) -> Bool[Array, "b q k"]:
    """Which pairs of a `[b, bq]` x `[b, bk]` tile attend (padding never does)."""
    q, k = qi.expand(2), ki.expand(1)
    return mask.allows(q, k) & q.valid & k.valid


def _logits(
    qt: Array,
    kt: Array,
    qi: TokenInfo,
    ki: TokenInfo,
    score_mod: AbstractScoreMod | None,
    scale: float,
):
    """Scaled (and modified) logits `[b, kv_heads, groups, bq, bk]` in float32, with
    the vjp of the modifier (identity when there is none)."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qt, kt, preferred_element_type=jnp.float32)
    s = s * scale
    if score_mod is None:
        return s, lambda ds: ds
    b, kh, g, bq, bk = s.shape

    def mod(s):
        out = score_mod(
            s.reshape(b, kh * g, bq, bk),
            jax.tree.map(lambda x: x[:, None, :, None], qi),
            jax.tree.map(lambda x: x[:, None, None, :], ki),
        )
        return out.reshape(s.shape)

    s, vjp = jax.vjp(mod, s)
    return s, lambda ds: vjp(ds)[0]


def _tile_sizes(block: int, length: int) -> tuple[int, int]:
    size = min(block, length)
    return size, math.ceil(length / size)


class XlaKernel(AbstractAttentionKernel):
    """Flash attention tiled in `block_q x block_kv` tiles, written in plain JAX.

    Per device, memory holds one `[heads, block_q, block_kv]` tile of scores at a time,
    never the whole `[q_len, kv_len]` matrix. Tiles that the mask's block rule rules out
    are skipped with `lax.cond` (a real branch on CPU, GPU and TPU). GQA is native: query
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

    block_q: int = eqx.field(static=True, default=256, converter=as_int)
    block_kv: int = eqx.field(static=True, default=256, converter=as_int)

    def tile_candidates(self) -> list[tuple[int, int]]:
        sizes = (256, 512, 1024)
        return [(bq, bk) for bq in sizes for bk in sizes]

    def __check_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"XlaKernel `{name}` must be an integer >= 1; got {value!r}.")

    def devices(self) -> frozenset[str]:
        return frozenset({"cpu", "gpu", "tpu"})

    def forward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        mask: AbstractMask,
        score_mod: AbstractScoreMod | None,
        scale: float,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"], Float[Array, "batch heads q_len"]
    ]:
        with jax.named_scope("ringeqx_xla_forward"):
            b, h, q_len, d = q.shape
            kh, kv_len = k.shape[1], k.shape[2]
            g = h // kh
            bq, nq = _tile_sizes(self.block_q, q_len)
            bk, nk = _tile_sizes(self.block_kv, kv_len)
            qt = _pad_axis(q, 2, nq * bq).reshape(b, kh, g, nq, bq, d)
            qt = jnp.moveaxis(qt, 3, 0)
            kt = jnp.moveaxis(_pad_axis(k, 2, nk * bk).reshape(b, kh, nk, bk, d), 2, 0)
            vt = jnp.moveaxis(_pad_axis(v, 2, nk * bk).reshape(b, kh, nk, bk, d), 2, 0)
            qi = _tile_info(q_info, nq, bq)
            ki = _tile_info(kv_info, nk, bk)
            q_sum = BlockSummary.of(qi, axis=(1, 2))
            k_sum = BlockSummary.of(ki, axis=(1, 2))

            def q_tile(xs):
                q_blk, qi_blk, qs = xs
                # Derive the carry from the inputs so that it has their sharding type.
                zero = jnp.zeros_like(q_blk[..., 0], jnp.float32)
                init = (zero - jnp.inf, zero, jnp.zeros_like(q_blk, jnp.float32))

                def kv_step(carry, ys):
                    k_blk, v_blk, ki_blk, ks = ys

                    def update(carry):
                        m, denom, acc = carry
                        s, _ = _logits(q_blk, k_blk, qi_blk, ki_blk, score_mod, scale)
                        ok = _pair_mask(mask, qi_blk, ki_blk)[:, None, None]
                        s = jnp.where(ok, s, -jnp.inf)
                        m_new = jnp.maximum(m, s.max(axis=-1))
                        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                        p = jnp.exp(s - m_safe[..., None])
                        alpha = jnp.exp(m - m_safe)
                        denom = denom * alpha + p.sum(axis=-1)
                        # 0 * NaN = NaN in p @ v: zero non-finite value rows, then give
                        # NaN back only to the query rows that attend them.
                        bad = ~jnp.all(jnp.isfinite(v_blk), axis=-1)
                        pv = jnp.einsum(
                            "bhgqk,bhkd->bhgqd",
                            p.astype(v_blk.dtype),
                            jnp.where(bad[..., None], 0, v_blk),
                            preferred_element_type=jnp.float32,
                        )
                        hit = jnp.any(ok & bad[:, :, None, None], axis=-1)[..., None]
                        pv = jnp.where(hit, jnp.nan, pv)
                        return m_new, denom, acc * alpha[..., None] + pv

                    run = block_rule(mask, qs, ks)
                    return jax.lax.cond(run, update, lambda c: c, carry), None

                (m, denom, acc), _ = jax.lax.scan(kv_step, init, (kt, vt, ki, k_sum))
                seen = denom > 0
                out = acc / jnp.where(seen, denom, 1.0)[..., None]
                lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
                return out, lse

            out, lse = jax.lax.map(q_tile, (qt, qi, q_sum))
            out = jnp.moveaxis(out, 0, 3).reshape(b, h, nq * bq, d)[:, :, :q_len]
            lse = jnp.moveaxis(lse, 0, 3).reshape(b, h, nq * bq)[:, :, :q_len]
            return out, lse

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
        mask: AbstractMask,
        score_mod: AbstractScoreMod | None,
        scale: float,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
    ]:
        with jax.named_scope("ringeqx_xla_backward"):
            b, h, q_len, d = q.shape
            kh, kv_len = k.shape[1], k.shape[2]
            g = h // kh
            bq, nq = _tile_sizes(self.block_q, q_len)
            bk, nk = _tile_sizes(self.block_kv, kv_len)

            def q_tiles(x):
                x = _pad_axis(x, 2, nq * bq)
                return jnp.moveaxis(x.reshape((b, kh, g, nq, bq) + x.shape[3:]), 3, 0)

            lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
            qt, dot_, lt, delt = (q_tiles(x) for x in (q, d_out, lse_safe, delta))
            kt = jnp.moveaxis(_pad_axis(k, 2, nk * bk).reshape(b, kh, nk, bk, d), 2, 0)
            vt = jnp.moveaxis(_pad_axis(v, 2, nk * bk).reshape(b, kh, nk, bk, d), 2, 0)
            qi = _tile_info(q_info, nq, bq)
            ki = _tile_info(kv_info, nk, bk)
            q_sum = BlockSummary.of(qi, axis=(1, 2))
            k_sum = BlockSummary.of(ki, axis=(1, 2))

            def kv_tile(dq_acc, xs):
                k_blk, v_blk, ki_blk, ks = xs
                zero_kv = jnp.zeros_like(k_blk, jnp.float32)

                def q_step(carry, ys):
                    q_blk, do_blk, l_blk, de_blk, qi_blk, qs = ys

                    def grads(carry):
                        dk, dv = carry
                        s, mod_vjp = _logits(q_blk, k_blk, qi_blk, ki_blk, score_mod, scale)
                        ok = _pair_mask(mask, qi_blk, ki_blk)[:, None, None]
                        p = jnp.where(ok, jnp.exp(s - l_blk[..., None]), 0.0)
                        dv = dv + jnp.einsum(
                            "bhgqk,bhgqd->bhkd",
                            p.astype(do_blk.dtype),
                            do_blk,
                            preferred_element_type=jnp.float32,
                        )
                        dp = jnp.einsum(
                            "bhgqd,bhkd->bhgqk",
                            do_blk,
                            v_blk,
                            preferred_element_type=jnp.float32,
                        )
                        ds = mod_vjp(p * (dp - de_blk[..., None])) * scale
                        ds = ds.astype(q_blk.dtype)
                        dq = jnp.einsum(
                            "bhgqk,bhkd->bhgqd", ds, k_blk, preferred_element_type=jnp.float32
                        )
                        dk = dk + jnp.einsum(
                            "bhgqk,bhgqd->bhkd", ds, q_blk, preferred_element_type=jnp.float32
                        )
                        return (dk, dv), dq

                    def skip(carry):
                        return carry, jnp.zeros_like(q_blk, jnp.float32)

                    run = block_rule(mask, qs, ks)
                    return jax.lax.cond(run, grads, skip, carry)

                (dk, dv), dq = jax.lax.scan(
                    q_step, (zero_kv, zero_kv), (qt, dot_, lt, delt, qi, q_sum)
                )
                return dq_acc + dq, (dk, dv)

            dq0 = jnp.zeros_like(qt, jnp.float32)
            dq, (dk, dv) = jax.lax.scan(kv_tile, dq0, (kt, vt, ki, k_sum))
            dq = jnp.moveaxis(dq, 0, 3).reshape(b, h, nq * bq, d)[:, :, :q_len]

            def kv_back(x):
                return jnp.moveaxis(x, 0, 2).reshape(b, kh, nk * bk, d)[:, :, :kv_len]

            return dq, kv_back(dk), kv_back(dv)
