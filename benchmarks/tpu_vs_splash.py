"""ringeqx against the TPU's best attention kernels, at their best tiles, on one chip.

On one TPU chip this times, per shape (batch 1, bfloat16, 16 query heads : 4 K/V heads
unless the name says `mha8`), the forward and the forward+backward
(`jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(f32) * ct), argnums=(0, 1, 2))`):

- `ringeqx`: `ringeqx.ring_attention(..., kernel="auto")` on a one-chip mesh
  (`jax.set_mesh`), BTNH, as a user calls it; `ringeqx[BQxBKV]` with
  `PallasTpuKernel(BQ, BKV, ...)` for each of `--tiles` (the forward's tiles, then the
  backward's after a slash; without one the backward's are the forward's);
- `kernel`: the same kernel object called bare (`forward`, then `forward` + `backward`, as
  one ring step), heads-major, so that `ringeqx / kernel - 1` is what the ring costs on
  one chip beyond its kernel (layout transposes, merges, custom VJP);
- peers: splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, heads-major
  under `jax.vmap`, grouped K/V heads as they are, q pre-scaled) with every tile 1024 and
  the fused backward (`splash[1024 fused]`), and with every tile 512 and the separate dQ
  kernel (`splash[512]`); the older Pallas `flash_attention` with 1024 blocks
  (`flash[1024]`; it needs as many K/V heads as query heads: they are repeated inside
  the timed function); tokamax 0.0.12's Mosaic TPU flash attention
  (`tokamax.dot_product_attention`, BTNH) with q/K/V tiles 1024 and K/V computed 512 at a
  time, forward and backward (`tokamax[1024/512]`).

Every candidate is compiled ahead of time (`jax.jit(f).lower(...).compile()`; splash's
mask tables, built on the host in O(N^2) NumPy, are built once per shape, untimed), run
twice, then timed in `--reps` rounds, each round running every candidate once in turn;
the table gives medians, TFLOP/s (forward `4 B H N^2 d`, halved when causal;
forward+backward 3.5 times that), the ratio to the best peer (the fastest of all peers
for that shape and direction; > 1 is slower) and the ring's cost over its bare kernel. A
candidate that fails to compile or runs out of memory is reported, not fatal.

Modes: `--memory` adds each compiled program's `memory_analysis()` temp bytes;
`--check` compares outputs and gradients at 8K head_dim 128 causal with a float32
reference; `--longest` compiles causal forward+backward at head_dim 128, 16:4 heads, for
262144 and 393216 tokens (ringeqx and splash; splash with full-mask tables unless
`--splash-causal-tables`: its causal tables take tens of minutes of host time there,
and its buffers do not depend on the mask) and reports which fit in HBM; `--compile-only
v5e` builds every candidate for a compile-only v5e chip (`ringeqx.tools.target_mesh`, needs
`jax[tpu]`, no TPU) and reports compile status and temp bytes, timing nothing.

On the chip (no network there: the wheels in `.whl-tpu/` are equinox, jaxtyping,
wadler-lindig, tokamax 0.0.12 and what tokamax imports: absl-py, pydantic, qwix and flax,
...; ringeqx comes from `src/`, with a stub of its distribution metadata, which its
`__version__` reads). Programs are compiled `--workers` at a time, about a minute or two
per shape on the chip's host, so one command (10 minutes at most) holds a few shapes:
the JSON is rewritten after each shape, so a run cut short keeps what it measured.

```
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD/src || exit; mkdir -p /tmp/site/ringeqx-0.1.0.dist-info && printf 'Metadata-Version: 2.1\\nName: ringeqx\\nVersion: 0.1.0\\n' > /tmp/site/ringeqx-0.1.0.dist-info/METADATA; PYTHONUNBUFFERED=1 python3 benchmarks/tpu_vs_splash.py --memory --check --json $OUT/tpu.json
```

Other runs: `--quick` (3 shapes), `--shapes 8k-d128-causal,32k-d128-causal` (65536
tokens are named `64k`), `--only ringeqx,kernel,splash[512]`,
`--tiles 1024x1024,1024x2048`, `--longest`; without a TPU:
`python benchmarks/tpu_vs_splash.py --compile-only v5e --shapes 8k-d128-causal`.
"""  # noqa: E501 - the chip command is one line, to be copied whole

