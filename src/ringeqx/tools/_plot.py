"""Pictures of a layout and of a schedule, for notebooks (needs matplotlib)."""

import numpy as np

from .._layout._layout import Layout
from ._schedule import Schedule


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "ringeqx plotting needs matplotlib: `pip install 'ringeqx[plot]'`."
        ) from e
    return plt


def _new_axes(ax, width: float, height: float):
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=(width, height))
    return ax


def plot_layout(layout: Layout, *, color_by: str = "position", ax=None):
    """Draw which token lives where: one row per shard, one column per slot.

    **Arguments:**

    - `layout`: an unbatched [`ringeqx.Layout`][] (index a batched one first:
        `jax.tree.map(lambda x: x[0], layout)`).
    - `color_by`: `"position"` (original token index), `"segment"` or `"span"`. Padding
        slots are blank.
    - `ax`: a matplotlib `Axes` to draw on (default: a new figure).

    **Returns:** the matplotlib `Axes`.
    """
    if layout.batch_shape:
        raise ValueError(
            f"plot_layout draws one example; got a layout with batch shape "
            f"{layout.batch_shape}: index it first."
        )
    match color_by:
        case "position":
            values = layout.positions
        case "segment":
            values = layout.segments
        case "span":
            values = layout.spans
        case _:
            raise ValueError(
                f"plot_layout `color_by` must be 'position', 'segment' or 'span'; got {color_by!r}."
            )
    data = np.ma.masked_array(np.asarray(values), mask=~np.asarray(layout.valid))
    ax = _new_axes(ax, 8.0, 0.4 * layout.num_shards + 1.5)
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.figure.colorbar(image, ax=ax, label=color_by)
    ax.set_xlabel("slot")
    ax.set_ylabel("shard (device)")
    ax.set_yticks(range(layout.num_shards))
    ax.set_title(f"{layout.seq_len} tokens on {layout.num_shards} x {layout.capacity} slots")
    return ax


def plot_schedule(schedule: Schedule, *, what: str = "pairs", ax=None):
    """Draw the work of every device at every ring step as a heat map.

    **Arguments:**

    - `schedule`: a [`ringeqx.tools.Schedule`][] (from [`ringeqx.tools.schedule`][]).
    - `what`: `"pairs"` (unmasked query-key pairs) or `"tiles"` (kernel tiles run).
    - `ax`: a matplotlib `Axes` to draw on (default: a new figure).

    **Returns:** the matplotlib `Axes`. The title gives the imbalance and the critical
    path.
    """
    match what:
        case "pairs":
            values, ratio = schedule.pairs, schedule.imbalance
        case "tiles":
            values, ratio = schedule.tiles_run, schedule.tile_imbalance
        case _:
            raise ValueError(f"plot_schedule `what` must be 'pairs' or 'tiles'; got {what!r}.")
    values = np.asarray(values)
    steps, shards = values.shape
    ax = _new_axes(ax, 0.5 * shards + 3, 0.4 * steps + 1.5)
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="magma")
    ax.figure.colorbar(image, ax=ax, label=what)
    ax.set_xlabel("device")
    ax.set_ylabel("ring step")
    ax.set_xticks(range(shards))
    ax.set_yticks(range(steps))
    ax.set_title(f"imbalance {float(ratio):.3f}, critical path {int(schedule.critical_path)} tiles")
    return ax
