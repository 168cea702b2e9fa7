"""`XlaKernel`: tiled flash attention in plain JAX; runs on every backend."""

import functools
import math
from types import MappingProxyType
from typing import Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PyTree

from .._layout._tokens import BlockSummary, TokenInfo
from .._masks._base import AbstractMask, tile_branch
from .._score_mods import AbstractScoreMod
from .._util._numbers import as_int, shown
from ._base import AbstractAttentionKernel, Scores
from ._tiling import Softmax, pad_axis, tile_info


def _pair_mask(
    mask: AbstractMask, qi: TokenInfo, ki: TokenInfo, keys_first: bool = False
) -> Bool[Array, "b q k"]:
    """Which pairs of a `[b, bq]` x `[b, bk]` tile attend (padding never does):
    `[b, bq, bk]`, or `[b, bk, bq]` with `keys_first`."""
    q, k = (qi.expand(1), ki.expand(2)) if keys_first else (qi.expand(2), ki.expand(1))
    return mask.allows(q, k) & q.valid & k.valid


def _modify(score_mod: AbstractScoreMod, s: Array, qi: TokenInfo, ki: TokenInfo) -> Array:
    """`score_mod` on logits `[b, kv_heads, groups, bq, bk]` (its own `[heads, q, k]`
    orientation)."""
    b, kh, g, bq, bk = s.shape
    out = score_mod(
        s.reshape(b, kh * g, bq, bk),
        jax.tree.map(lambda x: x[:, None, :, None], qi),
        jax.tree.map(lambda x: x[:, None, None, :], ki),
    )
    return out.reshape(s.shape)


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
            return jnp.moveaxis(_modify(score_mod, s, qi, ki), -1, 2).reshape(b, kh, bk, rows)
        s = _modify(score_mod, s.reshape(b, kh, groups, bq, bk), qi, ki)
        return s.reshape(b, kh, rows, bk)

    s, vjp = jax.vjp(mod, s)
    return s, lambda ds: vjp(ds)[0]


def _tile_sizes(block: int, length: int) -> tuple[int, int]:
    size = min(block, length)
    return size, math.ceil(length / size)


def _grouped(x: Array, kv_heads: int, length: int) -> Array:
    """`[b, heads, len, *rest]` -> `[b, kv_heads, groups, length, *rest]`, padded to
    `length`: a reshape, no copy unless padding is needed."""
    b, h = x.shape[:2]
    x = pad_axis(x, 2, length)
    return x.reshape((b, kv_heads, h // kv_heads) + x.shape[2:])


def _ungrouped(x: Array, length: int) -> Array:
    """Inverse of `_grouped`: `[b, heads, length, *rest]`."""
    x = x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])
    return x[:, :, :length]


def _tile(x: Array, index, block: int, axis: int) -> Array:
    """Tile `index` (traced) of `block` tokens along `axis`: a slice, not a copy of `x`."""
    return jax.lax.dynamic_slice_in_dim(x, index * block, block, axis)


def _add_tile(x: Array, update: Array, index, block: int, axis: int) -> Array:
    """`x` with `update` added to its tile `index` (in place in a loop)."""
    old = _tile(x, index, block, axis)
    return jax.lax.dynamic_update_slice_in_dim(x, old + update, index * block, axis)


def _loop(num: int, body, init):
    """`lax.fori_loop(0, num, body, init)`, or the body itself for one tile (no loop, so
    no loop-carried copies of whole buffers)."""
    if num == 1:
        return body(0, init)
    return jax.lax.fori_loop(0, num, body, init)


def _pick(tree, index):
    """Entry `index` of stacked per-tile records."""
    return jax.tree.map(lambda x: x[index], tree)


class _Tiles(NamedTuple):
    """Per-tile token records `[num, batch, block]`, their summaries, and whether every
    token of a tile is valid `[num]`."""

    info: TokenInfo
    summary: BlockSummary
    full: Array


