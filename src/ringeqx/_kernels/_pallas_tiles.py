"""The tile maths and the input plumbing that both Pallas kernels share.

A Pallas program sees one `[block_q, head_dim]` tile of one query head and walks the key
tiles. Everything here acts on values already loaded from refs, so the Triton kernel
(`_pallas_gpu.py`) and the Mosaic kernel (`_pallas_tpu.py`) differ only in how they lay
out the grid, load tiles and keep their accumulators. The dense reference for all of it
is `XlaKernel` (`_xla.py`), which the contract tests compare against.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int

from .._masks import AbstractMask
from .._score_mods import AbstractScoreMod
from .._tokens import TokenInfo


# Row order of the int32 token records that the kernels receive.
RECORD_FIELDS = ("positions", "segments", "spans", "valid")
_RECORD_FILL = (0, -1, -1, 0)

# `(((1,), (1,)), ((), ()))`: contract the last axes of both, i.e. `a @ b.T`.
_NT = (((1,), (1,)), ((), ()))
# `a.T @ b`.
_TN = (((0,), (0,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def round_up(x: int, multiple: int) -> int:
    return multiple * math.ceil(x / multiple)


def pad_axis(x: Array, axis: int, size: int, value: Any = 0) -> Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def records(info: TokenInfo, length: int) -> Int[Array, "batch 4 length"]:
    """Stack a `[batch, len]` TokenInfo into one int32 array `[batch, 4, length]`,
    padded with invalid slots (one kernel input instead of four)."""
    rows = [
        pad_axis(getattr(info, name).astype(jnp.int32), 1, length, fill)
        for name, fill in zip(RECORD_FIELDS, _RECORD_FILL)
    ]
    return jnp.stack(rows, axis=1)


def token_info(rows: Sequence[Array]) -> TokenInfo:
    """Rebuild a TokenInfo from four loaded record rows (any common shape)."""
    positions, segments, spans, valid = rows
    return TokenInfo(positions, segments, spans, valid != 0)


def check_inputs(
    kernel_name: str,
    q: Array,
    k: Array,
    v: Array,
    dtypes: tuple[str, ...],
    head_dim_ok: Callable[[int], bool],
    head_dim_rule: str,
) -> None:
    """Trace-time checks of what a Pallas kernel can run on its device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in dtypes:
            raise TypeError(
                f"{kernel_name} does not support dtype {jnp.dtype(x.dtype).name} for "
                f"`{name}`; supported dtypes: {', '.join(dtypes)}."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{kernel_name} needs q, k and v of one dtype; got {q.dtype}, {k.dtype} "
            f"and {v.dtype}."
        )
    head_dim = q.shape[-1]
    if not head_dim_ok(head_dim):
        raise ValueError(
            f"head_dim={head_dim} is not supported by {kernel_name}, which needs "
            f"{head_dim_rule}."
        )


def split_operands(
    mask: AbstractMask, score_mod: AbstractScoreMod | None
) -> tuple[list[Array], Callable[[Sequence[Any]], tuple[AbstractMask, Any]]]:
    """Split the mask and score modifier of a call for a `pallas_call`.

    A kernel body may not close over traced arrays, so the array leaves of the two
    pytrees (a block-sparse table, ALiBi slopes, a softcap traced by the ring) become
    whole-array kernel inputs and the rest stays static. Leaves are passed with at least
    one dimension and booleans as int32 (Triton and Mosaic load neither 0-d nor boolean
    refs).

    **Returns:** `(leaves, rebuild)`: the kernel inputs, and a function of their refs
    (inside the kernel) that gives back `(mask, score_mod)`.
    """
    dynamic, static = eqx.partition((mask, score_mod), eqx.is_array)
    values, treedef = jax.tree.flatten(dynamic)
    shapes = [jnp.shape(x) for x in values]
    dtypes = [jnp.asarray(x).dtype for x in values]
    leaves = [
        jnp.atleast_1d(jnp.asarray(x, jnp.int32 if d == jnp.bool_ else d))
        for x, d in zip(values, dtypes)
    ]

    def rebuild(refs: Sequence[Any]) -> tuple[AbstractMask, Any]:
        loaded = [
            ref[...].reshape(shape).astype(dtype)
            for ref, shape, dtype in zip(refs, shapes, dtypes)
        ]
        return eqx.combine(jax.tree.unflatten(treedef, loaded), static)

    return leaves, rebuild


