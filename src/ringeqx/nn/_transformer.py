"""A pre-norm transformer block and a small language model on ring attention."""

import dataclasses
import warnings
from typing import Literal, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._inference._decode import errors_if_together
from .._inference._kvcache import (
    KVCache,
    cache_capacity,
    check_devices,
    check_servable,
    inference_mesh,
    layer_masks,
    place_cache,
    prefill_cache,
    replicated,
    sees_ahead,
)
from .._layout._layout import Layout, contiguous_layout
from .._layout._tokens import TokenInfo
from .._masks._reads import check_ids
from .._ring._mesh import keep_on_ring
from .._util._numbers import check_bool, check_size
from ._attention import RingAttention
from ._config import LMConfig
from ._mlp import AbstractMLP, GeluMLP, MLPName, build_mlp
from ._options import AttentionOptions
from ._precision import Precision, check_precision


class TransformerBlock(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    The block follows its attention's [`ringeqx.nn.Precision`][]: its MLP is stored in
    the policy's `param_dtype` and run in its `compute_dtype`, and the residual stream
    `x` is kept in its `output_dtype`. The RMSNorms compute their statistics in float32.

    **Arguments:**

    - `attention`: the block's [`ringeqx.nn.RingAttention`][] (its mask, kernel,
        config and precision are this layer's own).
    - `hidden`: MLP width.
    - `mlp`: `"gelu"` (the default, a [`ringeqx.nn.GeluMLP`][]) or `"swiglu"`
        (Llama's, a [`ringeqx.nn.SwiGLUMLP`][]).
    - `norm_bias`: whether the RMSNorms have a bias (Llama's have none).
    - `key`: a `jax.random` key.
    """

    attention_norm: eqx.nn.RMSNorm
    attention: RingAttention
    mlp_norm: eqx.nn.RMSNorm
    mlp: AbstractMLP

    def __init__(
        self,
        attention: RingAttention,
        hidden: int,
        *,
        mlp: MLPName = "gelu",
        norm_bias: bool = True,
        key: PRNGKeyArray,
    ):
        if not isinstance(attention, RingAttention):
            raise TypeError(
                "`attention` must be a ringeqx.nn.RingAttention; got "
                f"{type(attention).__name__}."
            )
        dim = attention.output_proj.out_features
        assert isinstance(dim, int)
        hidden = check_size("hidden", hidden)
        norm_bias = check_bool("norm_bias", norm_bias)
        dtype = attention.precision.param_dtype
        self.attention_norm = eqx.nn.RMSNorm(dim, use_bias=norm_bias, dtype=dtype)
        self.attention = attention
        self.mlp_norm = eqx.nn.RMSNorm(dim, use_bias=norm_bias, dtype=dtype)
        self.mlp = build_mlp(mlp, dim, hidden, dtype=dtype, key=key)

    @property
    def precision(self) -> Precision:
        """The block's policy: its attention's."""
        return self.attention.precision

    @property
    def mlp_in(self) -> eqx.nn.Linear:
        """The GELU MLP's first layer, `mlp.mlp_in` (where blocks held it before the
        MLP was a choice)."""
        return self._gelu().mlp_in

    @property
    def mlp_out(self) -> eqx.nn.Linear:
        """The GELU MLP's second layer, `mlp.mlp_out`."""
        return self._gelu().mlp_out

    def _gelu(self) -> GeluMLP:
        if not isinstance(self.mlp, GeluMLP):
            raise AttributeError(
                f"`mlp_in` and `mlp_out` are a GELU MLP's layers; this block's MLP is a "
                f"{type(self.mlp).__name__} (see `block.mlp`)."
            )
        return self.mlp

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        layout: Layout | None = None,
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        mesh=None,
    ) -> Float[Array, "seq dim"]:
        x = self.precision.cast_to_output(x)
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, layout, segment_ids=segment_ids, mesh=mesh)
        return self._mlp(x)

    def _mlp(self, x: Array) -> Array:
        p = self.precision
        h = p.cast_to_compute(jax.vmap(self.mlp_norm)(x))
        return x + p.cast_to_output(p.cast_to_compute(self.mlp)(h))

    def prefill(
        self, x: Float[Array, "seq dim"], layout: Layout, *, mesh=None
    ) -> tuple[
        Float[Array, "seq dim"],
        Float[Array, "kv_heads seq head_dim"],
        Float[Array, "kv_heads seq head_dim"],
    ]:
        """`__call__` on `x` in layout order, also returning the attention's keys and
        values (see [`ringeqx.nn.RingAttention.prefill`][])."""
        x = self.precision.cast_to_output(x)
        h = jax.vmap(self.attention_norm)(x)
        out, keys, values = self.attention.prefill(h, layout, mesh=mesh)
        return self._mlp(x + out), keys, values

    def decode(
        self,
        x: Float[Array, " dim"],
        keys: Float[Array, "kv_heads slots head_dim"],
        values: Float[Array, "kv_heads slots head_dim"],
        query: TokenInfo,
        records: TokenInfo,
        slot: Int[Array, ""],
        *,
        mesh=None,
    ) -> tuple[
        Float[Array, " dim"],
        Float[Array, "kv_heads slots head_dim"],
        Float[Array, "kv_heads slots head_dim"],
    ]:
        """One decode step of the block for a new token `x` `[dim]` (see
        [`ringeqx.nn.RingAttention.decode`][])."""
        x = self.precision.cast_to_output(x)
        h = self.attention_norm(x)
        out, keys, values = self.attention.decode(h, keys, values, query, records, slot, mesh=mesh)
        return self._mlp((x + out)[None])[0], keys, values


