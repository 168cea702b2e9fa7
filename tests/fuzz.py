"""A differential fuzzer: `ringeqx.ring_attention` against a dense attention written here.

Every configuration is a `Config` of plain Python values, drawn from `(seed, index)`
alone, so any failure is reproduced by `python tests/fuzz.py --seed S --index I` or, after
shrinking, by the `--config '{...}'` line the fuzzer prints. The dense attention below
reads only the `Config` (its own mask rules, score modifiers and sinks), never
`ringeqx.reference_attention`, so a bug shared by the library and its reference is
still caught.

Compiling dominates the time, so configurations come in groups of `GROUP`: one group
shares everything static (device count, shapes, dtype, kernel and its tiles, mask
structure and windows, score modifier kind, sinks, compression, strategy), and its
members differ only in array values (inputs, segment and span ids, the layout's
positions, prefix lengths, block maps, caps, slopes, sink logits), which are traced.
One compiled program then serves the whole group (a layout whose capacity differs, e.g.
`Boundary` with other breaks, recompiles).

Run `python tests/fuzz.py --configs 500` (or `nox -s fuzz -- --configs 500`); see
`docs/fuzzing.md`.
"""

import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any


if __name__ == "__main__":
    # As a script: the same fake devices and numerics flags as the test suite's conftest.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    ).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ringeqx as rx  # noqa: E402


if __name__ == "__main__":
    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")


GROUP = 6  # configurations per shared static part (per compiled program)
LENGTHS = (1, 2, 3, 5, 7, 12, 17, 24, 33, 41)  # a small set, so programs are reused
STRATEGIES = (
    "uniform",
    "zigzag",
    "striped",
    "boundary",
    "work_balanced",
    "modality_aware",
    "modality_aware_contiguous",
)

# Mismatches that are known bugs, excluded from the verdict but still counted and
# printed. Each entry: (name, reason citing the bug, predicate on a Config). Empty: the
# fuzzer has found no bug that is not fixed. Add an entry only with the lead's consent.
KNOWN_BUGS: list[tuple[str, str, Callable[["Config"], bool]]] = []


@dataclasses.dataclass(frozen=True)
class Config:
    """One fuzz case, in plain values (JSON round-trips it).

    `mask` is an expression: `["full"]`, `["causal"]`, `["document"]`,
    `["window", w, two_sided]`, `["prefix"]`, `["spans"]`, `["block_sparse", size]`,
    `["and", a, b]`, `["or", a, b]`. Array parameters (the prefix length, the block map)
    come from `data_seed`, as do the inputs, segment and span ids and `Boundary` breaks.
    `score_mod` is `"none"`, `"softcap"`, `"alibi"` or `"chain"` (ALiBi then softcap).
    `bias`: a `bias=` per key and head (`[1, heads, 1, seq]`, run before the modifier).
    `trainable`: the modifier's leaves (cap, slopes) and the bias are differentiated too,
    and their gradients compared.
    """

    devices: int
    seq: int
    batch: int  # 0: no batch axis
    batched_ids: bool  # per-example segment / span ids (a batched layout)
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16"
    kernel: str  # "xla" | "pallas_gpu" | "pallas_tpu"
    block_q: int
    block_kv: int
    strategy: str
    stripe: int
    mask: Any
    score_mod: str
    sinks: bool
    compression: bool
    data_seed: int
    bias: bool = False
    trainable: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Config":
        return Config(**json.loads(text))

    def static_key(self) -> tuple:
        """Everything but the data seed: configs equal here share a compiled program."""
        d = dataclasses.asdict(self)
        del d["data_seed"]
        return tuple((k, json.dumps(v)) for k, v in sorted(d.items()))


# ---------------------------------------------------------------------------------------
# Drawing configurations


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


def _draw_mask(r: np.random.Generator, depth: int = 0) -> Any:
    leaves = ["full", "causal", "document", "window", "prefix", "spans", "block_sparse"]
    if depth < 2 and r.random() < (0.35 if depth == 0 else 0.15):
        op = str(r.choice(["and", "or"]))
        return [op, _draw_mask(r, depth + 1), _draw_mask(r, depth + 1)]
    kind = str(r.choice(leaves))
    if kind == "window":
        return ["window", int(r.integers(1, 12)), bool(r.random() < 0.4)]
    if kind == "block_sparse":
        return ["block_sparse", int(r.choice([2, 3, 5]))]
    return [kind]