def whole_array_specs(leaves: Sequence[Array]) -> list[Any]:
    """Block specs that hand each leaf to every program whole."""
    return [pl.BlockSpec(x.shape, lambda *_, n=x.ndim: (0,) * n) for x in leaves]


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
    s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    if score_mod is None:
        return s, lambda ds: ds

    def mod(s):
        # The modifier's contract: scores `[*batch, heads, q, k]`, records
        # `[*batch, 1, q, 1]` and `[*batch, 1, 1, k]`; here batch and heads are 1.
        q4 = jax.tree.map(lambda x: x[None, None], qi)
        k4 = jax.tree.map(lambda x: x[None, None], ki)
        out = score_mod(s[None, None], q4, k4)
        if out.shape != (1, 1) + s.shape:
            raise ValueError(
                f"score_mod {type(score_mod).__name__}.for_head(h) must give scores "
                f"of the one-head tile's shape {(1, 1) + s.shape}; got {out.shape}."
            )
        return out[0, 0]

    s, vjp = jax.vjp(mod, s)
    return s, lambda ds: vjp(ds)[0]


class Softmax(eqx.Module):
    """Online softmax state of a query tile: running max `m` and running sum `total`
    (both `[bq, 1]`), and the unnormalised output `acc` (`[bq, d]`), all float32."""

    m: Array
    total: Array
    acc: Array

    @staticmethod
    def init(block_q: int, head_dim: int) -> "Softmax":
        zero = jnp.zeros((block_q, 1), jnp.float32)
        return Softmax(
            zero - jnp.inf, zero, jnp.zeros((block_q, head_dim), jnp.float32)
        )

    def update(self, s: Array, ok: Array, v: Array) -> "Softmax":
        """Fold in a tile of logits `s` (`ok` marks attending pairs) and values `v`."""
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(self.m, jnp.max(s, axis=1, keepdims=True))
        # Rows that have seen nothing keep m = -inf; exponentiate against 0 instead.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(self.m - m_safe)
        total = self.total * alpha + jnp.sum(p, axis=1, keepdims=True)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32
        )
        return Softmax(m_new, total, self.acc * alpha + pv)

    def finish(self) -> tuple[Array, Array]:
        """`(out [bq, d], lse [bq, 1])`; rows that saw nothing give 0 and -inf."""
        seen = self.total > 0
        total = jnp.where(seen, self.total, 1.0)
        return self.acc / total, jnp.where(seen, self.m + jnp.log(total), -jnp.inf)


def tile_grads(
    q: Array,
    k: Array,
    v: Array,
    d_out: Array,
    lse: Array,
    delta: Array,
    qi: TokenInfo,
    ki: TokenInfo,
    mask: AbstractMask,
    score_mod: AbstractScoreMod | None,
    scale: float,
) -> tuple[Array, Array]:
    """Probabilities `p` (from the global lse, `[bq, 1]` with -inf replaced by 0) and
    the logit gradients `ds` of one tile, both `[bq, bk]` float32 (Flash Attention
    2)."""
    s, mod_vjp = logits(q, k, qi, ki, score_mod, scale)
    p = jnp.where(allowed(mask, qi, ki), jnp.exp(s - lse), 0.0)
    dp = jax.lax.dot_general(d_out, v, _NT, preferred_element_type=jnp.float32)
    ds = mod_vjp(p * (dp - delta)) * scale
    return p, ds


def matmul_tn(a: Array, b: Array) -> Array:
    """`a.T @ b` in float32 (dK, dV from a tile of probabilities or logit gradients)."""
    return jax.lax.dot_general(a, b, _TN, preferred_element_type=jnp.float32)


def matmul(a: Array, b: Array) -> Array:
    """`a @ b` in float32."""
    return jax.lax.dot_general(a, b, _NN, preferred_element_type=jnp.float32)
