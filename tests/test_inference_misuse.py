"""Misuse of prefill, decode and `generate` (issue 25): every input that would give a
wrong answer, or fail deep in a compiled loop, is a clear error naming the argument."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from helpers import mesh

import ringeqx as rx
from ringeqx._inference._generate import _arguments


VOCAB, SEQ = 11, 6


def _model(mask=None, *, num_heads=2, num_kv_heads=None, dim=8, layers=1):
    return rx.nn.RingTransformerLM(
        VOCAB,
        dim,
        num_heads,
        layers,
        num_kv_heads=num_kv_heads,
        hidden=8,
        attention=rx.nn.AttentionOptions(mask=mask or rx.Causal(), kernel=rx.XlaKernel(8, 8)),
        key=jax.random.key(0),
    )


PROMPT = jnp.arange(SEQ, dtype=jnp.int32) % VOCAB


@contextlib.contextmanager
def _our_checks():
    """Our own checks, as a user without jaxtyping's runtime hook meets them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def _prefill(model, tokens=PROMPT, max_new_tokens=0, layout=None):
    # Under jit: the layout's records are traced, so prefill defers the mask check to
    # the decode steps (which is what the run-time tests below exercise).
    return eqx.filter_jit(lambda m, t: m.prefill(t, layout, max_new_tokens=max_new_tokens))(
        model, tokens
    )


# (1) Masks that need ids the call did not get, or that a KV cache cannot serve.


def test_masks_reading_ids_not_given_are_refused():
    with jax.set_mesh(mesh(2)):
        documents = _model(rx.Causal() & rx.Document())
        with pytest.raises(
            ValueError,
            match=r"`segment_ids` must be given: `model.blocks\[0\].attention.mask` \(And\) "
            r"reads `segments`; got segment_ids=None",
        ):
            rx.generate(documents, PROMPT, 2, jax.random.key(0))
        # The same words as the full forward, which refuses the same input.
        with pytest.raises(ValueError, match="This mask reads segment ids"):
            documents(PROMPT)
        with pytest.raises(ValueError, match="This mask reads segment ids: pass `segment_ids=`"):
            documents.prefill(PROMPT)
        spans = _model(rx.BidirectionalSpans())
        with pytest.raises(ValueError, match=r"`span_ids` must be given: .*\(BidirectionalSpans\)"):
            rx.generate(spans, PROMPT, 2, jax.random.key(0))
        with pytest.raises(ValueError, match="This mask reads span ids"):
            spans.prefill(PROMPT)


@pytest.mark.parametrize(
    "mask, seen",
    [
        (rx.Full(), 0),
        (rx.Document(), 0),
        (rx.SlidingWindow(3, two_sided=True), SEQ - 2),
        (rx.PrefixLM(8), 0),
    ],
)
def test_masks_a_cache_cannot_serve_are_refused_before_compiling(mask, seen):
    # A prompt token that may see a generated token would need its cached keys and values
    # recomputed: refused from the prompt's records, before anything compiles.
    model = _model(mask)
    ids = dict(segment_ids=jnp.zeros(SEQ, jnp.int32)) if isinstance(mask, rx.Document) else {}
    match = (
        rf"`model.blocks\[0\].attention.mask` \({type(mask).__name__}\) must not let a prompt "
        rf"token attend to a later one.*got prompt position {seen} attending to the generated "
        rf"token at position {SEQ}\."
    )
    with jax.set_mesh(mesh(2)):
        with pytest.raises(ValueError, match=match):
            rx.generate(model, PROMPT, 2, jax.random.key(0), **ids)
        layout = rx.Uniform().layout(SEQ, 2, **ids)
        with pytest.raises(ValueError, match=match):
            model.prefill(layout.shard(PROMPT), layout, max_new_tokens=1)


def test_masks_a_cache_serves_pass():
    # PrefixLM with the prefix inside the prompt, spans inside the prompt: generated
    # tokens are causal, so the checks (run here, without compiling generate) pass.
    prompt = jnp.stack([PROMPT, PROMPT])
    spans = jnp.array([[-1, 0, 0, -1, 1, 1], [2, 2, -1, -1, -1, -1]], jnp.int32)
    with jax.set_mesh(mesh(2)):
        key = jax.random.key(0)
        _arguments(_model(rx.PrefixLM(4)), prompt, 3, key, 0.0, None, None, None, None)
        spanned = _model(rx.BidirectionalSpans())
        _arguments(spanned, prompt, 3, key, 0.0, None, None, None, None, spans)
        # One row of span ids for the batch, and a spanned prompt that generates.
        tokens = rx.generate(spanned, PROMPT, 2, key, span_ids=spans[0])
    assert tokens.shape == (2,)


