"""`XlaKernel`: tiled flash attention in plain JAX; runs on every backend."""

import functools
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
from ._tiling import Softmax, pad_axis, tile_info


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


def _q_tiles(x: Array, kv_heads: int, num: int, block: int) -> Array:
    """`[b, heads, len, *rest]` -> `[num, b, kv_heads, groups, block, *rest]`, padded."""
    b, h = x.shape[:2]
    x = pad_axis(x, 2, num * block)
    x = x.reshape((b, kv_heads, h // kv_heads, num, block) + x.shape[3:])
    return jnp.moveaxis(x, 3, 0)


def _kv_tiles(x: Array, num: int, block: int) -> Array:
    """`[b, kv_heads, len, d]` -> `[num, b, kv_heads, block, d]`, padded."""
    b, kh, _, d = x.shape
    return jnp.moveaxis(pad_axis(x, 2, num * block).reshape(b, kh, num, block, d), 2, 0)


def _untile(x: Array, head_axes: int, length: int) -> Array:
    """Inverse of `_q_tiles` (`head_axes=2`) and `_kv_tiles` (`head_axes=1`):
    `[b, heads, length, *rest]`."""
    x = jnp.moveaxis(x, 0, 1 + head_axes)  # [b, *heads, num, block, *rest]
    heads = math.prod(x.shape[1 : 1 + head_axes])
    num, block = x.shape[1 + head_axes : 3 + head_axes]
    x = x.reshape((x.shape[0], heads, num * block) + x.shape[3 + head_axes :])
    return x[:, :, :length]


def _info_tiles(info: TokenInfo, num: int, block: int) -> tuple[TokenInfo, BlockSummary]:
    """`[batch, len]` records -> `[num, batch, block]` tiles and their summaries."""
    tiles = tile_info(info, num, block, axis=0)
    return tiles, BlockSummary.of(tiles, axis=(1, 2))


def _tile_grads(q, k, v, d_out, lse, delta, qi, ki, mask, score_mod, scale):
    """`(dq, dk, dv)` contributions of one `[b, kv_heads, groups, bq]` x `[b, kv_heads,
    bk]` tile, float32 (Flash Attention 2)."""
    s, mod_vjp = _logits(q, k, qi, ki, score_mod, scale)
    ok = _pair_mask(mask, qi, ki)[:, None, None]
    p = jnp.where(ok, jnp.exp(s - lse[..., None]), 0.0)
    f32 = jnp.float32
    p_low = p.astype(d_out.dtype)
    dv = jnp.einsum("bhgqk,bhgqd->bhkd", p_low, d_out, preferred_element_type=f32)
    dp = jnp.einsum("bhgqd,bhkd->bhgqk", d_out, v, preferred_element_type=f32)
    # Masked pairs contribute exactly nothing, a non-finite K or V row included.
    dp = jnp.where(ok, dp, 0.0)
    ds = (mod_vjp(p * (dp - delta[..., None])) * scale).astype(q.dtype)
    k_finite, k_bad = _finite_rows(k)
    dq = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_finite, preferred_element_type=f32)
    dq = jnp.where(_attends(ok, k_bad), jnp.nan, dq)
    dk = jnp.einsum("bhgqk,bhgqd->bhkd", ds, q, preferred_element_type=f32)
    return dq, dk, dv


def _pv(p: Array, v: Array) -> Array:
    return jnp.einsum("bhgqk,bhkd->bhgqd", p, v, preferred_element_type=jnp.float32)


def _finite_rows(x: Array) -> tuple[Array, Array]:
    """`x` `[b, h, k, d]` with its non-finite rows zeroed, and where they were `[b, h, k]`."""
    bad = ~jnp.all(jnp.isfinite(x), axis=-1)
    return jnp.where(bad[..., None], 0, x), bad


def _attends(ok: Array, bad: Array) -> Array:
    """`[b, h, 1, bq, 1]`: the query rows that attend one of the `bad` key rows."""
    return jnp.any(ok & bad[:, :, None, None], axis=-1)[..., None]


def _masked_pv(p: Array, v: Array, ok: Array) -> Array:
    """`p @ v` in which masked pairs contribute exactly nothing. Their probabilities are
    already 0, but 0 * NaN is NaN: value rows that are not finite are zeroed, and NaN is
    given back only to the query rows that attend them."""
    v_finite, bad = _finite_rows(v)
    return jnp.where(_attends(ok, bad), jnp.nan, _pv(p, v_finite))


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
            kh = k.shape[1]
            bq, nq = _tile_sizes(self.block_q, q_len)
            bk, nk = _tile_sizes(self.block_kv, k.shape[2])
            qi, q_sum = _info_tiles(q_info, nq, bq)
            ki, k_sum = _info_tiles(kv_info, nk, bk)
            kv = (_kv_tiles(k, nk, bk), _kv_tiles(v, nk, bk), ki, k_sum)

            def q_tile(xs):
                q_blk, qi_blk, qs = xs
                # Derive the carry from the inputs so that it has their sharding type.
                zero = jnp.zeros_like(q_blk[..., :1], jnp.float32)
                init = Softmax(zero - jnp.inf, zero, jnp.zeros_like(q_blk, jnp.float32))

                def kv_step(acc, ys):
                    k_blk, v_blk, ki_blk, ks = ys

                    def update(acc):
                        s, _ = _logits(q_blk, k_blk, qi_blk, ki_blk, score_mod, scale)
                        ok = _pair_mask(mask, qi_blk, ki_blk)[:, None, None]
                        pv = functools.partial(_masked_pv, ok=ok)
                        return acc.update(s, ok, v_blk, pv)

                    run = block_rule(mask, qs, ks)
                    return jax.lax.cond(run, update, lambda c: c, acc), None

                acc, _ = jax.lax.scan(kv_step, init, kv)
                out, lse = acc.finish()
                return out, lse[..., 0]

            out, lse = jax.lax.map(q_tile, (_q_tiles(q, kh, nq, bq), qi, q_sum))
            return _untile(out, 2, q_len), _untile(lse, 2, q_len)

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
            q_len, kh, kv_len = q.shape[2], k.shape[1], k.shape[2]
            bq, nq = _tile_sizes(self.block_q, q_len)
            bk, nk = _tile_sizes(self.block_kv, kv_len)
            qi, q_sum = _info_tiles(q_info, nq, bq)
            ki, k_sum = _info_tiles(kv_info, nk, bk)
            lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
            qs_in = [_q_tiles(x, kh, nq, bq) for x in (q, d_out, lse_safe, delta)]

            def kv_tile(dq_acc, xs):
                k_blk, v_blk, ki_blk, ks = xs
                zero_kv = jnp.zeros_like(k_blk, jnp.float32)

                def q_step(carry, ys):
                    q_blk, do_blk, l_blk, de_blk, qi_blk, qs = ys

                    def grads(carry):
                        blocks = (q_blk, k_blk, v_blk, do_blk, l_blk, de_blk)
                        dq, dk, dv = _tile_grads(
                            *blocks, qi_blk, ki_blk, mask, score_mod, scale
                        )
                        return (carry[0] + dk, carry[1] + dv), dq

                    def skip(carry):
                        return carry, jnp.zeros_like(q_blk, jnp.float32)

                    return jax.lax.cond(block_rule(mask, qs, ks), grads, skip, carry)

                ys = (*qs_in, qi, q_sum)
                (dk, dv), dq = jax.lax.scan(q_step, (zero_kv, zero_kv), ys)
                return dq_acc + dq, (dk, dv)

            kv = (_kv_tiles(k, nk, bk), _kv_tiles(v, nk, bk), ki, k_sum)
            dq0 = jnp.zeros_like(qs_in[0], jnp.float32)
            dq, (dk, dv) = jax.lax.scan(kv_tile, dq0, kv)
            return _untile(dq, 2, q_len), _untile(dk, 1, kv_len), _untile(dv, 1, kv_len)
