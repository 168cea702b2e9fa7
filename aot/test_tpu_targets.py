"""`target_mesh` for TPU slices (libtpu's compile-only topologies)."""

import pytest

import ringeqx as rx
from ringeqx._kernels._select import mesh_device_type


@pytest.mark.parametrize(
    "target, size, count, kind",
    [
        ("v5e", "2x2", 4, "TPU v5 lite"),
        ("v5p", "2x2x1", 4, "TPU v5"),
        ("v6e:4x4", None, 16, "TPU v6 lite"),
        ("v5p:4x4x4", None, 64, "TPU v5"),
        # Slices smaller than libtpu's default 2x2 host (a single-chip v5e is rented).
        ("v5e:1x1", None, 1, "TPU v5 lite"),
        ("v5p", "1x1x1", 1, "TPU v5"),
        ("v5e:1x2", None, 2, "TPU v5 lite"),
    ],
)
def test_tpu_slices(target, size, count, kind):
    mesh = rx.tools.target_mesh(target, size)
    assert mesh.shape == {"sequence": count}
    assert {d.device_kind for d in mesh.devices.flat} == {kind}
    assert mesh_device_type(mesh) == "tpu"
    assert isinstance(rx.select_kernel(mesh=mesh), rx.PallasTpuKernel)


def test_tpu_mesh_shapes():
    mesh = rx.tools.target_mesh("v5p:2x2x2", mesh_shape=(2, 4), axis_names=("batch", "sequence"))
    assert mesh.shape == {"batch": 2, "sequence": 4}
    with pytest.raises(ValueError, match=r"holds 6 devices; target 'v5p:2x2x2' has 8"):
        rx.tools.target_mesh("v5p:2x2x2", mesh_shape=(2, 3), axis_names=("batch", "sequence"))


def test_slices_libtpu_refuses_say_what_it_takes():
    # libtpu's INVALID_ARGUMENT came through raw (issue 45).
    said = r"libtpu describes no slice 'v5e:3x3'.*whole hosts of 2x2"
    with pytest.raises(ValueError, match=said):
        rx.tools.target_mesh("v5e:3x3")
