import os


# Fake CPU devices must be requested before JAX initialises its backends.
# LLVM at -O0: the suite's time is mostly compiling small programs, and the tests check
# values, not speed (HLO-level optimisations, which decide numerics, still run). ~1/3 faster.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
