"""Compile-only checks against the real TPU and GPU compilers (`nox -s aot`).

These tests run in virtual environments of their own, one with libtpu (`jax[tpu]`) and
one with the CUDA plugin (`jax[cuda12]`, plus `ptxas`), never in the CPU suite's: the
compilers are not dependencies of ringeqx. Files `test_tpu_*.py` need libtpu and files
`test_gpu_*.py` the CUDA plugin; `nox -s aot` runs each set in its venv.

The CUDA plugin registers without a driver only when JAX_SKIP_CUDA_CONSTRAINTS_CHECK is
set before JAX starts its backends, so it is set here, before any test imports JAX.
"""

import os


os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# `nox -s aot` runs two pytest workers; libtpu otherwise takes a lock file that lets
# only one process on the machine load it (compile-only topologies use no chip).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import sys
from pathlib import Path


# The CPU suite's lists of every mask, modifier and strategy (tests/helpers.py), so that
# a mask added there is compiled here too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
