"""The MLPs of a transformer block: the GELU MLP and Llama's SwiGLU."""

import abc
from typing import Literal

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray


MLPName = Literal["gelu", "swiglu"]


class AbstractMLP(eqx.Module):
    """The per-token MLP of a [`ringeqx.nn.TransformerBlock`][]. It computes in the
    dtype of its input and weights (the block casts both to its policy's compute dtype)."""

    @abc.abstractmethod
    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        """The MLP of every token of `x`."""


class GeluMLP(AbstractMLP):
    """`gelu(x W_in + b_in) W_out + b_out`: the GPT-2 MLP, with biases.

    **Arguments:**

    - `dim`: model width; `hidden`: the MLP's width.
    - `dtype`: the weights' dtype (default float32).
    - `key`: a `jax.random` key.
    """

    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, *, dtype=None, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.mlp_in = eqx.nn.Linear(dim, hidden, dtype=dtype, key=k1)
        self.mlp_out = eqx.nn.Linear(hidden, dim, dtype=dtype, key=k2)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        return jax.vmap(self.mlp_out)(jax.nn.gelu(jax.vmap(self.mlp_in)(x)))


class SwiGLUMLP(AbstractMLP):
    """`(silu(x W_gate) * (x W_up)) W_down`, without biases: Llama's MLP (three
    matrices, so `3 * dim * hidden` parameters; Llama sizes `hidden` near `8/3 dim`).

    **Arguments:**

    - `dim`: model width; `hidden`: the MLP's width.
    - `dtype`: the weights' dtype (default float32).
    - `key`: a `jax.random` key.

    ??? cite "GLU Variants Improve Transformer"

        ```bibtex
        @article{shazeer2020glu,
          title={GLU Variants Improve Transformer},
          author={Shazeer, Noam},
          journal={arXiv:2002.05202},
          year={2020}
        }
        ```
    """

    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, *, dtype=None, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(dim, hidden, use_bias=False, dtype=dtype, key=k1)
        self.up = eqx.nn.Linear(dim, hidden, use_bias=False, dtype=dtype, key=k2)
        self.down = eqx.nn.Linear(hidden, dim, use_bias=False, dtype=dtype, key=k3)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        h = jax.nn.silu(jax.vmap(self.gate)(x)) * jax.vmap(self.up)(x)
        return jax.vmap(self.down)(h)


def build_mlp(mlp: MLPName, dim: int, hidden: int, *, dtype, key: PRNGKeyArray) -> AbstractMLP:
    """The MLP named `mlp`, or a `ValueError` naming the argument and its choices."""
    match mlp:
        case "gelu":
            return GeluMLP(dim, hidden, dtype=dtype, key=key)
        case "swiglu":
            return SwiGLUMLP(dim, hidden, dtype=dtype, key=key)
        case _:
            raise ValueError(f"`mlp` must be 'gelu' or 'swiglu'; got {mlp!r}.")
