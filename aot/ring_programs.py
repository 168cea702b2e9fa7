"""The programs the aot checks compile: `jax.grad` of ring attention losses over q, k, v
sharded along the sequence of a compile-only mesh.

- `lowered_ring_grad`: one bfloat16 case, lowered (the caller compiles and reads it).
- `ring_cases` + `compile_ring`: the ring matrix of test_tpu_matrix and test_gpu_ring,
  one program holding many cases (a covering design of masks, modifiers, sinks, shapes,
  layouts and wires), each under a `jax.named_scope` of its own, compiled and checked
  the same way on every platform: nothing gathers the sequence, each case's three
  Pallas kernels are in the scheduled HLO (counted by their op names), and compressed
  K/V travel as bits.
"""

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from helpers import ALL_MASKS, SCORE_MODS, SINKS, block_pattern, packed_segments, span_ids
from jax.sharding import NamedSharding, PartitionSpec as P

import ringeqx as rx
from ringeqx._kernels._select import mesh_device_type


def lowered_ring_grad(mesh, mask, *, seq, heads, kv_heads, head_dim, kernel="auto", **ring):
    """`jax.jit(jax.grad(loss)).lower(...)` for bfloat16 `q [1, seq, heads, head_dim]`
    and K/V with `kv_heads`, the loss the sum of `ring_attention`'s output (`ring`: more
    of its arguments, e.g. `score_mod`, `segment_ids`)."""

    def loss(q, k, v):
        out = rx.ring_attention(q, k, v, mask=mask, mesh=mesh, kernel=kernel, **ring)
        return out.astype(jnp.float32).sum()

    spec = NamedSharding(mesh, P(None, "sequence"))
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.bfloat16, sharding=spec)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv)


def block_sparse_mask(which: str, seq: int, block: int) -> rx.AbstractMask:
    """BlockSparse `"alone"`, `"and_causal"` or `"or_prefix"` (`(... & Causal) |
    PrefixLM(100)`), over `helpers.block_pattern`."""
    sparse = rx.BlockSparse(block_pattern(seq, block), block)
    return {
        "alone": sparse,
        "and_causal": sparse & rx.Causal(),
        "or_prefix": (sparse & rx.Causal()) | rx.PrefixLM(100),
    }[which]


# ----------------------------------------------------------------------------------
# The ring matrix.

# Masks built from `&` and `|` beyond those in ALL_MASKS.
MASKS = ALL_MASKS + [
    ("sliding_or_spans", lambda n: rx.SlidingWindow(16) | rx.BidirectionalSpans()),
    ("causal_or_document", lambda n: rx.Causal() | rx.Document()),
]
# The BlockSparse masks, named so that they can be told apart: their map is a table
# looked up per token pair, which the Pallas kernels lower only through the mask's
# tile-local form (per-tile entries, `AbstractMask.tile_local`).
BLOCK_SPARSE = [name for name, _ in MASKS if "block_sparse" in name]

RING_SHARDS = 4
# Tokens per shard: 2.15 query tiles of Mosaic's default 512 and 1.07 key tiles of 1024
# (8.6 x 17.2 of Triton's 128 x 64).
RING_SEQ = RING_SHARDS * 1100
# (name, RingConfig or None): K/V as they are, and compressed on the wire.
WIRES = [
    ("plain", None),
    ("bf16_wire", rx.RingConfig(compression_dtype=jnp.bfloat16)),
    ("fp8_wire", rx.RingConfig(compression_dtype=jnp.float8_e4m3fn)),
]
# Bits the compressed K/V travel as (bitcast, so that XLA cannot move the cast).
_WIRE_BITS = {"bf16_wire": "u16", "fp8_wire": "u8"}

# Each platform's Pallas calls in the scheduled HLO, and where a call's kernel name is:
# a Mosaic call is named after its kernel (`%ringeqx_tpu_flash_forward.3 = ...`), a
# Triton call is a `%pallas_call.N` whose backend config names the kernel.
_KERNEL_CALLS = {
    "tpu": (
        re.compile(r'custom_call_target="tpu_custom_call"'),
        # The instruction's name, with XLA's suffixes: `.3`, and on JAX 0.12 also the
        # output's, `ringeqx_tpu_flash_backward_dq.2.refs_10_`.
        re.compile(r"%(ringeqx_tpu_flash_[a-z_]*[a-z])[\w.]* ="),
    ),
    "gpu": (
        re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"'),
        re.compile(r'\bname = "(ringeqx_gpu_flash_\w+)"'),
    ),
}


