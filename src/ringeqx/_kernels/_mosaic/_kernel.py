"""`PallasTpuKernel`: flash attention as Pallas (Mosaic TPU) kernels, forward and
backward."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..._layout._tokens import TokenInfo
from ..._util._numbers import as_int
from .._base import AbstractAttentionKernel, Scores
from .._pallas import _checks as checks, _common as common, _tiles as tiles
from ._bodies import LANES, SUBLANES, lanes
from ._calls import (
    Call,
    QuerySplit,
    backward_call,
    dq_row_tiles,
    forward_call,
    k_records,
    q_records,
    tile_plan,
)


_DTYPES = ("bfloat16", "float32")


def _head_dim_ok(d: int) -> bool:
    return d == 64 or (d > 0 and d % LANES == 0)


_HEAD_DIMS = "64 or a multiple of 128"



def _key_tile(block_kv: int, compute: int | None, length: int) -> int:
    """The key tile for `length` keys: as few tiles as `block_kv` allows, each as short
    as whole pieces of `compute` columns (or of 128, for a tile of one piece) make it,
    so that a sequence just past a tile is not padded by a whole wide tile (5000 keys
    in tiles of 4096 computed 1024 at a time: two tiles of 3072, not of 4096)."""
    tiles_needed = -(-length // block_kv)
    per_tile = -(-length // tiles_needed)
    unit = compute if compute is not None and per_tile > compute else LANES
    return min(block_kv, tiles.round_up(per_tile, unit))


class PallasTpuKernel(AbstractAttentionKernel):
    """Flash attention written in Pallas for TPUs (Mosaic).

    The grid runs over (batch, query head, query tile, key tile), the key tiles
    innermost and sequential, with the running max, sum and output accumulator in VMEM
    scratch. A table of which tile pairs run (the mask's block rule, computed before
    the kernel) is prefetched into SMEM, so the skip test of a tile is one scalar load;
    and the index maps of a skipped tile point at the K/V block already in VMEM (in the
    backward, the Q-side block), so a skipped tile costs no copy (splash attention's
    trick). Per-head modifier parameters (ALiBi slopes) reach each program through its
    block spec. The backward is one fused kernel over
    (batch, kv head, key tile, query head of the group, query tile): each pair of tiles'
    probabilities and logit gradients are computed once for dQ, dK and dV (5 matmuls a
    pair, where separate dQ and dK/dV kernels take 7); dK and dV accumulate over the
    last two axes (GQA without copying K/V heads), dQ in VMEM over the key tiles, for
    as many query rows as `_DQ_VMEM` holds a call (longer shards run as several calls,
    dK and dV carried). Token records travel broadcast to full vregs (queries along lanes, keys
    along sublanes), as in JAX's own TPU flash attention.

    **Arguments:**

    - `block_q`: query tile (static), a multiple of 8.
    - `block_kv`: key tile (static), a multiple of 128.
    - `interpret`: run in the Pallas interpreter (any backend; for tests on the CPU).
    - `block_kv_compute`: key columns computed at a time within a `block_kv` tile
      (static; a multiple of 128 dividing `block_kv`), or None (or at least `block_kv`)
      for the whole tile: the tile is copied in one DMA, its scores computed in smaller
      pieces, each piece on its own branch of the tile table (skipped where nobody
      attends, unmasked where all do), so a wide tile costs fewer grid steps and no
      more work.
    - `backward_block_kv`, `backward_block_kv_compute`: the same for the fused
      backward (static); `backward_block_kv=None` runs it on the forward's tiles (both
      of them). Its float32 dK and dV accumulators and four score-sized tiles make
      other tiles best there.

    Tiles (as shrunk to the sequence) whose kernels need more than Mosaic's default
    scoped VMEM (16 MiB on v5e and v5p), such as the defaults, ask Mosaic for 64 MiB;
    tiles that would need more than 56 MiB are an error when traced. At head_dims past
    128 the key tiles copied hold no more elements than the defaults' at 128 (head_dim
    256: 2048 keys forward, 1024 backward; a v5e ran 4096 there 1.5x slower).

    Supports bfloat16 and float32 and head_dim 64 or a multiple of 128, on a TPU or with
    `interpret=True`. Sequences are padded to whole tiles, the padding masked. The tile
    tables grow with query tiles x key tiles; where a shard's would overflow SMEM (1 MiB,
    about 240K tokens a shard with the default tiles), each kernel runs as several calls
    over runs of query tiles, each writing its rows of the same outputs (dK and dV
    accumulated across them), so a shard's length is bounded by HBM alone.
    `BlockSparse` (alone or combined) runs from per-tile windows of its map, prefetched
    into SMEM with the tile table (`AbstractMask.tile_local`), exact when traced where
    the records' runs (`TokenInfo.runs`, from the layout) bound every tile; elsewhere
    a tile whose window is inexact is a run-time error, never a wrong answer. Other
    masks that look a table up per token pair (a `gather`) are refused when traced. On
    a machine without a TPU the kernel still traces, so a program can be exported for
    `"tpu"` with `jax.export`; lowering it for any other platform is an error that
    names the platform.

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

    # The defaults are a v5e chip's best (benchmarks/LOG.md, issue 43): wide key
    # tiles, few grid steps; the backward's narrower, for its float32 dK/dV.
    block_q: int = eqx.field(static=True, default=1024, converter=as_int)
    block_kv: int = eqx.field(static=True, default=4096, converter=as_int)
    interpret: bool = eqx.field(static=True, default=False)
    block_kv_compute: int | None = eqx.field(static=True, default=1024)
    backward_block_kv: int | None = eqx.field(static=True, default=2048)
    backward_block_kv_compute: int | None = eqx.field(static=True, default=512)

    def tile_candidates(self) -> list[tuple[int, int]]:
        return [(256, 512), (512, 512), (512, 1024), (1024, 1024)]

    def __check_init__(self):
        for name, multiple in (("block_q", SUBLANES), ("block_kv", LANES)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < multiple or value % multiple != 0:
                raise ValueError(
                    f"PallasTpuKernel `{name}` must be a positive multiple of "
                    f"{multiple} (TPU vreg tiles); got {value!r}."
                )
        backward = self.backward_block_kv
        if backward is not None and (
            not isinstance(backward, int) or backward < LANES or backward % LANES != 0
        ):
            raise ValueError(
                f"PallasTpuKernel `backward_block_kv` must be None or a positive multiple "
                f"of {LANES} (TPU vreg tiles); got {backward!r}."
            )
        for name, tile in (
            ("block_kv_compute", "block_kv"),
            ("backward_block_kv_compute", "backward_block_kv"),
        ):
            compute, block_kv = getattr(self, name), getattr(self, tile)
            if block_kv is None:  # the backward runs on the forward's tiles
                continue
            # At least the tile: the tile is computed whole.
            if compute is not None and (
                not isinstance(compute, int)
                or compute < LANES
                or compute % LANES != 0
                or (compute < block_kv and block_kv % compute != 0)
            ):
                raise ValueError(
                    f"PallasTpuKernel `{name}` must be None or a positive multiple of "
                    f"{LANES} that divides `{tile}`={block_kv} (or is at least it); got "
                    f"{compute!r}."
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
        return frozenset({"cpu", "gpu", "tpu"} if self.interpret else {"tpu"})

    def _check(self, q, k, v, mask, score_mod) -> Array:
        """Trace-time checks; returns `q` behind the lowering-time platform check."""
        checks.check_inputs(
            "PallasTpuKernel", q, k, v, _DTYPES, _head_dim_ok, _HEAD_DIMS
        )
        if self.interpret:
            return q
        checks.check_lowerable(mask, score_mod, "PallasTpuKernel", "TPU", "Mosaic")
        return checks.platform_check(q, "PallasTpuKernel", ("tpu",), "TPU", "Mosaic")

    def _key_tiles(self, backward: bool) -> tuple[int, int | None]:
        """`(block_kv, block_kv_compute)` of the forward or the backward."""
        if backward and self.backward_block_kv is not None:
            return self.backward_block_kv, self.backward_block_kv_compute
        return self.block_kv, self.block_kv_compute

    def _key_tile_cap(self, head_dim: int, backward: bool) -> int:
        """The widest key tile the kernel copies at `head_dim`: the default's width at
        head_dim 128 (4096 keys forward, 2048 backward), in elements. At head_dim 256 a
        v5e ran the forward's 4096 keys 1.5x slower than 2048 (the copies of K and V
        no longer hide behind the matmuls)."""
        widest = PallasTpuKernel()._key_tiles(backward)[0] * 128 // head_dim
        return max(LANES, widest // LANES * LANES)

    def _compute(self, t: common.Tiling, backward: bool = False) -> int:
        """The key columns computed at a time in a tile of `t` (`block_kv_compute`, at
        most the tile as shrunk to the sequence)."""
        compute = self._key_tiles(backward)[1]
        if compute is None or compute >= t.block_kv or t.block_kv % compute != 0:
            return t.block_kv
        return compute

    def _tiling(self, q: Array, k: Array, backward: bool = False) -> common.Tiling:
        q_len, kv_len = q.shape[2], k.shape[2]
        block_q = min(self.block_q, tiles.round_up(q_len, SUBLANES))
        block_kv, compute = self._key_tiles(backward)
        cap = self._key_tile_cap(q.shape[3], backward)
        if compute is not None and compute < block_kv:
            cap = max(compute, cap // compute * compute)  # whole pieces
        block_kv = min(block_kv, cap)
        return common.tiling(q, k, block_q, _key_tile(block_kv, compute, kv_len))

    def _table(self, t: common.Tiling, scores: Scores, q_info, kv_info, backward: bool):
        """The tile table of tiles `t` (with its key chunks' branches) and the operands."""
        compute = self._compute(t, backward)
        table, local = common.tile_mask(
            t, scores.mask, q_info, kv_info, compute if compute < t.block_kv else None
        )
        ops = common.operands(table, local, scores.score_mod, t.heads, scores.scale)
        return table, ops

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
        tilings = [self._tiling(q, k)] + ([self._tiling(q, k, True)] if backward else [])
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
        return common.first_order("PallasTpuKernel", self._forward, *args)

    def _forward(self, q, k, v, q_info, kv_info, scores):
        q = self._check(q, k, v, scores.mask, scores.score_mod)
        with jax.named_scope("ringeqx_pallas_tpu_forward"):
            t = self._tiling(q, k)
            table, ops = self._table(t, scores, q_info, kv_info, backward=False)
            split = QuerySplit.of(t, table.shape[-1])
            qp, kp, vp = common.pad_qkv(t, q, k, v)
            inputs = (
                qp,
                kp,
                vp,
                q_records(q_info, t.q_padded),
                k_records(kv_info, t.kv_padded),
            )

            def call(tc, table_c, part):
                c = Call(
                    tc, "forward", tile_plan(table_c), inputs, ops, part, self.interpret,
                    self._compute(t), PallasTpuKernel,
                )
                return forward_call(c)

            out, lse = split.run(table, call)
            return out[:, :, : t.q_len], lse[:, :, : t.q_len, 0]

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
        return common.first_order("PallasTpuKernel", self._backward, *args)

    def _backward(self, q, k, v, lse, delta, d_out, q_info, kv_info, scores):
        q = self._check(q, k, v, scores.mask, scores.score_mod)
        with jax.named_scope("ringeqx_pallas_tpu_backward"):
            t = self._tiling(q, k, backward=True)
            table, ops = self._table(t, scores, q_info, kv_info, backward=True)
            split = QuerySplit.of(t, table.shape[-1], dq_row_tiles(t))
            qp, kp, vp = common.pad_qkv(t, q, k, v)
            dop, lse_p, delta_p = common.pad_rows(t, q, d_out, lse, delta)
            inputs = (
                qp,
                kp,
                vp,
                dop,
                lanes(lse_p[..., None]),
                lanes(delta_p[..., None]),
                q_records(q_info, t.q_padded),
                k_records(kv_info, t.kv_padded),
            )
            dq_parts = []

            def call(tc, table_c, part):
                # dK/dV add to dK and dV so far; dQ is this call's rows.
                plan = tile_plan(jnp.swapaxes(table_c, 1, 2))
                dk, dv, dq = backward_call(
                    Call(tc, "backward", plan, inputs, ops, part, self.interpret,
                          self._compute(t, backward=True), PallasTpuKernel)
                )
                dq_parts.append(dq)
                return dk, dv

            dk, dv = split.run(table, call)
            dq = dq_parts[0] if len(dq_parts) == 1 else jnp.concatenate(dq_parts, axis=2)
            return common.trim_grads(t, dq, dk, dv)