def _first(blocks: "tuple[TransformerBlock, ...] | TransformerBlock") -> "TransformerBlock":
    """The first block of a model's `blocks` (the stacked block itself when scanned: its
    static fields are every layer's)."""
    return blocks[0] if isinstance(blocks, tuple) else blocks


def _rematerialise(run, checkpoint):
    """`run` wrapped for the `checkpoint` setting of `RingTransformerLM`."""
    match checkpoint:
        case False | "none":
            return run
        case True | "block":
            return eqx.filter_checkpoint(run)
        case "attention":
            policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            return eqx.filter_checkpoint(run, policy=policy)
        case _:
            raise ValueError(f"Unknown checkpoint setting {checkpoint!r}.")


def _options(attention: AttentionOptions | None, kwargs: dict | None) -> AttentionOptions:
    """The blocks' attention options, from `attention=` or the deprecated dict."""
    if attention is not None and not isinstance(attention, AttentionOptions):
        raise TypeError(
            "`attention` must be a ringeqx.nn.AttentionOptions or None; got "
            f"{type(attention).__name__}. Pass `attention=ringeqx.nn.AttentionOptions(...)`"
            " (for a dict of options, `AttentionOptions(**options)`)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"`attention_kwargs` must be a dict or None; got {type(kwargs).__name__}.")
    if kwargs is None:
        return AttentionOptions() if attention is None else attention
    if attention is not None:
        raise ValueError(
            "Pass the attention options once: `attention=` (an AttentionOptions) or the "
            "deprecated `attention_kwargs=`, not both."
        )
    warnings.warn(
        "`attention_kwargs=` is deprecated: pass "
        "`attention=ringeqx.nn.AttentionOptions(**attention_kwargs)`.",
        DeprecationWarning,
        stacklevel=3,
    )
    return AttentionOptions(**kwargs)


def _with_precision(attention: AttentionOptions, precision) -> AttentionOptions:
    """The options with the model's `precision`, which an `attention.precision` of its
    own must not contradict."""
    if precision is None:
        return attention
    precision = check_precision(precision)
    if attention.precision is not None and attention.precision != precision:
        raise ValueError(
            "Pass the precision once: `precision=` and `attention.precision` differ "
            f"({precision} and {attention.precision})."
        )
    return dataclasses.replace(attention, precision=precision)


def _decode_mesh(layers, token, cache: KVCache, mesh, on_overflow: str, embedding):
    """The mesh a decode step runs on, after the checks made before anything is traced:
    `on_overflow`, the cache against the model and the mesh, and the token."""
    axis = layers[0].attention.axis_name
    mesh = inference_mesh(mesh, axis)
    match on_overflow:
        case "error" | "flag":
            pass
        case _:
            raise ValueError(f"`on_overflow` must be 'error' or 'flag'; got {on_overflow!r}.")
    _check_cache(layers, cache, mesh.shape[axis])
    check_devices(cache, mesh)
    _check_token(token, embedding.num_embeddings)
    return mesh


def _check_cache(
    layers: "tuple[TransformerBlock, ...]", cache: KVCache, ring_size: int
) -> None:
    """A cache a model of these `layers` can decode with: their number, kv heads,
    head_dim and dtype, one example, made for `ring_size` devices. Shapes and dtypes
    only, so a trace-time error."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"`cache` must be a ringeqx.KVCache; got {type(cache).__name__}.")
    axis = layers[0].attention.axis_name
    if cache.num_shards != ring_size:
        raise ValueError(
            f"`cache` was made for a ring of {cache.num_shards} devices (num_shards); the "
            f"ring axis {axis!r} has {ring_size} devices in the mesh it is decoded on."
        )
    if cache.num_layers != len(layers):
        raise ValueError(
            f"`cache` must have one layer per block of the model ({len(layers)}); "
            f"got {cache.num_layers} layers."
        )
    slots = jnp.shape(cache.records.positions)
    if len(slots) != 1:
        raise ValueError(
            "`cache` must be one example's (records [slots]): map a batch with "
            f"`jax.vmap`; got records of shape {slots}."
        )
    for name, dtype in (("length", jnp.int32), ("segment", jnp.int32), ("overflow", jnp.bool_)):
        x = getattr(cache, name)
        if jnp.shape(x) != () or jnp.result_type(x) != dtype:
            raise TypeError(
                f"`cache.{name}` must be a {jnp.dtype(dtype).name} scalar; got "
                f"{jnp.result_type(x)} of shape {jnp.shape(x)}."
            )
    for i, (block, k, v) in enumerate(zip(layers, cache.keys, cache.values)):
        a = block.attention
        want = (a.num_kv_heads, slots[0], a.head_dim)
        for name, x in (("keys", k), ("values", v)):
            if jnp.shape(x) != want:
                raise ValueError(
                    f"`cache.{name}[{i}]` must have shape [kv_heads={want[0]}, slots="
                    f"{want[1]}, head_dim={want[2]}] (layer {i} of the model); got shape "
                    f"{jnp.shape(x)}."
                )
            dtype = a.precision.compute_dtype
            if jnp.result_type(x) != dtype:
                raise TypeError(
                    f"`cache.{name}[{i}]` must have dtype {dtype} (layer {i}'s compute "
                    f"dtype, as prefill makes it); got {jnp.result_type(x)}."
                )


def _prompt(
    model: "RingTransformerLM", tokens, layout: Layout | None, segment_ids, ring_size: int
) -> tuple[Array, Layout]:
    """`prefill`'s prompt in layout order and its one-example layout (contiguous shards
    made from `segment_ids` without one), checked against each other and the masks."""
    shape = jnp.shape(tokens)
    if len(shape) != 1 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        hint = " (one example: map a batch with `jax.vmap`)" if len(shape) == 2 else ""
        raise ValueError(
            f"`tokens` must be an integer array [seq]{hint}; got "
            f"{jnp.result_type(tokens)} of shape {shape}."
        )
    if layout is None:
        if segment_ids is not None and jnp.shape(segment_ids) != shape:
            raise ValueError(
                f"`segment_ids` must have the shape of `tokens` [seq={shape[0]}] (one "
                f"example: map a batch with `jax.vmap`); got shape {jnp.shape(segment_ids)}."
            )
        for block in model.layers:
            # As `__call__` does: a mask that reads ids nobody gave is refused, not run
            # on the placeholder ids a layout makes without them.
            check_ids(block.attention.mask, segment_ids, None, None)
        layout = contiguous_layout(shape[0], ring_size, segment_ids=segment_ids)
        return layout.shard(tokens), layout
    if segment_ids is not None:
        raise ValueError(
            "Pass `segment_ids` to the strategy that builds the layout, not to prefill "
            "together with `layout=`."
        )
    if layout.batch_shape:
        raise ValueError(
            "`layout` must be one example's (batch shape ()); got batch shape "
            f"{layout.batch_shape}: map a batch with `jax.vmap`."
        )
    if shape != (layout.sharded_len,):
        raise ValueError(
            "`tokens` must be in the layout's order, [num_shards * capacity = "
            f"{layout.sharded_len}] (`layout.shard(tokens)`); got shape {shape}."
        )
    return tokens, layout


def _known(*trees) -> bool:
    """Whether every array of `trees` has a value here (outside `jit`)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _check_token(token, vocab_size: int) -> None:
    """A token id: an integer scalar, and where its value is known, in the vocabulary
    (an embedding lookup would clamp it onto another token)."""
    shape, dtype = jnp.shape(token), jnp.result_type(token)
    if shape != () or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"`token` must be an integer scalar (a token id); got {dtype} of shape {shape}."
        )
    if _known(token):
        t = int(token)
        if not 0 <= t < vocab_size:
            raise ValueError(
                f"`token` must be in [0, {vocab_size}) (the model's vocab_size); got {t}."
            )


