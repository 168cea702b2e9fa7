"""Developer sessions: `pip install nox`, then `nox -s tests` (or `nox -l` to list).

Arguments after `--` go to the tool a session runs, e.g. `nox -s tests -- -k causal -x`
or `nox -s demo -- --seq-len 4096`. Each session has its own virtual environment under
`.nox/`, reused between runs (JAX is a large download); `nox --reuse-venv=no -s NAME`
rebuilds one.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox


nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "lint", "docs"]

ROOT = Path(__file__).parent

# The supported range's two ends, each the newest Python its JAX supports (JAX 0.11 dropped
# Python 3.11). `tests` and `aot` run on both: `nox -s "tests(newest)"` or `nox -t oldest`
# picks one end. Keep pyproject's `jax>=`, its classifiers and the README's line in step.
_ENDS = [
    nox.param("3.11", "0.10.2", id="oldest", tags=["oldest"]),
    nox.param("3.13", "0.12.0.1", id="newest", tags=["newest"]),
]


def _pyenv_interpreters() -> None:
    """Let nox find every Python that pyenv has installed, not only the selected one.

    Two ways a Python can hide from nox: pyenv's `python3.13` shim runs only when 3.13 is
    among the selected versions (`PYENV_VERSION`, or `pyenv global`), and where pyenv's
    shims are not on `PATH` at all no `python3.13` is found. So every installed version
    joins the selection, after the versions selected now (`python` keeps its meaning), and
    the `bin` of each Python 3 whose `pythonX.Y` is still not found joins the end of `PATH`.
    CI once had 3.13 installed and still failed `tests(newest)`: "Python interpreter 3.13
    not found".
    """
    here = Path(sys.executable).resolve().parents  # .../versions/3.11.7/bin/python3.11
    roots = [os.environ.get("PYENV_ROOT"), Path.home() / ".pyenv", "/root/.pyenv"]
    roots += [here[2]] if len(here) > 2 and here[1].name == "versions" else []
    root = next((Path(r) for r in roots if r and Path(r, "versions").is_dir()), None)
    if root is None:
        return
    installed = sorted(p.parent.name for p in root.glob("versions/*/bin"))
    selected = os.environ.get("PYENV_VERSION", "").replace(":", " ").split()
    if not selected and shutil.which("pyenv") is not None:
        name = subprocess.run(["pyenv", "version-name"], capture_output=True, text=True)
        selected = name.stdout.replace(":", " ").split()
    if selected:
        rest = [v for v in installed if v not in selected]
        os.environ["PYENV_VERSION"] = ":".join(selected + rest)
    minor = {v: "python" + ".".join(v.split(".")[:2]) for v in installed}
    hidden = [v for v in installed if v.startswith("3.") and shutil.which(minor[v]) is None]
    bins = [root / "versions" / v / "bin" for v in hidden]
    bins = [str(b) for b in bins if (b / minor[b.parent.name]).exists()]
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *bins])


_pyenv_interpreters()

# Executes each notebook given on the command line headless, in order; the first cell
# that raises fails the run (nbclient raises CellExecutionError).
_RUN_NOTEBOOKS = """
import os, sys, time
import nbformat
from nbclient import NotebookClient

for path in sys.argv[1:]:
    start = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    cwd = os.path.dirname(os.path.abspath(path))  # a notebook runs in its own folder
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": cwd}}
    ).execute()
    print(f"{path}: ran without errors in {time.perf_counter() - start:.1f} s")
