"""`PallasGpuKernel`: flash attention as Pallas (Triton) kernels, forward and backward."""

from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float

from ..._layout._tokens import TokenInfo
from ..._util._numbers import as_int
from .._base import AbstractAttentionKernel, Scores
from .._pallas import _checks as checks, _common as common, _tiles as tiles
from ._calls import backward_inputs, dkv_call, dq_call, forward_call, run_table


_DTYPES = ("float16", "bfloat16", "float32")

Kind = Literal["forward", "dq", "dkv"]


class _Launch(NamedTuple):
    """The tiles and Triton launch parameters of one kernel call."""

    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int


def _kinds(
    forward: _Launch, dq: _Launch, dkv: _Launch
) -> "MappingProxyType[Kind, _Launch]":
    return MappingProxyType({"forward": forward, "dq": dq, "dkv": dkv})


_L = _Launch
# The default `(block_q, block_kv, num_warps, num_stages)` per (bits of the dtype,
# head_dim) and kernel, read from ptxas on what XLA compiles for A100 (sm_80) and H100
# (sm_90) (`aot/test_gpu_matrix.py`; the sweep is in benchmarks/LOG.md). For 16 bits:
# the largest tiles with which no kernel spills on either, under the heaviest mask and
# modifier (`Causal() & Document()` with ALiBi, GQA 4:1 and 1:1) and eight other
# mask/modifier pairs; between equal areas, the one with registers to spare (at head_dim
# 256 the forward's 64 x 16 uses all 255 on A100 and spills 4 bytes in float16 under
# `SlidingWindow` with `Softcap`; 32 x 32 uses 182 at most). Eight warps throughout:
# with four most of these tiles spill or use all 255 registers, sixteen cap a thread at
# 128 and spill; ptxas reports the same registers and spills for 1, 2 and 3 stages. In
# dK/dV `block_kv` is the tile a program holds (two float32 accumulators of it) and
# `block_q` the one it loops over; A100 spills there with key tiles above 32 at head_dim
# 64. Head dims below 64 take 64's row.
_TUNED = MappingProxyType(
    {
        (16, 64): _kinds(_L(128, 32, 8, 2), _L(128, 32, 8, 2), _L(64, 32, 8, 2)),
        (16, 128): _kinds(_L(64, 64, 8, 2), _L(64, 32, 8, 2), _L(32, 64, 8, 2)),
        (16, 256): _kinds(_L(32, 32, 8, 2), _L(32, 32, 8, 2), _L(16, 32, 8, 2)),
        # float32: the tiles that spill least of those tried. dK/dV still spills: up to
        # 3.3 KB at head_dim 256 (every tile tried spills there; 32 x 16 spills 500
        # bytes under the heavy mask but 10 KB under plain Causal), and up to 108 bytes
        # at 64 and 128.
        (32, 64): _kinds(_L(64, 32, 8, 2), _L(32, 64, 8, 2), _L(64, 32, 8, 2)),
        (32, 128): _kinds(_L(64, 32, 8, 2), _L(32, 64, 8, 2), _L(32, 32, 8, 2)),
        (32, 256): _kinds(_L(32, 32, 8, 2), _L(32, 32, 8, 2), _L(16, 16, 8, 2)),
    }
)
# Tiles for `tune_block_sizes` to try: the tuned ones.
_CANDIDATES = sorted(
    {(x.block_q, x.block_kv) for kinds in _TUNED.values() for x in kinds.values()}
)


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def _head_dim_ok(d: int) -> bool:
    return _power_of_two(d) and 16 <= d <= 256


_HEAD_DIMS = "a power of two from 16 to 256"


def _block(block: int, length: int) -> int:
    """The tile actually used: `block`, or the smallest power of two (>= 16, Triton's
    smallest matmul) covering a shorter sequence."""
    return min(block, max(16, 1 << (length - 1).bit_length()))