_STALE = (
    "`cache.overflow` is set: an earlier decode with on_overflow='flag' was not exact (it "
    "dropped a token, or kept one a mask let an earlier token see), so no later step of "
    "this cache is exact either. Prefill again with a larger `max_new_tokens`, or decode "
    "with on_overflow='flag' (and check `cache.overflow`) to go on regardless."
)
_LENGTH = (
    "`cache.length` must be one past the position of the cache's last token, as prefill "
    "and decode leave it; it was edited. Decode the cache that prefill or the previous "
    "decode returned (to decode from an earlier position, prefill that prompt again)."
)


def _raise_if_known(cache: KVCache, on_overflow: str, ok, ahead, sees) -> None:
    """Outside `jit` the step's conditions are values: say exactly what went wrong. An
    edited `length` is refused whatever `on_overflow`; the rest with "error" only."""
    if not _known(cache.length, cache.records, cache.overflow):
        return
    n = int(cache.length)
    if not bool(cache.length_fits()):
        held = np.asarray(cache.records.positions)[np.asarray(cache.records.valid)]
        after = int(held.max()) + 1 if held.size else 0
        want = f"at least {after}" if bool(cache.overflow) else f"{after}"
        raise ValueError(
            f"`cache.length` must be {want} (one past the position of the cache's last "
            f"token, as prefill and decode leave it); got {n}. Decode the cache that "
            "prefill or the previous decode returned (to decode from an earlier position, "
            "prefill that prompt again)."
        )
    if on_overflow != "error":
        return
    if bool(cache.overflow):
        raise ValueError(_STALE)
    if not _known(ok, sees):
        return
    if not bool(ok):
        p = cache.num_shards
        raise ValueError(
            f"`cache` must have room for the token at position {n}: its device {n % p} "
            f"holds {cache.capacity} slots, all taken by tokens that a mask may still "
            "see. Prefill with a larger `max_new_tokens` (or decode with "
            "on_overflow='flag' to drop the token and only set `cache.overflow`)."
        )
    for (name, mask), s in zip(ahead, sees):
        if bool(s):
            seen = sees_ahead(mask, cache.records, cache.query())
            p = int(cache.records.positions[jnp.argmax(seen)])
            raise ValueError(
                f"{name} must not let an earlier token attend to a later one, which a KV "
                "cache cannot serve (cached keys and values are never recomputed); got "
                f"the token at position {p} attending to the new token at position {n}."
            )


