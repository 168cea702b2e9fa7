"""`generate`: ring prefill, then one compiled `lax.scan` of decode steps."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._layout._layout import Layout
from .._ring._mesh import batch_axis as mesh_batch_axis
from .._strategies._base import AbstractShardingStrategy
from .._strategies._uniform import Uniform
from .._util._numbers import as_int, check_size, concrete_scalar, is_int
from ..nn._transformer import RingTransformerLM
from ._decode import error_if_together
from ._kvcache import check_servable, inference_mesh, layer_masks


def sample(
    logits: Float[Array, " vocab"],
    key: PRNGKeyArray,
    temperature: Float[ArrayLike, ""],
    top_k: int | None,
) -> Int[Array, ""]:
    """Greedy (`temperature == 0`) or temperature sampling, among the `top_k` largest
    logits when `top_k` is given."""
    logits = logits.astype(jnp.float32)
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    t = jnp.asarray(temperature, jnp.float32)
    hot = t > 0
    drawn = jax.random.categorical(key, logits / jnp.where(hot, t, 1.0))
    return jnp.where(hot, drawn, jnp.argmax(logits)).astype(jnp.int32)


@eqx.filter_jit
def _generate(model, tokens, layout, keys, temperature, steps, top_k, mesh, batch_axis):
    """Prefill and `steps` decode steps for a batch of prompts in layout order; one
    compiled program per shape (the decode step is traced once, inside the scan)."""

    def one(tokens, layout, key):
        logits, cache = model.prefill(tokens, layout, max_new_tokens=steps, mesh=mesh)

        def step(carry, key):
            logits, cache = carry
            token = sample(logits, key, temperature, top_k)
            # Checked once after the loop, so the compiled step has no host callback.
            new_logits, cache = model.decode(token, cache, mesh=mesh, on_overflow="flag")
            return (new_logits, cache), (token, logits.astype(jnp.float32))

        init = (logits, cache)
        (_, cache), (out, seen) = jax.lax.scan(step, init, jax.random.split(key, steps))
        return out, seen, cache.overflow

    layout_axis = 0 if layout.batch_shape else None
    out, seen, overflow = jax.vmap(one, in_axes=(0, layout_axis, 0), spmd_axis_name=batch_axis)(
        tokens, layout, keys
    )
    # Once, after every step of every prompt, on every device together.
    out = error_if_together(
        out,
        jnp.any(overflow),
        "A decode step was not exact (`cache.overflow`): a token found no slot in the KV "
        "cache, or a layer's mask let an earlier token see a generated one.",
        mesh,
    )
    return out, seen


def _check_ids(name: str, ids, prompt) -> None:
    """Ids for every prompt (`[seq]`, shared) or one row per prompt (`[batch, seq]`)."""
    if ids is None:
        return
    shape, seq = jnp.shape(ids), prompt.shape[-1]
    if shape not in ((seq,), prompt.shape):
        want = f"[seq={seq}]"
        if prompt.ndim == 2:
            want += f" or [batch={prompt.shape[0]}, seq={seq}]"
        raise ValueError(f"`{name}` must have shape {want} (the prompt's); got shape {shape}.")


def _prompt_layout(prompt, strategy, segment_ids, span_ids, num_shards: int) -> Layout:
    if prompt.ndim not in (1, 2) or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(
            "`prompt` must be an integer array [seq] or [batch, seq]; got "
            f"{prompt.dtype} of shape {prompt.shape}."
        )
    _check_ids("segment_ids", segment_ids, prompt)
    _check_ids("span_ids", span_ids, prompt)
    strategy = Uniform() if strategy is None else strategy
    return strategy.layout(
        prompt.shape[-1], num_shards, segment_ids=segment_ids, span_ids=span_ids
    )


def _check_masks(model, layout: Layout, segment_ids, span_ids, steps: int) -> None:
    """Masks `generate` can serve: the ids they read were given (the layout would hold
    placeholders), and, where the prompt's records are known, no prompt token may see a
    generated one (which a KV cache cannot serve; else the decode steps check it)."""
    masks = layer_masks(model.layers)
    for name, mask in masks:
        reads = mask.reads()
        for ids, field, given in (
            ("segment_ids", "segments", segment_ids),
            ("span_ids", "spans", span_ids),
        ):
            if given is None and field in reads:
                raise ValueError(
                    f"`{ids}` must be given: {name} ({type(mask).__name__}) reads "
                    f"`{field}`; got {ids}=None."
                )
    check_servable(masks, layout.token_info(), layout.seq_len, steps)


def _check_sampling(key, temperature) -> None:
    """A key that is a key, and a temperature that means something: a real scalar, and
    where its value is known, finite and >= 0 (0: greedy)."""
    key_like = isinstance(key, (jax.Array, np.ndarray)) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape in ((2,), (4,)))  # raw (legacy) keys
    )
    if not key_like:
        raise ValueError(
            "`key` must be a jax.random key (`jax.random.key(seed)`); got "
            f"{type(key).__name__} {getattr(key, 'dtype', '')}{getattr(key, 'shape', '')}."
        )
    t = temperature
    real = isinstance(t, (int, float, np.integer, np.floating, jax.Array, np.ndarray)) and (
        not isinstance(t, (bool, np.bool_))
    )
    if not real or np.ndim(t) != 0 or not jnp.issubdtype(jnp.result_type(t), jnp.number):
        raise ValueError(
            "`temperature` must be a real scalar (0 for greedy decoding); got "
            f"{type(t).__name__} {t!r}."
        )
    value = concrete_scalar(t)
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"`temperature` must be finite and >= 0 (0 for greedy decoding); got {value!r}."
        )


def _check_tokens(prompt: Array, vocab_size: int, mesh) -> Array:
    """`prompt`, whose ids must index the vocabulary (an embedding lookup would clamp
    them onto other tokens): checked now when known, else at run time (on every device
    of `mesh` together)."""
    if not isinstance(prompt, jax.core.Tracer):
        bad = np.asarray(prompt)
        bad = bad[(bad < 0) | (bad >= vocab_size)]
        if bad.size:
            raise ValueError(
                f"`prompt` token ids must be in [0, {vocab_size}) (the model's vocab_size); "
                f"got {bad.size} outside it, e.g. {int(bad[0])}."
            )
        return prompt
    outside = jnp.any((prompt < 0) | (prompt >= vocab_size))
    msg = f"`prompt` token ids must be in [0, {vocab_size}) (the vocab_size)."
    return error_if_together(prompt, outside, msg, mesh)


def _arguments(
    model, prompt, steps, key, temperature, top_k, strategy, segment_ids, mesh, span_ids=None
):
    """Check `generate`'s arguments and make those of `_generate` (prompts in layout
    order with a batch axis, one key per prompt)."""
    steps = check_size("steps", steps)
    top_k = None if top_k is None else as_int(top_k)
    if top_k is not None and not (is_int(top_k) and top_k >= 1):
        raise ValueError(f"`top_k` must be None or an integer >= 1; got {top_k!r}.")
    _check_sampling(key, temperature)
    axis = model.layers[0].attention.axis_name
    mesh = inference_mesh(mesh, axis)
    prompt = jnp.asarray(prompt)
    layout = _prompt_layout(prompt, strategy, segment_ids, span_ids, mesh.shape[axis])
    _check_masks(model, layout, segment_ids, span_ids, steps)
    prompt = _check_tokens(prompt, model.embedding.num_embeddings, mesh)
    prompts = prompt if prompt.ndim == 2 else prompt[None]
    tokens = layout.shard(prompts, axis=-1)
    keys = jax.random.split(key, prompts.shape[0])
    # Prompts [batch, seq] are sharded over the mesh's "batch" axis, which must divide
    # them (an error here, not deep inside the scan); one prompt [seq] is not sharded.
    batch_axis = mesh_batch_axis(mesh, prompt.shape[:-1])
    temperature = jnp.asarray(temperature, jnp.float32)
    return model, tokens, layout, keys, temperature, steps, top_k, mesh, batch_axis


def generate(
    model: RingTransformerLM,
    prompt: Int[Array, "*batch seq"],
    steps: int,
    key: PRNGKeyArray,
    *,
    temperature: Float[ArrayLike, ""] = 0.0,
    top_k: int | None = None,
    strategy: AbstractShardingStrategy | None = None,
    segment_ids: Int[Array, "*#batch seq"] | None = None,
    span_ids: Int[Array, "*#batch seq"] | None = None,
    mesh=None,
    return_logits: bool = False,
) -> (
    Int[Array, "*batch steps"]
    | tuple[Int[Array, "*batch steps"], Float[Array, "*batch steps vocab"]]
):
    """Generate `steps` tokens after `prompt`: a ring prefill, then exact decoding.

    The prompt runs through the ring as in training, in the layout `strategy` gives it,
    and fills a [`ringeqx.KVCache`][] sharded over the ring. Each decode step then
    attends the new token to the cache on every device at once and merges the partial
    results by one max and one sum reduction
    ([`ringeqx.nn.RingTransformerLM.decode`][]). Prefill and every step compile into one
    program (a `lax.scan` over the steps): calling again with prompts of the same shape
    does not recompile, whatever the values, key or temperature.

    **Arguments:**

    - `model`: a [`ringeqx.nn.RingTransformerLM`][].
    - `prompt`: `int[seq]`, or `int[batch, seq]` for a batch of prompts (mapped with
        `jax.vmap`; sharded over the mesh axis `"batch"` when the mesh has one).
    - `steps`: how many tokens to generate (static).
    - `key`: a `jax.random` key (unused by greedy decoding).
    - `temperature`: 0 for greedy decoding (argmax), else the softmax temperature (a
        real scalar, finite and >= 0).
    - `top_k`: sample among the `top_k` largest logits only (static), or None.
    - `strategy`: how the prompt is placed on the ring (default
        [`ringeqx.Uniform`][]); any strategy works, `Zigzag` balances causal prefill.
    - `segment_ids`: document ids of the prompt `[seq]` or `[batch, seq]`; generated
        tokens continue the prompt's last document. Required when a layer's mask reads
        them (`Document`), as in the model's `__call__`.
    - `span_ids`: span ids of the prompt `[seq]` or `[batch, seq]` (`-1`: no span), for
        masks that read them (`BidirectionalSpans`); generated tokens are in no span.
    - `mesh`: the device mesh (default: the one set by `jax.set_mesh`).
    - `return_logits`: also return the float32 logits each token was drawn from.

    **Returns:** the generated tokens `int32[*batch, steps]`, and with
    `return_logits=True` their logits `float32[*batch, steps, vocab]` too.

    **Raises:** a `ValueError` before anything is compiled for a mask a KV cache cannot
    serve (one that lets a prompt token see a generated one: `Full`, `Document` without
    `Causal`, a two-sided window, `PrefixLM` with a prefix longer than the prompt) or
    that reads ids not given, ids not shaped like the prompt, and a mesh without the
    model's ring axis. Where the prompt's records are only known at run time (under
    `jit`), the decode steps check each token and the result raises (`eqx.error_if`).

    **Example:**

    ```python
    model = ringeqx.nn.RingTransformerLM(256, 64, 4, 2, key=jax.random.key(0))
    with jax.set_mesh(jax.make_mesh((8,), ("sequence",))):
        tokens = ringeqx.generate(model, prompt, 32, jax.random.key(1), temperature=0.8)
    ```
    """
    args = _arguments(
        model, prompt, steps, key, temperature, top_k, strategy, segment_ids, mesh, span_ids
    )
    out, logits = _generate(*args)
    if jnp.ndim(prompt) == 1:
        out, logits = out[0], logits[0]
    return (out, logits) if return_logits else out
