"""Issue 25 for the command line, the reports and the profiler: every misuse is a clear,
early error. Flags: an argument error (exit status 2, no traceback, before JAX runs)
naming the flag, what it expects and what it got. Reports: no answer to a question about
another program. The profiler: a bad folder fails, and the next profile still works."""

import contextlib
import glob
import io
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import ringeqx as rx
from ringeqx._cli._main import main
from ringeqx.tools._hlo._parse import collectives, module, parse_collectives


SRC = str(Path(__file__).parents[1] / "src")
SMALL = ["--heads", "2", "--kv-heads", "1", "--head-dim", "4"]
# Python's names for what the flags set, and the CLI's private helpers: never in a CLI
# error.
INTERNAL = re.compile(
    r"\b_\w|seq_len|kv_heads|head_dim|num_devices|max_memory_usage|compression_dtype|"
    r"communication_parallelism|ring_buffer_size|top_k|RingConfig|Traceback"
)

MISUSE = [
    # Each flag's own values.
    (["demo", "--seq-len", "abc"], r"--seq-len: must be an integer >= 1, optionally with K.*'abc'"),
    (["bench", "--heads", "0"], r"--heads: must be an integer >= 1; got '0'"),
    (["bench", "--reps", "2.5"], r"--reps: must be an integer >= 1; got '2.5'"),
    (["demo", "--seed", "-1"], r"--seed: must be an integer in 0 \.\. 4294967295; got '-1'"),
    (["generate", "--seed", "x"], r"--seed: must be an integer in 0 \.\. 4294967295; got 'x'"),
    (["demo", "--timeout", "nan"], r"--timeout: must be a finite number of seconds > 0; got 'nan"),
    (["demo", "--timeout", "inf"], r"--timeout: must be a finite number of seconds > 0; got 'inf"),
    (["demo", "--timeout", "0"], r"--timeout: must be a finite number of seconds > 0; got '0'"),
    (["demo", "--coordinator-address", "localhost"], r"--coordinator-address: must be HOST:PORT"),
    (["demo", "--coordinator-address", "h:99999"], r"--coordinator-address: .* got 'h:99999'"),
    (["demo", "--process-id", "-1"], r"--process-id: must be an integer >= 0; got '-1'"),
    (["report", "--dtype", "foo"], r"--dtype: must be one of float32, .* got 'foo'"),
    (["report", "--compression", "int8"], r"--compression: must be one of float32, .* got 'int8'"),
    (["report", "--grad-compression", "f32"], r"--grad-compression: must be one of .* got 'f32'"),
    (
        ["generate", "--temperature", "nan"],
        r"--temperature: must be a finite number >= 0 \(0 for greedy decoding\); got 'nan'",
    ),
    (["generate", "--temperature", "-1"], r"--temperature: must be a finite number >= 0 .*'-1'"),
    (["generate", "--temperature", "inf"], r"--temperature: must be a finite number >= 0 .*'inf'"),
    (["plan", "--max-memory-mib", "inf"], r"--max-memory-mib: must be a finite number of MiB > 0"),
    (["plan", "--max-memory-mib", "1e-9"], r"--max-memory-mib: must be at least one byte"),
    # Flags that are fine alone, not together.
    (
        ["demo", "--seq-len", "30", "--devices", "4"],
        r"--seq-len: must be a multiple of the ring's 4 devices .*; got 30",
    ),
    (
        ["bench", "--seq-len", "100", "--devices", "8"],
        r"--seq-len: must be a multiple of the ring's 8 devices .*; got 100",
    ),
    (
        ["demo", "--seq-len", "36", "--num-processes", "2", "--process-id", "0",
         "--local-devices", "8"],
        r"--seq-len: must be a multiple of the ring's 16 devices .*; got 36",
    ),
    (["demo", "--num-processes", "2"], r"--num-processes: needs --process-id too"),
    (["demo", "--process-id", "0"], r"--process-id: needs --num-processes too"),
    (
        ["demo", "--num-processes", "2", "--process-id", "2"],
        r"--process-id: must be in 0 \.\. 1 \(--num-processes 2\); got 2",
    ),
    (
        ["demo", "--coordinator-address", "127.0.0.1:1234"],
        r"--coordinator-address: needs --num-processes and --process-id",
    ),
    (["plan", "--heads", "3", "--kv-heads", "2"], r"--heads: must be a multiple of --kv-heads"),
    (["plan", "--dim", "100", "--heads", "8"], r"--dim: must be a multiple of --heads \(8\).* 100"),
    (
        ["report", "--seq-len", "32", "--devices", "4", "--parallelism", "3"],
        r"--parallelism: must divide the 8 tokens per device \(--seq-len 32 over --devices 4\), "
        r"one of \[1, 2, 4, 8\]; got 3",
    ),
    (
        ["report", "--seq-len", "32", "--devices", "4", "--ring-buffer-size", "3"],
        r"--ring-buffer-size: must divide the 8 tokens per device .*; got 3",
    ),
    (
        ["report", "--seq-len", "28", "--devices", "4", "--bidirectional"],
        r"--bidirectional: sends half of each shard each way, so the 7 tokens per device",
    ),
    (
        ["report", "--seq-len", "24", "--devices", "4", "--parallelism", "3", "--bidirectional"],
        r"--parallelism: with --bidirectional .* even number of pieces; got 3 \(3 pieces\)",
    ),
    (
        ["generate", "--vocab", "16", "--top-k", "100"],
        r"--top-k: must be at most --vocab \(16\); got 100",
    ),
]


