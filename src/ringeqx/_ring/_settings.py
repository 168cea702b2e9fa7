"""The static settings of one ring call (`RingSettings`) and the resolved call the ring
runs (`RingCall`), made by the front door (`ringeqx._ring._call`)."""

from typing import Any

import equinox as eqx
from jaxtyping import Array, Float

from .._kernels._base import Scores
from .._layout._layout import Layout
from ._comm import RingPlan


class RingSettings:
    """Hashable, static settings of one ring call (the custom VJP's non-diff argument):
    the kernel, the ring axis and its size, the steps the ring takes and the
    `RingConfig`, and whether the mesh is a CPU mesh (`ordered`: its collectives then
    carry a token that puts them in one order on every device, see `ringeqx._ring._order`)."""

    def __init__(
        self, kernel, axis_name, num_shards, num_steps, config, num_ahead=0, *, ordered=False
    ):
        self.kernel = kernel
        self.axis_name = axis_name
        self.num_shards = num_shards
        self.num_steps = num_steps
        self.config = config
        # The ring starts with each device holding the K/V of the shard `num_ahead` ahead
        # of its own (two-sided bounded masks), then moves them +1 per step.
        self.num_ahead = num_ahead
        self.ordered = ordered
        self._key = (kernel, axis_name, num_shards, num_steps, config, num_ahead, ordered)

    def plan(self, capacity: int) -> RingPlan:
        """How K/V travel, for shards of `capacity` tokens (known at trace time)."""
        return RingPlan(
            self.config,
            self.axis_name,
            self.num_shards,
            self.num_ahead,
            self.num_steps,
            capacity,
            self.ordered,
        )

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, RingSettings) and self._key == other._key


class RingCall(eqx.Module):
    """One `ring_attention` call, resolved by the front door (`ringeqx._ring._call`): everything
    the ring needs besides q/k/v.

    **Fields:**

    - `scores`: the mask, the score modifier and the scale, as the kernels take them;
        `sinks`: as resolved (`ringeqx._ring._call.resolve_attention`).
    - `layout`: the layout the ring runs on (given, or contiguous), batch axes flat.
    - `settings`: the ring's static settings (kernel, axis, steps, config).
    - `mesh`, `batch_axis`: where it runs; the batch is sharded over `batch_axis`.
    - `original`: whether q/k/v came (and the result goes back) in the original order.
    - `shape`: the shape of `q` as given (the result's).
    """

    scores: Scores
    sinks: Float[Array, " heads"] | None
    layout: Layout
    settings: RingSettings = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    batch_axis: str | None = eqx.field(static=True)
    original: bool = eqx.field(static=True)
    shape: tuple[int, ...] = eqx.field(static=True)
