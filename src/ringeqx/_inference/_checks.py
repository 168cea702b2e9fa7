"""The checks of inference, each made once, before anything is traced: the mesh, a prompt
(`prefill`'s, or `generate`'s batch of them), a cache and a token for `decode`, the masks a
KV cache can serve; and what a decode step found wrong, said exactly where it is known.

`RingTransformerLM.prefill` and `decode` call these, then run; `generate` calls them, then
runs the same steps without checking again (the model's own prompt and cache, inside `jit`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._layout._layout import Layout, contiguous_layout
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._masks._reads import check_ids
from .._ring._mesh import resolve_mesh
from ._decode import error_if_together
from ._kvcache import KVCache, last_segment, new_token, sees_ahead


def inference_mesh(mesh, axis_name: str):
    """The mesh prefill, decode and `generate` run on (`resolve_mesh`), with errors
    that name `mesh`: it must be a mesh with the model's ring axis."""
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None; got {type(mesh).__name__}.")
    where = "`mesh`" if mesh is not None else "the mesh set by `jax.set_mesh`"
    known = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if not known.empty and axis_name not in known.axis_names:
        raise ValueError(
            f"{where} must have the model's ring axis {axis_name!r} (the layers' "
            f"`axis_name`); got a mesh with axes {tuple(known.axis_names)}."
        )
    return resolve_mesh(mesh, axis_name)


def layer_masks(layers) -> list[tuple[str, AbstractMask]]:
    """Every layer's mask (of a `RingTransformerLM`'s `layers`), named as errors name it."""
    return [(f"`model.blocks[{i}].attention.mask`", b.attention.mask) for i, b in enumerate(layers)]


def lookahead_masks(layers) -> list[tuple[str, AbstractMask]]:
    """The layers' masks that may let a token see a later one (`max_lookahead() != 0`),
    which a KV cache may not serve, named with their type as errors name them."""
    return [
        (f"{name} ({type(mask).__name__})", mask)
        for name, mask in layer_masks(layers)
        if mask.max_lookahead() != 0
    ]


