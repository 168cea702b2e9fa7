"""`measure_memory`: compile the program a [`ringeqx.tools.Plan`][] describes and read its
per-device memory from XLA (`memory_analysis()`), allocating no arrays; and the search
that plans for a target cluster with its own compiler."""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..._ring._call import ring_attention
from .._cost import RingCost
from .._hardware import HARDWARE
from .._hlo._overlap import ring_overlap
from .._targets import target_mesh
from ._analytic import kernel_tiles, predict
from ._plan import CompiledMemory, Plan, PlanOverlap, make_plan
from ._problem import Problem, Remat


_GIB = 2**30


def _mesh(plan: Plan) -> Mesh:
    """`("batch", "sequence")` devices: the plan's target's chips, or the first
    `batch_devices * num_devices` of JAX's."""
    if plan.target is not None:
        return target_mesh(
            plan.target,
            mesh_shape=(plan.batch_devices, plan.num_devices),
            axis_names=("batch", "sequence"),
        )
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
        lambda: plan.model(key=jax.random.key(0))
    )
    is_param = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(model, is_param)
    if plan.target is not None:
        params = jax.tree.map(lambda x: _fully_sharded(x, mesh), params)
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


def _fully_sharded(x: jax.ShapeDtypeStruct, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """`x` sharded over every device along its largest axis that they divide (fully
    sharded data parallel, as a model too large for one chip is trained), else
    replicated: a target plan's parameters and optimizer state."""
    n = mesh.size
    axes = sorted(range(len(x.shape)), key=lambda a: -x.shape[a])
    spec = [None] * len(x.shape)
    for a in axes:
        if x.shape[a] % n == 0:
            spec[a] = ("batch", "sequence")
            break
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


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
    plan, a training step of the model `plan.model(...)` builds (loss,
    gradients and one Adam update, `params, m, v, count, tokens, labels -> loss, (params,
    m, v, count)`, nothing donated). Inputs are `jax.ShapeDtypeStruct`s sharded
    `P("batch", "sequence")` in the layout order of the plan's strategy, so nothing is
    allocated: the program is lowered and compiled only. A `Document` mask is measured on
    four packed documents of equal length.

    Needs `batch_devices * num_devices` devices (on CPU, fake them with
    `XLA_FLAGS=--xla_force_host_platform_device_count=8`), or for a plan with a `target`
    that target's compiler: the program then runs on its chips, with the platform's
    Pallas kernel, and an LM's parameters and Adam state fully sharded and donated
    (`outputs` counts what is not aliased to them).

    **Returns:** `{"arguments", "outputs", "temp", "total"}` in bytes per device, as
    `compiled.memory_analysis()` reports them (`total` is their sum).
    """
    memory = compile_plan(plan)[0]
    out = {"arguments": memory.arguments, "outputs": memory.outputs, "temp": memory.temp}
    out["total"] = memory.total
    return out


def compile_plan(plan: Plan) -> tuple[CompiledMemory, jax.stages.Compiled]:
    """Compile the program `plan` describes (see `measure_memory`) on its mesh: the
    target's chips for a plan with a `target`. Returns the compiler's bytes per device
    and the compiled program."""
    mesh = _mesh(plan)
    layout = _layout(plan)
    build = _lm_program if plan.kind == "lm" else _attention_program
    step, args = build(plan, mesh, layout)
    # A target LM step donates its parameters and Adam state, as a training loop does:
    # the updated ones then reuse their buffers (outputs aliased to arguments).
    donate = (0, 1, 2) if plan.kind == "lm" and plan.target is not None else ()
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=donate).lower(*args).compile()
    stats = compiled.memory_analysis()
    memory = CompiledMemory(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        seconds=time.perf_counter() - start,
    )
    return memory, compiled


def _overlap(cfg: Problem, program: jax.stages.Compiled) -> PlanOverlap:
    """The overlap condition at the chip's published figures, and the schedule's answer."""
    cost = RingCost(
        cfg.seq_len, cfg.num_devices, cfg.heads, cfg.kv_heads, cfg.head_dim,
        kv_bytes=jnp.dtype(cfg.dtype).itemsize,
    )  # fmt: skip
    chip = HARDWARE[cfg.device]
    report = ring_overlap(program)
    return PlanOverlap(
        shard=cost.shard,
        min_shard=cost.min_shard(chip),
        min_shard_backward=cost.min_shard(chip, backward=True),
        scheduled=report.all_overlap,
        permutes=len(report.permutes),
    )


def state_bytes(plan: Plan) -> int:
    """Bytes per chip of a target LM step's parameters and Adam's two moments, as the
    step takes them (fully sharded): exact, read from their shardings, nothing compiled."""
    _, args = _lm_program(plan, _mesh(plan), _layout(plan))
    leaves = jax.tree.leaves(args[:3])
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


# The compilers' refusals of a kernel's on-chip memory, unlike HBM's ("Ran out of memory
# on HBM"): libtpu's for a Mosaic kernel's scoped VMEM or SMEM, XLA's CUDA compiler's for
# a Triton kernel's shared memory. A longer or shorter context does not change them.
_ON_CHIP = (
    "memory space vmem",
    "memory space smem",
    "ScopedVmemOom",
    "Shared memory size limit exceeded",
)


def _check_on_chip_memory(error: Exception, plan: Plan) -> None:
    """A ValueError where the compiler refused a kernel's on-chip memory rather than the
    chip's HBM: not a length that does not fit (which the planner would answer by
    shortening the sequence) but tiles the kernel cannot hold."""
    text = str(error)
    said = next((line for line in text.splitlines() if any(k in line for k in _ON_CHIP)), None)
    if said is None:
        return
    raise ValueError(
        f"Compiling for {plan.target}, a kernel ran out of the chip's on-chip memory, not "
        f"of HBM: {said.strip()[:300]} (tiles `block_q`={plan.block_q} x "
        f"`block_kv`={plan.block_kv}, head_dim {plan.head_dim}). No context length "
        "changes this; expected the kernel to fit its tiles: please report it."
    ) from error


def _check_state(cfg: Problem, plan: Plan) -> None:
    """A NoFit, before any compile, when the LM's parameters and Adam state alone exceed
    the budget: no context, remat or tile can fit then."""
    state = state_bytes(plan)
    if state > cfg.max_memory_usage:
        raise NoFit(
            f"Nothing fits in max_memory_usage={format_bytes(cfg.max_memory_usage)} per "
            f"chip of {plan.target}: the parameters and Adam state alone take "
            f"{format_bytes(state)} per chip, fully sharded over its "
            f"{plan.batch_devices * plan.num_devices} chips "
            f"({plan.precision.param_dtype.name}), whatever the context. Add chips or "
            "shrink the model.",
            state,
            cfg.max_memory_usage,
            0.0,
            before_compile=True,
        )


def compiled_search(cfg: Problem, target: str, remats: tuple[Remat, ...]) -> Plan:
    """The first of `remats` whose program, compiled for `target`, fits the budget
    (`ringeqx.tools.plan(..., target=...)`); a ValueError with every compiled size when none
    does (before any compile when an LM's parameters and Adam state alone do not fit)."""
    tiles = kernel_tiles(cfg)
    candidates = [
        make_plan(cfg, tiles[0], r, predict(cfg, tiles[0], r, cfg.num_devices), tiles=tiles,
                  target=target)
        for r in remats
    ]  # fmt: skip
    if cfg.kind == "lm":
        _check_state(cfg, candidates[0])
    tried, total, seconds = [], None, 0.0
    for plan in candidates:
        remat, memory = plan.remat, plan.memory
        start = time.perf_counter()
        try:
            compiled, program = compile_plan(plan)
        except jax.errors.JaxRuntimeError as e:
            # A program larger than the chip: the compiler refuses it (RESOURCE_EXHAUSTED).
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            _check_on_chip_memory(e, plan)
            seconds += time.perf_counter() - start
            said = str(e).strip().splitlines()[0][:200]
            tried.append(f"remat={remat!r}: refused by the compiler ({said})")
            total = None
            continue
        seconds += compiled.seconds
        plan = make_plan(
            cfg, tiles[0], remat, memory, tiles=tiles, target=target, compiled=compiled,
            overlap=_overlap(cfg, program),
        )
        if compiled.total <= cfg.max_memory_usage:
            return plan
        total = compiled.total
        tried.append(f"remat={remat!r}: {format_bytes(total)}")
    raise NoFit(
        f"Nothing fits in max_memory_usage={format_bytes(cfg.max_memory_usage)} per chip of "
        f"{target}: seq_len={cfg.seq_len} compiles to {'; '.join(tried)} per chip (the "
        f"compiler's bytes). {_advice(cfg, total)}",
        total,
        cfg.max_memory_usage,
        seconds,
    )


def format_bytes(n: int) -> str:
    """Bytes for a message: GiB to two places, or MiB / bytes where GiB would round to
    nothing (a small budget said as "0.00 GiB")."""
    if n >= _GIB // 100:
        return f"{n / _GIB:,.2f} GiB"
    if n >= 2**20 // 100:
        return f"{n / 2**20:,.2f} MiB"
    return f"{n:,} bytes"


def _advice(cfg: Problem, total: int | None) -> str:
    """What would fit: a budget up to the chip's memory only where the budget is below
    it and the compiler did not refuse the program as larger than the chip."""
    chip = HARDWARE[cfg.device].memory
    advice = "Shorten the sequence or add chips"
    if cfg.kind == "lm":
        advice += ", or rematerialise more (`remat`)"
    if total is not None and chip is not None and cfg.max_memory_usage < chip:
        advice += f", or raise max_memory_usage (up to the chip's {format_bytes(chip)})"
    return advice + "."


class NoFit(ValueError):
    """Nothing fits the budget on the target: what [`ringeqx.tools.plan`][]`(...,
    target=...)` raises, a `ValueError` whose message lists what each candidate
    compiled to.

    **Attributes:** `total` (the last candidate's bytes per chip, None where the
    compiler refused it as larger than the chip), `budget` (bytes per chip), `seconds`
    (the compiles' time), `before_compile` (True when refused with nothing compiled: an
    LM's parameters and Adam state alone exceed the budget, so no context fits; `total`
    is then their bytes per chip).
    """

    def __init__(
        self,
        message: str,
        total: int | None,
        budget: int,
        seconds: float,
        *,
        before_compile: bool = False,
    ):
        super().__init__(message)
        self.total, self.budget, self.seconds = total, budget, seconds
        self.before_compile = before_compile
