"""One process of the multi-host checkpoint test in `test_checkpoint.py`.

`python tests/_checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT OUT DIRECTORY`.
Each process has 4 fake CPU devices; together they form one 8-device mesh. The
processes build the same small model and (perturbed, so not zeros) AdamW state, place
them on the global mesh (arrays whose first axis divides by 8 sharded over it, so each
process holds only its shards), and save one checkpoint to `DIRECTORY` together.
Process 0 writes the values it placed to `OUT` (`.npz`), for the parent to compare.
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
    pid, nproc, port = map(int, sys.argv[1:4])
    out_path, directory = sys.argv[4], sys.argv[5]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
    )

    import equinox as eqx
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import ringeqx as rx

    assert jax.process_count() == nproc and jax.local_device_count() == 4
    ring = jax.make_mesh(
        (jax.device_count(),), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    model = rx.nn.RingTransformerLM(16, 8, 2, 2, hidden=16, key=jax.random.key(0))
    optimizer = optax.adamw(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    # Moments that are not zeros (as after training), the same on every process.
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda x: np.asarray(x) + rng.standard_normal(np.shape(x)).astype(x.dtype), state
    )
    host = jax.tree.map(np.asarray, eqx.filter((model, state), eqx.is_array))

    def place(x):
        x = np.asarray(x)
        sharded = x.ndim > 0 and x.shape[0] % jax.device_count() == 0
        sharding = NamedSharding(ring, P("sequence") if sharded else P())
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    static = eqx.partition((model, state), eqx.is_array)[1]
    model, state = eqx.combine(jax.tree.map(place, host), static)
    sharded = [x for x in jax.tree.leaves(model) if not x.is_fully_replicated]
    assert sharded and all(not x.is_fully_addressable for x in sharded)
    rx.nn.save_checkpoint(directory, model, state, step=3)
    if pid == 0:
        np.savez(out_path, *jax.tree.leaves(host))
    else:
        open(out_path, "wb").close()


if __name__ == "__main__":
    main()