def _known(*trees) -> bool:
    """Whether every array of `trees` has a value here (outside `jit`)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


# Prompts.


def check_prefill_prompt(
    layers, tokens, layout: Layout | None, segment_ids, max_new_tokens, ring_size: int
) -> tuple[Array, Layout]:
    """`prefill`'s prompt in layout order and its one-example layout (contiguous shards
    made from `segment_ids` without one), checked against each other and the masks,
    and `max_new_tokens`: the masks must serve that many tokens after the prompt."""
    tokens, layout = _prefill_prompt(layers, tokens, layout, segment_ids, ring_size)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be an integer >= 0; got {max_new_tokens!r}.")
    check_servable(layers, layout.token_info(), layout.seq_len, max_new_tokens)
    return tokens, layout


def _prefill_prompt(layers, tokens, layout, segment_ids, ring_size: int):
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
        for block in layers:
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


def check_generate_prompt(
    layers, vocab_size: int, prompt: Array, strategy, segment_ids, span_ids, steps: int, mesh
) -> tuple[Array, Layout]:
    """`generate`'s prompt `[seq]` or `[batch, seq]` and its ids, and their `Layout`
    from `strategy` (an `AbstractShardingStrategy`) on the ring of `mesh`: masks that
    read ids must have them, and serve `steps` tokens after the prompt, and the token
    ids must index the vocabulary (now when known, else at run time)."""
    if prompt.ndim not in (1, 2) or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(
            "`prompt` must be an integer array [seq] or [batch, seq]; got "
            f"{prompt.dtype} of shape {prompt.shape}."
        )
    _check_ids("segment_ids", segment_ids, prompt)
    _check_ids("span_ids", span_ids, prompt)
    ring_size = mesh.shape[layers[0].attention.axis_name]
    layout = strategy.layout(
        prompt.shape[-1], ring_size, segment_ids=segment_ids, span_ids=span_ids
    )
    for name, mask in layer_masks(layers):
        # The layout would hold placeholders for ids not given.
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
    check_servable(layers, layout.token_info(), layout.seq_len, steps)
    return _check_vocab(prompt, vocab_size, mesh), layout


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


def _check_vocab(prompt: Array, vocab_size: int, mesh) -> Array:
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


# The masks a cache can serve.


@eqx.filter_jit
def _seen_ahead(mask: AbstractMask, info: TokenInfo, seq_len: int, steps: int):
    """`bool[examples, steps]`: whether any prompt token of each example (records
    `[examples, slots]`) may see the generated token at `seq_len + t`."""

    def example(info):
        segment = last_segment(info, seq_len)

        def at(position):
            return jnp.any(sees_ahead(mask, info, new_token(position, segment)))

        return jax.lax.map(at, seq_len + jnp.arange(steps, dtype=jnp.int32))

    return jax.vmap(example)(info)


def check_servable(layers, info: TokenInfo, seq_len: int, steps: int) -> None:
    """Raise when a mask of `layers` lets a prompt token (records `info`, `[*batch,
    slots]`) attend to one of the `steps` tokens generated after it, which a KV cache
    cannot serve.

    Masks that never look ahead (`max_lookahead() == 0`) pass statically. For the others
    the records decide, so it is checked here when they are known (outside `jit`); else
    every decode step checks its own token at run time."""
    masks = lookahead_masks(layers)
    leaves = (info.positions, info.segments, info.spans, info.valid)
    if steps < 1 or not masks or any(isinstance(x, jax.core.Tracer) for x in leaves):
        return
    flat = TokenInfo(*(x.reshape((-1, x.shape[-1])) for x in leaves))
    for name, mask in masks:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(mask)):
            continue  # a traced model (inside `jit`): the decode steps check
        hits = np.asarray(_seen_ahead(mask, flat, seq_len, steps))
        if not hits.any():
            continue
        b, t = (int(i) for i in np.argwhere(hits)[0])
        one = TokenInfo(*(x[b] for x in (flat.positions, flat.segments, flat.spans, flat.valid)))
        new = new_token(seq_len + t, last_segment(one, seq_len))
        seen = np.asarray(sees_ahead(mask, one, new))
        p = int(np.asarray(one.positions)[np.argmax(seen)])
        example = f" (example {b})" if hits.shape[0] > 1 else ""
        raise ValueError(
            f"{name} must not let a prompt token attend to a later "
            "one, which a KV cache cannot serve (the cached keys and values of earlier "
            f"tokens are never recomputed); got prompt position {p} attending to the "
            f"generated token at position {seq_len + t}{example}. Decode with a mask under "
            "which no token sees a later one after the prompt: Causal, Causal() & "
            "Document(), a causal SlidingWindow, PrefixLM with the prefix in the prompt."
        )


# Decoding: the cache and the token, then what a step found.


def check_decode(layers, vocab_size: int, token, cache: KVCache, mesh, on_overflow: str) -> None:
    """What `decode` checks before anything is traced: `on_overflow`, the cache against
    the model of these `layers` and the `mesh` it is decoded on, and the token."""
    match on_overflow:
        case "error" | "flag":
            pass
        case _:
            raise ValueError(f"`on_overflow` must be 'error' or 'flag'; got {on_overflow!r}.")
    _check_cache(layers, cache, mesh.shape[layers[0].attention.axis_name])
    _check_devices(cache, mesh)
    _check_token(token, vocab_size)


def _check_cache(layers, cache: KVCache, ring_size: int) -> None:
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



def _check_devices(cache: KVCache, mesh) -> None:
    """Where the cache's arrays are known (outside `jit`), they must live on the mesh's
    devices: a cache prefilled on another mesh fails deep in a reshard otherwise."""
    leaf = cache.keys[0] if cache.keys else None
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        return
    if not leaf.committed:  # made without a placement (by hand): free to move
        return
    have = sorted(d.id for d in leaf.sharding.device_set)
    if isinstance(mesh, jax.sharding.Mesh):
        want = sorted(d.id for d in mesh.devices.flat)
        same = have == want
    else:  # the abstract mesh of `jax.set_mesh` knows its size, not its devices
        want, same = mesh.size, len(have) == mesh.size
    if not same:
        raise ValueError(
            f"`cache` must live on the devices of the mesh it is decoded on ({want}); "
            f"got a cache on devices {have}. Decode on the mesh the cache was prefilled "
            "on, or move it there with `jax.device_put`."
        )


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


def raise_if_known(cache: KVCache, on_overflow: str, ok, ahead, sees) -> None:
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



def step_errors(cache: KVCache, ok, fits, in_vocab, ahead, sees, vocab_size: int):
    """The run-time checks of a decode step with `on_overflow="error"`, `(pred, msg)`
    pairs in the order their messages win (the first that fails is raised): a flagged
    cache, an edited `length`, a token outside the vocabulary, no slot for it, and a
    mask of `ahead` (named as `lookahead_masks` names it) that lets an earlier token see it."""
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
        ),
    ]
    return checks + [
        (
            s,
            f"{name} must not let an earlier token attend to the new one, which a "
            "KV cache cannot serve (cached keys and values are never recomputed).",
        )
        for (name, _), s in zip(ahead, sees)
    ]