# The Pallas kernels of the ring on each platform: Mosaic's backward is one fused kernel,
# Triton's two (dQ, then dK/dV).
KERNEL_PARTS = {
    "tpu": ("forward", "backward"),
    "gpu": ("forward", "backward_dq", "backward_dkv"),
}


def kernel_names(platform: str) -> set[str]:
    """The Pallas kernels of the ring on `platform` ("tpu" or "gpu")."""
    return {f"ringeqx_{platform}_flash_{part}" for part in KERNEL_PARTS[platform]}


def all_kernel_calls(text: str, platform: str) -> list[str]:
    """Every Pallas call of `platform` in the compiled `text`, as a line of HLO."""
    target, _ = _KERNEL_CALLS[platform]
    return [line for line in text.splitlines() if target.search(line)]


def kernel_calls(text: str, scope: str, platform: str) -> list[str]:
    """The Pallas calls (their kernel names) under `jax.named_scope(scope)`, forward
    (`jvp(scope)`) and backward (`transpose(jvp(scope))`) alike."""
    _, name = _KERNEL_CALLS[platform]
    under = re.compile(rf'op_name="[^"]*[/(]{scope}[)/]')
    return [name.search(line).group(1) for line in all_kernel_calls(text, platform)
            if under.search(line)]


def ring_masks(leave_out=()) -> list:
    """`MASKS` less the masks named in `leave_out`."""
    return [(name, make) for name, make in MASKS if name not in leave_out]


class RingCase(NamedTuple):
    name: str
    dtype: Any
    head_dim: int
    heads: int
    kv_heads: int
    mask: rx.AbstractMask
    mod: Any
    sinks: Any
    zigzag: bool
    wire: str
    config: rx.RingConfig | None


