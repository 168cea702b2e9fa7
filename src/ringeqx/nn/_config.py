"""`LMConfig`: the sizes of a `RingTransformerLM`, and the named Llama-shaped ones."""

import equinox as eqx

from .._util._numbers import check_bool, check_positive, check_size
from ._mlp import MLPName


class LMConfig(eqx.Module):
    """The shape of a [`ringeqx.nn.RingTransformerLM`][]: what
    [`ringeqx.nn.RingTransformerLM.from_config`][] builds. Each field means what the
    model's argument of that name means; `rope_theta` is the attention's.

    Named shapes: [`ringeqx.nn.LLAMA3_8B`][], [`ringeqx.nn.LLAMA3_70B`][] (Llama 3's,
    exactly: the models' published parameter counts), [`ringeqx.nn.TINYLLAMA_1B`][]
    (TinyLlama-1.1B's) and [`ringeqx.nn.LLAMA_300M`][] (a small Llama-shaped model for
    one chip). Other sizes: `dataclasses.replace(ringeqx.nn.LLAMA3_8B, num_layers=2)`.

    **Example:**

    ```python
    lm = ringeqx.nn.RingTransformerLM.from_config(
        ringeqx.nn.LLAMA_300M, precision=ringeqx.nn.Precision.mixed(), key=key
    )
    ```
    """

    vocab_size: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)
    mlp: MLPName = eqx.field(static=True, default="swiglu")
    norm_bias: bool = eqx.field(static=True, default=False)
    rope_theta: float = eqx.field(static=True, default=500000.0)

    def __check_init__(self):
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "hidden"):
            check_size(name, getattr(self, name))
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"`mlp` must be 'gelu' or 'swiglu'; got {self.mlp!r}.")
        check_bool("norm_bias", self.norm_bias)
        check_positive("rope_theta", self.rope_theta, " (the base of rotary embeddings)")
        if self.num_heads % self.num_kv_heads != 0 or self.dim % self.num_heads != 0:
            raise ValueError(
                "`num_heads` must divide `dim` and be a multiple of `num_kv_heads`; got "
                f"dim={self.dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}."
            )

    @property
    def head_dim(self) -> int:
        """`dim // num_heads`."""
        return self.dim // self.num_heads

    def param_count(self) -> int:
        """Parameters of the model this config builds (embedding and head untied)."""
        d, h = self.dim, self.hidden
        attention = 2 * d * d + 2 * d * self.num_kv_heads * self.head_dim
        mlp: int
        match self.mlp:
            case "swiglu":
                mlp = 3 * d * h
            case "gelu":
                mlp = 2 * d * h + h + d
            case _:
                raise ValueError(f"`mlp` must be 'gelu' or 'swiglu'; got {self.mlp!r}.")
        norm = 2 * d if self.norm_bias else d
        block = attention + mlp + 2 * norm
        return 2 * self.vocab_size * d + self.num_layers * block + norm


LLAMA3_8B = LMConfig(
    vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, hidden=14336
)
"""Llama-3-8B's shape: width 4096, 32 layers, 32 query and 8 key/value heads of 128,
SwiGLU of 14336, vocabulary 128256, rope_theta 500000; 8,030,261,248 parameters."""
LLAMA3_70B = LMConfig(
    vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, hidden=28672
)
"""Llama-3-70B's shape: width 8192, 80 layers, 64 query and 8 key/value heads of 128,
SwiGLU of 28672, vocabulary 128256, rope_theta 500000; 70,553,706,496 parameters."""
TINYLLAMA_1B = LMConfig(
    vocab_size=32000,
    dim=2048,
    num_layers=22,
    num_heads=32,
    num_kv_heads=4,
    hidden=5632,
    rope_theta=10000.0,
)
"""TinyLlama-1.1B's shape: width 2048, 22 layers, 32 query and 4 key/value heads of 64,
SwiGLU of 5632, vocabulary 32000 (Llama 2's), rope_theta 10000; 1,100,048,384 parameters."""
LLAMA_300M = LMConfig(
    vocab_size=32000,
    dim=1024,
    num_layers=20,
    num_heads=16,
    num_kv_heads=8,
    hidden=2816,
    rope_theta=10000.0,
)
"""A small Llama-shaped model for one chip: width 1024, 20 layers, 16 query and 8
key/value heads of 64, SwiGLU of 2816, vocabulary 32000, rope_theta 10000; 301,507,584
parameters."""