def test_mask_seeing_ahead_is_caught_by_decode_at_run_time():
    # Records known only at run time (a jitted prefill): each decode step checks its token.
    model = _model(rx.Document())
    segment_ids = jnp.zeros(SEQ, jnp.int32)
    with jax.set_mesh(mesh(2)):
        prefill = eqx.filter_jit(lambda m, t, s: m.prefill(t, segment_ids=s, max_new_tokens=2))
        _, cache = prefill(model, PROMPT, segment_ids)
        with pytest.raises(
            ValueError,
            match=r"`model.blocks\[0\].attention.mask` \(Document\) must not let an earlier "
            r"token attend to a later one.*got the token at position 0 attending to the new "
            r"token at position 6",
        ):
            model.decode(jnp.int32(1), cache)
        step = eqx.filter_jit(lambda m, c: m.decode(jnp.int32(1), c))
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"\(Document\) must not let an"):
            jax.block_until_ready(step(model, cache))
        # Opted in to the flag: the step runs and says it was not exact.
        _, flagged = model.decode(jnp.int32(1), cache, on_overflow="flag")
        assert bool(flagged.overflow)


# (2) A cache that does not match the model.


def test_cache_that_does_not_fit_the_model_is_refused():
    model = _model()
    with jax.set_mesh(mesh(2)):
        _, cache = _prefill(model, max_new_tokens=2)
        slots = cache.records.positions.shape[0]
        token = jnp.int32(1)
        cases = [
            (_model(num_kv_heads=1), cache, ValueError,
             rf"`cache.keys\[0\]` must have shape \[kv_heads=1, slots={slots}, head_dim=4\] "
             rf"\(layer 0 of the model\); got shape \(2, {slots}, 4\)"),
            (_model(dim=16), cache, ValueError,
             rf"`cache.keys\[0\]` must have shape \[kv_heads=2, slots={slots}, head_dim=8\]"),
            (model, jax.tree.map(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32
                                 else x, cache), TypeError,
             r"`cache.keys\[0\]` must have dtype float32 .*; got float16"),
            (_model(layers=2), cache, ValueError,
             r"`cache` must have one layer per block of the model \(2\); got 1 layers"),
            (model, jax.tree.map(lambda x: x[None], cache), ValueError,
             rf"`cache` must be one example's .*got records of shape \(1, {slots}\)"),
            (model, eqx.tree_at(lambda c: c.length, cache, jnp.float32(6)), TypeError,
             r"`cache.length` must be a int32 scalar; got float32"),
        ]
        for other, bad, error, match in cases:
            with pytest.raises(error, match=match):
                other.decode(token, bad)
        with _our_checks():
            with pytest.raises(ValueError, match="`on_overflow` must be 'error' or 'flag'; got"):
                model.decode(token, cache, on_overflow="warn")


def test_hand_built_cache_is_checked():
    positions = jnp.arange(4, dtype=jnp.int32)
    records = rx.TokenInfo(positions, positions * 0, positions * 0 - 1, positions >= 0)
    kv = jnp.zeros((1, 4, 2))
    scalars = (jnp.int32(4), jnp.int32(0), jnp.zeros((), bool))
    with _our_checks():
        with pytest.raises(ValueError, match=r"KVCache `keys\[0\]` must have shape \[kv_heads, "
                           r"slots=4, head_dim\] \(one slot per record\); got shape \(1, 3, 2\)"):
            rx.KVCache((kv[:, :3],), (kv[:, :3],), records, *scalars, 2)
        with pytest.raises(ValueError, match=r"KVCache `values\[0\]` must have the shape of "
                           r"`keys\[0\]` \(1, 4, 2\); got \(1, 4, 3\)"):
            rx.KVCache((kv,), (jnp.zeros((1, 4, 3)),), records, *scalars, 2)
        short = eqx.tree_at(lambda r: r.segments, records, positions[:3])
        with pytest.raises(ValueError, match=r"KVCache `records.segments` must have the shape "
                           r"of `records.positions` \(4,\); got \(3,\)"):
            rx.KVCache((kv,), (kv,), short, *scalars, 2)
        floats = eqx.tree_at(lambda r: r.positions, records, positions.astype(jnp.float32))
        with pytest.raises(TypeError, match="KVCache `records.positions` must have dtype "
                           "int32; got float32"):
            rx.KVCache((kv,), (kv,), floats, *scalars, 2)
        with pytest.raises(ValueError, match="KVCache `num_shards` must be an integer >= 1"):
            rx.KVCache((kv,), (kv,), records, *scalars, 0)