"""


@nox.session
@nox.parametrize(("python", "jax"), _ENDS)
def tests(session: nox.Session, jax: str) -> None:
    """Run the test suite with pytest, on the oldest and on the newest supported JAX.

    `tests(oldest)` is Python 3.11 with JAX 0.10.2, `tests(newest)` Python 3.13 with JAX
    0.12.0.1; `nox -s tests` runs both. Shapes are checked at runtime by jaxtyping +
    beartype (pyproject's `addopts`). Posargs go to pytest. A run that collects no tests
    fails (pytest exits 5).
    """
    session.install("-e", ".[test]", f"jax=={jax}", f"jaxlib=={jax}")
    # Two workers: compiling, most of the suite's time, keeps one core busy, and CI has
    # two (each worker sets its own 8 fake devices). `-- -n 0` runs in one process.
    workers = ["-n", "2", "--dist", "worksteal"]
    # The slowest 30 tests in every run's log, the suite's time budget read where it goes.
    session.run("python", "-m", "pytest", *workers, "--durations=30", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Lint: `ruff check` on the code and notebooks, then pyright on `src/`.

    Posargs go to ruff.
    """
    session.install("-e", ".", "ruff", "pyright[nodejs]")
    paths = ["src", "tests", "benchmarks", "examples", "notebooks", "docs", "noxfile.py"]
    session.run("ruff", "check", *paths, *session.posargs)
    session.run("pyright", "src")


@nox.session
def demo(session: nox.Session) -> None:
    """Run `ringeqx demo`: 16K-token causal ring attention on 8 fake CPU devices.

    Forward and backward of causal GQA attention, timed and checked against dense
    attention. Posargs go to the demo (`--seq-len`, `--devices`, `--device-type`, ...).
    """
    session.install("-e", ".")
    session.run("ringeqx", "demo", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Run the differential fuzzer: ring attention against the fuzzer's dense attention.

    Random configurations, outputs and gradients (see `docs/fuzzing.md`).
    `nox -s fuzz -- --configs 500` checks 500 configurations (default seed: from the
    commit); posargs go to `tests/fuzz.py` (`--seed`, `--start`, `--index`, `--config`,
    `-v`). Mismatches are shrunk and printed as reproducers; any makes the session fail.
    """
    session.install("-e", ".[test]")
    session.run("python", "tests/fuzz.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark ringeqx against `ringattention` and dense attention.

    Runs `benchmarks/ring_vs_dense.py`, which prints times, memory and the target
    ratios. Posargs go to the script (`--reps`, `--block-q`, `--block-kv`, ...).
    """
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/ring_vs_dense.py", *session.posargs)


# The compilers of `nox -s aot`, each pinned to the JAX release of its end (`_AOT`):
# libtpu and the CUDA plugin are built against one jaxlib.
_COMPILERS = {
    "tpu": lambda jax: [f"jax[tpu]=={jax}"],
    "gpu": lambda jax: [f"jax[cuda12]=={jax}", "nvidia-cuda-nvcc-cu12"],
}


# Each compiler at each end of the range, but the CUDA plugin 0.12.0.1: there Triton
# lowers only under a mesh that names the GPU (`aot/test_gpu_matrix.py` lowers without
# one: "No supported GPU devices found, please specify an abstract GPU device"), and
# under `jax.set_mesh` the compile writes no `*.ptx` to `xla_dump_to`, which the spill
# checks read ("no PTX dumped for h100"). `aot/test_gpu_targets.py` passes on it.
_AOT_OLDEST = "0.10.2"
_AOT = [
    nox.param("3.11", "0.10.2", "tpu", id="oldest, tpu", tags=["oldest"]),
    nox.param("3.11", "0.10.2", "gpu", id="oldest, gpu", tags=["oldest"]),
    nox.param("3.13", "0.12.0.1", "tpu", id="newest, tpu", tags=["newest"]),
]


@nox.session
@nox.parametrize(("python", "jax", "target"), _AOT)
def aot(session: nox.Session, jax: str, target: str) -> None:
    """Compile for real TPUs and GPUs on this machine (no accelerator needed).

    One venv per compiler and end of the supported range (`aot(newest, tpu)` with
    libtpu 0.0.50, `aot(oldest, gpu)` with the CUDA plugin and ptxas, ...) runs
    `aot/test_{target}_*.py`: every kernel and the ring, fwd + grad, compiled for TPU
    v5e/v5p and H100/A100 meshes of compile-only devices (`ringeqx.tools.target_mesh`), with
    checks that read what the compilers emit (spills, the scheduled HLO). Posargs go to
    pytest.
    """
    session.install("-e", ".", "pytest", "pytest-xdist", "beartype", *_COMPILERS[target](jax))
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "aot").glob(f"test_{target}_*.py"))
    if jax != _AOT_OLDEST:
        # The newest compilers run the kernels and the ring's targets. The planner's and
        # the overlap checks' figures are the calibrated libtpu's (the oldest end's), so
        # they run there only.
        tests = [t for t in tests if t.rsplit("_", 1)[-1] in ("targets.py", "matrix.py")]
        # The whole ring for v5e only: v5p's ring (with v5e's, the longest compile of
        # the TPU sessions) is compiled at the oldest end, and v5p's kernels at both.
        v5p_ring = "aot/test_tpu_matrix.py::test_ring_forward_and_grad_every_mask[v5p]"
        tests += ["--deselect", v5p_ring] if target == "tpu" else []
    if not tests:
        session.error(f"No aot/test_{target}_*.py files.")
    # Each compile keeps one core busy, so two workers use both of CI's cores; work
    # stealing keeps them busy to the end (the cases take from seconds to two minutes).
    workers = ["-n", "2", "--dist", "worksteal"]
    pytest = ["python", "-m", "pytest", "-p", "no:cacheprovider"]
    session.run(*pytest, *workers, *tests, *session.posargs)


@nox.session
def gpu_check(session: nox.Session) -> None:
    """Run `benchmarks/gpu_check.py` (`nox -s gpu_check -- --tiny` on CPU).

    Posargs go to the script. Skipped where the script does not exist.
    """
    script = ROOT / "benchmarks" / "gpu_check.py"
    if not script.exists():
        session.skip(f"{script.relative_to(ROOT)} does not exist")
    session.install("-e", ".")
    session.run("python", str(script.relative_to(ROOT)), *session.posargs)


@nox.session
def notebooks(session: nox.Session) -> None:
    """Execute every `notebooks/*.ipynb` headless with nbclient.

    Any cell error fails the session. Posargs select notebooks (paths) instead of all.
    """
    session.install("-e", ".[notebooks]")
    paths = session.posargs or sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb")
    )
    if not paths:
        session.error("No notebooks found in notebooks/.")
    session.run("python", "-c", _RUN_NOTEBOOKS, *paths)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into `site/` with `mkdocs build --strict`.

    First checks that every public name of `ringeqx` and `ringeqx.nn` has an API page
    (`docs/check_api.py`). Strict: a broken link, an unresolved `[ringeqx.X][]` reference or
    any other warning fails. Notebooks are shown as committed, not executed (the
    `notebooks` session runs them). Posargs go to `mkdocs build` (e.g. `--site-dir DIR`).
    """
    session.install("-e", ".[docs]")
    session.run("python", "docs/check_api.py")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})
