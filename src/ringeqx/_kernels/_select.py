"""Resolve the `kernel=` and `device_type=` arguments to a kernel object."""

from typing import Literal

import jax

from ._base import AbstractAttentionKernel
from ._mosaic._kernel import PallasTpuKernel
from ._triton._kernel import PallasGpuKernel
from ._xla import xla_kernel


KernelName = Literal["auto", "xla", "pallas_gpu", "pallas_tpu"]
DeviceType = Literal["auto", "cpu", "gpu", "tpu"]


def _device_of_platform(platform: str, origin: str) -> Literal["cpu", "gpu", "tpu"]:
    match platform:
        case "cpu":
            return "cpu"
        case "gpu" | "cuda" | "rocm":
            return "gpu"
        case "tpu":
            return "tpu"
        case _:
            raise ValueError(
                f"device_type='auto' found {origin} {platform!r}, which ringeqx has no "
                "kernel for; pass device_type='cpu', 'gpu' or 'tpu' with an explicit "
                "kernel."
            )


def mesh_device_type(mesh=None) -> Literal["cpu", "gpu", "tpu"] | None:
    """The device type of `mesh`'s devices (default: the mesh set by `jax.set_mesh`),
    or None where no mesh is given or set, or an abstract mesh names no platform."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return None
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    device = abstract.abstract_device
    if device is None or device.platform is None:
        return None
    return _device_of_platform(device.platform, "mesh devices of platform")


def resolve_device_type(
    device_type: DeviceType, mesh=None
) -> Literal["cpu", "gpu", "tpu"]:
    """`"auto"` -> the device type of the mesh's devices (`mesh`, else the one set by
    `jax.set_mesh`), else of JAX's default backend; other names unchanged."""
    match device_type:
        case "auto":
            on_mesh = mesh_device_type(mesh)
            if on_mesh is not None:
                return on_mesh
            return _device_of_platform(jax.default_backend(), "JAX backend")
        case "cpu" | "gpu" | "tpu":
            return device_type
        case _:
            raise ValueError(
                "`device_type` must be 'auto', 'cpu', 'gpu' or 'tpu'; got "
                f"{device_type!r}."
            )


def _has_devices(device: str) -> bool:
    try:
        return len(jax.devices(device)) > 0
    except RuntimeError:
        return False


def _check_object(kernel: AbstractAttentionKernel, device: str, on_mesh: bool) -> None:
    runs_on = kernel.devices()
    if device not in runs_on:
        where = f"the mesh's {device} devices" if on_mesh else f"device_type={device!r}"
        raise ValueError(
            f"{type(kernel).__name__} runs on device_type {' or '.join(sorted(runs_on))}"
            f", not on {where}; pass a kernel that runs there (a Pallas "
            "kernel with interpret=True runs in the Pallas interpreter anywhere), or "
            "XlaKernel."
        )


def _pallas_device(name: str, needs: str, device: str, interpret: bool) -> None:
    if device != needs and not interpret:
        raise ValueError(
            f"kernel={name!r} needs device_type={needs!r}; got device_type={device!r}. "
            "Pass interpret=True to run it in the Pallas interpreter."
        )


def _by_name(kernel: str, device: str, interpret: bool) -> AbstractAttentionKernel:
    """The kernel named `kernel` with its default tiles on `device` (see
    `select_kernel`)."""
    match kernel:
        case "auto":
            match device:
                case "cpu":
                    return _by_name("xla", device, interpret)
                case "gpu":
                    return _by_name("pallas_gpu", device, interpret)
                case "tpu":
                    return _by_name("pallas_tpu", device, interpret)
                case _:
                    raise AssertionError(device)
        case "xla":
            return xla_kernel(device)  # its default tiles on `device`
        case "pallas_gpu":
            _pallas_device(kernel, "gpu", device, interpret)
            return PallasGpuKernel(interpret=interpret)
        case "pallas_tpu":
            _pallas_device(kernel, "tpu", device, interpret)
            return PallasTpuKernel(interpret=interpret)
        case _:
            raise ValueError(
                "`kernel` must be 'auto', 'xla', 'pallas_gpu', 'pallas_tpu' or an "
                f"AbstractAttentionKernel; got {kernel!r}."
            )


def default_kernel(device: Literal["cpu", "gpu", "tpu"]) -> AbstractAttentionKernel:
    """The kernel `"auto"` gives on `device` devices, with its default tiles, without
    asking JAX for such devices: what a planner asks about a device it does not have."""
    return _by_name("auto", device, interpret=False)


