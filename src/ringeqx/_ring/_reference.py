"""Dense attention with ringeqx semantics, for tests and users."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._layout._layout import Layout
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._score_mods import AbstractScoreMod
from ._call import NO_COMPAT, Attention, input_order, resolve_attention


def reference_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    *,
    mask: AbstractMask | None = None,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    layout: Layout | None = None,
    scale: float | None = None,
    score_mod: AbstractScoreMod | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
    sinks: Float[Array, " heads"] | None = None,
    order: Literal["original", "layout"] = "original",
) -> Float[Array, "*batch seq heads head_dim"]:
    """The dense answer of [`ringeqx.ring_attention`][] on one device, in float32.

    Same arguments, checks and semantics (the front door's resolution: masks, segment
    ids, the layout and `order`, score modifiers, zero rows where nothing is attended);
    it materialises the full score matrix, so use it for small problems. `sinks` (one
    logit per head) join every row's softmax denominator as a key of value zero.
    """
    a = resolve_attention(
        q,
        k,
        v,
        mask=mask,
        segment_ids=segment_ids,
        layout=layout,
        scale=scale,
        score_mod=score_mod,
        span_ids=span_ids,
        sinks=sinks,
        compat=NO_COMPAT,
    )
    original = input_order(layout, a.q.shape[-3], order) == "original"
    a.mask.check(a.q.shape[-3] if layout is None else layout.seq_len)
    if layout is not None and original:
        a = eqx.tree_at(
            lambda a: (a.q, a.k, a.v), a, tuple(layout.shard(x, axis=-3) for x in (a.q, a.k, a.v))
        )
    out = _dense(a, layout)
    return layout.unshard(out, axis=-3) if layout is not None and original else out


def _dense(a: Attention, layout: Layout | None) -> Array:
    """Dense attention of the resolved `a` (q/k/v in layout order when `layout`)."""
    q, k, v = a.q, a.k, a.v
    mask, score_mod, sinks, scale = a.mask, a.score_mod, a.sinks, a.scale
    segment_ids, span_ids = a.segment_ids, a.span_ids
    seq, heads = q.shape[-3], q.shape[-2]
    kv_heads = k.shape[-2]
    if layout is None:
        pos = jnp.arange(seq, dtype=jnp.int32)
        seg = pos * 0 - 1 if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
        span = pos * 0 - 1 if span_ids is None else jnp.asarray(span_ids, jnp.int32)
        info = TokenInfo(*jnp.broadcast_arrays(pos, seg, span, pos >= 0))
    else:
        info = layout.token_info()
    # info: [*batch or (), seq]
    # Queries [..., 1 (heads), seq, 1] against keys [..., 1 (heads), 1, seq].
    qi = info.expand(-1).expand(-3)
    ki = info.expand(-2).expand(-3)
    ok = mask.allows(qi, ki) & qi.valid & ki.valid
    g = heads // kv_heads
    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), g, axis=-2)
    vf = jnp.repeat(v.astype(jnp.float32), g, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", qf, kf) * scale
    if score_mod is not None:
        s = score_mod(s, qi, ki)
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        z = sinks.astype(jnp.float32).reshape(heads, 1, 1)
        z = z.reshape((1,) * (s.ndim - 3) + z.shape)
        m = jnp.maximum(m, z)
    # Softmax does not depend on the shift: no gradient through the max (and none of its
    # tie-breaking at -inf rows).
    m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(z - m)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("...hqk,...khd->...qhd", p, vf)
    return out.astype(q.dtype)
