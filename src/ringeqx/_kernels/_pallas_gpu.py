"""`PallasGpuKernel`: flash attention as Pallas (Triton) kernels, forward and
backward."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from .._masks import AbstractMask
from .._score_mods import AbstractScoreMod
from .._tokens import BlockSummary, TokenInfo
from . import _pallas_tiles as tiles
from ._base import AbstractAttentionKernel


_DTYPES = ("float16", "bfloat16", "float32")


def _power_of_two(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def _head_dim_ok(d: int) -> bool:
    return _power_of_two(d) and 16 <= d <= 256


def _block(block: int, length: int) -> int:
    """The tile actually used: `block`, or the smallest power of two (>= 16, Triton's
    smallest matmul) covering a shorter sequence."""
    return min(block, max(16, 1 << (length - 1).bit_length()))


def _q_info(rows) -> TokenInfo:
    return tiles.token_info([r[:, None] for r in rows])


def _k_info(rows) -> TokenInfo:
    return tiles.token_info([r[None, :] for r in rows])


def _forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild,
    scale: float,
    block_kv: int,
    num_kv: int,
):
    *leaf_refs, o_ref, lse_ref = refs
    mask, score_mod = rebuild(leaf_refs)
    if score_mod is not None:
        score_mod = score_mod.for_head(pl.program_id(1))
    q = q_ref[...]
    qi = _q_info(q_rec_ref[...])
    qs = BlockSummary.of(qi)

    def body(j, acc):
        kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        ki = _k_info(k_rec_ref[:, kv])
        ks = BlockSummary.of(ki)

        def update(acc):
            s, _ = tiles.logits(q, k_ref[kv, :], qi, ki, score_mod, scale)
            return acc.update(s, tiles.allowed(mask, qi, ki), v_ref[kv, :])

        run = qs.any_valid & ks.any_valid & mask.may_attend(qs, ks)
        return jax.lax.cond(run, update, lambda acc: acc, acc)

    init = tiles.Softmax.init(q.shape[0], q.shape[1])
    out, lse = jax.lax.fori_loop(0, num_kv, body, init).finish()
    o_ref[...] = out
    lse_ref[...] = lse[:, 0]


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild,
    scale: float,
    block_kv: int,
    num_kv: int,
):
    *leaf_refs, dq_ref = refs
    mask, score_mod = rebuild(leaf_refs)
    if score_mod is not None:
        score_mod = score_mod.for_head(pl.program_id(1))
    q, d_out = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    qi = _q_info(q_rec_ref[...])
    qs = BlockSummary.of(qi)

    def body(j, dq):
        kv = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        ki = _k_info(k_rec_ref[:, kv])
        ks = BlockSummary.of(ki)

        def grads(dq):
            k = k_ref[kv, :]
            _, ds = tiles.tile_grads(
                q, k, v_ref[kv, :], d_out, lse, delta, qi, ki, mask, score_mod, scale
            )
            return dq + tiles.matmul(ds.astype(k.dtype), k)

        run = qs.any_valid & ks.any_valid & mask.may_attend(qs, ks)
        return jax.lax.cond(run, grads, lambda dq: dq, dq)

    dq_ref[...] = jax.lax.fori_loop(0, num_kv, body, jnp.zeros(q.shape, jnp.float32))


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    q_rec_ref,
    k_rec_ref,
    *refs,
    rebuild,
    scale: float,
    block_q: int,
    num_q: int,
    groups: int,
):
    *leaf_refs, dk_ref, dv_ref = refs
    mask, score_mod = rebuild(leaf_refs)
    # Read at the top level: the interpreter cannot see program ids inside loops.
    kv_head = pl.program_id(1)
    k, v = k_ref[...], v_ref[...]
    ki = _k_info(k_rec_ref[...])
    ks = BlockSummary.of(ki)

    def body(t, carry):
        # One loop over (query head of this kv head's group, query tile).
        g, i = t // num_q, t % num_q
        qb = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        qi = _q_info(q_rec_ref[:, qb])
        qs = BlockSummary.of(qi)

        def grads(carry):
            dk, dv = carry
            mod = score_mod
            if mod is not None:
                mod = mod.for_head(kv_head * groups + g)
            q, d_out = q_ref[g, qb, :], do_ref[g, qb, :]
            lse, delta = lse_ref[g, qb][:, None], delta_ref[g, qb][:, None]
            p, ds = tiles.tile_grads(
                q, k, v, d_out, lse, delta, qi, ki, mask, mod, scale
            )
            dv = dv + tiles.matmul_tn(p.astype(d_out.dtype), d_out)
            dk = dk + tiles.matmul_tn(ds.astype(q.dtype), q)
            return dk, dv

        run = qs.any_valid & ks.any_valid & mask.may_attend(qs, ks)
        return jax.lax.cond(run, grads, lambda c: c, carry)

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, groups * num_q, body, (zero, zero))
    dk_ref[...] = dk
    dv_ref[...] = dv


class PallasGpuKernel(AbstractAttentionKernel):
    """Flash attention written in Pallas for GPUs (Triton).

    The forward runs one program per (batch, query head, query tile) and loops over the
    key tiles, keeping the running max, sum and output in registers. The backward is the
    usual split: a dK/dV kernel with one program per (batch, key/value head, key tile)
    that loops over the query tiles of every query head in its GQA group (so K/V heads
    are never copied and dK/dV need no reduction afterwards), and a dQ kernel shaped
    like the forward. All three read the token records of their tiles, apply the mask's
    elementwise rule and the score modifier on the loaded values, and skip tiles that
    the mask's block rule rules out.

    **Arguments:**

    - `block_q`, `block_kv`: tile sizes (static), powers of two >= 16. Sequences are
        padded to whole tiles, the padding masked.
    - `num_warps`, `num_stages`: Triton launch parameters (None: 4 warps for head_dim
        <= 64, else 8; 2 stages).
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

    block_q: int = eqx.field(static=True, default=128)
    block_kv: int = eqx.field(static=True, default=64)
    num_warps: int | None = eqx.field(static=True, default=None)
    num_stages: int = eqx.field(static=True, default=2)
    interpret: bool = eqx.field(static=True, default=False)

    def tile_candidates(self) -> list[tuple[int, int]]:
        # A Triton program holds its score tile in registers: small tiles.
        return [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]

    def __check_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or not _power_of_two(value):
                raise ValueError(
                    f"PallasGpuKernel `{name}` must be a power of two >= 16 (Triton "
                    f"tiles); got {value!r}."
                )

    def _check(self, q, k, v) -> None:
        if not self.interpret and jax.default_backend() != "gpu":
            raise ValueError(
                "PallasGpuKernel(interpret=False) compiles with Triton and needs a "
                f"GPU; JAX's backend is {jax.default_backend()!r}. Pass interpret=True "
                "to run it in the Pallas interpreter, or use XlaKernel."
            )
        tiles.check_inputs(
            "PallasGpuKernel",
            q,
            k,
            v,
            _DTYPES,
            _head_dim_ok,
            "a power of two from 16 to 256",
        )

    def _params(self, head_dim: int):
        warps = self.num_warps
        if warps is None:
            warps = 4 if head_dim <= 64 else 8
        return plgpu.CompilerParams(num_warps=warps, num_stages=self.num_stages)

    def forward(
        self,
        q: Float[Array, "batch heads q_len head_dim"],
        k: Float[Array, "batch kv_heads kv_len head_dim"],
        v: Float[Array, "batch kv_heads kv_len head_dim"],
        q_info: TokenInfo,
        kv_info: TokenInfo,
        mask: AbstractMask,
        score_mod: AbstractScoreMod | None,
        scale: float,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"], Float[Array, "batch heads q_len"]
    ]:
        self._check(q, k, v)
        with jax.named_scope("ringeqx_pallas_gpu_forward"):
            b, h, q_len, d = q.shape
            kh, kv_len = k.shape[1], k.shape[2]
            g = h // kh
            bq, bk = _block(self.block_q, q_len), _block(self.block_kv, kv_len)
            lq, lk = tiles.round_up(q_len, bq), tiles.round_up(kv_len, bk)
            leaves, rebuild = tiles.split_operands(mask, score_mod)
            kernel = functools.partial(
                _forward_kernel,
                rebuild=rebuild,
                scale=scale,
                block_kv=bk,
                num_kv=lk // bk,
            )
            whole = tiles.whole_array_specs(leaves)
            out, lse = pl.pallas_call(
                kernel,
                grid=(b, h, lq // bq),
                in_specs=[
                    pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
                    pl.BlockSpec(
                        (None, None, lk, d), lambda b, h, i: (b, h // g, 0, 0)
                    ),
                    pl.BlockSpec(
                        (None, None, lk, d), lambda b, h, i: (b, h // g, 0, 0)
                    ),
                    pl.BlockSpec((None, 4, bq), lambda b, h, i: (b, 0, i)),
                    pl.BlockSpec((None, 4, lk), lambda b, h, i: (b, 0, 0)),
                    *whole,
                ],
                out_specs=[
                    pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
                    pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
                ],
                out_shape=[
                    jax.ShapeDtypeStruct((b, h, lq, d), jnp.float32),
                    jax.ShapeDtypeStruct((b, h, lq), jnp.float32),
                ],
                compiler_params=self._params(d),
                interpret=self.interpret,
                name="ringeqx_gpu_flash_forward",
            )(
                tiles.pad_axis(q, 2, lq),
                tiles.pad_axis(k, 2, lk),
                tiles.pad_axis(v, 2, lk),
                tiles.records(q_info, lq),
                tiles.records(kv_info, lk),
                *leaves,
            )
            return out[:, :, :q_len], lse[:, :, :q_len]

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
        mask: AbstractMask,
        score_mod: AbstractScoreMod | None,
        scale: float,
    ) -> tuple[
        Float[Array, "batch heads q_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
        Float[Array, "batch kv_heads kv_len head_dim"],
    ]:
        self._check(q, k, v)
        with jax.named_scope("ringeqx_pallas_gpu_backward"):
            b, h, q_len, d = q.shape
            kh, kv_len = k.shape[1], k.shape[2]
            g = h // kh
            bq, bk = _block(self.block_q, q_len), _block(self.block_kv, kv_len)
            lq, lk = tiles.round_up(q_len, bq), tiles.round_up(kv_len, bk)
            leaves, rebuild = tiles.split_operands(mask, score_mod)
            whole = tiles.whole_array_specs(leaves)
            lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
            qp, dop = (tiles.pad_axis(x, 2, lq) for x in (q, d_out.astype(q.dtype)))
            lse_p, delta_p = (tiles.pad_axis(x, 2, lq) for x in (lse, delta))
            kp, vp = (tiles.pad_axis(x, 2, lk) for x in (k, v))
            q_rec, k_rec = tiles.records(q_info, lq), tiles.records(kv_info, lk)
            inputs = (qp, kp, vp, dop, lse_p, delta_p, q_rec, k_rec, *leaves)

            dq = pl.pallas_call(
                functools.partial(
                    _dq_kernel,
                    rebuild=rebuild,
                    scale=scale,
                    block_kv=bk,
                    num_kv=lk // bk,
                ),
                grid=(b, h, lq // bq),
                in_specs=[
                    pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
                    pl.BlockSpec(
                        (None, None, lk, d), lambda b, h, i: (b, h // g, 0, 0)
                    ),
                    pl.BlockSpec(
                        (None, None, lk, d), lambda b, h, i: (b, h // g, 0, 0)
                    ),
                    pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0)),
                    pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
                    pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
                    pl.BlockSpec((None, 4, bq), lambda b, h, i: (b, 0, i)),
                    pl.BlockSpec((None, 4, lk), lambda b, h, i: (b, 0, 0)),
                    *whole,
                ],
                out_specs=pl.BlockSpec(
                    (None, None, bq, d), lambda b, h, i: (b, h, i, 0)
                ),
                out_shape=jax.ShapeDtypeStruct((b, h, lq, d), jnp.float32),
                compiler_params=self._params(d),
                interpret=self.interpret,
                name="ringeqx_gpu_flash_backward_dq",
            )(*inputs)

            # The query heads of kv head `j` are `j * g, ..., j * g + g - 1`: one block.
            dk, dv = pl.pallas_call(
                functools.partial(
                    _dkv_kernel,
                    rebuild=rebuild,
                    scale=scale,
                    block_q=bq,
                    num_q=lq // bq,
                    groups=g,
                ),
                grid=(b, kh, lk // bk),
                in_specs=[
                    pl.BlockSpec((None, g, lq, d), lambda b, j, t: (b, j, 0, 0)),
                    pl.BlockSpec((None, None, bk, d), lambda b, j, t: (b, j, t, 0)),
                    pl.BlockSpec((None, None, bk, d), lambda b, j, t: (b, j, t, 0)),
                    pl.BlockSpec((None, g, lq, d), lambda b, j, t: (b, j, 0, 0)),
                    pl.BlockSpec((None, g, lq), lambda b, j, t: (b, j, 0)),
                    pl.BlockSpec((None, g, lq), lambda b, j, t: (b, j, 0)),
                    pl.BlockSpec((None, 4, lq), lambda b, j, t: (b, 0, 0)),
                    pl.BlockSpec((None, 4, bk), lambda b, j, t: (b, 0, t)),
                    *whole,
                ],
                out_specs=[
                    pl.BlockSpec((None, None, bk, d), lambda b, j, t: (b, j, t, 0)),
                    pl.BlockSpec((None, None, bk, d), lambda b, j, t: (b, j, t, 0)),
                ],
                out_shape=[jax.ShapeDtypeStruct((b, kh, lk, d), jnp.float32)] * 2,
                compiler_params=self._params(d),
                interpret=self.interpret,
                name="ringeqx_gpu_flash_backward_dkv",
            )(*inputs)
            return dq[:, :, :q_len], dk[:, :, :kv_len], dv[:, :, :kv_len]