import argparse
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from _splash import splash_kernel
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import ringeqx as rx


_GIB = 2.0**30
_DIRECTIONS = ("forward", "forward+backward")
_LONGEST = (262144, 393216)


class Shape(NamedTuple):
    """One problem: batch 1, bfloat16, `[1, length, heads, head_dim]` queries."""

    length: int
    head_dim: int
    causal: bool
    heads: int = 16
    kv_heads: int = 4

    @property
    def name(self) -> str:
        mha = f"-mha{self.heads}" if self.heads == self.kv_heads else ""
        mask = "causal" if self.causal else "full"
        return f"{self.length // 1024}k-d{self.head_dim}-{mask}{mha}"

    def flops(self, direction: str) -> float:
        forward = 4.0 * self.heads * self.length**2 * self.head_dim
        forward = forward / 2 if self.causal else forward
        return forward if direction == "forward" else 3.5 * forward


def _all_shapes() -> list[Shape]:
    shapes = [
        Shape(n, d, causal)
        for n in (8192, 32768)
        for d in (64, 128)
        for causal in (True, False)
    ]
    shapes.append(Shape(32768, 128, True, heads=8, kv_heads=8))
    shapes += [Shape(65536, 128, True), Shape(65536, 128, False), Shape(65536, 64, True)]
    shapes += [Shape(n, 256, causal) for n in (8192, 32768) for causal in (True, False)]
    return shapes


SHAPES = {s.name: s for s in _all_shapes()}
QUICK = ("8k-d64-full", "8k-d128-causal", "32k-d128-causal")


class Candidate(NamedTuple):
    """One attention program: `forward(q, k, v) -> out` and `forward_backward(q, k, v, ct)
    -> (dq, dk, dv)`, on arrays in `layout` (`"btnh"` or `"bhnd"`, heads-major).

    `role` is `"ringeqx"`, `"kernel"` (the ring's kernel called bare) or `"peer"`;
    `bare` names the kernel candidate a ring candidate is compared with; `lower_in`
    is the context its programs are lowered in (the mesh, for the ring)."""

    name: str
    role: str
    layout: str
    forward: Callable
    forward_backward: Callable
    bare: str | None = None
    lower_in: Callable[[], Any] = contextlib.nullcontext


def _loss_grad(attend: Callable) -> Callable:
    """The forward+backward every candidate but the bare kernel is timed with."""

    def loss(q, k, v, ct):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * ct.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


# ----------------------------------------------------------------------------------------
# ringeqx: the ring on one chip, and its kernel called bare


def ring_candidate(name, shape: Shape, mesh, kernel, bare: str) -> Candidate:
    mask = rx.Causal() if shape.causal else None

    def forward(q, k, v):
        return rx.ring_attention(q, k, v, mask=mask, kernel=kernel)

    return Candidate(
        name, "ringeqx", "btnh", forward, _loss_grad(forward), bare,
        lambda: jax.set_mesh(mesh),
    )  # fmt: skip