@pytest.mark.parametrize("argv, match", MISUSE, ids=[" ".join(argv) for argv, _ in MISUSE])
def test_flag_misuse_is_an_argument_error(argv, match, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ringeqx {argv[0]}: error: argument "), err
    assert re.search(match, last), err
    assert not INTERNAL.search(last), err


def _cli(*argv: str, env=None, **kwargs) -> subprocess.CompletedProcess:
    """`python -m ringeqx ARGV` in a child process (`env`: variables to add). The timeout
    only stops a hung child; nothing here bounds how long a run may take."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "ringeqx", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


# A JAX platform that does not exist: anything that starts a backend fails with JAX's
# "Unable to initialize backend" (exit status 1), so an exit status of 2 with the
# argument error shows that the error came before JAX ran anything.
NO_BACKEND = {"JAX_PLATFORMS": "ringeqx_no_backend"}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["demo", "--seq-len", "30", "--devices", "4"], "--seq-len: must be a multiple"),
        (["generate", "--temperature", "nan"], "--temperature: must be a finite number"),
        (["report", "--dtype", "foo"], "--dtype: must be one of"),
    ],
)
def test_argument_errors_exit_2_before_jax_runs_without_a_traceback(argv, match):
    result = _cli(*argv, env=NO_BACKEND)
    assert result.returncode == 2, result.stderr
    assert match in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stdout == ""


def test_a_command_that_starts_jax_fails_without_a_backend():
    # The control for the test above: the same environment stops a command that runs.
    result = _cli("demo", "--seq-len", "16", "--check-len", "8", *SMALL, "--devices", "2",
                  env=NO_BACKEND)
    assert result.returncode == 1, result.stderr
    assert "Unable to initialize backend 'ringeqx_no_backend'" in result.stderr, result.stderr


def test_plan_that_does_not_fit_speaks_in_flags(capsys):
    argv = ["plan", "--seq-len", "8192", "--devices", "4", "--heads", "4", "--kv-heads", "2"]
    assert main([*argv, "--max-memory-mib", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "Nothing fits in --max-memory-mib 0.5 per device: --seq-len 8192 on --devices 4" in out
    assert "raise --max-memory-mib" in out and not INTERNAL.search(out), out


def _unwritable(tmp_path: Path) -> str:
    """A folder no file can be written to: root writes anywhere but in /proc (Linux) or
    below a file (a folder there cannot be made)."""
    if os.geteuid() == 0:
        if sys.platform == "linux":
            return "/proc/ringeqx-no-such-folder"
        below_a_file = tmp_path / "plain-file"
        below_a_file.write_text("")
        return str(below_a_file / "folder")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return str(folder)


def test_report_profile_folder_errors_then_a_profile_works(tmp_path, capsys):
    # A file where a folder is expected (DIR itself, or DIR/trace), and a folder that
    # cannot be written to: argument errors naming --profile and the path, before
    # anything runs. Then the same process still profiles.
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    trace_is_a_file = tmp_path / "out"
    trace_is_a_file.mkdir()
    (trace_is_a_file / "trace").write_text("")
    report = ["report", "--seq-len", "64", *SMALL, "--devices", "4", "--forward-only"]
    for folder in (str(a_file), str(trace_is_a_file / "trace"), _unwritable(tmp_path)):
        profile_dir = str(trace_is_a_file) if folder.endswith("trace") else folder
        with pytest.raises(SystemExit) as exit:
            main([*report, "--profile", profile_dir])
        assert exit.value.code == 2
        err = capsys.readouterr().err
        assert (
            "argument --profile: must be a folder that files can be written to; got "
            f"{folder!r} ("
        ) in err
        assert "Traceback" not in err
    good = tmp_path / "good"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*report, "--profile", str(good)]) == 0
    assert "collective: collective-permute" in out.getvalue()
    assert glob.glob(str(good / "trace" / "**" / "*.trace.json.gz"), recursive=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "process_id, says", [(0, "waiting for 1 more process at"), (1, "joining process 0 at")]
)
def test_demo_whose_peer_never_comes_says_so_and_times_out(process_id, says):
    address = f"127.0.0.1:{_free_port()}"
    argv = [
        "demo", "--seq-len", "16", "--check-len", "8", *SMALL,
        "--coordinator-address", address, "--num-processes", "2",
        "--process-id", str(process_id), "--local-devices", "2", "--timeout", "2",
    ]
    result = _cli(*argv, start_new_session=True)
    # The demo's own --timeout ended the wait (its message), not the harness's.
    assert f"{says} {address} (--timeout 2 s)..." in result.stdout, result.stdout
    assert result.returncode == 1, result.stderr
    assert f"not every process joined at {address} within --timeout 2 s" in result.stderr
    assert "Traceback" not in result.stderr and "Check failure" not in result.stderr


# The reports: no answer about another program.


def _ring_program():
    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(AxisType.Auto,))
    q = jax.ShapeDtypeStruct((24, 2, 3), jnp.float32)
    return jax.jit(lambda q, k, v: rx.ring_attention(q, k, v, mesh=mesh)), q, mesh


def test_comm_report_refuses_the_mesh_of_another_program():
    f, q, mesh = _ring_program()
    assert rx.tools.comm_report(f, q, q, q, mesh=mesh).count("collective-permute") > 0
    eight = jax.make_mesh((8,), ("sequence",), axis_types=(AxisType.Auto,))
    with pytest.raises(
        ValueError,
        match=r"`mesh` must be the mesh the program runs on \(4 devices with axes "
        r"\('sequence': 4\)\); got a mesh of 8 devices with axes \('sequence': 8\)",
    ):
        rx.tools.comm_report(f, q, q, q, mesh=eight)
    # As many devices, other axes.
    other = jax.make_mesh((2, 2), ("batch", "sequence"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"got a mesh of 4 devices with axes \('batch': 2"):
        rx.tools.comm_report(f, q, q, q, mesh=other)
    # A program on one device, with a ring's mesh.
    with pytest.raises(ValueError, match=r"runs on \(1 device\); got a mesh of 4 devices"):
        rx.tools.comm_report(lambda x: x * 2, q, mesh=mesh)
    with pytest.raises(TypeError, match="`mesh` must be a jax.sharding.Mesh .* got str"):
        rx.tools.comm_report(f, q, q, q, mesh="sequence")
    # The ambient mesh of `jax.set_mesh` is only a default: a program that does not run
    # on it is still reported.
    with jax.set_mesh(eight):
        assert rx.tools.comm_report(lambda x: x * 2, q).rows == ()


def test_collectives_are_read_only_from_hlo_modules():
    f, q, _ = _ring_program()
    lowered = f.lower(q, q, q)
    hlo = lowered.compile().as_text()
    assert parse_collectives(hlo) and collectives(hlo)
    for read in (parse_collectives, collectives, rx.tools.permute_stats):
        with pytest.raises(ValueError, match="`hlo` must be the text of a compiled HLO module"):
            read(lowered.as_text())  # StableHLO: no ENTRY computation
    # (The public readers' `hlo: str` is also checked by jaxtyping in the test suite.)
    with pytest.raises(TypeError, match=r"`hlo` must be the text .*; got a Compiled"):
        module(lowered.compile())
