"""The tile maths that both Pallas kernels share, on values already loaded from refs.

A Pallas program sees one `[block_q, head_dim]` tile of one query head and walks the key
tiles. Everything here acts on values already loaded from refs, so the Triton kernel
(`_triton/`) and the Mosaic kernel (`_mosaic/`) differ only in how they lay out the
grid, load tiles and keep their accumulators. The dense reference for all of it is
`XlaKernel` (`_xla.py`), which the contract tests compare against. Padding, token record
tiling and the online softmax, which `XlaKernel` and `schedule` share, live in
`_tiling.py` (no Pallas import) and are re-exported here.
"""

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..._layout._tokens import TokenInfo
from ..._masks._base import AbstractMask
from ..._score_mods import AbstractScoreMod
from .._tiling import (
    RECORD_FIELDS as RECORD_FIELDS,
    Softmax as Softmax,
    matmul as matmul,
    pad_axis as pad_axis,
    pad_info,
)


# `(((1,), (1,)), ((), ()))`: contract the last axes of both, i.e. `a @ b.T`.
_NT = (((1,), (1,)), ((), ()))
# `a.T @ b`.
_TN = (((0,), (0,)), ((), ()))


def round_up(x: int, multiple: int) -> int:
    return multiple * math.ceil(x / multiple)


def records(info: TokenInfo, length: int) -> Int[Array, "batch 4 length"]:
    """Stack a `[batch, len]` TokenInfo into one int32 array `[batch, 4, length]`,
    padded with invalid slots (one kernel input instead of four)."""
    padded = pad_info(info, length)
    rows = [getattr(padded, name).astype(jnp.int32) for name in RECORD_FIELDS]
    return jnp.stack(rows, axis=1)


def token_info(rows: Sequence[Array]) -> TokenInfo:
    """Rebuild a TokenInfo from four loaded record rows (any common shape)."""
    positions, segments, spans, valid = rows
    return TokenInfo(positions, segments, spans, valid != 0)


def allowed(mask: AbstractMask, qi: TokenInfo, ki: TokenInfo) -> Array:
    """`[bq, bk]`: pairs of a query tile (`[bq, 1]` records) and a key tile (`[1, bk]`)
    that attend; padding never does."""
    return mask.allows(qi, ki) & qi.valid & ki.valid


def logits(
    q: Array,
    k: Array,
    qi: TokenInfo,
    ki: TokenInfo,
    score_mod: AbstractScoreMod | None,
    scale: float,
) -> tuple[Array, Callable[[Array], Array]]:
    """Scaled, modified float32 logits `[bq, bk]` of one head, and the vjp of the
    modifier (identity without one). `score_mod` is already restricted to this head."""
    s = _scaled(jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32), scale)
    if score_mod is None:
        return s, lambda ds: ds

    def mod(s):
        # The modifier's contract: scores `[*batch, heads, q, k]`, records
        # `[*batch, 1, q, 1]` and `[*batch, 1, 1, k]`; here batch and heads are 1.
        # The scores are reshaped, not indexed with `None`: the transpose of a reshape is a
        # reshape, where that of `s[None, None]` is a sum over two axes, which Triton's
        # lowering in JAX 0.12 cannot do under an explicit mesh (it keeps the 4-d
        # sharding on the 3-d partial sum).
        q4 = jax.tree.map(lambda x: x[None, None], qi)
        k4 = jax.tree.map(lambda x: x[None, None], ki)
        out = score_mod(s.reshape((1, 1) + s.shape), q4, k4)
        if out.shape != (1, 1) + s.shape:
            raise ValueError(
                f"score_mod {type(score_mod).__name__}.for_head(h) must give scores "
                f"of the one-head tile's shape {(1, 1) + s.shape}; got {out.shape}."
            )
        return out.reshape(s.shape)

    s, vjp = jax.vjp(mod, s)
    return s, lambda ds: vjp(ds)[0]


