"""`target_mesh` without the compilers: the CPU suite's venv has neither libtpu nor the
CUDA plugin, so asking for a target names the package that brings its compiler, and bad
names and sizes are clear errors. The meshes themselves are compiled for in `aot/`."""

import pytest

import ringeqx as rx
from ringeqx.tools._hardware import TARGETS
from ringeqx.tools._targets import GPUS, TPUS, gpu_target_config


def test_missing_compilers_name_their_package():
    with pytest.raises(ImportError, match=r"needs jax\[tpu\] \(pip install 'jax\[tpu\]=="):
        rx.tools.target_mesh("v5p", "2x2x1")
    with pytest.raises(ImportError, match=r"needs jax\[cuda12\]"):
        rx.tools.target_mesh("h100", 8)


@pytest.mark.parametrize(
    "args, match",
    [
        (("v9",), "Unknown target 'v9'; known targets: TPU v5e, v5p, v6e"),
        # Listed as supported, and no mesh could be made of it (issue 45).
        (("v4:2x2x1",), "TPU v4 has no compile-only target"),
        (("v5e:2xb",), "A TPU slice is its chip count along each axis joined by 'x'"),
        (("v5e", "0x2"), "A TPU slice is its chip count along each axis"),
        (("v5p",), "A TPU target needs its slice topology as a string"),
        (("v5p", 4), "A TPU target needs its slice topology as a string"),
        (("v5p:2x2x1", "2x2x1"), "names its slice already"),
        (("h100", 0), "A GPU target needs a positive device count"),
        (("h100", True), "A GPU target needs a positive device count"),
        (("h100", "8"), "A GPU target needs a positive device count"),
    ],
)
def test_bad_targets_are_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        rx.tools.target_mesh(*args)


def test_axis_names_must_be_a_sequence_of_names():
    # A string was split into one axis a letter (issue 45).
    with pytest.raises(TypeError, match=r"`axis_names` must be a sequence of strings.*'sequence'"):
        rx.tools.target_mesh("v5e:2x2", axis_names="sequence")


def test_gpu_target_configs_carry_the_published_figures():
    h100 = gpu_target_config("h100")
    assert "cuda_compute_capability { major: 9 minor: 0 }" in h100
    assert "core_count: 132" in h100 and "device_memory_size: 80000000000" in h100
    assert "cuda_compute_capability { major: 8 minor: 0 }" in gpu_target_config("a100")
    assert set(GPUS) == {"a100", "h100", "h200"}
    with pytest.raises(ValueError, match="Unknown GPU 'b200'; known GPUs: a100, h100, h200"):
        gpu_target_config("b200")


def test_the_targets_are_read_from_the_hardware_table():
    # One table (issue 44): the targets, their profiles and a GPU's figures are its rows'.
    hardware = rx.tools.HARDWARE
    assert TPUS == ("v5e", "v5p", "v6e")
    assert dict(TARGETS) == {
        "v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
        "a100": "a100-nvlink", "h100": "h100", "h200": "h200",
    }  # fmt: skip
    for target, key in TARGETS.items():
        assert hardware[key].target == target
        assert hardware[key].kind == ("tpu" if target in TPUS else "gpu")
    for gpu, figures in GPUS.items():
        assert figures is hardware[TARGETS[gpu]].gpu
        assert figures.memory_bytes == hardware[TARGETS[gpu]].memory
    assert {key for key, hw in hardware.items() if hw.target is None} == {
        "a100-infiniband", "tpu-v3", "tpu-v4",
    }  # fmt: skip