# (3) Decoding past the cache's capacity: an error unless the caller opts in to the flag.


@pytest.mark.parametrize("mask", [rx.Causal(), rx.SlidingWindow(5)])
def test_overflow_is_an_error_unless_flagged(mask):
    # 4 prompt tokens on 2 devices fill every slot; a window of 5 is longer than the 4
    # slots, so nothing may be evicted either.
    model = _model(mask)
    with jax.set_mesh(mesh(2)):
        _, cache = _prefill(model, PROMPT[:4])
        with pytest.raises(
            ValueError,
            match=r"`cache` must have room for the token at position 4: its device 0 holds "
            r"2 slots.*Prefill with a larger `max_new_tokens`",
        ):
            model.decode(jnp.int32(1), cache)
        step = eqx.filter_jit(lambda m, c: m.decode(jnp.int32(1), c))
        with pytest.raises(eqx.EquinoxRuntimeError, match="`cache` is full"):
            jax.block_until_ready(step(model, cache))
        _, flagged = model.decode(jnp.int32(1), cache, on_overflow="flag")
        assert bool(flagged.overflow) and not bool(cache.overflow)


# (4) Ids of another batch.


def test_ids_not_shaped_like_the_prompt_are_refused():
    prompts = jnp.stack([PROMPT, PROMPT])
    model = _model()
    with jax.set_mesh(mesh(2)):
        with _our_checks():
            for shape in [(3, SEQ), (1, SEQ)]:
                with pytest.raises(
                    ValueError,
                    match=rf"`segment_ids` must have shape \[seq={SEQ}\] or \[batch=2, "
                    rf"seq={SEQ}\] \(the prompt's\); got shape \({shape[0]}, {SEQ}\)",
                ):
                    rx.generate(model, prompts, 2, jax.random.key(0),
                                segment_ids=jnp.zeros(shape, jnp.int32))
            with pytest.raises(ValueError, match=rf"`segment_ids` must have shape \[seq={SEQ}\] "
                               r"\(the prompt's\); got shape \(2, 6\)"):
                rx.generate(model, PROMPT, 2, jax.random.key(0),
                            segment_ids=jnp.zeros((2, SEQ), jnp.int32))
            with pytest.raises(ValueError, match=r"`span_ids` must have shape"):
                rx.generate(model, PROMPT, 2, jax.random.key(0),
                            span_ids=jnp.zeros((2, SEQ), jnp.int32))
            with pytest.raises(ValueError, match=r"`segment_ids` must have the shape of `tokens` "
                               r"\[seq=6\] \(one example.*got shape \(2, 6\)"):
                model.prefill(PROMPT, segment_ids=jnp.zeros((2, SEQ), jnp.int32))
            with pytest.raises(ValueError, match=r"`tokens` must be an integer array \[seq\] "
                               r"\(one example"):
                model.prefill(prompts)
            batched = rx.Uniform().layout(SEQ, 2, segment_ids=jnp.zeros((2, SEQ), jnp.int32))
            with pytest.raises(ValueError, match=r"`layout` must be one example's .*got batch "
                               r"shape \(2,\)"):
                model.prefill(PROMPT, batched)
            zigzag = rx.Zigzag().layout(SEQ, 2)
            with pytest.raises(ValueError, match=r"`tokens` must be in the layout's order, "
                               rf"\[num_shards \* capacity = {zigzag.sharded_len}\].*got "
                               r"shape \(6,\)"):
                model.prefill(PROMPT, zigzag)


# (5) A mesh other than the one the model and cache need.


