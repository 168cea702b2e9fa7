"""One process of `test_multiprocess.py`: joins a `jax.distributed` run and saves results.

`python tests/_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT [--die]`.
Each process has 4 fake CPU devices; together they form one global ring. The process
computes, on the global mesh, `ring_attention`'s output and gradients and one
`RingTransformerLM` training step, gathers them, and also computes the same on a
one-device ring of its own (the single-process answer); both go to `OUT` (`.npz`).
`--die`: process 1 exits with status 3 right after joining, to test that the others are
stopped rather than left hanging.
"""

import os
import sys


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402


jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


def main() -> None:
    pid, nproc, port, out_path = (*map(int, sys.argv[1:4]), sys.argv[4])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
    )
    if "--die" in sys.argv and pid == 1:
        os._exit(3)  # a crash: no shutdown, no goodbye to the coordinator

    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ringeqx as rx

    assert jax.process_count() == nproc and jax.local_device_count() == 4
    auto = (jax.sharding.AxisType.Auto,)
    ring = jax.make_mesh((jax.device_count(),), ("sequence",), axis_types=auto)
    one = jax.make_mesh(
        (1,), ("sequence",), devices=jax.local_devices()[:1], axis_types=auto
    )

    def global_array(x, spec=P()):
        """A global array from a value every process holds whole (same seed)."""
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(ring, spec), lambda i: x[i])

    def gather(tree):
        return jax.tree.map(
            lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
        )

    results = {}

    # ring_attention: causal GQA with documents, forward and vjp; every axis a different
    # size (batch 2, 24 tokens on 8 devices, 4 heads, 2 kv heads, head_dim 3).
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, 24, 4, 3))
    k = jax.random.normal(kk, (2, 24, 2, 3))
    v = jax.random.normal(kv, (2, 24, 2, 3))
    ct = jax.random.normal(kc, (2, 24, 4, 3))
    seg = jnp.asarray(np.repeat(np.arange(3), [5, 9, 10]), jnp.int32)

    def attention(mesh):
        def f(q, k, v):
            return rx.ring_attention(
                q, k, v, mask=rx.Causal() & rx.Document(), segment_ids=seg, mesh=mesh,
                kernel=rx.XlaKernel(block_q=2, block_kv=3),
            )

        @jax.jit
        def run(q, k, v, ct):
            out, vjp = jax.vjp(f, q, k, v)
            return (out, *vjp(ct))

        return run

    spec = P(None, "sequence")
    got = attention(ring)(*(global_array(x, spec) for x in (q, k, v, ct)))
    for name, g in zip(("out", "dq", "dk", "dv"), gather(got)):
        results[f"ring_{name}"] = g
    for name, r in zip(("out", "dq", "dk", "dv"), attention(one)(q, k, v, ct)):
        results[f"one_{name}"] = np.asarray(r)

    # One training step of a small LM (adam), on the global ring and on one device.
    model = rx.nn.RingTransformerLM(
        vocab_size=11, dim=8, num_heads=2, num_layers=1, hidden=12,
        attention=rx.nn.AttentionOptions(kernel=rx.XlaKernel(block_q=2, block_kv=2)),
        key=jax.random.key(1),
    )
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 11)
    opt = optax.adam(1e-2)

    def step_fn(mesh):
        def loss_fn(model, tokens):
            logits = jax.vmap(lambda t: model(t[:-1], mesh=mesh))(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, tokens[:, 1:]
            ).mean()

        @eqx.filter_jit
        def step(model, state, tokens):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
            # optax mixes Python floats with int32 step counts; strict promotion refuses.
            with jax.numpy_dtype_promotion("standard"):
                updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), loss

        return step

    params, static = eqx.partition(model, eqx.is_array)
    state = opt.init(params)
    # Parameters and the batch replicated over the global mesh (make_array_from_callback:
    # every process holds the same values, from the same seeds).
    g_model = eqx.combine(jax.tree.map(global_array, params), static)
    g_state = jax.tree.map(lambda x: global_array(x) if eqx.is_array(x) else x, state)
    new, loss = step_fn(ring)(g_model, g_state, global_array(tokens))
    results["ring_loss"] = gather(loss)
    results["ring_params"] = np.concatenate(
        [np.ravel(x) for x in gather(jax.tree.leaves(eqx.filter(new, eqx.is_array)))]
    )
    new, loss = step_fn(one)(model, state, tokens)
    results["one_loss"] = np.asarray(loss)
    results["one_params"] = np.concatenate(
        [np.ravel(np.asarray(x)) for x in jax.tree.leaves(eqx.filter(new, eqx.is_array))]
    )
    np.savez(out_path, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