def kernel_candidate(name, shape: Shape, kernel) -> Candidate:
    """One ring step's kernel calls on the whole sequence, with the records a contiguous
    one-shard layout gives (positions in one run, one segment, no spans)."""
    mask = rx.Causal() if shape.causal else rx.Full()
    scores = rx.Scores(mask, None, 1.0 / math.sqrt(shape.head_dim))

    def records():
        pos = jnp.arange(shape.length, dtype=jnp.int32)[None]
        return rx.TokenInfo(
            pos, jnp.zeros_like(pos), jnp.full_like(pos, -1), pos >= 0,
            rx.Runs((0,), shape.length),
        )  # fmt: skip

    def forward(q, k, v):
        info = records()
        out, _ = kernel.forward(q, k, v, info, info, scores)
        return out.astype(q.dtype)

    def forward_backward(q, k, v, ct):
        info = records()
        out, lse = kernel.forward(q, k, v, info, info, scores)
        d_out = ct.astype(q.dtype)
        delta = jnp.sum(out * d_out.astype(jnp.float32), axis=-1)
        grads = kernel.backward(q, k, v, lse, delta, d_out, info, info, scores)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

    return Candidate(name, "kernel", "bhnd", forward, forward_backward)


# ----------------------------------------------------------------------------------------
# Peers


@functools.cache
def splash_candidate(name, shape: Shape, tiles: int, fused: bool, causal_tables=True):
    kernel = splash_kernel(
        shape.causal and causal_tables, shape.length, shape.heads, tiles, fused
    )
    scale = 1.0 / math.sqrt(shape.head_dim)

    def forward(q, k, v):
        # Splash does not scale the logits.
        return jax.vmap(kernel)((q * scale).astype(q.dtype), k, v)

    return Candidate(name, "peer", "bhnd", forward, _loss_grad(forward))


def flash_candidate(name, shape: Shape, tiles: int) -> Candidate:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b = min(tiles, shape.length)
    sizes = fa.BlockSizes(
        block_q=b, block_k_major=b, block_k=b, block_b=1,
        block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b,
        block_k_major_dq=b, block_k_dq=b, block_q_dq=b,
    )  # fmt: skip
    group = shape.heads // shape.kv_heads

    def forward(q, k, v):
        # The old kernel takes as many K/V heads as query heads.
        k, v = (jnp.repeat(x, group, axis=1) for x in (k, v))
        return fa.flash_attention(
            q, k, v, causal=shape.causal, sm_scale=1.0 / math.sqrt(shape.head_dim),
            block_sizes=sizes,
        )  # fmt: skip

    return Candidate(name, "peer", "bhnd", forward, _loss_grad(forward))


@functools.cache
def _tokamax():
    import tokamax
    from absl import flags

    # tokamax reads its options as absl flags, parsing sys.argv on first use: this
    # script's arguments are not its flags.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS([sys.argv[0]])
    return tokamax


def tokamax_candidate(name, shape: Shape, tiles: int, compute: int) -> Candidate:
    tokamax = _tokamax()
    from tokamax._src.ops.attention import (
        pallas_mosaic_tpu as tk_fwd,
        pallas_mosaic_tpu_vjp as tk_vjp,
    )
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as tk_splash,
    )

    b = min(tiles, shape.length)
    c = min(compute, b)
    minor = tk_splash.QKVLayout.HEAD_DIM_MINOR
    fwd_config = tk_fwd.Config(
        block_q=b, block_kv=b, block_kv_compute=c, q_layout=minor, k_layout=minor,
        v_layout=minor, use_experimental_scheduler=True,
    )  # fmt: skip
    vjp_config = tk_vjp.Config(block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=c)
    op = tk_fwd.PallasMosaicTpuFlashAttention(
        config=fwd_config, vjp=tk_vjp.PallasMosaicTpuFlashAttentionVjp(config=vjp_config)
    )

    def forward(q, k, v):
        return tokamax.dot_product_attention(q, k, v, is_causal=shape.causal, implementation=op)

    return Candidate(name, "peer", "btnh", forward, _loss_grad(forward))


