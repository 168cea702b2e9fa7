"""Inference: ring prefill into a sharded KV cache, exact decoding, `generate`."""

import contextlib
import io

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import assert_close, mesh

import ringeqx as rx
from ringeqx._cli._main import main as cli_main
from ringeqx._inference._generate import _arguments, _generate
from ringeqx.tools._hlo._parse import parse_collectives


VOCAB, PROMPT, STEPS = 37, 61, 8
_TRACES = []


class _CountingSoftcap(rx.AbstractScoreMod):
    """A soft cap that counts how often it is traced on one-query (decode) scores."""

    cap: float = 6.0

    def __call__(self, scores, q, k):
        if scores.shape[-2] == 1:
            _TRACES.append(scores.shape)
        return self.cap * jnp.tanh(scores / self.cap)

    def for_head(self, head):
        return self

    def check(self, heads):
        pass


def _model(key=0, masks=None, score_mods=None):
    """Two layers: causal documents with a soft cap, a causal window with ALiBi; GQA
    (4 query / 2 kv heads) and non-zero sinks everywhere."""
    masks = masks or (rx.Causal() & rx.Document(), rx.SlidingWindow(7))
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    score_mods = score_mods or (_CountingSoftcap(), rx.ALiBi(slopes))
    model = rx.nn.RingTransformerLM(
        VOCAB,
        16,
        4,
        len(masks),
        num_kv_heads=2,
        hidden=24,
        attention=rx.nn.AttentionOptions(kernel=rx.XlaKernel(8, 8), sinks=True),
        key=jax.random.key(key),
    )
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    for i, (mask, mod) in enumerate(zip(masks, score_mods)):
        model = eqx.tree_at(
            lambda m: (
                m.blocks[i].attention.mask,
                m.blocks[i].attention.score_mod,
                m.blocks[i].attention.sinks,
            ),
            model,
            (mask, mod, sinks * (i + 1)),
            is_leaf=lambda x: x is None,
        )
    return model


def _dense_lm(model, tokens, segment_ids):
    """The model's maths written independently, with dense attention, on one device."""
    seq = tokens.shape[0]
    pos = jnp.arange(seq)
    x = model.embedding.weight[tokens]
    for block in model.blocks:
        a = block.attention
        h = jax.vmap(block.attention_norm)(x)
        q = (h @ a.query_proj.weight.T).reshape(seq, a.num_heads, a.head_dim)
        k = (h @ a.key_proj.weight.T).reshape(seq, a.num_kv_heads, a.head_dim)
        v = (h @ a.value_proj.weight.T).reshape(seq, a.num_kv_heads, a.head_dim)
        q, k = rx.nn.apply_rope(q, pos, a.rope_theta), rx.nn.apply_rope(k, pos, a.rope_theta)
        out = rx.reference_attention(
            q,
            k,
            v,
            mask=a.mask,
            segment_ids=segment_ids,
            sinks=a.sinks,
            score_mod=a.score_mod,
        )
        x = x + out.reshape(seq, -1) @ a.output_proj.weight.T
        h = jax.vmap(block.mlp_norm)(x)
        x = x + jax.vmap(block.mlp_out)(jax.nn.gelu(jax.vmap(block.mlp_in)(h)))
    return jax.vmap(model.head)(jax.vmap(model.final_norm)(x))


@eqx.filter_jit
def _dense_batch(model, tokens, segment_ids):
    return jax.vmap(_dense_lm, in_axes=(None, 0, 0))(model, tokens, segment_ids)


def _host(x):
    return jnp.asarray(np.asarray(x))


