"""Score modifiers: functions applied to the attention logits before the softmax."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from ._layout._tokens import TokenInfo
from ._util._numbers import concrete_scalar


class AbstractScoreMod(eqx.Module):
    """Changes the scaled logits `s = scale * q . k` before masking and softmax.

    Kernels apply it tile by tile, forward and backward (the backward differentiates
    through it with `jax.vjp`), so any smooth elementwise function of the logit, the
    positions and the head index is exact under the ring. Masked pairs are removed after
    the modifier, so it never needs to mask itself.

    The modifier's floating array fields (a cap, ALiBi slopes, a user modifier's
    parameters) are trainable: where a caller differentiates them, the ring's backward
    adds one pass in plain JAX over the tiles of each step, whatever the kernel, which
    turns the logits' gradient into theirs through the modifier's own VJP and sums it
    round the ring (`jax.vjp` of `__call__`, so it must be differentiable in them). Where
    no leaf is differentiated, the pass is not built and costs nothing. Attention sinks
    are the `sinks=` argument of [`ringeqx.ring_attention`][], not a modifier.

    Subclass it to write your own (implement `__call__`, `for_head` and `check`, and
    `for_heads` if it has per-head parameters); combine several with [`ringeqx.Chain`][].
    """

    @abc.abstractmethod
    def __call__(
        self,
        scores: Float[Array, "*batch heads q k"],
        q: TokenInfo,
        k: TokenInfo,
    ) -> Float[Array, "*batch heads q k"]:
        """Return modified logits.

        **Arguments:**

        - `scores`: float32 logits, query heads on axis -3 (head `h` uses key/value head
            `h // (heads // kv_heads)`).
        - `q`, `k`: token records broadcastable against `scores` (shapes
            `[*batch, 1, q, 1]` and `[*batch, 1, 1, k]`).
        """

    @abc.abstractmethod
    def for_head(self, head: Int[Array, ""]) -> "AbstractScoreMod":
        """This modifier as seen by query head `head` alone.

        Pallas kernels run one head per program and call the result on scores whose
        heads axis has size 1 (`[1, 1, block_q, block_kv]`). A modifier without per-head
        parameters returns `self`; one with them (ALiBi slopes `[heads]`) returns a copy
        holding that head's slice, kept with a heads axis of size 1 (`slopes[head][None]`,
        with `head` a traced int32 scalar). The Pallas kernels call it under `jax.vmap`
        over all heads, before the kernel, and hand each program its head's arrays
        through a block spec (no per-head slicing inside the kernel, which Triton and
        Mosaic cannot lower).
        """

    def for_heads(self, first: Int[ArrayLike, ""], count: int) -> "AbstractScoreMod":
        """This modifier as seen by the `count` query heads `first, ..., first + count -
        1` alone (a contiguous chunk, with `count` static and `first` possibly traced).

        The Ulysses x ring hybrid (`RingConfig(ulysses_axis=...)`) calls it on each
        device, which holds one chunk of the heads: the result is called on scores whose
        heads axis has size `count`, and its `check(count)` must pass. The default
        returns `self`, right for a modifier without per-head parameters; one with them
        (ALiBi slopes `[heads]`) must override it to keep the chunk's slice.
        """
        return self

    @abc.abstractmethod
    def check(self, heads: int) -> None:
        """Trace-time check of the modifier against the number of query heads.

        Raise a `ValueError` naming the offending field when the modifier cannot serve
        `heads` query heads (ALiBi slopes of another length); a modifier without per-head
        parameters does nothing (`pass`). `ring_attention` and `reference_attention` call
        it before anything runs.
        """


def lift(x: Array, ndim: int) -> Array:
    """Prepend unit axes so that `x` has `ndim` axes (the tests forbid implicit rank
    promotion, and records may carry fewer batch axes than the scores)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


class Softcap(AbstractScoreMod):
    r"""Logit soft-capping: $s \mapsto \text{cap} \cdot \tanh(s / \text{cap})$ (Gemma 2, Grok).

    Applied to the scaled logits, before masking.

    **Arguments:**

    - `cap`: the cap, > 0 (a float or a float32 scalar array; a leaf, so new values do not
        recompile).
    """

    cap: Float[ArrayLike, ""]

    def __check_init__(self):
        cap = concrete_scalar(self.cap)  # None when traced: then it cannot be checked
        if cap is not None and not cap > 0:
            raise ValueError(f"Softcap `cap` must be > 0; got {self.cap!r}.")

    def __call__(
        self,
        scores: Float[Array, "*batch heads q k"],
        q: TokenInfo,
        k: TokenInfo,
    ) -> Float[Array, "*batch heads q k"]:
        cap = jnp.asarray(self.cap, scores.dtype)
        return cap * jnp.tanh(scores / cap)

    def for_head(self, head: Int[Array, ""]) -> "Softcap":
        return self

    def check(self, heads: int) -> None:
        pass