def candidates(shape: Shape, mesh, tiles: list[str], only: set[str] | None):
    """`(name, maker)` of every candidate of `shape`; a maker may raise (reported)."""
    auto = rx.select_kernel("auto", mesh=mesh)
    makers = [
        ("ringeqx", lambda: ring_candidate("ringeqx", shape, mesh, "auto", "kernel")),
        ("kernel", lambda: kernel_candidate("kernel", shape, auto)),
    ]
    for text in tiles:
        suffix = f"[{text}]"
        make = functools.partial(_tile_kernel, text)

        def ring(make=make, suffix=suffix):
            return ring_candidate("ringeqx" + suffix, shape, mesh, make(), "kernel" + suffix)

        def bare(make=make, suffix=suffix):
            return kernel_candidate("kernel" + suffix, shape, make())

        makers += [("ringeqx" + suffix, ring), ("kernel" + suffix, bare)]
    makers += [
        ("splash[1024 fused]", lambda: splash_candidate("splash[1024 fused]", shape, 1024, True)),
        ("splash[512]", lambda: splash_candidate("splash[512]", shape, 512, False)),
        ("flash[1024]", lambda: flash_candidate("flash[1024]", shape, 1024)),
        ("tokamax[1024/512]", lambda: tokamax_candidate("tokamax[1024/512]", shape, 1024, 512)),
    ]
    return [(n, m) for n, m in makers if only is None or n in only]


# ----------------------------------------------------------------------------------------
# Arrays, compiling, timing


def _problem_shapes(shape: Shape, layout: str):
    """Shapes of q, k, v and the output cotangent in `layout`."""
    q = (1, shape.length, shape.heads, shape.head_dim)
    kv = (1, shape.length, shape.kv_heads, shape.head_dim)
    if layout == "bhnd":
        q, kv = ((x[0], x[2], x[1], x[3]) for x in (q, kv))
    return q, kv, kv, q


def abstract_inputs(shape: Shape, sharding) -> dict[str, tuple]:
    return {
        layout: tuple(
            jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding)
            for s in _problem_shapes(shape, layout)
        )
        for layout in ("btnh", "bhnd")
    }


def concrete_inputs(shape: Shape, sharding) -> dict[str, tuple]:
    """Random q, k, v and cotangent in both layouts, on the chip (the heads-major ones
    are copies, so no candidate times a transpose it would not do in a model)."""
    keys = jax.random.split(jax.random.key(shape.length + shape.head_dim), 4)
    btnh = tuple(
        jax.device_put(jax.random.normal(key, s, jnp.bfloat16), sharding)
        for key, s in zip(keys, _problem_shapes(shape, "btnh"))
    )
    bhnd = tuple(jax.jit(lambda x: jnp.swapaxes(x, 1, 2))(x) for x in btnh)
    return {"btnh": btnh, "bhnd": bhnd}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return f"{type(e).__name__}: {line[:200]}"


def _failure(e: BaseException, stage: str) -> str:
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return f"out of memory ({stage}): {_first_line(e)}"
    return f"{stage} failed: {_first_line(e)}"