class RingTransformerLM(eqx.Module):
    """A small decoder-only language model whose attention runs on a ring.

    Each block is a [`ringeqx.nn.TransformerBlock`][]. By default they are a tuple run in
    a Python loop, so they may differ (per-layer plans: local and global masks, their own
    kernels). With `scan_layers=True` the layers, all alike, are one block whose arrays
    have a leading layer axis, run by `jax.lax.scan`: the compiler sees one layer, so a
    deep model compiles in the time of a shallow one, and the backward keeps one layer's
    working memory (measured for an 8B-shaped step on a TPU v5p-8 at 112K tokens, remat
    `"block"`: 39.6 GiB a chip, compiled in 109 s, against 86.3 GiB and 737 s unrolled;
    see docs/longest_context.md).

    **Arguments:**

    - `vocab_size`, `dim`, `num_heads`, `num_kv_heads`, `num_layers`, `hidden`: sizes.
    - `checkpoint`: what each block rematerialises in the backward pass (gradient
        checkpointing). `False` or `"none"`: nothing, every activation is kept.
        `"attention"`: the block keeps the outputs of its projections and MLP matmuls
        (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`) and recomputes
        the rest, ring attention included. `True` or `"block"`: the block keeps only its
        input (activation memory of one block instead of all).
    - `attention`: the options of every block's [`ringeqx.nn.RingAttention`][] (mask,
        kernel, ...), an [`ringeqx.nn.AttentionOptions`][] (default: its defaults).
    - `attention_kwargs`: deprecated: the same options as a dict (a
        `DeprecationWarning`; pass `attention=AttentionOptions(**attention_kwargs)`).
    - `scan_layers`: stack the layers and scan over them (see above); `blocks` is then
        one `TransformerBlock` with a leading layer axis on every array, and `layers`
        gives them one by one.
    - `mlp`, `norm_bias`: every block's MLP (`"gelu"`, the default, or Llama's
        `"swiglu"`) and whether its RMSNorms (and the final one) have a bias (see
        [`ringeqx.nn.TransformerBlock`][]).
    - `precision`: a [`ringeqx.nn.Precision`][], e.g. `Precision.mixed()` (float32
        parameters, bfloat16 compute); default float32 throughout. It becomes every
        block's attention's (`attention.precision`, which it must not contradict).
        Embedding, norms and head are stored in its `param_dtype`, the residual stream
        between blocks is in its `output_dtype`, and the head's product accumulates in
        float32: the loss reads float32 logits, and `__call__` returns them in
        `output_dtype`.
    - `key`: a `jax.random` key.

    Llama-shaped models of published sizes: [`ringeqx.nn.RingTransformerLM.from_config`][].

    To save a model (and its optimiser's state), use [`ringeqx.nn.save_checkpoint`][]:
    `eqx.tree_serialise_leaves` stores the arrays only, and deserialising them into a
    model built with another mask or kernel keeps the template's, silently.
    """

    embedding: eqx.nn.Embedding
    blocks: tuple[TransformerBlock, ...] | TransformerBlock
    final_norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear
    checkpoint: bool | Literal["none", "attention", "block"] = eqx.field(static=True)
    scan_layers: bool = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        num_heads: int,
        num_layers: int,
        *,
        num_kv_heads: int | None = None,
        hidden: int | None = None,
        checkpoint: bool | Literal["none", "attention", "block"] = False,
        attention: AttentionOptions | None = None,
        attention_kwargs: dict | None = None,
        scan_layers: bool = False,
        mlp: MLPName = "gelu",
        norm_bias: bool = True,
        precision: Precision | None = None,
        key: PRNGKeyArray,
    ):
        vocab_size, dim = check_size("vocab_size", vocab_size), check_size("dim", dim)
        num_layers = check_size("num_layers", num_layers)
        hidden = 4 * dim if hidden is None else check_size("hidden", hidden)
        scan_layers = check_bool("scan_layers", scan_layers)
        # A bool or a name: `1` equals True but `match` tells them apart (a "setting"
        # refused only when the model is first called).
        if isinstance(checkpoint, np.bool_):
            checkpoint = bool(checkpoint)
        named = isinstance(checkpoint, str) and checkpoint in ("none", "attention", "block")
        if not (isinstance(checkpoint, bool) or named):
            raise ValueError(
                "`checkpoint` must be a bool or one of 'none', 'attention', 'block'; "
                f"got {checkpoint!r}."
            )
        keys = jax.random.split(key, 2 * num_layers + 2)
        attention = _with_precision(_options(attention, attention_kwargs), precision)
        dtype = check_precision(attention.precision).param_dtype
        norm_bias = check_bool("norm_bias", norm_bias)
        self.embedding = eqx.nn.Embedding(vocab_size, dim, dtype=dtype, key=keys[0])

        def block(k1, k2):
            attn = attention.build(dim, num_heads, num_kv_heads, key=k1)
            return TransformerBlock(attn, hidden, mlp=mlp, norm_bias=norm_bias, key=k2)

        k1, k2 = keys[1:-1:2], keys[2:-1:2]
        if scan_layers:  # the same keys, so the same weights as the unrolled model
            self.blocks = eqx.filter_vmap(block)(k1, k2)
        else:
            self.blocks = tuple(block(a, b) for a, b in zip(k1, k2))
        self.scan_layers = scan_layers
        self.final_norm = eqx.nn.RMSNorm(dim, use_bias=norm_bias, dtype=dtype)
        self.head = eqx.nn.Linear(dim, vocab_size, use_bias=False, dtype=dtype, key=keys[-1])
        self.checkpoint = checkpoint

    @classmethod
    def from_config(
        cls,
        config: LMConfig,
        *,
        attention: AttentionOptions | None = None,
        precision: Precision | None = None,
        checkpoint: bool | Literal["none", "attention", "block"] = False,
        scan_layers: bool = False,
        key: PRNGKeyArray,
    ) -> "RingTransformerLM":
        """The model of a named shape: `config` an [`ringeqx.nn.LMConfig`][] such as
        [`ringeqx.nn.LLAMA3_8B`][] (its sizes, MLP, norms and `rope_theta`, which
        replaces `attention`'s); the other arguments as in `__init__`.

        **Example:**

        ```python
        lm = ringeqx.nn.RingTransformerLM.from_config(
            ringeqx.nn.LLAMA_300M, precision=ringeqx.nn.Precision.mixed(),
            scan_layers=True, checkpoint="block", key=key,
        )
        ```
        """
        if not isinstance(config, LMConfig):
            hint = " (e.g. ringeqx.nn.LLAMA3_8B, not its name)" if isinstance(config, str) else ""
            raise TypeError(
                f"`config` must be a ringeqx.nn.LMConfig{hint}; got {type(config).__name__} "
                f"{config!r}."
            )
        attention = _options(attention, None)
        attention = dataclasses.replace(attention, rope_theta=config.rope_theta)
        return cls(
            config.vocab_size,
            config.dim,
            config.num_heads,
            config.num_layers,
            num_kv_heads=config.num_kv_heads,
            hidden=config.hidden,
            checkpoint=checkpoint,
            attention=attention,
            scan_layers=scan_layers,
            mlp=config.mlp,
            norm_bias=config.norm_bias,
            precision=precision,
            key=key,
        )

    @property
    def precision(self) -> Precision:
        """The model's [`ringeqx.nn.Precision`][]: its blocks' attention's."""
        return _first(self.blocks).attention.precision

    def _logits(self, x: Array) -> Array:
        """Float32 logits `[seq, vocab]` of the final hidden states `x`: the norm in
        float32, the head's product in the compute dtype, accumulated in float32."""
        p = self.precision
        h = p.cast_to_compute(jax.vmap(self.final_norm)(x))
        weight = p.cast_to_compute(self.head.weight)
        return jnp.einsum("sd,vd->sv", h, weight, preferred_element_type=jnp.float32)

    def _embed(self, tokens: Array) -> Array:
        """The residual stream `[seq, dim]` of `tokens`, in the output dtype."""
        return self.precision.cast_to_output(jax.vmap(self.embedding)(tokens))

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        layout: Layout | None = None,
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        mesh=None,
    ) -> Float[Array, "seq vocab"]:
        """Logits for one example (`tokens` in layout order when `layout` is given).

        Every layer is per token or ring attention, so tokens sharded over the ring's
        sequence axis give logits sharded the same way: no device holds the sequence.
        """
        return self.precision.cast_to_output(
            self._forward(tokens, layout, segment_ids=segment_ids, mesh=mesh)
        )

    def _forward(self, tokens, layout, *, segment_ids, mesh) -> Array:
        """`__call__`'s logits in float32."""
        # The stream stays sharded over the ring between layers (see `keep_on_ring`).
        axis = _first(self.blocks).attention.axis_name
        x = keep_on_ring(self._embed(tokens), mesh, axis)

        def run(block, x):
            return keep_on_ring(block(x, layout, segment_ids=segment_ids, mesh=mesh), mesh, axis)

        run = _rematerialise(run, self.checkpoint)
        if self.scan_layers:
            stacked, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(x, arrays):
                return run(eqx.combine(arrays, static), x), None

            x = jax.lax.scan(layer, x, stacked)[0]
        else:
            for block in self.layers:
                x = run(block, x)
        return self._logits(x)

    @property
    def layers(self) -> tuple[TransformerBlock, ...]:
        """Every layer as its own [`ringeqx.nn.TransformerBlock`][]: `blocks`, or with
        `scan_layers` the stacked block's slices (what prefill and decode run)."""
        if not self.scan_layers:
            assert isinstance(self.blocks, tuple)
            return self.blocks
        stacked, static = eqx.partition(self.blocks, eqx.is_array)
        count = jax.tree.leaves(stacked)[0].shape[0]
        return tuple(
            eqx.combine(jax.tree.map(lambda a: a[i], stacked), static) for i in range(count)
        )

    def prefill(
        self,
        tokens: Int[Array, " seq"],
        layout: Layout | None = None,
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        max_new_tokens: int = 0,
        mesh=None,
    ) -> tuple[Float[Array, " vocab"], KVCache]:
        """Run a prompt through the ring, exactly as in training, and keep its keys and
        values: the first step of generation.

        **Arguments:**

        - `tokens`: the prompt `[seq]`, in layout order when `layout` is given (any
            strategy's layout: `Zigzag`, `Uniform`, ...).
        - `layout`: the prompt's [`ringeqx.Layout`][] (default: contiguous shards, as
            `__call__` uses, made from `segment_ids`).
        - `segment_ids`: document ids in original order, without a layout only.
        - `max_new_tokens`: how many tokens the cache must take after the prompt; each
            device gets `ceil(max_new_tokens / devices)` free slots.
        - `mesh`: the device mesh (default: the one set by `jax.set_mesh`).

        **Returns:** `(logits, cache)`: the logits `[vocab]` that follow the prompt's
        last token, and the filled [`ringeqx.KVCache`][], sharded over the ring.

        **Raises:** a `ValueError`, before anything runs, for a mask that reads segment
        or span ids given by neither `segment_ids` nor `layout` (as `__call__`), and,
        where the layout's records are known (outside `jit`), for a mask that lets a
        prompt token see one of the next `max_new_tokens` tokens, which a cache cannot
        serve (`decode` checks that at run time otherwise).
        """
        layers = self.layers  # with `scan_layers`, each one sliced from the stack
        axis = layers[0].attention.axis_name
        mesh = inference_mesh(mesh, axis)
        tokens, layout = _prompt(self, tokens, layout, segment_ids, mesh.shape[axis])
        capacity = cache_capacity(layout, max_new_tokens)
        info = layout.token_info()
        check_servable(layer_masks(layers), info, layout.seq_len, max_new_tokens)
        x = self._embed(tokens)
        keys, values = [], []
        for block in layers:
            x, k, v = block.prefill(x, layout, mesh=mesh)
            keys.append(k)
            values.append(v)
        last = info.valid & (info.positions == layout.seq_len - 1)
        x = jnp.sum(jnp.where(last[:, None], x, 0), axis=0)
        logits = self.precision.cast_to_output(self._logits(x[None])[0])
        cache = prefill_cache(layout, tuple(keys), tuple(values), capacity)
        return logits, place_cache(cache, mesh, axis)

    def decode(
        self,
        token: Int[Array, ""],
        cache: KVCache,
        *,
        mesh=None,
        on_overflow: Literal["error", "flag"] = "error",
    ) -> tuple[Float[Array, " vocab"], KVCache]:
        """One generation step: append `token` (at position `cache.length`) to the
        cache and return the logits of the token after it.

        The token's query is computed on every device (it is small), each device attends
        to its own slots of the cache, and the partial results are merged across the ring
        by one max and one sum reduction: the compiled step has no collective-permute.
        Exact: the logits equal those of `__call__` on the whole sequence, as long as
        the cache has room for the token (a free slot on its device, or a token there
        that no query can see any more) and no layer's mask lets an earlier token see it.

        **Arguments:**

        - `token`: the new token id (an int32 scalar).
        - `cache`: the [`ringeqx.KVCache`][] from `prefill` or an earlier `decode` of this
            model (one example: map a batch with `jax.vmap`).
        - `mesh`: the device mesh the cache was prefilled on (default: the one set by
            `jax.set_mesh`).
        - `on_overflow`: what a step that cannot be exact does. `"error"` (the default):
            it raises (a `ValueError` where the cache's values are known, outside `jit`;
            else `eqx.error_if` at run time, a host callback in the step). `"flag"`: the
            token is dropped (no free slot) or kept (a mask that sees ahead), and
            `cache.overflow` becomes True, for callers who check it once after their
            loop, as [`ringeqx.generate`][] does: the compiled step then has no callback.
            A flagged cache is never exact again, so `"error"` refuses it.

        **Returns:** `(logits, cache)`: logits `[vocab]` and the advanced cache.

        **Raises:** a `ValueError` or `TypeError` before anything is traced for a cache
        that does not fit this model and mesh (layers, kv heads, head_dim, dtype, slots,
        devices) or an unknown `on_overflow`, and for a `token` that is not an integer
        scalar. Where their values are known (outside `jit`), also for a `token` outside
        the vocabulary and a `cache.length` that is not what prefill and decode left (an
        edited cache), whatever `on_overflow`; under `jit` these are run-time checks
        (`"error"`) or set `cache.overflow` (`"flag"`).
        """
        layers = self.layers  # with `scan_layers`, each one sliced from the stack
        mesh = _decode_mesh(layers, token, cache, mesh, on_overflow, self.embedding)
        vocab_size = self.embedding.num_embeddings
        distances = [b.attention.mask.max_distance() for b in layers]
        bound = None if None in distances else max(d for d in distances if d is not None)
        slot, ok = cache.next_slot(bound)
        # Masks that may look ahead: does an earlier token see this one? (Then its
        # cached keys and values, never recomputed, are wrong.)
        ahead = [
            (f"{name} ({type(m).__name__})", m)
            for name, m in layer_masks(layers)
            if m.max_lookahead() != 0
        ]
        sees = [jnp.any(sees_ahead(m, cache.records, cache.query())) for _, m in ahead]
        _raise_if_known(cache, on_overflow, ok, ahead, sees)
        fits = cache.length_fits()
        in_vocab = (token >= 0) & (token < vocab_size)
        slot = jnp.where(ok, slot, -1)  # a full cache drops the token and says so
        query, records = cache.query(), replicated(cache.write_records(slot), mesh)
        x = self._embed(token[None])[0]
        keys, values = [], []
        for block, k, v in zip(layers, cache.keys, cache.values):
            x, k, v = block.decode(x, k, v, query, records, slot, mesh=mesh)
            keys.append(k)
            values.append(v)
        logits = self.precision.cast_to_output(self._logits(x[None])[0])
        length = cache.length + 1
        inexact = ~ok | ~fits | ~in_vocab
        for s in sees:
            inexact = inexact | s
        if on_overflow == "error":
            # On the logits and the length (which every later step reads), not on the
            # sharded cache arrays; on every device together, in one host callback.
            checks = [
                (cache.overflow, _STALE),
                (~fits, _LENGTH),
                (~in_vocab, f"`token` must be in [0, {vocab_size}) (the model's vocab_size)."),
                (
                    ~ok,
                    "`cache` is full: the new token found no free slot on its device and "
                    "none that it could evict. Prefill with a larger `max_new_tokens` (or "
                    "decode with on_overflow='flag' to drop the token and only set "
                    "`cache.overflow`).",
                )
            ]
            checks += [
                (
                    s,
                    f"{name} must not let an earlier token attend to the new one, which a "
                    "KV cache cannot serve (cached keys and values are never recomputed).",
                )
                for (name, _), s in zip(ahead, sees)
            ]
            logits, length = errors_if_together((logits, length), checks, mesh)
        cache = KVCache(
            tuple(keys),
            tuple(values),
            records,
            length,
            cache.segment,
            cache.overflow | inexact,
            cache.num_shards,
        )
        return logits, cache

    def loss(
        self,
        tokens: Int[Array, " seq"],
        labels: Int[Array, " seq"],
        layout: Layout | None = None,
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        mesh=None,
    ) -> Float[Array, ""]:
        """Mean cross-entropy of one example, computed where the logits are.

        Pass labels already aligned with the tokens (for next-token prediction,
        `tokens = data[:-1]`, `labels = data[1:]`, shifted *before* sharding): the loss then
        reads each device's own logits and labels, and a training step gathers no part
        of the sequence (only parameter gradients are summed over the devices).

        **Arguments:**

        - `tokens`, `labels`: `[seq]`, in layout order when `layout` is given (shard
            both with `layout.shard`); padding slots of the layout do not count.
        - `layout`, `segment_ids`, `mesh`: as in `__call__`.

        **Returns:** the mean over valid tokens of `logsumexp(logits) - logits[label]`.
        """
        if labels.shape != tokens.shape:
            raise ValueError(
                f"`labels` must have the shape of `tokens` {tokens.shape}; got {labels.shape}."
            )
        # Float32 logits, whatever the output dtype: the softmax needs the range.
        logits = self._forward(tokens, layout, segment_ids=segment_ids, mesh=mesh)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        if layout is None:
            return jnp.mean(nll)
        valid = layout.token_info().valid
        # The count cast to float: an int32 divisor fails under strict dtype promotion.
        return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid).astype(nll.dtype)

    @classmethod
    def from_plan(cls, plan: "_ModelPlan", *, key: PRNGKeyArray) -> "RingTransformerLM":
        """Deprecated: `plan.model(key=key)` ([`ringeqx.tools.Plan.model`][]) builds the
        model a plan describes. This alias warns and calls it; it goes in the next release.

        (A plan is a tool, in `ringeqx.tools`, and `ringeqx.nn` imports none of the
        tools, so the model no longer reads plans: the plan builds the model.)
        """
        warnings.warn(
            "`RingTransformerLM.from_plan(plan, key=...)` is deprecated: use "
            "`plan.model(key=...)`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return plan.model(key=key)


@runtime_checkable
class _ModelPlan(Protocol):
    """What `from_plan` needs of a plan: that it builds the model (`ringeqx.tools.Plan`
    does), named structurally so that `ringeqx.nn` imports no tool."""

    def model(self, *, key: PRNGKeyArray) -> RingTransformerLM: ...
