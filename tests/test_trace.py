import contextlib
import glob
import io
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import ringeqx as rx
from ringeqx._cli._main import main as cli_main


def test_profile_program_dumps_traces_and_attributes_collectives(tmp_path):
    """One small ring: the per-compile dump holds this compile's HLO text, the profiler's
    trace is written, and the ring's collective-permutes are collective time."""
    mesh = jax.make_mesh((8,), ("sequence",), axis_types=(AxisType.Auto,))
    q, k, v = jax.random.normal(jax.random.key(0), (3, 256, 3, 8))

    def attend(q, k, v, *, mask):
        return rx.ring_attention(q, k, v, mask=mask, mesh=mesh)

    dump, trace = str(tmp_path / "dump"), str(tmp_path / "trace")
    profile = rx.tools.profile_program(
        attend, q, k, v, dump_dir=dump, trace_dir=trace, repeats=2, mask=rx.Causal()
    )
    after = glob.glob(os.path.join(dump, "*after_optimizations.txt"))
    assert after and "collective-permute(" in open(after[0]).read()
    assert glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True)
    assert profile.trace_file.startswith(trace) and profile.dump_dir == dump

    # Every collective-permute the HLO executes per device, once on each of 8 devices.
    per_device = rx.tools.permute_stats(profile.hlo)[0]
    assert per_device > 0
    assert profile.collective_count == {"collective-permute": 8 * per_device}
    assert profile.collective["collective-permute"] > 0
    assert 0 < profile.waiting <= profile.collective_seconds
    assert profile.compute["matmul"] > 0 and "collective-permute" not in profile.compute
    # XLA:CPU's pool may run the 8 programs on more threads than devices.
    assert len(profile.threads) >= 1
    for t in profile.threads:
        assert 0 <= t.collective + t.compute <= t.total
        assert t.waiting <= t.collective
    assert profile.total == pytest.approx(sum(t.total for t in profile.threads))
    assert profile.collective_seconds + profile.compute_seconds <= profile.total
    assert 0 < profile.wall and profile.repeats == 2
    assert "collective: collective-permute" in str(profile)
    with pytest.raises(ValueError, match="`repeats` must be a positive integer; got 0"):
        rx.tools.profile_program(attend, q, k, v, repeats=0, mask=rx.Causal())


def test_cli_report_profile(tmp_path):
    """`ringeqx report --profile DIR` prints the report, then the profile; dump and trace
    land under DIR."""
    out = io.StringIO()
    args = "report --seq-len 64 --heads 2 --kv-heads 1 --head-dim 4 --devices 4"
    with contextlib.redirect_stdout(out):
        code = cli_main([*args.split(), "--forward-only", "--profile", str(tmp_path)])
    text = out.getvalue()
    assert code == 0 and "A100 InfiniBand" in text
    assert text.index("A100 InfiniBand") < text.index("collective: collective-permute")
    assert glob.glob(str(tmp_path / "dump" / "*after_optimizations.txt"))
    assert glob.glob(str(tmp_path / "trace" / "**" / "*.trace.json.gz"), recursive=True)


def test_profile_program_folder_errors_leave_the_profiler_usable(tmp_path):
    # A file where a folder is expected (the trace's, the dump's, or a parent): an error
    # naming the argument and the path, before the profiler starts; the next profile in
    # this process works (a trace that failed to write used to leave JAX's profiler
    # session open: "Profile has already been started").
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    x = jnp.ones((4, 4))
    for name, path in [
        ("trace_dir", str(a_file)),
        ("dump_dir", str(a_file)),
        ("trace_dir", str(a_file / "sub")),
    ]:
        with pytest.raises(
            ValueError,
            match=f"`{name}` must be a folder that files can be written to; got "
            f"{re.escape(repr(path))}",
        ):
            rx.tools.profile_program(lambda x: x @ x, x, repeats=1, **{name: path})
    trace = str(tmp_path / "trace")
    profile = rx.tools.profile_program(lambda x: x @ x, x, repeats=1, trace_dir=trace)
    assert profile.trace_file.startswith(trace)
