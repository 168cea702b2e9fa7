"""The flags' types and the flags every command takes.

Each type's error becomes `ringeqx CMD: error: argument --FLAG: ...` (exit status 2, no
traceback). Each raises ArgumentTypeError, never ValueError, which argparse would report
under the function's own name; none imports JAX, so a wrong flag fails before anything
starts."""

import argparse
import math
import os
import tempfile


def _integer(text: str, least: int, most: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least or (most is not None and value > most):
        expected = f">= {least}" if most is None else f"in {least} .. {most}"
        raise argparse.ArgumentTypeError(f"must be an integer {expected}; got {text!r}")
    return value


def positive(text: str) -> int:
    return _integer(text, 1)


def tokens(text: str) -> int:
    """A token count, with an optional binary suffix: `128K` = 131072, `1M` = 2**20."""
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not (digits.isdigit() and int(digits) > 0):
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1, optionally with K or M (128K, 1M); got {text!r}"
        )
    return int(digits) * scale


def target(text: str) -> str:
    """A cluster `ringeqx.tools.target_mesh` knows: `v5p:4x4x4`, `h100:8`."""
    try:
        target_chips(text)
    except ValueError as error:
        message = str(error).replace("`target` must be", "must be")
        raise argparse.ArgumentTypeError(message.replace("`target` ", "")) from None
    return text


def index(text: str) -> int:
    return _integer(text, 0)


def seed(text: str) -> int:
    return _integer(text, 0, 2**32 - 1)


def _number(text: str, kind: str, zero: bool = False, note: str = "") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise argparse.ArgumentTypeError(
            f"must be a finite {kind} {'>=' if zero else '>'} 0{note}; got {text!r}"
        )
    return value


def budget_mib(text: str) -> float:
    value = _number(text, "number of MiB")
    if value * 2**20 < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte (in MiB); got {text!r}")
    return value


def seconds(text: str) -> float:
    return _number(text, "number of seconds")


def temperature(text: str) -> float:
    return _number(text, "number", zero=True, note=" (0 for greedy decoding)")


def float_dtype(text: str) -> str:
    # Names, not jnp.dtype: argument errors come before JAX is imported.
    names = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
    if text not in names:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}; got {text!r}")
    return text


def address(text: str) -> str:
    host, colon, port = text.rpartition(":")
    if not (host and colon and port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT, with a port in 1 .. 65535 (e.g. 10.0.0.1:1234); got {text!r}"
        )
    return text


def writable_folder(flag: str, path: str) -> str | None:
    """Make the folder `path` (and its parents) and check that files can be written
    there; what went wrong, naming `flag`, or None. Before anything runs: a profiler
    that fails on its output folder leaves JAX unable to profile again."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        found = os.path.exists(path) and not os.path.isdir(path)
        why = "a file, not a folder" if found else error.strerror or str(error)
        return (
            f"argument {flag}: must be a folder that files can be written to; got "
            f"{path!r} ({why})"
        )
    return None


def common(sub: argparse.ArgumentParser, seq_len: int, heads: int, kv_heads: int):
    """The problem and the ring, which every command takes."""
    sub.add_argument("--seq-len", type=tokens, default=seq_len, help="tokens (128K, 1M)")
    sub.add_argument("--heads", type=positive, default=heads, help="query heads")
    sub.add_argument(
        "--kv-heads", type=positive, default=kv_heads, help="key/value heads"
    )
    sub.add_argument("--head-dim", type=positive, default=64)
    sub.add_argument(
        "--devices", type=positive, default=8, help="ring size (fake CPU devices)"
    )
    sub.add_argument(
        "--device-type",
        choices=("auto", "cpu", "gpu", "tpu"),
        default="auto",
        help="which devices; ring_attention picks its kernel for them",
    )


def indivisible(seq_len: int, ring: int) -> str:
    return (
        f"argument --seq-len: must be a multiple of the ring's {ring} devices (each holds "
        f"an equal shard); got {seq_len}"
    )


def target_chips(target: str) -> int:
    """The chips `target` names (importing JAX, but starting no backend)."""
    from ..tools._planner._problem import target_chips

    return target_chips(target)


def target_device(target: str) -> str:
    """The device profile of `target`'s chips (importing JAX, but starting no backend)."""
    from ..tools._planner._problem import target_device

    return target_device(target)
