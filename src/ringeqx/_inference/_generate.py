"""`generate`: ring prefill, then one compiled `lax.scan` of decode steps."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._ring._mesh import batch_axis as mesh_batch_axis
from .._strategies._base import AbstractShardingStrategy
from .._strategies._uniform import Uniform
from .._util._numbers import as_int, check_size, concrete_scalar, is_int
from ..nn._lm import RingTransformerLM, run_decode, run_prefill
from ._checks import check_generate_prompt, inference_mesh
from ._decode import error_if_together


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
    layers = model.layers  # with `scan_layers`, each one sliced from the stack

    def one(tokens, layout, key):
        # Checked and resolved once, by `_arguments`: the model's steps, run unchecked.
        logits, cache = run_prefill(model, layers, tokens, layout, steps, mesh)

        def step(carry, key):
            logits, cache = carry
            token = sample(logits, key, temperature, top_k)
            # Checked once after the loop, so the compiled step has no host callback.
            new_logits, cache = run_decode(model, layers, token, cache, mesh, "flag")
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
    layers = model.layers
    mesh = inference_mesh(mesh, layers[0].attention.axis_name)
    strategy = Uniform() if strategy is None else strategy
    prompt, layout = check_generate_prompt(
        layers,
        model.embedding.num_embeddings,
        jnp.asarray(prompt),
        strategy,
        segment_ids,
        span_ids,
        steps,
        mesh,
    )
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