def draw_config(seed: int, index: int) -> Config:
    """The configuration number `index` of the run with this `seed`.

    The static part comes from `(seed, index // GROUP)`, the data seed from
    `(seed, index)`.
    """
    r = _rng(seed, index // GROUP, 1)
    kernel = str(r.choice(["xla"] * 8 + ["pallas_gpu", "pallas_tpu"]))
    if kernel == "xla":
        devices = int(r.choice([1, 2, 3, 4, 5, 6, 7, 8]))
        kv_heads = int(r.integers(1, 4))
        heads = kv_heads * int(r.integers(1, 4))
        head_dim = int(r.integers(1, 10))
        block_q, block_kv = int(r.choice([1, 3, 5, 8])), int(r.choice([2, 3, 4, 7]))
        seq = int(r.choice(LENGTHS))
    else:
        # The interpreter is slow: fewer devices; only the head dims each kernel takes
        # (Triton: powers of two from 16; Mosaic: 64 or multiples of 128).
        devices = int(r.choice([1, 2, 3, 4]))
        kv_heads = int(r.integers(1, 3))
        heads = kv_heads * int(r.integers(1, 3))
        head_dim = int(r.choice([16, 32])) if kernel == "pallas_gpu" else 64
        block_q, block_kv = (16, 16) if kernel == "pallas_gpu" else (16, 128)
        seq = int(r.choice(LENGTHS[:8]))
    dtype = "bfloat16" if r.random() < 0.25 else "float32"
    return Config(
        devices=devices,
        seq=seq,
        batch=(batch := int(r.choice([0, 0, 1, 2]))),
        batched_ids=bool(batch and r.random() < 0.5),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        kernel=kernel,
        block_q=block_q,
        block_kv=block_kv,
        strategy=str(r.choice(STRATEGIES)),
        stripe=int(r.choice([1, 2, 3])),
        mask=_draw_mask(r),
        score_mod=str(r.choice(["none", "none", "softcap", "alibi", "chain"])),
        sinks=bool(r.random() < 0.3),
        compression=bool(dtype == "float32" and r.random() < 0.2),
        data_seed=int(_rng(seed, index, 2).integers(0, 2**31)),
        bias=bool(r.random() < 0.3),
        trainable=bool(r.random() < 0.5),
    )


# ---------------------------------------------------------------------------------------
# Building a case: arrays from the data seed


def _mask_params(expr: Any, r: np.random.Generator, seq: int, out: list) -> None:
    """Array parameters of the mask expression, in a fixed (depth-first) order."""
    match expr[0]:
        case "and" | "or":
            _mask_params(expr[1], r, seq, out)
            _mask_params(expr[2], r, seq, out)
        case "prefix":
            out.append(np.int32(r.integers(-1, seq + 2)))
        case "block_sparse":
            n = -(-seq // expr[1])
            out.append(r.random((n, n)) < 0.45)


def build_arrays(c: Config) -> dict[str, Any]:
    """Every array of the case, as NumPy (original order), from `c.data_seed`."""
    r = _rng(c.data_seed, 3)
    bshape = (c.batch,) if c.batch else ()
    dt = jnp.dtype(c.dtype)

    def normal(*shape):
        return np.asarray(jnp.asarray(r.standard_normal(shape), jnp.float32).astype(dt))

    q = normal(*bshape, c.seq, c.heads, c.head_dim)
    k = normal(*bshape, c.seq, c.kv_heads, c.head_dim)
    v = normal(*bshape, c.seq, c.kv_heads, c.head_dim)
    ct = normal(*bshape, c.seq, c.heads, c.head_dim)
    ids_shape = (c.batch,) if c.batched_ids else ()
    seg = np.zeros(ids_shape + (c.seq,), np.int32)
    spans = np.full(ids_shape + (c.seq,), -1, np.int32)
    for row_seg, row_spans in zip(seg.reshape(-1, c.seq), spans.reshape(-1, c.seq)):
        lengths = r.integers(1, 10, size=8)
        row_seg[:] = np.resize(np.repeat(np.arange(8), lengths), c.seq)
        for sid in range(int(r.integers(0, 4))):
            start = int(r.integers(0, c.seq))
            row_spans[start : start + int(r.integers(1, 9))] = sid
    breaks = np.sort(r.integers(0, c.seq + 1, size=int(r.integers(1, 6)))).astype(np.int32)
    mask_params: list = []
    _mask_params(c.mask, r, c.seq, mask_params)
    return dict(
        q=q,
        k=k,
        v=v,
        ct=ct,
        seg=seg,
        spans=spans,
        breaks=breaks,
        mask_params=mask_params,
        cap=np.float32(r.uniform(0.5, 4.0)),
        slopes=r.uniform(0.01, 0.5, size=c.heads).astype(np.float32),
        sinks=r.uniform(-2.0, 2.0, size=c.heads).astype(np.float32),
        bias=r.uniform(-1.0, 1.0, size=(c.heads, c.seq)).astype(np.float32),
    )


def build_layout(c: Config, a: dict[str, Any]) -> rx.Layout:
    seg, spans = jnp.asarray(a["seg"]), jnp.asarray(a["spans"])
    match c.strategy:
        case "uniform":
            s = rx.Uniform()
        case "zigzag":
            s = rx.Zigzag()
        case "striped":
            s = rx.Striped(stripe=c.stripe)
        case "boundary":
            s = rx.Boundary(a["breaks"])
        case "work_balanced":
            s = rx.WorkBalanced(chunk=c.stripe, iterations=50)
        case "modality_aware":
            s = rx.ModalityAware()
        case "modality_aware_contiguous":
            s = rx.ModalityAware(zigzag=False)
        case other:
            raise ValueError(f"unknown strategy {other!r}")
    layout = s.layout(c.seq, c.devices, segment_ids=seg, span_ids=spans)
    # Boundary and ModalityAware pick the smallest capacity that fits, which depends on
    # the breaks / spans (array values): pad to a fixed capacity where it fits, so that
    # the group's members share one compiled program.
    fixed = 2 * -(-c.seq // c.devices) + 1
    if c.strategy == "boundary" and layout.capacity < fixed:
        layout = rx.Boundary(a["breaks"], capacity=fixed).layout(
            c.seq, c.devices, segment_ids=seg, span_ids=spans
        )
    elif c.strategy.startswith("modality_aware") and layout.capacity < fixed:
        s = rx.ModalityAware(capacity=fixed, zigzag=c.strategy == "modality_aware")
        layout = s.layout(c.seq, c.devices, segment_ids=seg, span_ids=spans)
    return layout


def build_kernel(c: Config) -> rx.AbstractAttentionKernel:
    match c.kernel:
        case "xla":
            return rx.XlaKernel(block_q=c.block_q, block_kv=c.block_kv)
        case "pallas_gpu":
            return rx.PallasGpuKernel(block_q=c.block_q, block_kv=c.block_kv, interpret=True)
        case "pallas_tpu":
            return rx.PallasTpuKernel(
                block_q=c.block_q,
                block_kv=c.block_kv,
                block_kv_compute=None,
                backward_block_kv=None,
                interpret=True,
            )
        case other:
            raise ValueError(f"unknown kernel {other!r}")


def ring_mask(expr: Any, params: Iterator) -> rx.AbstractMask:
    """The ringeqx mask for an expression (array parameters taken from `params`)."""
    match expr[0]:
        case "and":
            return ring_mask(expr[1], params) & ring_mask(expr[2], params)
        case "or":
            return ring_mask(expr[1], params) | ring_mask(expr[2], params)
        case "full":
            return rx.Full()
        case "causal":
            return rx.Causal()
        case "document":
            return rx.Document()
        case "window":
            return rx.SlidingWindow(expr[1], two_sided=expr[2])
        case "prefix":
            return rx.PrefixLM(next(params))
        case "spans":
            return rx.BidirectionalSpans()
        case "block_sparse":
            return rx.BlockSparse(next(params), expr[1])
        case other:
            raise ValueError(f"unknown mask {other!r}")


def ring_score_mod(kind: str, cap, slopes) -> rx.AbstractScoreMod | None:
    match kind:
        case "none":
            return None
        case "softcap":
            return rx.Softcap(cap)
        case "alibi":
            return rx.ALiBi(slopes)
        case "chain":
            return rx.Chain(rx.ALiBi(slopes), rx.Softcap(cap))
        case other:
            raise ValueError(f"unknown score_mod {other!r}")


# ---------------------------------------------------------------------------------------
# The dense attention this fuzzer trusts: written from the definitions, in float32.


def dense_allowed(expr: Any, params: Iterator, qp, kp, qs, ks, qsp, ksp):
    """Elementwise mask `[batch or 1, q, k]` from positions, segments and span ids
    (queries `[., q, 1]`, keys `[., 1, k]`)."""
    match expr[0]:
        case "and":
            a = dense_allowed(expr[1], params, qp, kp, qs, ks, qsp, ksp)
            return a & dense_allowed(expr[2], params, qp, kp, qs, ks, qsp, ksp)
        case "or":
            a = dense_allowed(expr[1], params, qp, kp, qs, ks, qsp, ksp)
            return a | dense_allowed(expr[2], params, qp, kp, qs, ks, qsp, ksp)
        case "full":
            return jnp.ones_like(qp >= kp)
        case "causal":
            return qp >= kp
        case "document":
            return qs == ks
        case "window":
            w, two_sided = expr[1], expr[2]
            d = qp - kp
            return (d < w) & (d > -w if two_sided else d >= 0)
        case "prefix":
            n = next(params)
            return (qp >= kp) | ((qp < n) & (kp < n))
        case "spans":
            return (qp >= kp) | ((qsp == ksp) & (qsp >= 0))
        case "block_sparse":
            size, table = expr[1], next(params)
            return table[qp // size, kp // size]  # [1, q, k]
        case other:
            raise ValueError(f"unknown mask {other!r}")


def dense_attention(c: Config, q, k, v, sinks, extra):
    """softmax(scale q.k + modifier, masked, with sinks in the denominator) @ v.

    `q`: `[*batch, seq, heads, d]`, `k`/`v`: `[*batch, seq, kv_heads, d]`, float32.
    Rows that see nothing are zero.
    """
    seq = c.seq
    # Records as [ids_batch or 1, q, 1] and [ids_batch or 1, 1, k].
    pos = jnp.arange(seq)[None]
    seg, spans = extra["seg"], extra["spans"]
    seg, spans = (x if c.batched_ids else x[None] for x in (seg, spans))
    allowed = dense_allowed(
        c.mask, iter(extra["mask_params"]),
        pos[:, :, None], pos[:, None, :], seg[:, :, None], seg[:, None, :],
        spans[:, :, None], spans[:, None, :],
    )[:, None]  # [ids_batch or 1, 1 (heads), q, k]
    if not c.batch:
        allowed = allowed[0]
    pos = pos[0]
    group = c.heads // c.kv_heads
    k = jnp.repeat(k, group, axis=-2)
    v = jnp.repeat(v, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.float32(math.sqrt(c.head_dim))

    def lift(x):  # explicit broadcasting (the suite forbids rank promotion)
        return x.reshape((1,) * (s.ndim - x.ndim) + x.shape)

    allowed = lift(allowed)
    dist = jnp.abs(pos[:, None] - pos[None, :]).astype(jnp.float32)
    if c.bias:
        s = s + lift(extra["bias"][:, None, :])
    if c.score_mod in ("alibi", "chain"):
        s = s - lift(extra["slopes"][:, None, None] * dist[None])
    if c.score_mod in ("softcap", "chain"):
        s = extra["cap"] * jnp.tanh(s / extra["cap"])
    m = jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1, keepdims=True)
    if c.sinks:
        m = jnp.maximum(m, lift(sinks[:, None, None]))
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(jnp.where(allowed, s - m, -jnp.inf))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if c.sinks:
        denom = denom + jnp.exp(lift(sinks[:, None, None]) - m)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("...hqk,...khd->...qhd", p, v)


# ---------------------------------------------------------------------------------------
# Running a case


def _mesh(devices: int):
    return jax.make_mesh(
        (devices,), ("sequence",), devices=jax.devices()[:devices],
        axis_types=(jax.sharding.AxisType.Auto,),
    )


@eqx.filter_jit
def _compare(c_static, kernel, mesh, layout, arrays):
    """Ring and dense outputs and vjps, in one compiled program per static part."""
    c = c_static
    q, k, v, ct = arrays["q"], arrays["k"], arrays["v"], arrays["ct"]
    config = rx.RingConfig(compression_dtype=jnp.bfloat16 if c.compression else None)

    def shard(x):
        if c.batched_ids:
            return jax.vmap(rx.Layout.shard)(layout, x)
        return jax.vmap(layout.shard)(x) if c.batch else layout.shard(x)

    def unshard(y):
        if c.batched_ids:
            return jax.vmap(rx.Layout.unshard)(layout, y)
        return jax.vmap(layout.unshard)(y) if c.batch else layout.unshard(y)

    def ring(q, k, v, sinks, params):
        out = rx.ring_attention(
            shard(q), shard(k), shard(v),
            mask=ring_mask(c.mask, iter(arrays["mask_params"])),
            layout=layout, order="layout", mesh=mesh, kernel=kernel, config=config,
            score_mod=ring_score_mod(c.score_mod, params["cap"], params["slopes"]),
            sinks=sinks if c.sinks else None,
            bias=params["bias"][None, :, None, :] if c.bias else None,
        )
        return unshard(out)

    def dense(q, k, v, sinks, params):
        return dense_attention(c, q, k, v, sinks, {**arrays, **params})

    def value_and_grads(f, q, k, v, sinks, params, ct):
        # Differentiated leaves take the ring's extra pass; closed-over ones must not.
        if c.trainable:
            out, vjp = jax.vjp(f, q, k, v, sinks, params)
            return out, vjp(ct)
        out, vjp = jax.vjp(lambda q, k, v, sinks: f(q, k, v, sinks, params), q, k, v, sinks)
        return out, (*vjp(ct), jax.tree.map(jnp.zeros_like, params))

    sinks = arrays["sinks"]
    params = {name: arrays[name] for name in ("cap", "slopes", "bias")}
    out, grads = value_and_grads(ring, q, k, v, sinks, params, ct)
    # The reference after the ring: XLA's CPU runtime runs independent collectives
    # concurrently (the reference's, where sharding propagation splits it over the
    # mesh), and on 2 cores a device's ring permute waited for a thread that the
    # others' blocked all-gather held, until the 40 s rendezvous timeout aborted the
    # process (seed 1977852426, index 42; test_comm.py's rings do the same).
    q, k, v, sinks, params, ct = jax.lax.optimization_barrier(
        ((q, k, v, sinks, params, ct), (out, grads))
    )[0]
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref, ref_grads = value_and_grads(dense, *f32, sinks, params, ct.astype(jnp.float32))
    return (out, *grads), (ref, *ref_grads)


def _static(c: Config) -> Config:
    """The config with its data seed zeroed: the part that is static under jit (hashed
    by value, so the mask expression becomes nested tuples)."""
    return dataclasses.replace(c, data_seed=0, mask=_freeze(c.mask))


def _freeze(x):
    return tuple(_freeze(y) for y in x) if isinstance(x, list) else x


def tolerance(c: Config) -> tuple[float, float]:
    """(outputs, gradients) absolute tolerance, relative to the reference's magnitude.

    float32: summation order only. bfloat16 inputs: the ring rounds probabilities to
    bfloat16 before P @ V and the output to bfloat16 (test_ring.py's bf16 bounds).
    Compressed K/V (float32 inputs, bfloat16 on the wire): relative rounding 2^-9 of
    every remote key and value.
    """
    if c.dtype == "bfloat16":
        return 3e-2, 6e-2
    if c.compression:
        return 2e-2, 4e-2
    return 2e-5, 5e-5


NAMES = ("out", "dq", "dk", "dv", "dsinks", "dparams")


def _compared(c: Config, name: str) -> bool:
    """Whether the output or gradient `name` (of NAMES, or `dparams.<leaf>`) is checked."""
    match name:
        case "dsinks":
            return c.sinks
        case "dparams.cap":
            return c.trainable and c.score_mod in ("softcap", "chain")
        case "dparams.slopes":
            return c.trainable and c.score_mod in ("alibi", "chain")
        case "dparams.bias":
            return c.trainable and c.bias
        case _:
            return True


def check(c: Config) -> str | None:
    """Run one configuration; None if ring and dense agree, else what differs."""
    a = build_arrays(c)
    try:
        layout = build_layout(c, a)
        kernel = build_kernel(c)
        arrays = {
            key: (jnp.asarray(val) if key != "mask_params" else [jnp.asarray(p) for p in val])
            for key, val in a.items()
            if key != "breaks"
        }
        got, want = _compare(
            _static(c), kernel, _mesh(c.devices), layout, arrays,
        )
    except Exception as e:  # an error on valid input is a finding too
        if refused(c, e):
            return None
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    tol_out, tol_grad = tolerance(c)
    problems = []
    named = list(zip(NAMES, got, want))
    params = named.pop()[1:]
    named += [(f"dparams.{key}", params[0][key], params[1][key]) for key in sorted(params[0])]
    for name, g, w in named:
        if not _compared(c, name):
            continue
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if not np.all(np.isfinite(g)):
            problems.append(f"{name}: non-finite values")
            continue
        scale = max(1.0, float(np.max(np.abs(w), initial=0.0)))
        err = float(np.max(np.abs(g - w), initial=0.0))
        tol = (tol_out if name == "out" else tol_grad) * scale
        if not err <= tol:
            problems.append(f"{name}: max error {err:.3g} > {tol:.3g}")
    if got[0].dtype != jnp.dtype(c.dtype):
        problems.append(f"out dtype {got[0].dtype} != {c.dtype}")
    return "; ".join(problems) or None


# The documented refusal of a Pallas kernel whose BlockSparse tiles hold positions too far
# apart for the map window it gets per tile, found at run time on layouts whose runs of
# consecutive positions are not known when traced (ModalityAware, Zigzag chunks that a
# tile straddles). It must be raised on every device at once: before the ring made the
# check together, one device raised and the others hung in the next transfer.
_RUNTIME_REFUSAL = "cannot run exactly in a Pallas kernel with"


def refused(c: Config, e: Exception) -> bool:
    """Whether `e` is a clear refusal the library documents for `c` (not a finding)."""
    return (
        c.kernel != "xla"
        and "block_sparse" in json.dumps(c.mask)
        and _RUNTIME_REFUSAL in str(e)
    )


def known_bug(c: Config) -> str | None:
    for name, reason, pred in KNOWN_BUGS:
        if pred(c):
            return f"{name}: {reason}"
    return None


# ---------------------------------------------------------------------------------------
# Shrinking


def _simpler_masks(expr: Any) -> list[Any]:
    out = []
    if expr[0] in ("and", "or"):
        out += [expr[1], expr[2]]
        out += [[expr[0], m, expr[2]] for m in _simpler_masks(expr[1])]
        out += [[expr[0], expr[1], m] for m in _simpler_masks(expr[2])]
    elif expr[0] != "full":
        out.append(["full"])
        if expr[0] == "window" and expr[1] > 1:
            out.append(["window", expr[1] // 2, expr[2]])
        if expr[0] == "window" and expr[2]:
            out.append(["window", expr[1], False])
    return out


def _candidates(c: Config) -> Iterator[Config]:
    r = dataclasses.replace
    for d in sorted({1, 2, c.devices - 1} - {c.devices}):
        if 1 <= d < c.devices:
            yield r(c, devices=d)
    for n in sorted({1, 2, 3, c.seq // 2, c.seq - 1}):
        if 1 <= n < c.seq:
            yield r(c, seq=n)
    if c.batched_ids:
        yield r(c, batched_ids=False)
    if c.batch:
        yield r(c, batch=0, batched_ids=False)
    if c.kv_heads > 1:
        yield r(c, kv_heads=1, heads=c.heads // c.kv_heads)
    if c.heads > c.kv_heads:
        yield r(c, heads=c.kv_heads)
    if c.kernel == "xla" and c.head_dim > 1:
        yield r(c, head_dim=1)
    for m in _simpler_masks(c.mask):
        yield r(c, mask=m)
    if c.score_mod != "none":
        yield r(c, score_mod="none")
    if c.score_mod == "chain":
        yield r(c, score_mod="alibi")
        yield r(c, score_mod="softcap")
    if c.sinks:
        yield r(c, sinks=False)
    if c.trainable:
        yield r(c, trainable=False)
    if c.bias:
        yield r(c, bias=False)
    if c.compression:
        yield r(c, compression=False)
    if c.dtype != "float32":
        yield r(c, dtype="float32")
    if c.strategy != "uniform":
        yield r(c, strategy="uniform")
    if c.kernel != "xla":
        yield r(c, kernel="xla", block_q=8, block_kv=4, head_dim=min(c.head_dim, 8))
    elif (c.block_q, c.block_kv) != (8, 4):
        yield r(c, block_q=8, block_kv=4)


def shrink(c: Config, budget: int = 60, log=print) -> Config:
    """Greedily simplify a failing config while it still fails (at most `budget` runs)."""
    runs = 0
    progress = True
    while progress and runs < budget:
        progress = False
        for cand in _candidates(c):
            if runs >= budget:
                break
            runs += 1
            if check(cand) is not None:
                log(f"  shrunk: {cand.to_json()}")
                c, progress = cand, True
                break
    return c


def reproducer(c: Config) -> str:
    return f"python tests/fuzz.py --config '{c.to_json()}'"


# ---------------------------------------------------------------------------------------
# Driving a run


def default_seed() -> int:
    """`FUZZ_SEED` if set, else derived from the commit (CI's `GITHUB_SHA`, else
    `git rev-parse HEAD`), else 0: the CI slice sees new configurations each commit."""
    if "FUZZ_SEED" in os.environ:
        return int(os.environ["FUZZ_SEED"])
    sha = os.environ.get("GITHUB_SHA")
    if not sha:
        try:
            sha = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            sha = ""
    try:
        return int(hashlib.sha256(sha.encode()).hexdigest()[:8], 16) if sha else 0
    except ValueError:
        return 0


@dataclasses.dataclass
class Result:
    seed: int
    configs: int = 0
    compiles: int = 0
    failures: list = dataclasses.field(default_factory=list)  # (index, config, message)
    known: list = dataclasses.field(default_factory=list)  # (index, config, message, bug)
    seconds: float = 0.0


def run(
    seed: int,
    configs: int,
    start: int = 0,
    shrink_budget: int = 60,
    log=print,
    verbose: bool = False,
) -> Result:
    """Check configurations `start .. start + configs - 1` of `seed`; shrink failures."""
    res = Result(seed=seed)
    t0 = time.perf_counter()
    seen = set()
    for index in range(start, start + configs):
        c = draw_config(seed, index)
        key = c.static_key()
        if key not in seen:
            seen.add(key)
            res.compiles += 1
        t = time.perf_counter()
        msg = check(c)
        res.configs += 1
        if verbose:
            log(f"[{index}] {time.perf_counter() - t:5.1f} s {'ok' if msg is None else 'FAIL'} "
                f"{c.to_json()}")
        if msg is None:
            continue
        bug = known_bug(c)
        if bug is not None:
            log(f"[{index}] known bug ({bug}): {msg}")
            res.known.append((index, c, msg, bug))
            continue
        log(f"[{index}] MISMATCH: {msg}\n  config: {c.to_json()}")
        small = shrink(c, shrink_budget, log=log) if shrink_budget else c
        small_msg = check(small) if small is not c else msg
        log(f"  reproduce: {reproducer(small)}\n  -> {small_msg}")
        res.failures.append((index, small, small_msg))
    res.seconds = time.perf_counter() - t0
    return res


def summary(res: Result) -> str:
    return (
        f"fuzz seed={res.seed}: {res.configs} configs, {res.compiles} static groups, "
        f"{len(res.failures)} mismatches, {len(res.known)} known bugs, "
        f"{res.seconds:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=64, help="number of configurations")
    p.add_argument("--seed", type=int, default=None, help="default: from the commit")
    p.add_argument("--start", type=int, default=0, help="first configuration index")
    p.add_argument("--index", type=int, default=None, help="run this one index only")
    p.add_argument("--config", default=None, help="run this JSON config only")
    p.add_argument("--shrink-budget", type=int, default=60, help="0: do not shrink")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per config")
    args = p.parse_args(argv)
    seed = default_seed() if args.seed is None else args.seed
    if args.config is not None or args.index is not None:
        c = Config.from_json(args.config) if args.config else draw_config(seed, args.index)
        print(c.to_json())
        msg = check(c)
        print("ok" if msg is None else f"MISMATCH: {msg}")
        return 0 if msg is None else 1
    res = run(seed, args.configs, args.start, args.shrink_budget, verbose=args.verbose)
    print(summary(res))
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
