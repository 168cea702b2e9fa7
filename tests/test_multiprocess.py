"""Multi-process runs: 2 local processes x 4 fake CPU devices form one 8-device ring.

Each process runs `tests/_multiprocess_worker.py` (`jax.distributed` with the coordinator
on 127.0.0.1, gloo CPU collectives). The ring's output, gradients and one training step
on the global mesh must equal the single-process answer (a one-device ring), and a
process that dies must fail the run quickly, with no process left behind.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest


WORKER = Path(__file__).with_name("_multiprocess_worker.py")


class WorkerFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each worker's process group (its own session), then reap it. Also the
    groups of workers that already exited: anything they started dies with them."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        p.wait(timeout=30)


def run_workers(
    tmp_path: Path, num_processes: int = 2, timeout: float = 600.0, extra=(), command=None
) -> list[Path]:
    """Start the workers and wait; the first failure or the timeout kills them all.

    `command(i, port, out)` gives process `i`'s argv (default: the worker script).
    The timeout only stops a hung run (a deadlock); it is no bound on speed.

    **Returns:** each process's result file (its log is beside it, `worker{i}.log`).
    **Raises:** `WorkerFailed` (naming the process, its status and stderr tail) if a
    process exits non-zero or the run exceeds `timeout` seconds.
    """
    env = dict(os.environ)
    # The parent's 8 fake devices (conftest) must not leak into the workers, which set 4.
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    src = str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = _free_port()
    outs = [tmp_path / f"worker{i}.npz" for i in range(num_processes)]
    logs = [open(tmp_path / f"worker{i}.log", "w+b") for i in range(num_processes)]
    procs = []
    try:
        for i in range(num_processes):
            cmd = (
                [sys.executable, str(WORKER), str(i), str(num_processes), str(port), str(outs[i])]
                if command is None
                else command(i, port, outs[i])
            )
            # start_new_session: each worker leads its own process group, so killing the
            # group also kills anything it started.
            procs.append(
                subprocess.Popen(
                    [*cmd, *extra], env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad or time.monotonic() > deadline:
                _kill(procs)
                what = (
                    ", ".join(f"process {i} exited with status {codes[i]}" for i in bad)
                    if bad
                    else f"the run exceeded {timeout:.0f} s"
                )
                tails = []
                for i, log in enumerate(logs):
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-1500:]
                    tails.append(f"--- process {i} ---\n{tail}")
                raise WorkerFailed(f"{what}; all workers killed.\n" + "\n".join(tails))
            if all(c == 0 for c in codes):
                return outs
            time.sleep(0.2)
    finally:
        _kill(procs)
        for log in logs:
            log.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_processes_match_single_process(tmp_path):
    outs = run_workers(tmp_path)
    results = [dict(np.load(p)) for p in outs]
    # Every process sees the same gathered global values.
    for key in results[0]:
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
    r = results[0]
    assert r["ring_out"].shape == (2, 24, 4, 3)
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(r[f"ring_{name}"], r[f"one_{name}"], rtol=1e-5, atol=1e-5)
    # The training step: the loss and every updated parameter.
    np.testing.assert_allclose(r["ring_loss"], r["one_loss"], rtol=1e-5, atol=1e-6)
    assert r["ring_params"].size > 100
    np.testing.assert_allclose(r["ring_params"], r["one_params"], rtol=1e-5, atol=1e-6)
    # The step changed the model (a test that compares no-ops would pass vacuously).
    assert not np.allclose(r["one_params"], r["ring_params"] * 0)


def _recording_popen(monkeypatch) -> list[subprocess.Popen]:
    seen = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        p = real_popen(*args, **kwargs)
        seen.append(p)
        return p

    monkeypatch.setattr(subprocess, "Popen", popen)
    return seen


def test_a_dead_process_fails_the_run_cleanly(tmp_path, monkeypatch):
    seen = _recording_popen(monkeypatch)
    # Only process 1 had exited when the run was stopped: process 0, which waits on its
    # dead peer until the coordinator's heartbeat timeout, was still running, so the
    # harness (not JAX) noticed the death and killed it. Nothing is left running.
    with pytest.raises(WorkerFailed, match="^process 1 exited with status 3; all workers killed"):
        run_workers(tmp_path, timeout=600.0, extra=("--die",))
    assert len(seen) == 2
    assert not any(_alive(p.pid) for p in seen)


def test_a_run_past_its_timeout_is_killed(tmp_path, monkeypatch):
    # Healthy workers that cannot finish in 2 s: the timeout path kills them all too.
    seen = _recording_popen(monkeypatch)
    with pytest.raises(WorkerFailed, match="the run exceeded 2 s"):
        run_workers(tmp_path, timeout=2.0)
    assert len(seen) == 2
    assert not any(_alive(p.pid) for p in seen)


def test_demo_joins_a_multiprocess_run(tmp_path):
    # `ringeqx demo` with the multi-process flags: 2 processes x 4 fake CPU devices, one
    # ring of 8, checked against dense attention by the demo itself (exit status 0).
    def demo(i, port, out):
        return [
            sys.executable, "-m", "ringeqx", "demo", "--seq-len", "64", "--check-len", "32",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "4",
            "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
            "--process-id", str(i), "--local-devices", "4",
        ]

    run_workers(tmp_path, command=demo)
    for i in range(2):
        log = (tmp_path / f"worker{i}.log").read_text()
        assert f"process {i} of 2: 4 local / 8 global devices" in log, log
        assert "8 devices" in log and "\n  OK" in log, log