@pytest.mark.parametrize(
    "shape, names, explicit, strategy, sampling",
    [
        ((1,), ("sequence",), False, rx.Uniform(), dict()),
        ((3,), ("sequence",), True, rx.Zigzag(), dict(temperature=1.0, top_k=5)),
        ((8,), ("sequence",), False, rx.Zigzag(), dict()),
        ((2, 4), ("batch", "sequence"), False, rx.Uniform(), dict(temperature=1.0)),
    ],
)
def test_decode_logits_equal_dense_recomputation(shape, names, explicit, strategy, sampling):
    # Two prompts of two documents each, batched in one compiled program; every step's
    # logits (the first from the prefill) equal a dense run over the whole sequence. On
    # Explicit mesh axes the cache is resharded onto the ring as the ring's inputs are.
    model = _model()
    prompts = jax.random.randint(jax.random.key(1), (2, PROMPT), 0, VOCAB)
    cut = jnp.array([[25], [40]])
    seg = (jnp.arange(PROMPT)[None] >= cut).astype(jnp.int32) + jnp.array([[3], [7]])
    m = mesh(*shape, names=names, explicit=explicit)
    before = len(_TRACES)
    with jax.set_mesh(m):
        tokens, logits = rx.generate(
            model,
            prompts,
            STEPS,
            jax.random.key(2),
            strategy=strategy,
            segment_ids=seg,
            return_logits=True,
            **sampling,
        )
        traced = len(_TRACES)
        again = rx.generate(
            model,
            prompts[::-1],
            STEPS,
            jax.random.key(3),
            strategy=strategy,
            segment_ids=seg[::-1],
            **{**sampling, "temperature": 0.5 * sampling.get("temperature", 0.0)},
        )
    # New prompt values, key and temperature reuse the compiled program: no retrace.
    assert len(_TRACES) == traced > before  # traced once for the first call only
    # Inside the compiled decode loop (the scan of STEPS trips): only the merge's
    # all-reduces, one max and one sum per layer; the ring's permutes are the prefill's.
    with jax.set_mesh(m):
        args = _arguments(
            model,
            prompts,
            STEPS,
            jax.random.key(2),
            sampling.get("temperature", 0.0),
            sampling.get("top_k"),
            strategy,
            seg,
            None,
        )
        hlo = _generate.lower(*args).compile().compiled.as_text()
    in_loop = [c.kind for c in parse_collectives(hlo) if STEPS in c.trips]
    assert in_loop == ["all-reduce"] * 4
    assert tokens.shape == again.shape == (2, STEPS)
    assert logits.shape == (2, STEPS, VOCAB)
    full = jnp.concatenate([prompts, _host(tokens[:, :-1])], axis=1)
    full_seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:], STEPS - 1, axis=1)], axis=1)
    dense = _dense_batch(model, full, full_seg)[:, PROMPT - 1 :]
    assert_close(_host(logits), dense, 1e-5, 1e-5)
    if not sampling:
        assert (_host(tokens) == jnp.argmax(dense, -1)).all()


def test_decode_step_evicts_exactly_without_collective_permute():
    # Prompt shards with no free slot (32 tokens on 8 devices): every decode token evicts
    # the oldest token of its device, which no query sees any more; the logits stay
    # exact. The compiled step has, per layer, one max and one sum all-reduce (the
    # merge) and no collective-permute; the cache stays sharded over the ring.
    model = _model(masks=(rx.SlidingWindow(6), rx.SlidingWindow(9)), score_mods=(None, None))
    prompt = jax.random.randint(jax.random.key(5), (32,), 0, VOCAB)
    with jax.set_mesh(mesh(8)):
        logits, cache = eqx.filter_jit(lambda mo, t: mo.prefill(t))(model, prompt)
        step = jax.jit(lambda t, c: model.decode(t, c))
        hlo = step.lower(jnp.int32(0), cache).compile().as_text()
        seen, tokens = [logits], []
        for _ in range(6):
            tokens.append(jnp.argmax(seen[-1]).astype(jnp.int32))
            logits, cache = step(tokens[-1], cache)
            seen.append(logits)
    found = parse_collectives(hlo)
    assert not [c for c in found if c.kind == "collective-permute"]
    assert sorted(c.kind for c in found) == ["all-reduce"] * 4
    assert cache.keys[0].sharding.spec == jax.sharding.PartitionSpec(None, "sequence")
    assert cache.capacity == 4 and not bool(cache.overflow) and int(cache.length) == 38
    # 32..37 went round robin to devices 0..5 and evicted the oldest of each.
    held = set(np.asarray(cache.records.positions).tolist())
    assert held == set(range(38)) - {0, 4, 8, 12, 16, 20}
    full = jnp.concatenate([prompt, _host(jnp.stack(tokens))])
    dense = eqx.filter_jit(_dense_lm)(model, full, None)[31:]
    assert_close(_host(jnp.stack(seen)), dense, 1e-5, 1e-5)


def _cache(positions, length, p=2):
    positions = jnp.asarray(positions, jnp.int32)
    records = rx.TokenInfo(positions, positions * 0, positions * 0 - 1, positions >= 0)
    kv = jnp.zeros((1, positions.shape[0], 2))
    return rx.KVCache(
        (kv,), (kv,), records, jnp.int32(length), jnp.int32(0), jnp.zeros((), bool), p
    )