def _info_tiles(info: TokenInfo, num: int, block: int) -> _Tiles:
    """`[batch, len]` records -> `[num, batch, block]` tiles and their summaries."""
    tiles = tile_info(info, num, block, axis=0)
    return _Tiles(tiles, BlockSummary.of(tiles, axis=(1, 2)), jnp.all(tiles.valid, axis=(1, 2)))


def _which(mask: AbstractMask, q: _Tiles, k: _Tiles, i, j):
    """The branch tile `(i, j)` takes (`tile_branch`): 0 skipped, 1 masked, 2 dense."""
    return tile_branch(mask, _pick(q.summary, i), _pick(k.summary, j), q.full[i], k.full[j])


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
        ok = _pair_mask(mask, qi, ki, keys_first=True)[:, None, :, None, :]
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
            bq, nq = _tile_sizes(self.block_q, q_len)
            bk, nk = _tile_sizes(self.block_kv, k.shape[2])
            q_tiles, k_tiles = _info_tiles(q_info, nq, bq), _info_tiles(kv_info, nk, bk)
            qi, ki = q_tiles.info, k_tiles.info
            # Tiles are sliced where they lie (no tiled copies of q, k, v or out).
            qg = _grouped(q, kh, nq * bq)
            k, v = (pad_axis(x, 2, nk * bk) for x in (k, v))

            def q_tile(i, out_lse):
                q_blk, qi_blk = _tile(qg, i, bq, 3), _pick(qi, i)
                # A query head's group is folded into the rows: `[b, kv_heads, g * bq, d]`.
                b, _, g, _, d = q_blk.shape
                q2 = q_blk.reshape(b, kh, g * bq, d)
                # Derive the carry from the inputs so that it has their sharding type.
                zero = jnp.zeros_like(q2[..., :1], jnp.float32)
                init = Softmax(zero - jnp.inf, zero, jnp.zeros_like(q2, jnp.float32))

                def kv_step(acc, j):
                    ki_blk = _pick(ki, j)

                    def update(acc, dense: bool):
                        # Sliced inside the branch: a skipped tile copies nothing.
                        k_blk, v_blk = _tile(k, j, bk, 2), _tile(v, j, bk, 2)
                        s, _ = _logits(q2, k_blk, qi_blk, ki_blk, score_mod, scale, g)
                        if dense:
                            return acc.update(s, None, v_blk, _pv)
                        ok = _pair_mask(mask, qi_blk, ki_blk)[:, None, None]
                        ok = jnp.broadcast_to(ok, (b, 1, g, bq, bk)).reshape(b, 1, g * bq, bk)
                        pv = functools.partial(_masked_pv, ok=ok)
                        return acc.update(s, ok, v_blk, pv)

                    branches = (lambda c: c, functools.partial(update, dense=False))
                    branches += (functools.partial(update, dense=True),)
                    return jax.lax.switch(_which(mask, q_tiles, k_tiles, i, j), branches, acc), None

                acc, _ = jax.lax.scan(kv_step, init, jnp.arange(nk))
                o, lse = acc.finish()
                out, lse_all = out_lse
                update = jax.lax.dynamic_update_slice_in_dim
                return (
                    update(out, o.reshape(q_blk.shape), i * bq, 3),
                    update(lse_all, lse.reshape(q_blk.shape[:-1]), i * bq, 3),
                )

            out = jnp.zeros_like(qg, jnp.float32)
            out, lse = _loop(nq, q_tile, (out, out[..., 0]))
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
            bq, nq = _tile_sizes(self.block_q, q_len)
            bk, nk = _tile_sizes(self.block_kv, kv_len)
            q_tiles, k_tiles = _info_tiles(q_info, nq, bq), _info_tiles(kv_info, nk, bk)
            qi, ki = q_tiles.info, k_tiles.info
            lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
            # Tiles are sliced where they lie, and gradients are added into their tiles.
            qs_in = [_grouped(x, kh, nq * bq) for x in (q, d_out, lse_safe, delta)]
            k, v = (pad_axis(x, 2, nk * bk) for x in (k, v))

            def kv_tile(j, grads_all):
                k_blk, v_blk, ki_blk = _tile(k, j, bk, 2), _tile(v, j, bk, 2), _pick(ki, j)

                def q_step(carry, i):
                    dq_all, dk, dv = carry

                    def grads(dense: bool):
                        # Sliced inside the branch: a skipped tile copies nothing.
                        q_blk, do_blk, l_blk, de_blk = (_tile(x, i, bq, 3) for x in qs_in)
                        tiles = (q_blk, k_blk, v_blk, do_blk, l_blk, de_blk)
                        args = (_pick(qi, i), ki_blk, mask, score_mod, scale, dense)
                        return _tile_grads(*tiles, *args)

                    def skip():
                        # Zeros shaped like a dQ^T tile, derived from the carry so that
                        # they share its sharding type.
                        zero_q = jnp.zeros_like(dq_all[..., :bq])
                        return zero_q, jnp.zeros_like(dk), jnp.zeros_like(dv)

                    branches = (skip, functools.partial(grads, False))
                    branches += (functools.partial(grads, True),)
                    index = _which(mask, q_tiles, k_tiles, i, j)
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
            dq_t, dk, dv = _loop(nk, kv_tile, (dq_t, dk0, dk0))
            return (
                _ungrouped(jnp.moveaxis(dq_t, 2, -1), q_len),
                dk[:, :, :kv_len],
                dv[:, :, :kv_len],
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
        bq, nq = _tile_sizes(block_q, q_len)
        bk, nk = _tile_sizes(block_kv, kv_len)
        q_tiles, k_tiles = _info_tiles(q_info, nq, bq), _info_tiles(kv_info, nk, bk)
        lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        qs_in = [_grouped(x, kh, nq * bq) for x in (q, d_out, lse_safe, delta)]
        k, v = (pad_axis(x, 2, nk * bk) for x in (k, v))

        def tile(i, j, grads):
            q_blk, do_blk, l_blk, de_blk = (_tile(x, i, bq, 3) for x in qs_in)
            k_blk, v_blk = _tile(k, j, bk, 2), _tile(v, j, bk, 2)
            qi, ki = _pick(q_tiles.info, i), _pick(k_tiles.info, j)
            b, _, g, _, d = q_blk.shape
            q2, do2 = (x.reshape(b, kh, g * bq, d) for x in (q_blk, do_blk))
            lse2, de2 = (x.reshape(b, kh, g * bq, 1) for x in (l_blk, de_blk))
            ok = _pair_mask(mask, qi, ki)[:, None, None]
            ok = jnp.broadcast_to(ok, (b, 1, g, bq, bk)).reshape(b, 1, g * bq, bk)
            raw = jnp.einsum("bhqd,bhkd->bhqk", q2, k_blk, preferred_element_type=f32) * scale
            raw = jnp.where(ok, raw, 0.0)

            def logits(p):
                mod = eqx.combine(p, rest)
                s = _modify(mod, raw.reshape(b, kh, g, bq, bk), qi, ki)
                return s.reshape(raw.shape)

            s, vjp = jax.vjp(logits, params)
            p = jnp.where(ok, jnp.exp(s - lse2), 0.0)
            dp = jnp.einsum("bhqd,bhkd->bhqk", do2, v_blk, preferred_element_type=f32)
            ds = jnp.where(ok, p * (dp - de2), 0.0)
            (new,) = vjp(ds)
            return jax.tree.map(lambda a, b: a + b.astype(f32), grads, new)

        def q_tile(i, grads):
            def kv_step(grads, j):
                run = _which(mask, q_tiles, k_tiles, i, j) > 0
                return jax.lax.cond(run, functools.partial(tile, i, j), lambda g: g, grads), None

            grads, _ = jax.lax.scan(kv_step, grads, jnp.arange(nk))
            return grads

        zero = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), f32), params)
        return _loop(nq, q_tile, zero)
