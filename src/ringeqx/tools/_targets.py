"""Meshes of compile-only devices: ask the real TPU or GPU compiler about a cluster from a
machine that has none of its chips.

libtpu describes any TPU slice by name (`jax.experimental.topologies`), and the CUDA
plugin builds compile-only GPUs from a `stream_executor.GpuTargetConfigProto`, which is
written here from the vendors' published figures. A program lowered and compiled on such
a mesh is compiled exactly as it would be on the cluster (Mosaic and Triton included):
its `memory_analysis()` is the per-chip memory, its `as_text()` the scheduled program.
Nothing can run on these devices.
"""

import functools
import math
import os
from collections.abc import Sequence
from types import MappingProxyType

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ._hardware import HARDWARE, TARGETS, GpuFigures


_KIB = 1024

# The compile-only targets, read from the hardware table (its `target` and `gpu` fields):
# TPU generations libtpu describes by name (`"v5p"` for `v5p:XxYxZ` slices), in the
# table's order, and GPUs by name with the figures their descriptions are written from.
TPUS = tuple(t for t, key in TARGETS.items() if HARDWARE[key].kind == "tpu")
GPUS: "MappingProxyType[str, GpuFigures]" = MappingProxyType(
    {t: figures for t, key in TARGETS.items() if (figures := HARDWARE[key].gpu) is not None}
)


