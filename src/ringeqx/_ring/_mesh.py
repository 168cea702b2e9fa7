"""Meshes and their axes, in one place: which mesh a call runs on, which axis holds the
batch, and how arrays are placed on it (Explicit axes need the placement said, Auto axes
do not).

Every caller that runs on a mesh (the ring, the `nn` layers, decoding, `generate`, the KV
cache) asks here, so the batch axis's name and the rules for Explicit axes live once.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec


BATCH_AXIS = "batch"
"""The mesh axis that batch axes are sharded over, where a mesh has it."""


def resolve_mesh(mesh, axis_name: str):
    """The mesh a call runs on: `mesh`, else the one set by `jax.set_mesh`, else (one
    device only) a one-device ring; it must have the ring axis `axis_name`."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            if len(jax.devices()) != 1:
                raise ValueError(
                    f"ring_attention needs a mesh with axis {axis_name!r}: pass `mesh=` or "
                    f"call it under `with jax.set_mesh(mesh):` (there are "
                    f"{len(jax.devices())} devices, so no default ring is assumed)."
                )
            mesh = jax.make_mesh((1,), (axis_name,), axis_types=(AxisType.Auto,))
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not an axis of the mesh; the mesh has axes "
            f"{tuple(mesh.axis_names)}."
        )
    return mesh


def on_cpu(mesh) -> bool:
    """Whether `mesh`'s devices are CPUs (a mesh that names no platform, an abstract one,
    runs on JAX's default backend). The ring orders its collectives there, which XLA:CPU
    does not do for it (`ringeqx._ring._order`)."""
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    device = abstract.abstract_device
    if device is None or device.platform is None:
        return jax.default_backend() == "cpu"
    return device.platform == "cpu"


def batch_axis(mesh, batch_shape: tuple[int, ...]) -> str | None:
    """The mesh axis the batch `batch_shape` is sharded over: `BATCH_AXIS` where the mesh
    has one (and the batch has axes), which must then divide the batch."""
    if not (batch_shape and BATCH_AXIS in mesh.axis_names):
        return None
    batch, size = math.prod(batch_shape), mesh.shape[BATCH_AXIS]
    if batch % size != 0:
        raise ValueError(
            f"The batch size {batch} must be divisible by the mesh axis {BATCH_AXIS!r} of "
            f"size {size}."
        )
    return BATCH_AXIS


def constrain(x, mesh, spec: PartitionSpec):
    """Put `x` on `spec` where the mesh axes are Explicit (Auto axes need nothing)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types))

    def explicit_only(a):
        names = a if isinstance(a, tuple) else (a,)
        explicit = a is not None and all(types[n] == AxisType.Explicit for n in names)
        return a if explicit else None

    if AxisType.Explicit not in types.values():
        return x
    explicit = PartitionSpec(*(explicit_only(a) for a in spec))
    return jax.sharding.reshard(x, NamedSharding(mesh, explicit))


def keep_on_ring(x, mesh, axis_name: str):
    """`x` `[seq, ...]` (in layout order) held sharded over the ring axis `axis_name`,
    where that axis is Auto: a hint to the compiler between layers.

    Without it, XLA's sharding propagation may gather the whole sequence to meet weights
    sharded over the same devices (fully sharded data parallel) rather than gather the
    weights, and a device then holds O(N) activations instead of O(N / P): measured for a
    2-layer LM step at 4096 tokens a chip (libtpu), 0.55 GiB of temp on 8 v5p chips and
    1.5 GiB on 64, with `f32[262144, 512]` buffers (the whole sequence) on every chip.
    Explicit axes carry the sharding in the arrays' types and need no hint, and a length
    the ring does not divide (the original order, which the ring pads itself) gets none."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis_name not in mesh.axis_names:
        return x
    if dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] != AxisType.Auto:
        return x
    if jnp.shape(x)[0] % mesh.shape[axis_name]:  # in the original order, unpadded
        return x
    spec = PartitionSpec(axis_name, *([None] * (jnp.ndim(x) - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def place(tree, mesh, spec: PartitionSpec):
    """Every array of `tree` on `spec`: resharded where the mesh has Explicit axes (as
    the ring does with its inputs), a sharding constraint for Auto axes."""
    if AxisType.Explicit in mesh.axis_types:
        return jax.tree.map(lambda x: constrain(x, mesh, spec), tree)
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def to_layout_order(x, lay, mesh, batch: str | None):
    """`x` `[batch, seq, ...]` from the original order to the layout order of `lay`."""
    # A layout in the original order only pads the end (the sharding of x is kept);
    # others gather, which Explicit axes need to see done on the whole sequence.
    if not lay.in_order:
        x = constrain(x, mesh, PartitionSpec(batch, None))
    return lay.shard(x, axis=1)


def to_original_order(out, lay, mesh, batch: str | None):
    """`out` `[batch, sharded_len, ...]` back from layout order to the original order."""
    # A layout in the original order drops the end padding: a slice, so the output
    # keeps the input's sharding. With padding, `seq` has no even sharding (JAX cannot
    # have placed q sharded): the result comes back whole, as q came in; Explicit axes
    # need that said first, as they do before the gather of other layouts.
    if lay.sharded_len != lay.seq_len or not lay.in_order:
        out = constrain(out, mesh, PartitionSpec(batch, None))
    return lay.unshard(out, axis=1)
