"""`AttentionOptions`: the typed options of the `RingAttention` layers a model builds."""

import dataclasses
import warnings

import equinox as eqx
from jaxtyping import PRNGKeyArray

from .._kernels._base import AbstractAttentionKernel
from .._kernels._select import DeviceType, KernelName
from .._masks._base import AbstractMask
from .._ring._comm import AllGather, RingConfig
from .._score_mods import AbstractScoreMod
from ._attention import RingAttention, check_options
from ._precision import Precision, check_precision


class AttentionOptions(eqx.Module):
    """Everything about a [`ringeqx.nn.RingAttention`][] but its sizes and key: what a
    model that builds one per block (a [`ringeqx.nn.RingTransformerLM`][]) passes to
    each. Each field means what the layer's argument of that name means, with the same
    default.

    **Example:**

    ```python
    options = ringeqx.nn.AttentionOptions(mask=ringeqx.SlidingWindow(4096), sinks=True)
    lm = ringeqx.nn.RingTransformerLM(32000, 512, 8, 4, attention=options, key=key)
    ```
    """

    head_dim: int | None = eqx.field(static=True, default=None)
    mask: AbstractMask | None = None
    score_mod: AbstractScoreMod | None = None
    sinks: bool = eqx.field(static=True, default=False)
    rope_theta: float | None = eqx.field(static=True, default=10000.0)
    kernel: KernelName | AbstractAttentionKernel = eqx.field(static=True, default="auto")
    device_type: DeviceType = eqx.field(static=True, default="auto")
    interpret: bool = eqx.field(static=True, default=False)
    config: RingConfig | AllGather | None = None
    axis_name: str = eqx.field(static=True, default="sequence")
    use_bias: bool = eqx.field(static=True, default=False)
    precision: Precision | None = None

    def __check_init__(self):
        # The layer's own checks, now: a wrong option is named where it was written,
        # not when a model builds its first block.
        check_options(
            head_dim=self.head_dim,
            mask=self.mask,
            score_mod=self.score_mod,
            sinks=self.sinks,
            rope_theta=self.rope_theta,
            interpret=self.interpret,
            use_bias=self.use_bias,
            precision=self.precision,
        )

    def build(
        self, dim: int, num_heads: int, num_kv_heads: int | None, *, key: PRNGKeyArray
    ) -> RingAttention:
        """A `RingAttention(dim, num_heads, num_kv_heads, ..., key=key)` with these
        options (checked there, as if passed to it)."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return RingAttention(dim, num_heads, num_kv_heads, key=key, **options)


def options_from(attention: AttentionOptions | None, kwargs: dict | None) -> AttentionOptions:
    """A model's attention options, from `attention=` or the deprecated
    `attention_kwargs=` dict (which warns)."""
    if attention is not None and not isinstance(attention, AttentionOptions):
        raise TypeError(
            "`attention` must be a ringeqx.nn.AttentionOptions or None; got "
            f"{type(attention).__name__}. Pass `attention=ringeqx.nn.AttentionOptions(...)`"
            " (for a dict of options, `AttentionOptions(**options)`)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"`attention_kwargs` must be a dict or None; got {type(kwargs).__name__}.")
    if kwargs is None:
        return AttentionOptions() if attention is None else attention
    if attention is not None:
        raise ValueError(
            "Pass the attention options once: `attention=` (an AttentionOptions) or the "
            "deprecated `attention_kwargs=`, not both."
        )
    warnings.warn(
        "`attention_kwargs=` is deprecated: pass "
        "`attention=ringeqx.nn.AttentionOptions(**attention_kwargs)`.",
        DeprecationWarning,
        stacklevel=3,
    )
    return AttentionOptions(**kwargs)


def with_precision(attention: AttentionOptions, precision) -> AttentionOptions:
    """The options with the model's `precision`, which an `attention.precision` of its
    own must not contradict."""
    if precision is None:
        return attention
    precision = check_precision(precision)
    if attention.precision is not None and attention.precision != precision:
        raise ValueError(
            "Pass the precision once: `precision=` and `attention.precision` differ "
            f"({precision} and {attention.precision})."
        )
    return dataclasses.replace(attention, precision=precision)
