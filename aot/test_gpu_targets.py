"""`target_mesh` for GPUs (the CUDA plugin's compile-only devices, from the published
figures in `ringeqx.tools._targets.GPUS`)."""

import pytest

import ringeqx as rx
from ringeqx._kernels._select import mesh_device_type
from ringeqx.tools._targets import GPUS


@pytest.mark.parametrize("gpu, count", [("h100", 8), ("a100", 4), ("h100", 16), ("h200", 8)])
def test_gpu_meshes(gpu, count):
    mesh = rx.tools.target_mesh(gpu, count)
    assert mesh.shape == {"sequence": count}
    device = mesh.devices.flat[0]
    assert device.device_kind == GPUS[gpu].name
    assert mesh.abstract_mesh.abstract_device.num_cores == GPUS[gpu].sm_count
    assert mesh_device_type(mesh) == "gpu"
    assert isinstance(rx.select_kernel(mesh=mesh), rx.PallasGpuKernel)


def test_gpu_hosts_are_whole():
    with pytest.raises(ValueError, match="whole hosts of 8; got 12 devices"):
        rx.tools.target_mesh("h100", 12)