def _compiled_row(lowered, lower_s: float) -> dict:
    """`{"compiled", "lower_s", "compile_s", "temp_bytes"}` or `{"error"}`."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - reported in the table
        traceback.print_exc(file=sys.stderr)
        return {"error": _failure(e, "compile")}
    row = {"compiled": compiled, "lower_s": lower_s, "compile_s": time.perf_counter() - start}
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis: no column
        m = None
    row["temp_bytes"] = None if m is None else int(m.temp_size_in_bytes)
    row["total_bytes"] = None if m is None else int(
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return row


def compile_all(jobs: dict, on_device: Callable, workers: int) -> dict[Any, dict]:
    """Compile `{key: (candidate, direction, args)}`: each program lowered in turn (in
    `on_device()`, see `_on_device`, and the candidate's `lower_in()`), then all compiled
    at once on `workers` threads (XLA compiles one program on about one core, and the
    Mosaic TPU programs take seconds each). Returns `{key: row}` (see `_compiled_row`)."""
    rows, lowered = {}, {}
    for key, (cand, direction, args) in jobs.items():
        fn = cand.forward if direction == "forward" else cand.forward_backward
        args = args if direction == "forward+backward" else args[:3]
        start = time.perf_counter()
        try:
            with on_device(), cand.lower_in():
                lowered[key] = jax.jit(fn).lower(*args), time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc(file=sys.stderr)
            rows[key] = {"error": _failure(e, "lowering")}
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {key: pool.submit(_compiled_row, *lo) for key, lo in lowered.items()}
        for key, future in futures.items():
            rows[key] = future.result()
    return {key: rows[key] for key in jobs}


def time_alternating(rows: dict[str, dict], args_of: dict[str, tuple], reps: int) -> None:
    """Two untimed calls of each, then `reps` rounds that call every candidate once in
    turn; sets `times` (seconds) or `error` in each row."""
    live = [n for n, r in rows.items() if "compiled" in r]
    for name in list(live):
        try:
            for _ in range(2):
                jax.block_until_ready(rows[name]["compiled"](*args_of[name]))
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc(file=sys.stderr)
            rows[name]["error"] = _failure(e, "run")
            live.remove(name)
        rows[name]["times"] = []
    for _ in range(reps):
        for name in list(live):
            start = time.perf_counter()
            try:
                jax.block_until_ready(rows[name]["compiled"](*args_of[name]))
            except Exception as e:  # noqa: BLE001 - reported in the table
                traceback.print_exc(file=sys.stderr)
                rows[name].update(error=_failure(e, "run"), times=[])
                live.remove(name)
                continue
            rows[name]["times"].append(time.perf_counter() - start)


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / _GIB:.2f}"


def summarise(shape: Shape, direction: str, rows: dict, cands: dict, memory: bool) -> dict:
    """Medians, TFLOP/s and ratios; prints the table, returns the JSON record."""
    flops = shape.flops(direction)
    med = {n: statistics.median(r["times"]) for n, r in rows.items() if r.get("times")}
    peers = [n for n in med if cands[n].role == "peer"]
    best = min(peers, key=med.__getitem__) if peers else None
    print(f"\n### {shape.name}, {direction} (best peer: {best or 'none ran'})\n")
    head = "| candidate | ms | TFLOP/s | / best peer | ring / bare kernel |"
    rule = "|---|---|---|---|---|"
    if memory:
        head, rule = head + " temp GiB |", rule + "---|"
    print(head + "\n" + rule)
    record = {}
    for name, row in rows.items():
        cand = cands.get(name)
        out = {"role": cand.role if cand else None}
        out.update((k, row[k]) for k in ("temp_bytes", "total_bytes", "lower_s", "compile_s")
                   if k in row)
        mem = f" {_gib(row.get('temp_bytes'))} |" if memory else ""
        if name not in med:
            out["error"] = row.get("error", "not run")
            print(f"| {name} | {out['error']} | | | |{mem}")
            record[name] = out
            continue
        t = med[name]
        out.update(ms=1e3 * t, times_ms=[1e3 * x for x in row["times"]], tflops=flops / t / 1e12)
        cells = [f"{1e3 * t:.3f}", f"{out['tflops']:.1f}", ""]
        if best is not None:
            out["vs_best_peer"] = t / med[best]
            cells[2] = f"{out['vs_best_peer']:.3f}x"
        overhead = ""
        if cand.bare is not None and cand.bare in med:
            out["ring_over_kernel"] = t / med[cand.bare] - 1
            overhead = f"{100 * out['ring_over_kernel']:+.1f}%"
        print(f"| {name} | {' | '.join(cells)} | {overhead} |{mem}")
        record[name] = out
    return {"flops": flops, "best_peer": best, "candidates": record}


def _on_device(mesh, compile_only: bool) -> Callable:
    """The context programs are lowered in. Mosaic's lowering asks the device kind of
    the mesh set by `jax.set_mesh`, else of JAX's default device (tokamax too, before it
    traces): for compile-only chips the default device (the CPU) must be the chip."""
    if compile_only:
        return lambda: jax.default_device(mesh.devices.flat[0])
    return contextlib.nullcontext


def run_shape(shape, mesh, sharding, args, only) -> dict:
    """Build, compile (both directions) and, unless compile-only, time one shape."""
    mask = "causal" if shape.causal else "full"
    print(
        f"\n## {shape.name}: {shape.length} tokens, heads {shape.heads}:{shape.kv_heads}, "
        f"head_dim {shape.head_dim}, {mask}, bfloat16"
    )
    cands, failed, order = {}, {}, []
    for name, make in candidates(shape, mesh, args.tiles, only):
        order.append(name)
        start = time.perf_counter()
        try:
            cands[name] = make()
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc(file=sys.stderr)
            failed[name] = {"error": _failure(e, "build")}
        print(f"  built {name} ({time.perf_counter() - start:.1f} s)", flush=True)
    inputs = (abstract_inputs if args.compile_only else concrete_inputs)(shape, sharding)
    result = {"shape": shape._asdict() | {"name": shape.name}}
    jobs = {
        (direction, name): (cands[name], direction, inputs[cands[name].layout])
        for direction in _DIRECTIONS
        for name in order
        if name in cands
    }
    start = time.perf_counter()
    compiled = compile_all(jobs, _on_device(mesh, bool(args.compile_only)), args.workers)
    print(f"  lowered and compiled {len(jobs)} programs in {time.perf_counter() - start:.1f} s")
    for direction in _DIRECTIONS:
        rows = {}
        for name in order:
            row = dict(failed[name]) if name in failed else compiled[direction, name]
            rows[name] = row
            status = row.get("error") or (
                f"lowered in {row['lower_s']:.1f} s, compiled in {row['compile_s']:.1f} s, "
                f"temp {_gib(row['temp_bytes'])} GiB"
            )
            print(f"  {direction} {name}: {status}", flush=True)
        if args.compile_only:
            result[direction] = {
                n: {k: v for k, v in r.items() if k != "compiled"} for n, r in rows.items()
            }
            continue
        n_args = 4 if direction == "forward+backward" else 3
        args_of = {n: inputs[c.layout][:n_args] for n, c in cands.items()}
        time_alternating(rows, args_of, args.reps)
        result[direction] = summarise(shape, direction, rows, cands, args.memory)
        for row in rows.values():
            row.pop("compiled", None)
    return result


# ----------------------------------------------------------------------------------------
# --check: numerics against float32


def _reference(q, k, v, ct, causal: bool):
    """Float32 out and grads, BTNH, one K/V head (and its query heads) at a time so that
    the score matrices fit."""
    heads, kv_heads, d = q.shape[2], k.shape[2], q.shape[3]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d)

    @jax.jit
    def one(q, k, v, ct):  # q, ct: [seq, group, d]; k, v: [seq, d]
        def attend(q, k, v):
            s = jnp.einsum("qgd,kd->gqk", q, k) * scale
            if causal:
                n = s.shape[-1]
                s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
            return jnp.einsum("gqk,kd->qgd", jax.nn.softmax(s, axis=-1), v)

        out, vjp = jax.vjp(attend, q, k, v)
        return out, *vjp(ct)

    f32 = [x[0].astype(jnp.float32) for x in (q, k, v, ct)]
    parts = []
    with jax.default_matmul_precision("highest"):
        for h in range(kv_heads):
            g = slice(h * group, (h + 1) * group)
            parts.append(one(f32[0][:, g], f32[1][:, h], f32[2][:, h], f32[3][:, g]))
    out, dq = (jnp.concatenate([p[i] for p in parts], axis=1)[None] for i in (0, 1))
    dk, dv = (jnp.stack([p[i] for p in parts], axis=1)[None] for i in (2, 3))
    return out, dq, dk, dv


def run_check(mesh, sharding, args) -> dict:
    shape = SHAPES["8k-d128-causal"]
    print(f"\n## Numerics: {shape.name} against float32 (max |error|)\n")
    inputs = concrete_inputs(shape, sharding)
    want = _reference(*inputs["btnh"], shape.causal)
    scales = [float(jnp.max(jnp.abs(w))) for w in want]
    print("| candidate | out | dq | dk | dv |\n|---|---|---|---|---|")
    print("| (max |reference|) | " + " | ".join(f"{s:.2e}" for s in scales) + " |")
    record = {"reference_max_abs": scales}
    for name, make in candidates(shape, mesh, [], None):
        try:
            cand = make()
            ins = inputs[cand.layout]
            with cand.lower_in():
                out = jax.jit(cand.forward)(*ins[:3])
                grads = jax.jit(cand.forward_backward)(*ins)
            got = (out, *grads)
            if cand.layout == "bhnd":
                got = tuple(jnp.swapaxes(x, 1, 2) for x in got)
            errs = [
                float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) for g, w in zip(got, want)
            ]
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc(file=sys.stderr)
            record[name] = {"error": _failure(e, "check")}
            print(f"| {name} | {record[name]['error']} | | | |")
            continue
        record[name] = dict(zip(("out", "dq", "dk", "dv"), errs))
        print(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
    return record


# ----------------------------------------------------------------------------------------
# --longest: which long causal contexts compile within HBM


def run_longest(mesh, sharding, args) -> dict:
    print("\n## Longest causal forward+backward, head_dim 128, heads 16:4 (compile only)\n")
    print("| tokens | candidate | result | temp GiB | total GiB |\n|---|---|---|---|---|")
    record = {}
    for length in _LONGEST:
        shape = Shape(length, 128, True)
        inputs = abstract_inputs(shape, sharding)
        makers = [
            ("ringeqx", lambda: ring_candidate("ringeqx", shape, mesh, "auto", "kernel")),
            ("splash[1024 fused]", lambda: splash_candidate(
                "splash[1024 fused]", shape, 1024, True, args.splash_causal_tables)),
            ("splash[512]", lambda: splash_candidate(
                "splash[512]", shape, 512, False, args.splash_causal_tables)),
        ]  # fmt: skip
        for name, make in makers:
            try:
                cand = make()
            except Exception as e:  # noqa: BLE001 - reported in the table
                row = {"error": _failure(e, "build")}
            else:
                job = {name: (cand, "forward+backward", inputs[cand.layout])}
                row = compile_all(job, _on_device(mesh, bool(args.compile_only)), 1)[name]
            row.pop("compiled", None)
            fits = "compiles" if "error" not in row else row["error"]
            gib = " | ".join(_gib(row.get(k)) for k in ("temp_bytes", "total_bytes"))
            print(f"| {length} | {name} | {fits} | {gib} |", flush=True)
            record[f"{length}/{name}"] = row
    return record


# ----------------------------------------------------------------------------------------


def print_summary(shapes: dict) -> None:
    """One line per shape and direction: ringeqx against its best peer and its kernel."""
    print("\n## Summary: ringeqx (auto)\n")
    print("| shape | direction | ringeqx ms | best peer | peer ms | ringeqx / peer "
          "| ring over bare kernel |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name, result in shapes.items():
        for direction in _DIRECTIONS:
            table = result.get(direction, {})
            ring = table.get("candidates", {}).get("ringeqx", {})
            best = table.get("best_peer")
            if "ms" not in ring or best is None:
                continue
            peer = table["candidates"][best]["ms"]
            over = ring.get("ring_over_kernel")
            over = "" if over is None else f"{100 * over:+.1f}%"
            print(f"| {name} | {direction} | {ring['ms']:.3f} | {best} | {peer:.3f} | "
                  f"{ring['ms'] / peer:.3f}x | {over} |")  # fmt: skip


def _tiles(text: str) -> list[str]:
    """`BQxBKV[xCOMPUTE][/BKVxCOMPUTE]` (the backward's key tiles after the slash), checked."""
    if not text:
        return []
    try:
        for t in text.split(","):
            _tile_kernel(t)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"tiles are BQxBKV[xBKV_COMPUTE][/BKVxBKV_COMPUTE],...; got {text!r}"
        ) from None
    return text.split(",")