def test_mesh_that_does_not_fit_is_refused():
    model = _model()
    other = mesh(2, names=("seq",))
    with pytest.raises(ValueError, match=r"`mesh` must have the model's ring axis 'sequence' "
                       r"\(the layers' `axis_name`\); got a mesh with axes \('seq',\)"):
        rx.generate(model, PROMPT, 2, jax.random.key(0), mesh=other)
    with jax.set_mesh(other):
        with pytest.raises(ValueError, match=r"the mesh set by `jax.set_mesh` must have the "
                           r"model's ring axis 'sequence'"):
            model.prefill(PROMPT)
    with _our_checks(), pytest.raises(TypeError, match="`mesh` must be a jax.sharding.Mesh"):
        model.prefill(PROMPT, mesh=2)
    with jax.set_mesh(mesh(2)):
        _, cache = _prefill(model, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"`cache` was made for a ring of 2 devices.*the ring "
                       r"axis 'sequence' has 4 devices"):
        model.decode(jnp.int32(1), cache, mesh=mesh(4))
    # Two devices on the ring as the cache's, but four in all: the cache lives on two.
    square = mesh(2, 2, names=("batch", "sequence"))
    with pytest.raises(ValueError, match=r"`cache` must live on the devices of the mesh it is "
                       r"decoded on \(\[0, 1, 2, 3\]\); got a cache on devices \[0, 1\]"):
        model.decode(jnp.int32(1), cache, mesh=square)
    with jax.set_mesh(square):
        with pytest.raises(ValueError, match=r"`cache` must live on the devices .*\(4\); got a "
                           r"cache on devices \[0, 1\]"):
            model.decode(jnp.int32(1), cache)


# (6) Cache states that no longer describe a sequence, and token ids outside the
# vocabulary: refused, not decoded into wrong logits (issue 45).


def test_flagged_cache_is_refused_by_the_default_decode():
    # 4 prompt tokens on 3 devices (2 slots each): position 4 goes to the full device 1
    # and is dropped (flagged); position 5 finds a free slot on device 2, so only the
    # flag says that the dropped token is missing from every later step.
    model = _model()
    with jax.set_mesh(mesh(3)):
        _, cache = _prefill(model, PROMPT[:4])
        _, flagged = model.decode(jnp.int32(1), cache, on_overflow="flag")
        assert bool(flagged.overflow)
        assert bool(flagged.next_slot(None)[1])  # room for the next token
        with pytest.raises(ValueError, match=r"`cache.overflow` is set: an earlier decode "
                           r"with on_overflow='flag' was not exact"):
            model.decode(jnp.int32(2), flagged)
        step = eqx.filter_jit(lambda m, c: m.decode(jnp.int32(2), c))
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"`cache.overflow` is set"):
            jax.block_until_ready(step(model, flagged))
        # Opted in to the flag, decoding goes on and the flag stays set.
        _, still = model.decode(jnp.int32(2), flagged, on_overflow="flag")
        assert bool(still.overflow)


def test_edited_cache_length_and_tokens_outside_the_vocabulary_are_refused():
    model = _model()
    with jax.set_mesh(mesh(2)):
        _, cache = _prefill(model, max_new_tokens=2)
        assert int(cache.length) == SEQ
        # Moved back (a position held twice), below 0, forward (positions skipped).
        edits = [eqx.tree_at(lambda c: c.length, cache, jnp.int32(n)) for n in (3, -1, 9)]
        for n, bad in zip((3, -1, 9), edits):
            with pytest.raises(ValueError, match=rf"`cache.length` must be {SEQ} \(one past "
                               rf"the position of the cache's last token.*; got {n}\."):
                model.decode(jnp.int32(1), bad)
        for token in (VOCAB, -1):
            with pytest.raises(ValueError, match=rf"`token` must be in \[0, {VOCAB}\) \(the "
                               rf"model's vocab_size\); got {token}\."):
                model.decode(jnp.int32(token), cache)
        with _our_checks(), pytest.raises(ValueError, match=r"`token` must be an integer "
                                          r"scalar \(a token id\); got float32 of shape \(\)"):
            model.decode(jnp.float32(1), cache)
        # Traced, they are checked at run time, or flag the step.
        step = eqx.filter_jit(lambda m, t, c: m.decode(t, c))
        with pytest.raises(eqx.EquinoxRuntimeError, match=r"`cache.length` must be one past"):
            jax.block_until_ready(step(model, jnp.int32(1), edits[0]))
        with pytest.raises(eqx.EquinoxRuntimeError, match=rf"`token` must be in \[0, {VOCAB}\)"):
            jax.block_until_ready(step(model, jnp.int32(VOCAB), cache))
        flag = eqx.filter_jit(lambda m, t, c: m.decode(t, c, on_overflow="flag")[1].overflow)
        assert bool(flag(model, jnp.int32(1), edits[2]))
        assert bool(flag(model, jnp.int32(-1), cache))
        assert not bool(flag(model, jnp.int32(1), cache))
