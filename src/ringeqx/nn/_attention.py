"""`RingAttention`: multi-head (GQA) attention whose sequence is sharded over a ring."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._comm import RingConfig
from .._kernels._base import AbstractAttentionKernel
from .._kernels._select import DeviceType, KernelName, select_kernel
from .._layout import Layout
from .._masks import AbstractMask, Causal
from .._ring import ring_attention
from .._score_mods import AbstractScoreMod
from ._rope import apply_rope


def _check_x(x, dim) -> None:
    shape = jnp.shape(x)
    if len(shape) != 2 or shape[-1] != dim:
        hint = (
            " It handles one example: map over a batch with `jax.vmap(attn)(x)` (or "
            "`jax.vmap(attn, in_axes=(0, None))(x, layout)` with a layout)."
            if len(shape) == 3
            else ""
        )
        raise ValueError(f"`x` must have shape [seq, dim={dim}]; got shape {shape}.{hint}")


class RingAttention(eqx.Module):
    """Multi-head attention with query/key/value/output projections, on a ring.

    Handles one example `x: [seq, dim]`; batch it with
    `jax.vmap(attn, in_axes=(0, None), spmd_axis_name="batch")` on a
    `("batch", "sequence")` mesh. With a `layout`, `x` is in layout order
    (`layout.shard(x)`), rotary embeddings use the layout's original positions and the
    mask its segment ids, so the result is exact for every strategy.

    Each instance holds its own `mask`, `kernel` and `config`: the layers of one model can
    use different block sizes, kernels or masks (local/global) while sharing one layout.

    **Arguments:**

    - `dim`: model width.
    - `num_heads`: query heads. `num_kv_heads`: key/value heads (default `num_heads`;
        must divide `num_heads`).
    - `head_dim`: per-head width (default `dim // num_heads`).
    - `mask`: an [`ringeqx.AbstractMask`][] (default `Causal()`).
    - `score_mod`: an optional score modifier.
    - `sinks`: whether each head has a learned attention-sink logit (initialised to 0)
        that joins every row's softmax denominator.
    - `rope_theta`: base of rotary embeddings, or None for none.
    - `kernel`, `device_type`, `interpret`: the per-device kernel, resolved once here (see
        [`ringeqx.ring_attention`][]); an unsupported choice raises at construction.
    - `config`: a [`ringeqx.RingConfig`][].
    - `axis_name`: the ring's mesh axis.
    - `use_bias`: whether the projections have biases.
    - `key`: a `jax.random` key.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    mask: AbstractMask
    score_mod: AbstractScoreMod | None
    sinks: Float[Array, " heads"] | None
    kernel: AbstractAttentionKernel
    config: RingConfig
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        mask: AbstractMask | None = None,
        score_mod: AbstractScoreMod | None = None,
        sinks: bool = False,
        rope_theta: float | None = 10000.0,
        kernel: KernelName | AbstractAttentionKernel = "auto",
        device_type: DeviceType = "auto",
        interpret: bool = False,
        config: RingConfig | None = None,
        axis_name: str = "sequence",
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                "`num_heads` must be a positive multiple of `num_kv_heads`; got "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}."
            )
        if head_dim is None:
            if dim % num_heads != 0:
                raise ValueError(
                    f"`dim`={dim} is not divisible by `num_heads`={num_heads}; pass `head_dim`."
                )
            head_dim = dim // num_heads
        if rope_theta is not None and head_dim % 2 != 0:
            raise ValueError(
                f"Rotary embeddings need an even `head_dim`; got {head_dim} "
                "(pass rope_theta=None to disable them)."
            )
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.query_proj = eqx.nn.Linear(dim, num_heads * head_dim, use_bias, key=kq)
        self.key_proj = eqx.nn.Linear(dim, num_kv_heads * head_dim, use_bias, key=kk)
        self.value_proj = eqx.nn.Linear(dim, num_kv_heads * head_dim, use_bias, key=kv)
        self.output_proj = eqx.nn.Linear(num_heads * head_dim, dim, use_bias, key=ko)
        self.mask = Causal() if mask is None else mask
        self.score_mod = score_mod
        self.sinks = jnp.zeros(num_heads, jnp.float32) if sinks else None
        self.kernel = select_kernel(kernel, device_type, interpret=interpret)
        self.config = RingConfig() if config is None else config
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.axis_name = axis_name

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        layout: Layout | None = None,
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        span_ids: Int[Array, " seq"] | None = None,
        mesh=None,
    ) -> Float[Array, "seq dim"]:
        """Attend over one example.

        **Arguments:**

        - `x`: activations `[seq, dim]`, in layout order when `layout` is given.
        - `layout`: the [`ringeqx.Layout`][] of the sequence (default: contiguous shards
            made on the fly, `x` in original order). Either way a sequence-sharded `x`
            gives a result sharded the same way; nothing gathers the sequence.
        - `segment_ids`, `span_ids`: document and span ids in original order, without a
            layout only (a layout carries its own).
        - `mesh`: the device mesh (default: the one set by `jax.set_mesh`).

        **Returns:** `[seq, dim]`, in the order of `x`.
        """
        _check_x(x, self.query_proj.in_features)
        seq = x.shape[0]

        def heads(proj, n):
            return jax.vmap(proj)(x).reshape(seq, n, self.head_dim)

        q = heads(self.query_proj, self.num_heads)
        k = heads(self.key_proj, self.num_kv_heads)
        v = heads(self.value_proj, self.num_kv_heads)
        if self.rope_theta is not None:
            if layout is None:
                positions = jnp.arange(seq, dtype=jnp.int32)
            else:
                positions = layout.token_info().positions
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        out = ring_attention(
            q,
            k,
            v,
            mask=self.mask,
            segment_ids=segment_ids,
            span_ids=span_ids,
            sinks=self.sinks,
            layout=layout,
            order=None if layout is None else "layout",
            mesh=mesh,
            axis_name=self.axis_name,
            kernel=self.kernel,
            config=self.config,
            score_mod=self.score_mod,
        )
        return jax.vmap(self.output_proj)(out.reshape(seq, -1))
