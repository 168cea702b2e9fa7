"""`ringeqx generate`: ring prefill and exact KV-cache decoding on a small LM of random
weights, checked against the whole sequence on one device."""

import argparse
import time

from ._devices import device_platform, ring_mesh
from ._flags import common, positive, seed, temperature
from ._output import say
from ._programs import max_error


def generate(args: argparse.Namespace) -> int:
    """`ringeqx generate`: ring prefill and exact decoding on a small LM with random
    weights (the machinery, not a trained model), checked against one device."""
    import jax
    import numpy as np

    import ringeqx as rx

    mesh = ring_mesh(args.devices, device_platform(args.device_type))
    p = mesh.shape["sequence"]
    strategy = rx.Zigzag() if args.strategy == "zigzag" else rx.Uniform()
    mask = rx.SlidingWindow(args.window) if args.window else rx.Causal()
    model = rx.nn.RingTransformerLM(
        args.vocab,
        args.heads * args.head_dim,
        args.heads,
        args.layers,
        num_kv_heads=args.kv_heads,
        attention=rx.nn.AttentionOptions(mask=mask, sinks=True),
        key=jax.random.key(args.seed),
    )
    prompt = jax.random.randint(jax.random.key(args.seed + 1), (args.seq_len,), 0, args.vocab)
    say(
        f"random {args.layers}-layer LM (vocab {args.vocab}, {args.heads} query / "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, {type(mask).__name__}); "
        f"prompt of {args.seq_len} tokens, {args.strategy} prefill on {p} device(s)"
    )

    def run(key):
        return rx.generate(
            model,
            prompt,
            args.steps,
            key,
            temperature=args.temperature,
            top_k=args.top_k,
            strategy=strategy,
            mesh=mesh,
            return_logits=True,
        )

    start = time.perf_counter()
    jax.block_until_ready(run(jax.random.key(args.seed + 2)))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens, logits = jax.block_until_ready(run(jax.random.key(args.seed + 3)))
    run_s = time.perf_counter() - start
    say(f"  compile + first run              {compile_s:8.2f} s")
    say(f"  prefill + {args.steps} decode steps       {run_s:8.2f} s")
    say(f"  generated                        {np.asarray(tokens).tolist()}")
    # The same logits from the whole sequence on one device, without a cache.
    one = jax.sharding.Mesh(np.asarray(mesh.devices.flat[:1]), ("sequence",))
    full = np.concatenate([np.asarray(prompt), np.asarray(tokens)[:-1]])
    with jax.set_mesh(one):
        dense = jax.jit(lambda m, t: m(t, mesh=one))(model, full)
    error = max_error(np.asarray(dense)[args.seq_len - 1 :], logits)
    say(f"  max |logits - one-device full recomputation|  {error:.2e}")
    ok = error < 1e-3
    say("  OK" if ok else "  MISMATCH against the full recomputation")
    return 0 if ok else 1


def arguments(generate_parser: argparse.ArgumentParser) -> None:
    common(generate_parser, seq_len=256, heads=4, kv_heads=2)
    generate_parser.add_argument("--steps", type=positive, default=16, help="new tokens")
    generate_parser.add_argument("--layers", type=positive, default=2)
    generate_parser.add_argument("--vocab", type=positive, default=256)
    generate_parser.add_argument("--strategy", choices=("zigzag", "uniform"), default="zigzag")
    generate_parser.add_argument(
        "--window", type=positive, default=None, help="sliding window (default: causal)"
    )
    generate_parser.add_argument(
        "--temperature", type=temperature, default=0.0, help="0 = greedy"
    )
    generate_parser.add_argument("--top-k", type=positive, default=None)
    generate_parser.add_argument("--seed", type=seed, default=0)
    generate_parser.set_defaults(run=generate, parser=generate_parser)