def test_next_slot_round_robin_free_evict_or_overflow():
    # Position 5 goes to device 1 (5 % 2): its free slot first.
    slot, ok = _cache([0, 2, 1, -1], 5).next_slot(None)
    assert int(slot) == 3 and bool(ok)
    # Full device 1: evict its oldest (position 1) only where the window allows it.
    cache = _cache([0, 2, 1, 3], 5)
    slot, ok = cache.next_slot(3)
    assert int(slot) == 2 and bool(ok)
    assert not bool(cache.next_slot(4)[1])  # 5 - 1 = 4: still in a window of 5
    assert not bool(cache.next_slot(None)[1])  # causal: nothing may be evicted
    records = cache.write_records(jnp.int32(2))
    assert np.asarray(records.positions).tolist() == [0, 2, 5, 3]


def test_inference_errors():
    model = _model(masks=(rx.Causal(),), score_mods=(None,))
    prompt = jnp.arange(12, dtype=jnp.int32)
    with jax.set_mesh(mesh(2)):
        with pytest.raises(ValueError, match="`steps` must be an integer >= 1"):
            rx.generate(model, prompt, 0, jax.random.key(0))
        with pytest.raises(ValueError, match="`top_k` must be None or an integer"):
            rx.generate(model, prompt, 2, jax.random.key(0), top_k=0)
        with pytest.raises(ValueError, match="`prompt` must be an integer array"):
            rx.generate(model, prompt[None, None], 2, jax.random.key(0))
        # Sampling parameters that mean nothing, and ids outside the vocabulary: our own
        # checks, as a user without jaxtyping's runtime hook meets them.
        jaxtyping.config.update("jaxtyping_disable", True)
        try:
            for t, match in [
                (-1.0, r"`temperature` must be finite and >= 0 .*got -1.0"),
                (float("nan"), r"`temperature` must be finite and >= 0 .*got nan"),
                ("hot", r"`temperature` must be a real scalar .*got str 'hot'"),
                (jnp.ones(2), r"`temperature` must be a real scalar"),
                (True, r"`temperature` must be a real scalar"),
            ]:
                with pytest.raises(ValueError, match=match):
                    rx.generate(model, prompt, 2, jax.random.key(0), temperature=t)
            with pytest.raises(ValueError, match="`key` must be a jax.random key"):
                rx.generate(model, prompt, 2, 0)
        finally:
            jaxtyping.config.update("jaxtyping_disable", False)
    # Prompts the mesh's batch axis does not divide: said before anything is traced.
    with jax.set_mesh(mesh(2, 2, names=("batch", "sequence"))):
        with pytest.raises(ValueError, match="batch size 3 must be divisible by the mesh axis"):
            rx.generate(model, jnp.stack([prompt] * 3), 2, jax.random.key(0))
    with jax.set_mesh(mesh(2)):
        vocab = model.embedding.num_embeddings
        with pytest.raises(ValueError, match=rf"token ids must be in \[0, {vocab}\).*e.g. {vocab}"):
            rx.generate(model, prompt.at[3].set(vocab), 2, jax.random.key(0))
        # Traced, the ids are checked at run time, on both devices together (a check
        # that fired on one device only would leave the other waiting).
        with pytest.raises(Exception, match=rf"token ids must be in \[0, {vocab}\)"):
            run = jax.jit(lambda p: rx.generate(model, p, 2, jax.random.key(0)))
            jax.block_until_ready(run(prompt.at[3].set(-1)))
        with pytest.raises(ValueError, match="not to prefill together with `layout=`"):
            model.prefill(prompt, rx.Uniform().layout(12, 2), segment_ids=prompt * 0)
        with pytest.raises(ValueError, match="`max_new_tokens` must be an integer >= 0"):
            model.prefill(prompt, max_new_tokens=-1)
        with pytest.raises(ValueError, match="the ring axis 'sequence' has 2 devices"):
            model.decode(jnp.int32(0), _cache([0, 1, 2], 3, p=3))
    with pytest.raises(ValueError, match="num_shards \\* capacity slots"):
        _cache([0, 1, 2], 3, p=2)


def test_cli_generate():
    out = io.StringIO()
    argv = "generate --devices 3 --seq-len 20 --steps 3 --layers 1 --vocab 11 --heads 2"
    argv += " --kv-heads 1 --head-dim 4 --window 5 --temperature 1.0 --top-k 4"
    with contextlib.redirect_stdout(out):
        code = cli_main(argv.split())
    text = out.getvalue()
    assert code == 0 and "prefill + 3 decode steps" in text and "  OK" in text, text