def gpu_target_config(gpu: str) -> str:
    """The `GpuTargetConfigProto` text of a GPU named in `GPUS` (what XLA's CUDA
    compiler reads instead of querying a device), from its figures in the hardware
    table."""
    f = _gpu(gpu)
    major, minor = f.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {48 * _KIB}
  shared_memory_per_core: {f.shared_per_sm}
  shared_memory_per_block_optin: {f.shared_per_block_optin}
  threads_per_core_limit: 2048
  core_count: {f.sm_count}
  fpus_per_core: {f.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(f.memory_bandwidth)}
  l2_cache_size: {f.l2_bytes}
  clock_rate_ghz: {f.clock_ghz}
  device_memory_size: {f.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  name: "{f.name}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 }}
device_description_str: "{f.name}"
"""


def _gpu(gpu: str) -> GpuFigures:
    if gpu not in GPUS:
        raise ValueError(f"Unknown GPU {gpu!r}; known GPUs: {', '.join(sorted(GPUS))}.")
    return GPUS[gpu]


def _needs(package: str, what: str) -> ImportError:
    return ImportError(
        f"{what} needs {package} (pip install '{package}=={jax.__version__}', best in a "
        "virtual environment of its own); it is not one of ringeqx's dependencies."
    )


@functools.cache
def _gpu_devices(gpu: str, count: int) -> tuple:
    from jax._src import xla_bridge

    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        raise _needs("jax[cuda12]", f"target_mesh({gpu!r})") from None
    # The CUDA plugin checks the installed CUDA libraries against a driver when JAX
    # starts its backends; a machine without a GPU has none, and the plugin then does not
    # register unless told to skip the check. That is only possible before JAX starts.
    if not os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        if xla_bridge.backends_are_initialized():
            raise RuntimeError(
                "Compile-only GPUs need the CUDA plugin registered without a driver: set "
                "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 in the environment before JAX starts "
                "(before the first jax.devices(), jit or array), or call "
                "ringeqx.tools.target_mesh before anything else uses JAX."
            )
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    # One host holds at most 8 GPUs; more are more hosts of 8.
    hosts, per_host = (1, count) if count <= 8 else (count // 8, 8)
    if hosts * per_host != count:
        raise ValueError(
            f"A GPU mesh of more than 8 devices is whole hosts of 8; got {count} devices."
        )
    topology = xla_bridge.make_pjrt_topology(
        "cuda",
        f"{gpu}x{count}",
        target_config=gpu_target_config(gpu),
        topology=f"1x{hosts}x{per_host}",
    )
    return tuple(topology._make_compile_only_devices())


@functools.cache
def _tpu_devices(name: str) -> tuple:
    # libtpu lays a slice out on hosts of 2x2 chips unless told otherwise, and refuses a
    # slice that is not whole hosts ("v5e:1x1", a single-chip v5e that Cloud TPU rents):
    # such a slice is one host of its own shape.
    target, topology = name.split(":")
    parts = topology.split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"A TPU slice is its chip count along each axis joined by 'x', e.g. "
            f"'{target}:2x2' or '{target}:4x4x4'; got {topology!r}."
        )
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise _needs("jax[tpu]", f"target_mesh({name!r})") from None
    from jax.experimental import topologies

    dims = [int(p) for p in parts]
    bounds = {} if math.prod(dims) >= 4 else {"chips_per_host_bounds": (*dims, 1, 1)[:3]}
    try:
        return tuple(topologies.get_topology_desc(name, "tpu", **bounds).devices)
    except jax.errors.JaxRuntimeError as error:
        first = str(error).splitlines()[0]
        raise ValueError(
            f"libtpu describes no slice {name!r} ({first}). A slice of 4 chips or more "
            f"is whole hosts of 2x2 chips (e.g. '{target}:2x4', '{target}:4x4'); one of "
            f"fewer is a single host (e.g. '{target}:1x1', '{target}:2x1')."
        ) from None


def target_devices(target: str, size: int | str | None = None) -> tuple:
    """The compile-only devices of a named cluster (see [`ringeqx.tools.target_mesh`][])."""
    if ":" in target:
        if size is not None:
            raise ValueError(
                f"`target` {target!r} names its slice already; pass `size` only with a "
                f"bare name (e.g. target_mesh('v5p', '2x2x1')); got size={size!r}."
            )
        target, size = target.split(":", 1)
        if target in GPUS and size.isdigit():
            size = int(size)  # "h100:8": a count
    if target == "v4":
        raise ValueError(
            "TPU v4 has no compile-only target: libtpu describes a v4 chip as two "
            "TensorCores, and JAX makes a v4 mesh only of whole chips (megacore), so no "
            "mesh can be made of them. Known TPU targets: "
            f"{', '.join(TPUS)} (v5p has v4's 3-D torus)."
        )
    if target in TPUS:
        if not isinstance(size, str) or not size:
            raise ValueError(
                f"A TPU target needs its slice topology as a string, e.g. "
                f"target_mesh('{target}', '2x2x1') or '{target}:2x2x1'; got size={size!r}."
            )
        return _tpu_devices(f"{target}:{size}")
    if target in GPUS:
        count = 8 if size is None else size
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(
                f"A GPU target needs a positive device count, e.g. "
                f"target_mesh('{target}', 8); got size={size!r}."
            )
        return _gpu_devices(target, int(count))
    raise ValueError(
        f"Unknown target {target!r}; known targets: TPU {', '.join(TPUS)} (with a slice, "
        f"'v5p:2x2x1') and GPU {', '.join(sorted(GPUS))} (with a count)."
    )


def target_mesh(
    target: str,
    size: int | str | None = None,
    *,
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] = ("sequence",),
) -> Mesh:
    """A mesh of compile-only devices of a TPU slice or a GPU cluster, for asking the
    real compiler about programs for it from any machine.

    `jax.jit(f).lower(*args).compile()` with arguments sharded on this mesh (for example
    `jax.ShapeDtypeStruct`s with a `NamedSharding`) runs the whole TPU or GPU compiler,
    Mosaic and Triton included: the compiled program's `memory_analysis()` gives the bytes
    per chip, `cost_analysis()` the FLOPs and `as_text()` the scheduled HLO (see
    [`ringeqx.tools.ring_overlap`][]). `kernel="auto"` in [`ringeqx.ring_attention`][] picks the
    Pallas kernel of the mesh's platform. The program cannot be run.

    Needs the compiler: `pip install "jax[tpu]==<jax version>"` (libtpu) for TPUs,
    `pip install "jax[cuda12]==<jax version>"` for GPUs (the CUDA plugin; no driver
    needed, but it must register before JAX starts, so call this before anything else
    uses JAX or set `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`).

    **Arguments:**

    - `target`: a TPU generation (`"v5e"`, `"v5p"`, `"v6e"`; not `"v4"`, whose chips
        libtpu describes as two devices each) with its slice,
        as `"v5p:4x4x4"` or `target_mesh("v5p", "4x4x4")` (a single chip too, as
        `"v5e:1x1"`); or a GPU (`"h100"`, `"h200"`,
        `"a100"`; their published figures are in [`ringeqx.tools.HARDWARE`][]) with a
        device count (default 8; more than 8 are hosts of 8), as `"h100:8"` or
        `target_mesh("h100", 8)`.
    - `size`: the slice topology (TPU) or device count (GPU), when `target` has none.
    - `mesh_shape`: the mesh's shape (default: one axis over every device).
    - `axis_names`: the mesh's axis names, one per axis of `mesh_shape`.

    **Returns:** a `jax.sharding.Mesh` with Auto axes.

    **Example:**

    ```python
    mesh = ringeqx.tools.target_mesh("v5p", "4x4x4")  # 64 chips
    spec = jax.ShapeDtypeStruct((1, 2**20, 32, 128), jnp.bfloat16,
                                sharding=NamedSharding(mesh, P(None, "sequence")))
    compiled = jax.jit(attn).lower(spec, kv_spec, kv_spec).compile()
    print(compiled.memory_analysis().temp_size_in_bytes)
    ```
    """
    if isinstance(axis_names, str) or not all(isinstance(n, str) for n in axis_names):
        raise TypeError(
            "`axis_names` must be a sequence of strings, one per mesh axis, e.g. "
            f"('sequence',); got {axis_names!r}."
        )
    devices = target_devices(target, size)
    names = tuple(axis_names)
    shape = (len(devices),) if mesh_shape is None else tuple(int(s) for s in mesh_shape)
    if len(shape) != len(names):
        raise ValueError(
            f"`mesh_shape` {shape} and `axis_names` {names} must have one name per axis."
        )
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"`mesh_shape` {shape} holds {math.prod(shape)} devices; target {target!r} "
            f"has {len(devices)}."
        )
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, list(devices))
    else:
        grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