def ring_cases(masks, shapes) -> list[RingCase]:
    """Every mask of `masks` and every `(dtype, head_dim, heads, kv_heads)` of `shapes`
    at least once (the longer list sets the count); the modifiers, sinks, layouts and
    wires dealt round them, so that each of those appears with several masks."""
    count = max(len(masks), len(shapes), len(WIRES) * 2)
    cases = []
    for n in range(count):
        mask_name, make_mask = masks[n % len(masks)]
        dtype, d, h, kh = shapes[n % len(shapes)]
        mod_name, make_mod = SCORE_MODS[n % len(SCORE_MODS)]
        sinks_name, make_sinks = SINKS[(n // 2) % len(SINKS)]
        wire_name, config = WIRES[n % len(WIRES)]
        zigzag = (n // 4) % 2 == 1
        name = "-".join(
            [mask_name, mod_name, sinks_name, wire_name, "zigzag" if zigzag else "contiguous"]
            + [jnp.dtype(dtype).name, f"d{d}", f"{h}x{kh}"]
        )
        cases.append(
            RingCase(name, dtype, d, h, kh, make_mask(RING_SEQ), make_mod(h), make_sinks(h),
                     zigzag, wire_name, config)
        )
    return cases


def compile_ring(mesh, cases: list[RingCase]) -> str:
    """Compile `jax.value_and_grad` of the sum of every case's ring attention on `mesh`
    (`kernel="auto"`: the mesh's platform picks the kernel), check it and return the
    compiled text."""
    assert mesh.shape == {"sequence": RING_SHARDS}
    platform = mesh_device_type(mesh)
    sharded = NamedSharding(mesh, P(None, "sequence"))
    segments = packed_segments(RING_SEQ, [700, 1900, 300, 1500])[None]
    spans = span_ids(RING_SEQ)[None]
    zigzag = rx.Zigzag().layout(RING_SEQ, RING_SHARDS, segment_ids=segments, span_ids=spans)

    def attend(case, q, k, v, sinks):
        ids = {"layout": zigzag, "order": "layout"} if case.zigzag else {
            "segment_ids": segments, "span_ids": spans
        }
        out = rx.ring_attention(
            q, k, v, mask=case.mask, mesh=mesh, config=case.config, score_mod=case.mod,
            sinks=sinks, **ids,
        )
        return out.astype(jnp.float32).sum()

    def loss(args):
        total = 0.0
        for n, (q, k, v, sinks) in enumerate(args):
            with jax.named_scope(f"ring{n}"):
                total = total + attend(cases[n], q, k, v, sinks)
        return total

    def program(args):
        return jax.value_and_grad(loss)(args)

    args = [
        (
            jax.ShapeDtypeStruct((1, RING_SEQ, c.heads, c.head_dim), c.dtype, sharding=sharded),
            jax.ShapeDtypeStruct((1, RING_SEQ, c.kv_heads, c.head_dim), c.dtype,
                                 sharding=sharded),
            jax.ShapeDtypeStruct((1, RING_SEQ, c.kv_heads, c.head_dim), c.dtype,
                                 sharding=sharded),
            c.sinks,
        )
        for c in cases
    ]
    text = jax.jit(program).lower(args).compile().as_text()
    # Nothing gathers the sequence: K/V, their records and dK/dV only pass round the
    # ring (the sinks' gradient is the one all-reduce).
    assert "all-gather" not in text
    assert "collective-permute" in text
    found = 0
    for n, case in enumerate(cases):
        calls = kernel_calls(text, f"ring{n}", platform)
        # Each kernel at least once: inside the ring's loop, and (for the device's own
        # block) before it.
        assert set(calls) == kernel_names(platform), (case.name, calls)
        assert len(calls) >= 3, case.name
        found += len(calls)
    # Every Pallas call of the program is one of the cases' kernels.
    assert found == len(all_kernel_calls(text, platform))
    # The compressed wires travel as bits (the check is per program: a permute's op name
    # does not always keep its case's scope).
    # Scheduled HLO: the ring's permutes are async (`collective-permute-start/-done`).
    permutes = [line for line in text.splitlines() if "collective-permute" in line]
    for wire, bits in _WIRE_BITS.items():
        if any(c.wire == wire and not (wire == "bf16_wire" and c.dtype == jnp.bfloat16)
               for c in cases):
            assert any(f"{bits}[" in line for line in permutes), wire
    return text


# ----------------------------------------------------------------------------------
# Trainable modifiers and biases.


def compile_trainable(mesh, *, seq: int = RING_SEQ, head_dim: int = 128) -> str:
    """Compile `jax.grad` of a ring loss over q, k, v *and* trainable score-modifier
    leaves (ALiBi slopes, a softcap given as an array) on `mesh` (`kernel="auto"`;
    `bias=`, a table looked up by key position, is a gather that neither Triton nor
    Mosaic lowers, and the Pallas kernels refuse it when traced), in bfloat16 with GQA
    4:1 and `Causal & Document`; check that the Pallas kernels and the modifier's
    gradient pass are both in the scheduled HLO and that nothing gathers the sequence;
    return the compiled text."""
    platform = mesh_device_type(mesh)
    heads, kv_heads = 4, 1
    sharded = NamedSharding(mesh, P(None, "sequence"))
    segments = packed_segments(seq, [seq // 3, seq // 2, seq])[None]

    def loss(q, k, v, params):
        mod = rx.Chain(rx.ALiBi(params["slopes"]), rx.Softcap(params["cap"]))
        out = rx.ring_attention(
            q, k, v, mask=rx.Causal() & rx.Document(), segment_ids=segments, mesh=mesh,
            score_mod=mod,
        )
        return out.astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.bfloat16, sharding=sharded)
    params = dict(
        slopes=jax.ShapeDtypeStruct((heads,), jnp.float32),
        cap=jax.ShapeDtypeStruct((), jnp.float32),
    )
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = grad.lower(q, kv, kv, params).compile().as_text()
    assert "all-gather" not in text
    assert "collective-permute" in text
    assert {name.search(line).group(1) for line in all_kernel_calls(text, platform)
            for name in [_KERNEL_CALLS[platform][1]]} == kernel_names(platform)
    assert "ringeqx_score_mod_grads" in text
    return text
