"""`RingTransformerLM`: a small language model of `TransformerBlock`s on ring attention,
and its prefill and decode steps (run after `_inference/_checks`, by the model's methods
and by `generate`)."""

import dataclasses
import warnings
from typing import Literal, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._inference._checks import (
    check_decode,
    check_prefill_prompt,
    inference_mesh,
    lookahead_masks,
    raise_if_known,
    step_errors,
)
from .._inference._decode import errors_if_together
from .._inference._kvcache import KVCache, prefill_cache, replicated, sees_ahead
from .._layout._layout import Layout
from .._ring._mesh import keep_on_ring
from .._util._numbers import check_bool, check_size
from ._block import TransformerBlock
from ._config import LMConfig
from ._mlp import MLPName
from ._options import AttentionOptions, options_from, with_precision
from ._precision import Precision, check_precision


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
        attention = with_precision(options_from(attention, attention_kwargs), precision)
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
        attention = options_from(attention, None)
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
        tokens, layout = check_prefill_prompt(
            layers, tokens, layout, segment_ids, max_new_tokens, mesh.shape[axis]
        )
        return run_prefill(self, layers, tokens, layout, max_new_tokens, mesh)

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
        mesh = inference_mesh(mesh, layers[0].attention.axis_name)
        check_decode(layers, self.embedding.num_embeddings, token, cache, mesh, on_overflow)
        return run_decode(self, layers, token, cache, mesh, on_overflow)

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


def run_prefill(
    model: RingTransformerLM,
    layers: tuple[TransformerBlock, ...],
    tokens: Array,
    layout: Layout,
    max_new_tokens: int,
    mesh,
) -> tuple[Array, KVCache]:
    """`model.prefill` after its checks (`check_prefill_prompt`): `tokens` in the order
    of the one-example `layout`, `layers` the model's, `mesh` resolved."""
    info = layout.token_info()
    x = model._embed(tokens)
    keys, values = [], []
    for block in layers:
        x, k, v = block.prefill(x, layout, mesh=mesh)
        keys.append(k)
        values.append(v)
    last = info.valid & (info.positions == layout.seq_len - 1)
    x = jnp.sum(jnp.where(last[:, None], x, 0), axis=0)
    logits = model.precision.cast_to_output(model._logits(x[None])[0])
    axis = layers[0].attention.axis_name
    cache = prefill_cache(layout, tuple(keys), tuple(values), max_new_tokens, mesh, axis)
    return logits, cache


def run_decode(
    model: RingTransformerLM,
    layers: tuple[TransformerBlock, ...],
    token: Array,
    cache: KVCache,
    mesh,
    on_overflow: str,
) -> tuple[Array, KVCache]:
    """`model.decode` after its checks (`check_decode`): `layers` the model's, `mesh`
    resolved."""
    vocab_size = model.embedding.num_embeddings
    distances = [b.attention.mask.max_distance() for b in layers]
    bound = None if None in distances else max(d for d in distances if d is not None)
    slot, ok = cache.next_slot(bound)
    # Masks that may look ahead: does an earlier token see this one? (Then its
    # cached keys and values, never recomputed, are wrong.)
    ahead = lookahead_masks(layers)
    sees = [jnp.any(sees_ahead(m, cache.records, cache.query())) for _, m in ahead]
    raise_if_known(cache, on_overflow, ok, ahead, sees)
    fits = cache.length_fits()
    in_vocab = (token >= 0) & (token < vocab_size)
    slot = jnp.where(ok, slot, -1)  # a full cache drops the token and says so
    query, records = cache.query(), replicated(cache.write_records(slot), mesh)
    x = model._embed(token[None])[0]
    keys, values = [], []
    for block, k, v in zip(layers, cache.keys, cache.values):
        x, k, v = block.decode(x, k, v, query, records, slot, mesh=mesh)
        keys.append(k)
        values.append(v)
    logits = model.precision.cast_to_output(model._logits(x[None])[0])
    length = cache.length + 1
    inexact = ~ok | ~fits | ~in_vocab
    for s in sees:
        inexact = inexact | s
    if on_overflow == "error":
        # On the logits and the length (which every later step reads), not on the
        # sharded cache arrays; on every device together, in one host callback.
        checks = step_errors(cache, ok, fits, in_vocab, ahead, sees, vocab_size)
        logits, length = errors_if_together((logits, length), checks, mesh)
    overflow = cache.overflow | inexact
    advanced = (tuple(keys), tuple(values), records, length, cache.segment, overflow)
    return logits, KVCache(*advanced, cache.num_shards)
