"""`measure_memory`: compile the program a [`ringeqx.Plan`][] describes and read its
per-device memory from XLA (`memory_analysis()`), allocating no arrays."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import nn
from ._call import ring_attention
from ._plan import Plan


def _mesh(plan: Plan) -> Mesh:
    """`("batch", "sequence")` devices, the first `batch_devices * num_devices` of JAX's."""
    count = plan.batch_devices * plan.num_devices
    if count > len(jax.devices()):
        raise ValueError(
            f"The plan needs {count} devices (batch_devices x num_devices); JAX has "
            f"{len(jax.devices())}."
        )
    devices = np.asarray(jax.devices()[:count]).reshape(plan.batch_devices, plan.num_devices)
    return Mesh(devices, ("batch", "sequence"), axis_types=(AxisType.Auto,) * 2)


def _segment_ids(seq_len: int):
    """Four packed documents of equal length: what a `Document` mask is measured with
    (memory depends on shapes, not on where documents end)."""
    return (jnp.arange(seq_len, dtype=jnp.int32) * 4) // seq_len


def _layout(plan: Plan):
    segment_ids = _segment_ids(plan.seq_len) if "segments" in plan.mask.reads() else None
    return plan.strategy.layout(plan.seq_len, plan.num_devices, segment_ids=segment_ids)


def _adam(params, grads, m, v, count):
    """One Adam step (lr 1e-3, betas 0.9/0.999): the optimizer state a plan counts."""
    count = count + 1
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
    t = count.astype(jnp.float32)
    c1, c2 = 1 - 0.9**t, 1 - 0.999**t

    def update(p, m, v):
        return p - 1e-3 * (m / c1) / (jnp.sqrt(v / c2) + 1e-8)

    return jax.tree.map(update, params, m, v), m, v, count


def _lm_program(plan: Plan, mesh: Mesh, layout):
    """The LM training step (loss, gradients, Adam) and its abstract arguments."""
    model = eqx.filter_eval_shape(
        lambda: nn.RingTransformerLM.from_plan(plan, key=jax.random.key(0))
    )
    is_param = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(model, is_param)
    seq = NamedSharding(mesh, PartitionSpec("batch", "sequence"))
    tokens = jax.ShapeDtypeStruct((plan.batch, layout.sharded_len), jnp.int32, sharding=seq)
    count = jax.ShapeDtypeStruct((), jnp.int32)

    def step(params, m, v, count, tokens, labels):
        def loss(params):
            model = eqx.combine(params, static)

            def one(t, y):
                return model.loss(t, y, layout, mesh=mesh)

            return jnp.mean(jax.vmap(one, spmd_axis_name="batch")(tokens, labels))

        value, grads = jax.value_and_grad(loss)(params)
        return value, _adam(params, grads, m, v, count)

    return step, (params, params, params, count, tokens, tokens)


def _attention_program(plan: Plan, mesh: Mesh, layout):
    """Ring attention forward and backward and its abstract arguments."""
    seq = NamedSharding(mesh, PartitionSpec("batch", "sequence"))
    dtype = jnp.dtype(plan.dtype)
    n = layout.sharded_len
    q = jax.ShapeDtypeStruct((plan.batch, n, plan.heads, plan.head_dim), dtype, sharding=seq)
    kv = jax.ShapeDtypeStruct((plan.batch, n, plan.kv_heads, plan.head_dim), dtype, sharding=seq)
    kernel = plan.kernel()

    def step(q, k, v, d_out):
        def attend(q, k, v):
            return ring_attention(
                q, k, v, mask=plan.mask, layout=layout, order="layout", mesh=mesh, kernel=kernel
            )

        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    return step, (q, kv, kv, q)


def measure_memory(plan: Plan) -> dict[str, int]:
    """Compile the program that `plan` describes and return XLA's per-device bytes.

    The program is the one the plan's prediction is for: for an attention plan, ring
    attention's forward and backward (`q, k, v, d_out -> out, (dq, dk, dv)`); for an LM
    plan, a training step of [`ringeqx.nn.RingTransformerLM.from_plan`][] (loss,
    gradients and one Adam update, `params, m, v, count, tokens, labels -> loss, (params,
    m, v, count)`, nothing donated). Inputs are `jax.ShapeDtypeStruct`s sharded
    `P("batch", "sequence")` in the layout order of the plan's strategy, so nothing is
    allocated: the program is lowered and compiled only. A `Document` mask is measured on
    four packed documents of equal length.

    Needs `batch_devices * num_devices` devices (on CPU, fake them with
    `XLA_FLAGS=--xla_force_host_platform_device_count=8`).

    **Returns:** `{"arguments", "outputs", "temp", "total"}` in bytes per device, as
    `compiled.memory_analysis()` reports them (`total` is their sum).
    """
    mesh = _mesh(plan)
    layout = _layout(plan)
    build = _lm_program if plan.kind == "lm" else _attention_program
    step, args = build(plan, mesh, layout)
    stats = jax.jit(step).lower(*args).compile().memory_analysis()
    out = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
    }
    out["total"] = sum(out.values())
    return out
