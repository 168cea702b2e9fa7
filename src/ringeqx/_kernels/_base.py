"""The contract every per-device attention kernel meets."""

import abc
from typing import Any

import equinox as eqx
from jaxtyping import Array, Bool, Float

from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._score_mods import AbstractScoreMod


class Scores(eqx.Module):
    """How a kernel forms the logits of a block, one argument of its `forward` and
    `backward`: `scale * q . k`, then the score modifier, then the mask.

    **Fields:**

    - `mask`: the [`ringeqx.AbstractMask`][] whose rules the kernel evaluates on the
        token records it loads (pairs it rules out get no weight).
    - `score_mod`: an optional [`ringeqx.AbstractScoreMod`][] applied to the scaled
        logits.
    - `scale`: the logit scale (a static Python float).
    """

    mask: AbstractMask
    score_mod: AbstractScoreMod | None
    scale: float = eqx.field(static=True)


class AbstractAttentionKernel(eqx.Module):
    """Attention of one block of queries against one block of keys, on one device.

    The ring calls `forward` once per step and merges the partial results by their
    log-sum-exp; its backward calls `backward` once per step with the *global* lse, so the
    steps are independent (Flash Attention 2). Arrays are heads-major:

    - `q`: `[batch, heads, q_len, head_dim]`; `k`, `v`: `[batch, kv_heads, kv_len,
      head_dim]`; query head `h` reads key/value head `h // (heads // kv_heads)`, with no
      copies of K/V heads.
    - `q_info`, `kv_info`: token records `[batch, q_len]` and `[batch, kv_len]`; pairs with
      an invalid (padding) token never attend.
    - `scores`: the mask, the score modifier and the scale, as one [`ringeqx.Scores`][].

    Every kernel works in `block_q x block_kv` tiles (static fields of the concrete
    kernel), which [`ringeqx.tools.schedule`][] counts and [`ringeqx.tune_block_sizes`][]
    tunes; `interpret` is a static field of the Pallas kernels. `PallasGpuKernel`'s
    tiles may be None: chosen per call from its tuned table, by dtype and head_dim.
    Whoever needs the numbers (the planner, the schedule) asks `tiles`, so that each
    kernel's defaults are written once, in its own file.
    """

    block_q: eqx.AbstractVar[int]
    block_kv: eqx.AbstractVar[int]

    def tiles(self, dtype: Any, head_dim: int) -> tuple[int, int]:
        """The forward's `(block_q, block_kv)` on inputs of `dtype` and `head_dim`,
        before they shrink to a shorter sequence: the fields (this default, so that a
        user's kernel written before this method needs nothing new), or where the kernel
        leaves them to a table (`PallasGpuKernel`), the table's entry. A kernel may
        narrow its key tile further inside where it copies tiles in pieces
        (`PallasTpuKernel` past head_dim 128); the planner and the schedule count these
        tiles."""
        return self.block_q, self.block_kv

    def unsupported_head_dim(self, head_dim: int) -> str | None:
        """None where the kernel takes heads `head_dim` wide; else a description of the
        head dims it does take, for a planner to refuse before it plans. The default
        None is right for a kernel that takes every width (`XlaKernel`); the Pallas
        kernels override it."""
        return None

    def unsupported_dtype(self, dtype: str) -> str | None:
        """None where the kernel takes q/k/v of `dtype` (a name); else the dtypes it
        takes, for a planner to refuse before it compiles. The default None is right for
        a kernel that takes every floating dtype (`XlaKernel`); the Pallas kernels
        override it."""
        return None

    @abc.abstractmethod
    def tile_candidates(self) -> list[tuple[int, int]]:
        """The `(block_q, block_kv)` pairs that [`ringeqx.tune_block_sizes`][] tries by
        default: tiles this kernel accepts and that suit its device (a kernel whose tiles
        cannot be tuned returns `[(self.block_q, self.block_kv)]`)."""

    @abc.abstractmethod
    def devices(self) -> frozenset[str]:
        """The device types (`"cpu"`, `"gpu"`, `"tpu"`) this kernel runs on.

        [`ringeqx.select_kernel`][] checks it against an explicit `device_type`. With
        `device_type="auto"` the platform is only known when the program is lowered (it
        may be exported for another platform), so a kernel that compiles for one
        platform also checks, when it is lowered, that it is lowered for that platform.
        """

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
        """The check of these records that `forward` (or, with `backward=True`,
        `backward`) makes at run time, if it makes one.

        A kernel that cannot tell when traced whether it computes every pair of the
        records exactly (a Pallas kernel's tile-local `BlockSparse` map on records
        without runs) checks them at run time (`eqx.error_if`) rather than answer
        wrongly. Inside a ring, a check that fails on some devices only would leave the
        others waiting in their next transfer, so the ring makes this check first,
        outside its per-step branch, and raises `message` on every device together when
        `flag` is True on any of them.

        **Returns:** None where no run-time check is made (decided when traced), else
        `(flag, message)`: `flag` True where the kernel's own check would fail. The
        default returns None, right for a kernel that makes no run-time check (the
        Pallas kernels override it).
        """
        return None

    @abc.abstractmethod
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
        """Softmax attention of `q` over this block of keys.

        **Returns:** `(out, lse)`, both float32: `out` normalised over this block only and
        `lse` the natural-log sum of exponentiated logits. Rows that see no key give
        `out = 0` and `lse = -inf`.
        """

    @abc.abstractmethod
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
        """Gradients of this block's share of the global attention.

        **Arguments:** `lse` is the *global* log-sum-exp of each query row (over all keys of
        the whole ring), and `delta = rowsum(d_out * out) - d_lse` with the global `out`
        (computed once by the ring; `d_lse` is the cotangent of the lse when a caller uses
        it, for example attention sinks).

        **Returns:** `(dq, dk, dv)` in float32; `dq` is this block's contribution only.
        """