class PallasGpuKernel(AbstractAttentionKernel):
    """Flash attention written in Pallas for GPUs (Triton).

    The forward runs one program per (batch, query head, query tile) and loops over the
    key tiles, keeping the running max, sum and output in registers. The backward is the
    usual split: a dK/dV kernel with one program per (batch, key/value head, key tile)
    that loops over the query tiles of every query head in its GQA group (so K/V heads
    are never copied and dK/dV need no reduction afterwards), and a dQ kernel shaped
    like the forward. All three read the token records of their tiles, apply the mask's
    elementwise rule and the score modifier on the loaded values, and skip tiles that
    the mask's block rule rules out (a table of which tile pairs run, computed before
    the kernels). Per-head modifier parameters (ALiBi slopes) reach each program through
    its block spec.

    `BlockSparse` (alone or combined) runs from per-tile windows of its map, read from
    each program's row of the tile table (`AbstractMask.tile_local`); a layout that
    puts positions too far apart in one tile for that window is a run-time error,
    never a wrong answer. Other masks that look a table up per token pair (a `gather`)
    are refused when traced. On a machine without a GPU the kernel still traces, so a
    program can be exported for `"cuda"` with `jax.export`; lowering it for any other
    platform is an error that names the platform.

    **Tiles.** A Triton program keeps its tiles in registers, and one that does not fit
    spills them to local memory (through L1/L2). By default (fields left None)
    each kernel takes its tiles and warps from a table by dtype and head_dim, measured
    with `ptxas` on what XLA compiles for A100 (sm_80) and H100 (sm_90)
    (`aot/test_gpu_matrix.py`): for bfloat16 and float16 the largest tiles tried with
    which no kernel spills a register on either, under the heaviest mask and modifier
    (`Causal() & Document()` with ALiBi, GQA 4:1 and 1:1) and eight other pairs, with
    registers to spare where two tiles tie. `block_q x block_kv`, all with 8 warps and
    2 stages:

    | dtype | head_dim | forward | dQ | dK/dV |
    |---|---|---|---|---|
    | 16-bit | <= 64 | 128 x 32 | 128 x 32 | 64 x 32 |
    | 16-bit | 128 | 64 x 64 | 64 x 32 | 32 x 64 |
    | 16-bit | 256 | 32 x 32 | 32 x 32 | 16 x 32 |
    | float32 | <= 64 | 64 x 32 | 32 x 64 | 64 x 32 |
    | float32 | 128 | 64 x 32 | 32 x 64 | 32 x 32 |
    | float32 | 256 | 32 x 32 | 32 x 32 | 16 x 16 |

    float32 takes the tiles that spill least of those tried; its dK/dV still spills,
    up to 3.3 KB at head_dim 256 (with every tile tried) and 108 bytes below.

    The dK/dV program holds its key tile (`block_kv`, with two float32 accumulators of
    it) and loops over query tiles; the forward and dQ programs hold a query tile. A
    field that is set is used for all three kernels, the others still come from the
    table: `PallasGpuKernel(block_q=64, block_kv=64)` keeps the table's warps.
    `launch(kind, dtype, head_dim)` says what a kernel will use.

    **Arguments:**

    - `block_q`, `block_kv`: tile sizes (static), powers of two >= 16, or None (the
        table). Sequences are padded to whole tiles, the padding masked; a tile longer
        than a sequence shrinks to it.
    - `num_warps`, `num_stages`: Triton launch parameters, or None (the table).
    - `interpret`: run in the Pallas interpreter (any backend; for tests on the CPU).

    Supports float16, bfloat16 and float32 and head_dim a power of two from 16 to 256,
    on a GPU or with `interpret=True`.

    ??? cite "Flash Attention 2"

        ```bibtex
        @article{dao2023flashattention2,
          title={FlashAttention-2: Faster Attention with Better Parallelism and Work
                 Partitioning},
          author={Dao, Tri},
          journal={arXiv:2307.08691},
          year={2023}
        }
        ```
    """

    # None is the tuned table; the base declares `int`, which these widen.
    block_q: int | None = eqx.field(static=True, default=None, converter=as_int)  # pyright: ignore
    block_kv: int | None = eqx.field(static=True, default=None, converter=as_int)  # pyright: ignore
    num_warps: int | None = eqx.field(static=True, default=None, converter=as_int)
    num_stages: int | None = eqx.field(static=True, default=None, converter=as_int)
    interpret: bool = eqx.field(static=True, default=False)

    def tile_candidates(self) -> list[tuple[int, int]]:
        # A Triton program holds its score tile in registers: small tiles (the tuned
        # ones, see `_TUNED`).
        return list(_CANDIDATES)

    def tiles(self, dtype: Any, head_dim: int) -> tuple[int, int]:
        return self.launch("forward", dtype, head_dim)[:2]

    def __check_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or value < 16 or not _power_of_two(value):
                raise ValueError(
                    f"PallasGpuKernel `{name}` must be a power of two >= 16 (Triton "
                    f"tiles); got {value!r}."
                )

    def unsupported_head_dim(self, head_dim: int) -> str | None:
        """None where the kernel takes heads `head_dim` wide; else a description of the
        head dims it does take, for a planner to refuse before it plans."""
        return None if _head_dim_ok(head_dim) else _HEAD_DIMS

    def unsupported_dtype(self, dtype: str) -> str | None:
        """None where the kernel takes q/k/v of `dtype` (a name); else the dtypes it
        takes, for a planner to refuse before it compiles."""
        return None if dtype in _DTYPES else ", ".join(_DTYPES)

    def devices(self) -> frozenset[str]:
        return frozenset({"cpu", "gpu", "tpu"} if self.interpret else {"gpu"})

    def _check(self, q, k, v, mask, score_mod) -> Array:
        """Trace-time checks; returns `q` behind the lowering-time platform check."""
        checks.check_inputs(
            "PallasGpuKernel",
            q,
            k,
            v,
            _DTYPES,
            _head_dim_ok,
            _HEAD_DIMS,
        )
        if self.interpret:
            return q
        checks.check_lowerable(mask, score_mod, "PallasGpuKernel", "GPU", "Triton")
        return checks.platform_check(
            q, "PallasGpuKernel", ("cuda", "rocm"), "GPU", "Triton"
        )

    def launch(self, kind: Kind, dtype: Any, head_dim: int) -> tuple[int, int, int, int]:
        """`(block_q, block_kv, num_warps, num_stages)` of the `kind` kernel
        (`"forward"`, `"dq"` or `"dkv"`) on inputs of `dtype` and `head_dim`: this
        kernel's fields, each None taken from the tuned table (tiles then shrink to a
        shorter sequence). `dtype` is float16, bfloat16 or float32."""
        bits = 8 * jnp.dtype(dtype).itemsize
        # Head dims below 64 hold less per thread than 64 does: its tiles fit them too.
        tuned = _TUNED[bits, max(head_dim, 64)][kind]
        mine = (self.block_q, self.block_kv, self.num_warps, self.num_stages)
        block_q, block_kv, warps, stages = (
            t if m is None else m for m, t in zip(mine, tuned)
        )
        return block_q, block_kv, warps, stages

    def _launch(self, kind: Kind, q: Array, k: Array) -> tuple[common.Tiling, Any]:
        """The tiling (tiles shrunk to short sequences) and the Triton parameters of
        the `kind` kernel on `q` and `k`."""
        block_q, block_kv, warps, stages = self.launch(kind, q.dtype, q.shape[-1])
        t = common.tiling(
            q, k, _block(block_q, q.shape[2]), _block(block_kv, k.shape[2])
        )
        return t, plgpu.CompilerParams(num_warps=warps, num_stages=stages)

    def runtime_check(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
        *,
        backward: bool,
    ) -> tuple[Bool[Array, ""], str] | None:
        kinds: tuple[Kind, ...] = ("dq", "dkv") if backward else ("forward",)
        tilings = [self._launch(kind, q, k)[0] for kind in kinds]
        return common.runtime_check(tilings, scores.mask, q_info, kv_info)

    def forward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"], Float[Array, "batch heads q_len"]
    ]:
        args = (q, k, v, q_info, kv_info, scores)
        return common.first_order("PallasGpuKernel", self._forward, *args)

    def _forward(self, q, k, v, q_info, kv_info, scores):
        mask, score_mod, scale = scores.mask, scores.score_mod, scores.scale
        q = self._check(q, k, v, mask, score_mod)
        with jax.named_scope("ringeqx_pallas_gpu_forward"):
            t, params = self._launch("forward", q, k)
            table, local = common.tile_mask(t, mask, q_info, kv_info)
            ops = common.operands(table, local, score_mod, t.heads, scale)
            run = run_table(table)
            inputs = (
                *common.pad_qkv(t, q, k, v),
                tiles.records(q_info, t.q_padded),
                tiles.records(kv_info, t.kv_padded),
                run,
            )
            out, lse = forward_call(t, ops, inputs, params, self.interpret)
            return out[:, :, : t.q_len], lse[:, :, : t.q_len]

    def backward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        lse: Float[Array, "batch heads q_len"],
        delta: Float[Array, "batch heads q_len"],
        d_out: Float[Array, "batch heads q_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        scores: Scores,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
    ]:
        args = (q, k, v, lse, delta, d_out, q_info, kv_info, scores)
        return common.first_order("PallasGpuKernel", self._backward, *args)

    def _backward(self, q, k, v, lse, delta, d_out, q_info, kv_info, scores):
        mask, score_mod, scale = scores.mask, scores.score_mod, scores.scale
        q = self._check(q, k, v, mask, score_mod)
        with jax.named_scope("ringeqx_pallas_gpu_backward"):
            # dQ and dK/dV each run on their own tiles (the dK/dV program holds two
            # accumulators of its key tile), so each pads the inputs to its tiles and
            # reads its own tile table.
            t, params = self._launch("dq", q, k)
            table, local = common.tile_mask(t, mask, q_info, kv_info)
            ops = common.operands(table, local, score_mod, t.heads, scale)
            inputs = backward_inputs(t, q, k, v, d_out, lse, delta, q_info, kv_info)
            dq = dq_call(t, ops, (*inputs, run_table(table)), params, self.interpret)
            t, params = self._launch("dkv", q, k)
            table, local = common.tile_mask(t, mask, q_info, kv_info)
            ops = common.operands(table, local, score_mod, t.heads, scale)
            inputs = backward_inputs(t, q, k, v, d_out, lse, delta, q_info, kv_info)
            run = run_table(jnp.swapaxes(table, 1, 2))
            dk, dv = dkv_call(t, ops, (*inputs, run), params, self.interpret)
            return common.trim_grads(t, dq, dk, dv)
