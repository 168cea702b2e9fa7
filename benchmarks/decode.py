"""Decoding over a sequence-sharded KV cache: latency and bytes per token, and exactness.

Three ways to attend one new token's query to a KV cache of `N` tokens sharded over `P`
(fake CPU) devices, one attention layer, each compiled once:

- **ringeqx** (`ringeqx._inference._decode.decode_attention`, what `RingTransformerLM.decode` runs):
  every device attends to its own slots, and the partial `(out, lse)` are merged by one
  `pmax` and one `psum` (the log-sum-exp merge; a reduction tree of `log P` steps).
- **all-gather**: every device gathers the whole cache (`all_gather`) and attends to it
  alone: the baseline of moving the cache to the query.
- **query ring**: the query and its running `(out, lse)` travel round the ring, `P - 1`
  hops of `collective-permute`, each device adding its slots' share on arrival (Ring
  Attention with the query moving instead of K/V; each hop waits for the one before).

Bytes are per device per token, read from the compiled HLO (`ringeqx.tools._hlo._parse`): the
result size of each collective times how often it runs (an all-reduce moves about twice
its size over a ring, an all-gather about its size).

The second part is the issue's exactness check at full size: a 1K-token prompt and 64
decode steps on 1, 3 and 8 devices, Zigzag and Uniform prefill, a model whose layers are
causal, causal-document and sliding-window with GQA, sinks and ALiBi; every step's logits
against a dense recomputation of the whole sequence (float32).

Run: `python benchmarks/decode.py` (`--help` for options).
"""

import argparse
import math
import time

from _devices import fake_cpu_devices


fake_cpu_devices(8)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import ringeqx as rx  # noqa: E402
from ringeqx._inference._decode import decode_attention  # noqa: E402
from ringeqx._util._timing import median_seconds  # noqa: E402
from ringeqx.tools._hlo._parse import parse_collectives  # noqa: E402


def _partial(kernel, q, keys, values, kv_info, q_info, mask, scale):
    """One device's `(out, lse)` of `q` `[heads, d]` over its slots `[kv_heads, C, d]`."""
    out, lse = kernel.forward(
        q[None, :, None], keys[None], values[None], q_info, kv_info, rx.Scores(mask, None, scale)
    )
    return out[0, :, 0], lse[0, :, 0]


def _methods(mesh, kernel, mask, scale):
    """`{name: f(q, k, v, keys, values, query, records, slot) -> out}`."""
    p = mesh.shape["sequence"]
    cache, rec, rep = PartitionSpec(None, "sequence"), PartitionSpec("sequence"), PartitionSpec()

    def ringeqx(q, k, v, keys, values, query, records, slot):
        return decode_attention(
            q,
            k,
            v,
            keys,
            values,
            query,
            records,
            slot,
            mask=mask,
            score_mod=None,
            sinks=None,
            kernel=kernel,
            scale=scale,
            mesh=mesh,
            axis_name="sequence",
        )[0]

    def q_info(query):
        return jax.tree.map(lambda x: x.reshape(1, 1), query)

    def gather_local(q, keys, values, query, records):
        keys, values = (
            jax.lax.all_gather(x, "sequence", axis=1, tiled=True) for x in (keys, values)
        )
        records = jax.tree.map(lambda x: jax.lax.all_gather(x, "sequence", tiled=True), records)
        kv_info = jax.tree.map(lambda x: x[None], records)
        return _partial(kernel, q, keys, values, kv_info, q_info(query), mask, scale)[0]

    def ring_local(q, keys, values, query, records):
        kv_info = jax.tree.map(lambda x: x[None], records)

        def add(q, o, lse):
            o2, l2 = _partial(kernel, q, keys, values, kv_info, q_info(query), mask, scale)
            both = jnp.logaddexp(lse, l2)
            safe = jnp.where(jnp.isfinite(both), both, 0.0)
            o = o * jnp.exp(lse - safe)[:, None] + o2 * jnp.exp(l2 - safe)[:, None]
            return o, both

        def hop(carry, _):
            q, o, lse = jax.lax.ppermute(carry, "sequence", [(i, (i + 1) % p) for i in range(p)])
            return (q, *add(q, o, lse)), None

        zero = jnp.zeros_like(q)
        init = (q, *add(q, zero, zero[:, 0] - jnp.inf))
        (_, o, _), _ = jax.lax.scan(hop, init, None, length=p - 1)
        return o

    def baseline(local):
        def f(q, k, v, keys, values, query, records, slot):
            return jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(rep, cache, cache, rep, rec),
                out_specs=rep,
                check_vma=False,
            )(q, keys, values, query, records)

        return f

    return {
        "ringeqx": ringeqx,
        "all-gather": baseline(gather_local),
        "query ring": baseline(ring_local),
    }