def select_kernel(
    kernel: KernelName | AbstractAttentionKernel = "auto",
    device_type: DeviceType = "auto",
    *,
    interpret: bool = False,
    mesh=None,
) -> AbstractAttentionKernel:
    """The per-device attention kernel for `kernel` on `device_type`.

    | `kernel`       | cpu         | gpu               | tpu               |
    |----------------|-------------|-------------------|-------------------|
    | `"auto"`       | `XlaKernel` | `PallasGpuKernel` | `PallasTpuKernel` |
    | `"xla"`        | `XlaKernel` | `XlaKernel`       | `XlaKernel`       |
    | `"pallas_gpu"` | interpret   | `PallasGpuKernel` | interpret         |
    | `"pallas_tpu"` | interpret   | interpret         | `PallasTpuKernel` |

    The device is the mesh's: with `device_type="auto"`, the platform of `mesh`'s devices
    (or, without `mesh`, of the mesh set by `jax.set_mesh`), so that a program for an
    H100 or TPU mesh gets that device's Pallas kernel even where this process's default
    backend is the CPU ([`ringeqx.tools.target_mesh`][] makes compile-only meshes); only
    without any mesh is it JAX's default backend.

    Kernels chosen by name get the default tiles of their device (256 x 256 for XLA on
    the CPU, 512 x 1024 for XLA on accelerators; Mosaic's own, `PallasTpuKernel()`: queries
    1024 at a time against 4096 keys computed 1024 at a time, the backward 2048 keys
    computed 512 at a time; Triton, whose score tile lives in registers, its table of
    tiles per dtype, head_dim and kernel, chosen so that no 16-bit kernel spills);
    [`ringeqx.tune_block_sizes`][] measures better ones.
    Nothing falls back silently: a device that JAX does not have, or a Pallas kernel
    away from its device without `interpret=True`, is an error. What a kernel cannot run
    (a dtype, a head_dim) is an error when it is traced.

    **Arguments:**

    - `kernel`: a name from the table or an [`ringeqx.AbstractAttentionKernel`][]
        (returned as it is, after checking that the device is one of its `devices()`;
        with `device_type="auto"` and no mesh that names its platform, a Pallas kernel
        instead checks the platform when the program is lowered, so that it can be
        exported with `jax.export` for a platform this machine does not have).
    - `device_type`: `"auto"` (the platform of the mesh's devices, else of JAX's
        default backend), `"cpu"`, `"gpu"` or `"tpu"` (which must then be the mesh's).
    - `interpret`: run Pallas kernels chosen by name in the Pallas interpreter, on any
        backend (for tests on the CPU; slow). Then `device_type` need not be present.
    - `mesh`: the mesh the kernel will run on (a `jax.sharding.Mesh` or an
        `AbstractMesh`; default: the one set by `jax.set_mesh`, if any).

    **Returns:** an `AbstractAttentionKernel`.

    **Example:**

    ```python
    kernel = ringeqx.select_kernel("auto", "gpu", interpret=True)  # PallasGpuKernel
    ```
    """
    on_mesh = mesh_device_type(mesh)
    device = resolve_device_type(device_type, mesh)
    if device_type != "auto" and not interpret:
        if on_mesh is not None and on_mesh != device:
            raise ValueError(
                f"device_type={device_type!r} but the mesh's devices are {on_mesh} "
                f"devices; use device_type='auto' (the mesh's) or {on_mesh!r}, or pass "
                "interpret=True to run that device's Pallas kernel in the interpreter."
            )
        if on_mesh is None and not _has_devices(device):
            raise ValueError(
                f"device_type={device_type!r} but JAX has no {device} devices (its "
                f"backend is {jax.default_backend()!r}) and no mesh says otherwise; use "
                "device_type='auto', pass a mesh of such devices (ringeqx.tools.target_mesh "
                "makes compile-only ones), or pass interpret=True to run that device's "
                "Pallas kernel in the interpreter."
            )
    if isinstance(kernel, AbstractAttentionKernel):
        # Without a mesh that names its platform, the platform is the one the program is
        # lowered for, which may not be this machine's (`jax.export` for "cuda" or
        # "tpu"): kernels that compile for one platform check it when they are lowered.
        if device_type != "auto" or on_mesh is not None:
            _check_object(kernel, device, on_mesh is not None)
        return kernel
    return _by_name(kernel, device, interpret)