# Rows of ones that `nan_columns` multiplies by: 16, Triton's smallest matmul side (and
# a multiple of Mosaic's sublanes for every dtype).
_ROWS = 16


def nan_columns(s: Array, x: Array) -> tuple[Array, Array]:
    """For a tile of logits `s` (`[bq, bk]`) and a key-side tile `x` (`[bk, d]`, K or
    V): `s` with NaN in the columns whose row of `x` is not finite, and `x` with its
    non-finite values zeroed.

    Masked pairs then contribute exactly nothing: the mask replaces their logits (or
    zeroes their probabilities), and 0 x a zeroed value is 0, where 0 x NaN was NaN.
    A query row that does attend a non-finite key or value row still gets NaN, through
    its logits, as in `XlaKernel` and dense attention. The cost: one add on the score
    tile, a select on `x` and a `[16, d] @ x.T` matmul per key tile.

    The row flags reach the columns of `s` (lanes) through that small matmul with ones
    and a max over its rows (sublanes): a reduction over `d` would leave them along
    sublanes, and moving them to lanes is a transpose, which the kernels avoid.
    """
    # In float32 (Mosaic's is_finite takes float32 only), cast back after the select.
    x32 = x.astype(jnp.float32)
    finite = jnp.isfinite(x32)
    ones = jnp.ones((_ROWS, x.shape[-1]), jnp.float32)
    bad = jnp.where(finite, 0.0, 1.0)
    counts = jax.lax.dot_general(ones, bad, _NT, preferred_element_type=jnp.float32)
    nan = jnp.where(jnp.max(counts, axis=0, keepdims=True) > 0, jnp.nan, 0.0)
    return s + nan, jnp.where(finite, x32, 0.0).astype(x.dtype)


def tile_grads(
    q: Array,
    k: Array,
    v: Array,
    d_out: Array,
    lse: Array,
    delta: Array,
    qi: TokenInfo,
    ki: TokenInfo,
    mask: AbstractMask | None,
    score_mod: AbstractScoreMod | None,
    scale: float,
) -> tuple[Array, Array, Array]:
    """Probabilities `p` (from the global lse, `[bq, 1]` or as wide as the tile, with
    -inf replaced by 0; `delta` likewise) and the logit gradients `ds` of one tile,
    both `[bq, bk]` float32 (Flash Attention 2),
    and `k` with its non-finite values zeroed (`nan_columns`), for dQ = dS K: masked
    pairs contribute exactly nothing to any of them. `mask=None` is a dense tile (every
    pair attends, `MaskReader.dense`): no elementwise mask, and `k` as it is, as in
    `XlaKernel`'s dense branch."""
    s, mod_vjp = logits(q, k, qi, ki, score_mod, scale)
    if mask is None:  # a dense tile: a non-finite K or V row reaches every row as is
        p = jnp.exp(s - lse)
        dp = jax.lax.dot_general(d_out, v, _NT, preferred_element_type=jnp.float32)
        return p, _scaled(mod_vjp(p * (dp - delta)), scale), k
    s, k_finite = nan_columns(s, k)
    ok = allowed(mask, qi, ki)
    p = jnp.where(ok, jnp.exp(s - lse), 0.0)
    dp = jax.lax.dot_general(d_out, v, _NT, preferred_element_type=jnp.float32)
    # A non-finite value row makes its column of dP non-finite: masked pairs drop it.
    dp = jnp.where(ok, dp, 0.0)
    ds = _scaled(mod_vjp(p * (dp - delta)), scale)
    return p, ds, k_finite


def _scaled(x: Array, scale: float) -> Array:
    """`x * scale`, no multiply for 1 (a kernel that feeds pre-scaled queries)."""
    return x if scale == 1.0 else x * scale


def matmul_tn(a: Array, b: Array) -> Array:
    """`a.T @ b` in float32 (dK, dV from a tile of probabilities or logit gradients)."""
    return jax.lax.dot_general(a, b, _TN, preferred_element_type=jnp.float32)