def _cache(n, p, kv_heads, head_dim, mesh):
    """A cache of `n` tokens in `p` shards (round robin) with one free slot per device."""
    c = n // p + 1
    keys = jax.random.split(jax.random.key(0), 2)
    kv = [jax.random.normal(k, (kv_heads, p * c, head_dim), jnp.float32) for k in keys]
    slots = np.arange(p * c).reshape(p, c)
    positions = np.where(slots % c < c - 1, (slots % c) * p + slots // c, 0)
    valid = slots % c < c - 1
    records = rx.TokenInfo(
        *(
            jnp.asarray(x.reshape(-1), d)
            for x, d in (
                (positions, jnp.int32),
                (positions * 0, jnp.int32),
                (positions * 0 - 1, jnp.int32),
                (valid, jnp.bool_),
            )
        )
    )
    sharded = NamedSharding(mesh, PartitionSpec(None, "sequence"))
    kv = [jax.device_put(x, sharded) for x in kv]
    # The records stay whole on every device, as in `RingTransformerLM.decode`.
    records = jax.device_put(records, NamedSharding(mesh, PartitionSpec()))
    query = rx.TokenInfo(jnp.int32(n), jnp.int32(0), jnp.int32(-1), jnp.bool_(True))
    return kv, records, query, jnp.int32(n % p * c + c - 1)


def latency(args):
    p, n = args.devices, args.cache
    mesh = jax.make_mesh((p,), ("sequence",), axis_types=(AxisType.Auto,))
    kernel, mask = rx.XlaKernel(1, args.block), rx.Causal()
    scale = 1.0 / math.sqrt(args.head_dim)
    (keys, values), records, query, slot = _cache(n, p, args.kv_heads, args.head_dim, mesh)
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (args.heads, args.head_dim), jnp.float32)
    k, v = jax.random.normal(kk, (2, args.kv_heads, args.head_dim), jnp.float32)
    operands = (q, k, v, keys, values, query, records, slot)
    print(
        f"# decode, one attention layer: cache of {n} tokens on {p} devices, {args.heads} "
        f"query / {args.kv_heads} kv heads x {args.head_dim}, float32, "
        f"XlaKernel(1, {args.block}), jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(
        "\n| method | collectives per token (HLO) | KiB per device per token | "
        "latency per token (ms) | max abs error vs ringeqx |"
    )
    print("|---|---|---|---|---|")
    ref = None
    for name, f in _methods(mesh, kernel, mask, scale).items():
        with jax.set_mesh(mesh):
            fn = jax.jit(f)
            compiled = fn.lower(*operands).compile()
            found = parse_collectives(compiled.as_text())
            seconds = median_seconds(compiled, *operands, repeats=args.reps)
            out = np.asarray(compiled(*operands))
        ref = out if ref is None else ref
        kinds = {}
        for c in found:
            kinds[c.kind] = kinds.get(c.kind, 0) + c.count
        text = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
        nbytes = sum(c.count * c.nbytes for c in found)
        print(
            f"| {name} | {text} | {nbytes / 1024:.1f} | {seconds * 1e3:.2f} | "
            f"{np.abs(out - ref).max():.1e} |"
        )


