"""`RingAttention`: multi-head (GQA) attention whose sequence is sharded over a ring."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._inference._decode import decode_attention
from .._kernels._base import AbstractAttentionKernel
from .._kernels._select import DeviceType, KernelName, select_kernel
from .._layout._layout import Layout
from .._layout._tokens import TokenInfo
from .._masks._base import AbstractMask
from .._masks._positional import Causal
from .._ring._call import ring_attention
from .._ring._checks import check_mask_arg
from .._ring._comm import AllGather, RingConfig, as_ring_config
from .._ring._mesh import resolve_mesh
from .._score_mods import AbstractScoreMod
from .._util._numbers import check_bool, check_positive, check_size
from ._precision import Precision, check_precision
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


def check_options(
    *, head_dim, mask, score_mod, sinks, rope_theta, interpret, use_bias, precision=None
) -> dict:
    """The options of a `RingAttention` that its annotations alone do not guard (a
    user without jaxtyping's hook passes anything), checked and made plain Python: the
    layer's and `AttentionOptions`' one definition. Kernel, device and config are
    checked where they are resolved (`select_kernel`, `as_ring_config`)."""
    if head_dim is not None:
        head_dim = check_size("head_dim", head_dim)
    check_mask_arg(mask)
    if score_mod is not None and not isinstance(score_mod, AbstractScoreMod):
        raise TypeError(
            "`score_mod` must be a ringeqx.AbstractScoreMod instance such as "
            f"`ringeqx.Softcap(30.0)`, or None; got {type(score_mod).__name__} {score_mod!r}."
        )
    if rope_theta is not None:
        hint = " (the base of rotary embeddings), or None for none"
        rope_theta = float(check_positive("rope_theta", rope_theta, hint))
    return dict(
        head_dim=head_dim,
        mask=mask,
        score_mod=score_mod,
        sinks=check_bool("sinks", sinks),
        rope_theta=rope_theta,
        interpret=check_bool("interpret", interpret),
        use_bias=check_bool("use_bias", use_bias),
        precision=check_precision(precision),
    )


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
    - `rope_theta`: base of rotary embeddings (a finite number > 0), or None for none.
    - `kernel`, `device_type`, `interpret`: the per-device kernel (see
        [`ringeqx.select_kernel`][]). A name with `device_type="auto"` (the default
        `"auto"` included) is kept as a name and resolved at each call from the mesh the
        layer runs on, so a TPU or GPU mesh gets its Pallas kernel; anything else is
        resolved here, and an unsupported choice raises at construction.
    - `config`: a [`ringeqx.RingConfig`][] or [`ringeqx.AllGather`][].
    - `axis_name`: the ring's mesh axis.
    - `use_bias`: whether the projections have biases.
    - `precision`: a [`ringeqx.nn.Precision`][] (default float32 throughout): the
        projections are stored in its `param_dtype`; each call casts them and `x` to its
        `compute_dtype` (queries, keys and values reach ring attention in it, which
        keeps its scores and softmax in float32) and returns its `output_dtype`. Prefill
        and decode keep keys and values in `compute_dtype`.
    - `key`: a `jax.random` key.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    mask: AbstractMask
    score_mod: AbstractScoreMod | None
    sinks: Float[Array, " heads"] | None
    kernel: AbstractAttentionKernel | KernelName = eqx.field(static=True)
    config: RingConfig | AllGather
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    precision: Precision

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
        config: RingConfig | AllGather | None = None,
        axis_name: str = "sequence",
        use_bias: bool = False,
        precision: Precision | None = None,
        key: PRNGKeyArray,
    ):
        dim, num_heads = check_size("dim", dim), check_size("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        num_kv_heads = check_size("num_kv_heads", num_kv_heads)
        options = check_options(
            head_dim=head_dim,
            mask=mask,
            score_mod=score_mod,
            sinks=sinks,
            rope_theta=rope_theta,
            interpret=interpret,
            use_bias=use_bias,
            precision=precision,
        )
        head_dim, sinks, rope_theta = options["head_dim"], options["sinks"], options["rope_theta"]
        interpret, use_bias = options["interpret"], options["use_bias"]
        precision = options["precision"]
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
        dtype = precision.param_dtype
        self.query_proj = eqx.nn.Linear(dim, num_heads * head_dim, use_bias, dtype, key=kq)
        self.key_proj = eqx.nn.Linear(dim, num_kv_heads * head_dim, use_bias, dtype, key=kk)
        self.value_proj = eqx.nn.Linear(dim, num_kv_heads * head_dim, use_bias, dtype, key=kv)
        self.output_proj = eqx.nn.Linear(num_heads * head_dim, dim, use_bias, dtype, key=ko)
        self.mask = Causal() if mask is None else mask
        self.score_mod = score_mod
        self.sinks = jnp.zeros(num_heads, jnp.float32) if sinks else None
        if isinstance(kernel, str) and device_type == "auto" and not interpret:
            # Chosen per call from the mesh the layer runs on (`select_kernel`): a model
            # built on a laptop and compiled for a TPU or GPU mesh gets that device's
            # kernel. Only the name is checked here.
            select_kernel(kernel, "cpu", interpret=True)
            self.kernel = kernel
        else:
            self.kernel = select_kernel(kernel, device_type, interpret=interpret)
        self.config = RingConfig() if config is None else config
        as_ring_config(self.config)  # a clear error for anything else
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.axis_name = axis_name
        self.precision = precision

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
        if layout is None:
            positions = jnp.arange(seq, dtype=jnp.int32)
        else:
            positions = layout.token_info().positions
        layer, x = self._in_compute(), self.precision.cast_to_compute(x)
        q, k, v = layer._project(x, positions)
        out = layer._attend(q, k, v, layout, mesh, segment_ids=segment_ids, span_ids=span_ids)
        return self.precision.cast_to_output(jax.vmap(layer.output_proj)(out.reshape(seq, -1)))

    def _in_compute(self) -> "RingAttention":
        """This layer with its projections in the policy's compute dtype (the sinks,
        a logit joining a float32 softmax, stay as they are)."""
        projections = (self.query_proj, self.key_proj, self.value_proj, self.output_proj)
        return eqx.tree_at(
            lambda a: (a.query_proj, a.key_proj, a.value_proj, a.output_proj),
            self,
            self.precision.cast_to_compute(projections),
        )

    def _attend(self, q, k, v, layout, mesh, **ids) -> Array:
        """This layer's ring attention over q/k/v `[seq, heads, head_dim]` (in layout
        order when `layout` is given)."""
        return ring_attention(
            q,
            k,
            v,
            mask=self.mask,
            sinks=self.sinks,
            layout=layout,
            order="original" if layout is None else "layout",
            mesh=mesh,
            axis_name=self.axis_name,
            kernel=self.kernel,
            config=self.config,
            score_mod=self.score_mod,
            **ids,
        )

    def _project(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
        """Queries, keys and values `[seq, heads, head_dim]` of `x` `[seq, dim]`, rotary
        embeddings applied at `positions`."""
        seq = x.shape[0]

        def heads(proj, n):
            return jax.vmap(proj)(x).reshape(seq, n, self.head_dim)

        q = heads(self.query_proj, self.num_heads)
        k = heads(self.key_proj, self.num_kv_heads)
        v = heads(self.value_proj, self.num_kv_heads)
        if self.rope_theta is not None:
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        return q, k, v

    def prefill(
        self,
        x: Float[Array, "seq dim"],
        layout: Layout,
        *,
        mesh=None,
    ) -> tuple[
        Float[Array, "seq dim"],
        Float[Array, "kv_heads seq head_dim"],
        Float[Array, "kv_heads seq head_dim"],
    ]:
        """The ring forward of `__call__` on `x` in layout order, which also returns
        the keys and values it attended to, for a [`ringeqx.KVCache`][].

        **Returns:** `(out, keys, values)`: `out` as `__call__` gives it, and keys
        (rotary embeddings applied) and values heads-major `[kv_heads, seq, head_dim]`,
        in layout order.
        """
        _check_x(x, self.query_proj.in_features)
        layer, x = self._in_compute(), self.precision.cast_to_compute(x)
        q, k, v = layer._project(x, layout.token_info().positions)
        out = layer._attend(q, k, v, layout, mesh)
        out = jax.vmap(layer.output_proj)(out.reshape(x.shape[0], -1))
        out = self.precision.cast_to_output(out)
        return out, jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)

    def decode(
        self,
        x: Float[Array, " dim"],
        keys: Float[Array, "kv_heads slots head_dim"],
        values: Float[Array, "kv_heads slots head_dim"],
        query: TokenInfo,
        records: TokenInfo,
        slot: Int[Array, ""],
        *,
        mesh=None,
    ) -> tuple[
        Float[Array, " dim"],
        Float[Array, "kv_heads slots head_dim"],
        Float[Array, "kv_heads slots head_dim"],
    ]:
        """Attention of one new token over a sequence-sharded cache (one decode step).

        The token's key and value are written at `slot` (on the device that owns it);
        every device attends the query to its own slots with this layer's kernel, mask,
        score modifier and sinks, and the partial results are merged across the ring
        by one max and one sum reduction (no collective-permute).
        [`ringeqx.nn.RingTransformerLM.decode`][] calls it for every layer.

        **Arguments:**

        - `x`: the new token's activations `[dim]`.
        - `keys`, `values`: this layer's cache arrays (see [`ringeqx.KVCache`][]).
        - `query`: the new token's records (scalars); `records`: every slot's, the new
            token already written at `slot`.
        - `slot`: where the token goes; `mesh`: as in `__call__`.

        **Returns:** `(out, keys, values)`: the output `[dim]` and the updated cache.
        """
        mesh = resolve_mesh(mesh, self.axis_name)
        layer, x = self._in_compute(), self.precision.cast_to_compute(x)
        q, k, v = layer._project(x[None], query.positions[None])
        out, keys, values = decode_attention(
            q[0],
            k[0],
            v[0],
            keys,
            values,
            query,
            records,
            slot,
            mask=self.mask,
            score_mod=self.score_mod,
            sinks=self.sinks,
            kernel=select_kernel(self.kernel, mesh=mesh),
            scale=1.0 / math.sqrt(self.head_dim),
            mesh=mesh,
            axis_name=self.axis_name,
        )
        out = self.precision.cast_to_output(layer.output_proj(out.reshape(-1)))
        return out, keys, values