class ALiBi(AbstractScoreMod):
    r"""Attention with linear biases: $s_{hij} \mapsto s_{hij} - m_h\,|i - j|$.

    $i$ and $j$ are the original positions of the query and the key, so the bias is exact
    under every sharding strategy. On causal pairs this is the usual ALiBi
    ($m_h (j - i)$); the absolute value makes it symmetric for bidirectional masks.

    **Arguments:**

    - `slopes`: `float[heads]`, one slope per query head (the paper uses
        $m_h = 2^{-8 (h + 1) / \text{heads}}$). Its length must equal the number of query
        heads. They can be trained: the ring gives them their exact gradient.

    ??? cite "ALiBi"

        ```bibtex
        @inproceedings{press2022train,
          title={Train Short, Test Long: Attention with Linear Biases Enables Input Length
                 Extrapolation},
          author={Press, Ofir and Smith, Noah A. and Lewis, Mike},
          booktitle={ICLR},
          year={2022}
        }
        ```
    """

    slopes: Float[Array, " heads"]

    def __check_init__(self):
        shape = jnp.shape(self.slopes)
        if len(shape) != 1:
            raise ValueError(f"ALiBi `slopes` must be 1-D [heads]; got shape {shape}.")

    def __call__(
        self,
        scores: Float[Array, "*batch heads q k"],
        q: TokenInfo,
        k: TokenInfo,
    ) -> Float[Array, "*batch heads q k"]:
        heads = scores.shape[-3]
        self.check(heads)
        n = scores.ndim
        dist = jnp.abs(q.positions - k.positions).astype(scores.dtype)
        slopes = self.slopes.astype(scores.dtype).reshape(heads, 1, 1)
        return scores - lift(slopes, n) * lift(dist, n)

    def for_head(self, head: Int[Array, ""]) -> "ALiBi":
        return ALiBi(jax.lax.dynamic_slice_in_dim(self.slopes, head, 1))

    def for_heads(self, first: Int[ArrayLike, ""], count: int) -> "ALiBi":
        return ALiBi(jax.lax.dynamic_slice_in_dim(self.slopes, first, count))

    def check(self, heads: int) -> None:
        got = self.slopes.shape[0]
        if got != heads:
            raise ValueError(
                f"ALiBi `slopes` must have one entry per query head ({heads}); got {got}."
            )


class Chain(AbstractScoreMod):
    """Several modifiers applied in order: `Chain(a, b)(s) = b(a(s))`.

    **Example:** ALiBi, then a soft cap:
    `ringeqx.Chain(ringeqx.ALiBi(slopes), ringeqx.Softcap(30.0))`.
    """

    mods: tuple[AbstractScoreMod, ...]

    def __init__(self, *mods: AbstractScoreMod):
        for i, mod in enumerate(mods):
            if not isinstance(mod, AbstractScoreMod):
                raise TypeError(
                    f"Chain arguments must be AbstractScoreMod instances; argument {i} is "
                    f"{type(mod).__name__}."
                )
        self.mods = tuple(mods)

    def __call__(
        self,
        scores: Float[Array, "*batch heads q k"],
        q: TokenInfo,
        k: TokenInfo,
    ) -> Float[Array, "*batch heads q k"]:
        for mod in self.mods:
            scores = mod(scores, q, k)
        return scores

    def for_head(self, head: Int[Array, ""]) -> "Chain":
        return Chain(*(mod.for_head(head) for mod in self.mods))

    def for_heads(self, first: Int[ArrayLike, ""], count: int) -> "Chain":
        return Chain(*(mod.for_heads(first, count) for mod in self.mods))

    def check(self, heads: int) -> None:
        for mod in self.mods:
            mod.check(heads)


def check_sinks(sinks, heads: int) -> None:
    """Trace-time checks of attention-sink logits against the number of query heads."""
    if sinks is None:
        return
    shape, dtype = jnp.shape(sinks), jnp.result_type(sinks)
    if shape != (heads,):
        raise ValueError(
            f"`sinks` must have shape [heads] = {(heads,)} (one logit per query head); got "
            f"shape {shape}."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`sinks` must be a floating array; got dtype {dtype}.")


def apply_sinks(
    out: Float[Array, "*batch seq heads head_dim"],
    lse: Float[Array, "*batch seq heads"],
    sinks: Float[Array, " heads"],
) -> Float[Array, "*batch seq heads head_dim"]:
    r"""Add one sink logit per head to every row's softmax denominator.

    With the row's log-sum-exp $\ell$ over its keys and the sink $z_h$,
    $\operatorname{out}' = \operatorname{out}\, e^{\ell - \operatorname{logaddexp}(\ell, z_h)}$:
    exactly softmax attention over the keys plus one extra key of logit $z_h$ and value 0.
    Rows that see no key stay zero. Differentiable in `out`, `lse` and `sinks`.
    """
    lse = lse.astype(jnp.float32)
    z = lift(sinks.astype(jnp.float32), lse.ndim)
    # Rows with lse = -inf: exp(-inf - z) = 0 and out = 0; no NaN in either direction.
    return out * jnp.exp(lse - jnp.logaddexp(lse, z))[..., None]