def _dense_lm(model, tokens, segment_ids):
    """The model's maths, with dense attention, on one device."""
    seq, pos = tokens.shape[0], jnp.arange(tokens.shape[0])
    x = model.embedding.weight[tokens]
    for block in model.blocks:
        a = block.attention
        h = jax.vmap(block.attention_norm)(x)
        q = (h @ a.query_proj.weight.T).reshape(seq, a.num_heads, a.head_dim)
        k = (h @ a.key_proj.weight.T).reshape(seq, a.num_kv_heads, a.head_dim)
        v = (h @ a.value_proj.weight.T).reshape(seq, a.num_kv_heads, a.head_dim)
        q, k = rx.nn.apply_rope(q, pos), rx.nn.apply_rope(k, pos)
        out = rx.reference_attention(
            q, k, v, mask=a.mask, segment_ids=segment_ids, sinks=a.sinks, score_mod=a.score_mod
        )
        x = x + out.reshape(seq, -1) @ a.output_proj.weight.T
        h = jax.vmap(block.mlp_norm)(x)
        x = x + jax.vmap(block.mlp_out)(jax.nn.gelu(jax.vmap(block.mlp_in)(h)))
    return jax.vmap(model.head)(jax.vmap(model.final_norm)(x))


def exactness(args):
    vocab, n, steps = 97, args.prompt, args.steps
    model = rx.nn.RingTransformerLM(
        vocab,
        32,
        4,
        3,
        num_kv_heads=2,
        hidden=64,
        attention=rx.nn.AttentionOptions(kernel=rx.XlaKernel(64, 64), sinks=True),
        key=jax.random.key(0),
    )
    masks = (rx.Causal(), rx.Causal() & rx.Document(), rx.SlidingWindow(100))
    alibi = rx.ALiBi(jnp.array([0.5, 0.25, 0.125, 0.0625]))
    for i, (mask, mod) in enumerate(zip(masks, (None, None, alibi))):
        model = eqx.tree_at(
            lambda m: (
                m.blocks[i].attention.mask,
                m.blocks[i].attention.score_mod,
                m.blocks[i].attention.sinks,
            ),
            model,
            (mask, mod, jnp.array([0.5, -1.0, 2.0, 0.0]) * (i + 1)),
            is_leaf=lambda x: x is None,
        )
    prompt = jax.random.randint(jax.random.key(1), (n,), 0, vocab)
    seg = (jnp.arange(n) >= n // 3).astype(jnp.int32)
    dense_fn = eqx.filter_jit(_dense_lm)
    print(
        f"\n# exactness: prompt {n} tokens, {steps} decode steps (greedy), 3 layers "
        "(causal / causal & document / window 100 + ALiBi), GQA 4/2, sinks\n"
    )
    print(
        "| devices | prefill layout | max abs logit error vs dense | "
        "max rel. error | compile + run s |"
    )
    print("|---|---|---|---|---|")
    worst = 0.0
    for p in (1, 3, 8):
        mesh = jax.make_mesh((p,), ("sequence",), axis_types=(AxisType.Auto,))
        for name, strategy in (("Zigzag", rx.Zigzag()), ("Uniform", rx.Uniform())):
            t0 = time.perf_counter()
            with jax.set_mesh(mesh):
                tokens, logits = rx.generate(
                    model,
                    prompt,
                    steps,
                    jax.random.key(2),
                    strategy=strategy,
                    segment_ids=seg,
                    return_logits=True,
                )
                tokens, logits = np.asarray(tokens), np.asarray(logits)
            seconds = time.perf_counter() - t0
            full = jnp.concatenate([prompt, jnp.asarray(tokens[:-1])])
            full_seg = jnp.concatenate([seg, jnp.ones(steps - 1, jnp.int32)])
            dense = np.asarray(dense_fn(model, full, full_seg))[n - 1 :]
            err = float(np.abs(logits - dense).max())
            worst = max(worst, err)
            rel = err / float(np.abs(dense).max())
            print(f"| {p} | {name} | {err:.1e} | {rel:.1e} | {seconds:.1f} |")
    print(f"\nworst error {worst:.1e}: {'OK' if worst < 1e-5 else 'ABOVE'} 1e-5")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=int, default=65536, help="tokens in the cache")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=1024, help="XlaKernel block_kv")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--skip-exactness", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    latency(args)
    if not args.skip_exactness:
        exactness(args)
    print(f"\nTotal time: {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
