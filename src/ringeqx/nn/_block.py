"""`TransformerBlock`: a pre-norm block of ring attention and an MLP."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._layout._layout import Layout
from .._layout._tokens import TokenInfo
from .._util._numbers import check_bool, check_size
from ._attention import RingAttention
from ._mlp import AbstractMLP, GeluMLP, MLPName, build_mlp
from ._precision import Precision


class TransformerBlock(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    The block follows its attention's [`ringeqx.nn.Precision`][]: its MLP is stored in
    the policy's `param_dtype` and run in its `compute_dtype`, and the residual stream
    `x` is kept in its `output_dtype`. The RMSNorms compute their statistics in float32.

    **Arguments:**

    - `attention`: the block's [`ringeqx.nn.RingAttention`][] (its mask, kernel,
        config and precision are this layer's own).
    - `hidden`: MLP width.
    - `mlp`: `"gelu"` (the default, a [`ringeqx.nn.GeluMLP`][]) or `"swiglu"`
        (Llama's, a [`ringeqx.nn.SwiGLUMLP`][]).
    - `norm_bias`: whether the RMSNorms have a bias (Llama's have none).
    - `key`: a `jax.random` key.
    """

    attention_norm: eqx.nn.RMSNorm
    attention: RingAttention
    mlp_norm: eqx.nn.RMSNorm
    mlp: AbstractMLP

    def __init__(
        self,
        attention: RingAttention,
        hidden: int,
        *,
        mlp: MLPName = "gelu",
        norm_bias: bool = True,
        key: PRNGKeyArray,
    ):
        if not isinstance(attention, RingAttention):
            raise TypeError(
                "`attention` must be a ringeqx.nn.RingAttention; got "
                f"{type(attention).__name__}."
            )
        dim = attention.output_proj.out_features
        assert isinstance(dim, int)
        hidden = check_size("hidden", hidden)
        norm_bias = check_bool("norm_bias", norm_bias)
        dtype = attention.precision.param_dtype
        self.attention_norm = eqx.nn.RMSNorm(dim, use_bias=norm_bias, dtype=dtype)
        self.attention = attention
        self.mlp_norm = eqx.nn.RMSNorm(dim, use_bias=norm_bias, dtype=dtype)
        self.mlp = build_mlp(mlp, dim, hidden, dtype=dtype, key=key)

    @property
    def precision(self) -> Precision:
        """The block's policy: its attention's."""
        return self.attention.precision

    @property
    def mlp_in(self) -> eqx.nn.Linear:
        """The GELU MLP's first layer, `mlp.mlp_in` (where blocks held it before the
        MLP was a choice)."""
        return self._gelu().mlp_in

    @property
    def mlp_out(self) -> eqx.nn.Linear:
        """The GELU MLP's second layer, `mlp.mlp_out`."""
        return self._gelu().mlp_out

    def _gelu(self) -> GeluMLP:
        if not isinstance(self.mlp, GeluMLP):
            raise AttributeError(
                f"`mlp_in` and `mlp_out` are a GELU MLP's layers; this block's MLP is a "
                f"{type(self.mlp).__name__} (see `block.mlp`)."
            )
        return self.mlp

    def __call__(
        self,
        x: Float[Array, "seq dim"],
        layout: Layout | None = None,
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        mesh=None,
    ) -> Float[Array, "seq dim"]:
        x = self.precision.cast_to_output(x)
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, layout, segment_ids=segment_ids, mesh=mesh)
        return self._mlp(x)

    def _mlp(self, x: Array) -> Array:
        p = self.precision
        h = p.cast_to_compute(jax.vmap(self.mlp_norm)(x))
        return x + p.cast_to_output(p.cast_to_compute(self.mlp)(h))

    def prefill(
        self, x: Float[Array, "seq dim"], layout: Layout, *, mesh=None
    ) -> tuple[
        Float[Array, "seq dim"],
        Float[Array, "kv_heads seq head_dim"],
        Float[Array, "kv_heads seq head_dim"],
    ]:
        """`__call__` on `x` in layout order, also returning the attention's keys and
        values (see [`ringeqx.nn.RingAttention.prefill`][])."""
        x = self.precision.cast_to_output(x)
        h = jax.vmap(self.attention_norm)(x)
        out, keys, values = self.attention.prefill(h, layout, mesh=mesh)
        return self._mlp(x + out), keys, values

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
        """One decode step of the block for a new token `x` `[dim]` (see
        [`ringeqx.nn.RingAttention.decode`][])."""
        x = self.precision.cast_to_output(x)
        h = self.attention_norm(x)
        out, keys, values = self.attention.decode(h, keys, values, query, records, slot, mesh=mesh)
        return self._mlp((x + out)[None])[0], keys, values