def _tile_kernel(text: str) -> "rx.PallasTpuKernel":
    """The kernel a `--tiles` entry names."""
    forward, _, backward = text.partition("/")
    bq, bkv, *compute = (int(x) for x in forward.split("x"))
    kwargs = {"block_kv_compute": compute[0] if compute else None, "backward_block_kv": None}
    if backward:
        bkv_b, *compute_b = (int(x) for x in backward.split("x"))
        kwargs.update(
            backward_block_kv=bkv_b, backward_block_kv_compute=compute_b[0] if compute_b else None
        )
    return rx.PallasTpuKernel(bq, bkv, **kwargs)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--only", default=None, help="comma-separated candidate names")
    parser.add_argument(
        "--tiles",
        type=_tiles,
        default=[],
        help="extra ringeqx tiles, 1024x2048 or 1024x1024x512 (block_kv_compute)",
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--memory", action="store_true", help="print temp GiB per candidate")
    parser.add_argument("--check", action="store_true", help="numerics at 8k-d128-causal")
    parser.add_argument("--longest", action="store_true", help="262144 / 393216 tokens")
    parser.add_argument("--splash-causal-tables", action="store_true",
                        help="--longest: splash with causal mask tables (slow on the host)")
    parser.add_argument("--no-bench", action="store_true", help="skip the timed tables")
    parser.add_argument("--compile-only", default=None, metavar="TPU",
                        help="compile for a compile-only chip (e.g. v5e), run nothing")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="threads compiling programs at once")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    names = QUICK if args.quick else (args.shapes.split(",") if args.shapes else list(SHAPES))
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    args.shape_list = [SHAPES[n] for n in names]
    args.only = set(args.only.split(",")) if args.only else None
    return args


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.compile_only:
        target = args.compile_only if ":" in args.compile_only else f"{args.compile_only}:1x1"
        mesh = rx.tools.target_mesh(target)
        where = f"compile-only {target} ({mesh.devices.flat[0].device_kind})"
    else:
        if jax.default_backend() != "tpu":
            print(
                f"No TPU: JAX's backend is {jax.default_backend()!r}. This benchmark runs on "
                "one TPU chip; without one, use --compile-only v5e (needs jax[tpu]).",
                file=sys.stderr,
            )
            return 2
        mesh = jax.make_mesh((1,), ("sequence",), axis_types=(AxisType.Auto,))
        where = f"{mesh.devices.flat[0].device_kind}"
    sharding = NamedSharding(mesh, P())
    print(f"# ringeqx vs splash / tokamax on {where}, jax {jax.__version__}")
    print(f"ringeqx auto kernel: {rx.select_kernel('auto', mesh=mesh)}")
    results: dict[str, Any] = {
        "device": where, "jax": jax.__version__, "reps": args.reps,
        "argv": sys.argv[1:], "shapes": {},
    }  # fmt: skip
    if args.check and not args.compile_only:
        results["check"] = run_check(mesh, sharding, args)
    if not args.no_bench:
        for shape in args.shape_list:
            results["shapes"][shape.name] = run_shape(shape, mesh, sharding, args, args.only)
            if args.json:  # after each shape, so a run cut short keeps what it measured
                _write(args.json, results)
    if results["shapes"] and not args.compile_only:
        print_summary(results["shapes"])
    if args.longest:
        results["longest"] = run_longest(mesh, sharding, args)
    if args.json:
        _write(args.json, results)
        print(f"\nwrote {args.json}")
    return 0


def _write(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
