"""The planner's problem: `plan`'s arguments checked once into a typed `Problem` (sizes,
mask, device profile, budget), and the chips and profile a target names."""

import math
from typing import Literal, NamedTuple

import jax.numpy as jnp
from jax.typing import DTypeLike

from ..._masks._base import AbstractMask
from ..._masks._positional import Causal
from ..._util._numbers import as_int, check_size, is_int
from ...nn._config import LMConfig
from ...nn._precision import Precision
from .._cost import float_itemsize
from .._hardware import HARDWARE, TARGETS


Remat = Literal["none", "attention", "block"]
REMATS: tuple[Remat, ...] = ("none", "attention", "block")
MLPS = ("gelu", "swiglu")
# The precisions a plan takes by name (or a `ringeqx.nn.Precision`).
PRECISIONS = {"float32": Precision, "mixed": Precision.mixed}


class Problem(NamedTuple):
    """What a plan is for, checked: the problem's sizes, the mask, the device profile
    and the budget (the fields of `Plan` that the search does not choose)."""

    kind: Literal["attention", "lm"]
    seq_len: int
    num_devices: int
    batch: int
    batch_devices: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    vocab_size: int | None
    dim: int | None
    num_layers: int | None
    hidden: int | None
    scan_layers: bool
    mask: AbstractMask
    device: str
    max_memory_usage: int
    mlp: str
    norm_bias: bool
    precision: Precision
    rope_theta: float | None


def target_chips(target: str) -> int:
    """The chip count of `"v5p:4x4x4"` (a slice) or `"h100:8"` (a count), read from the
    name (no compiler needed); a ValueError naming `target` for anything else."""
    name, _, size = target.partition(":") if isinstance(target, str) else ("", "", "")
    dims = size.split("x")
    if name not in TARGETS or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(
            "`target` must be a TPU generation and slice ('v5p:4x4x4') or a GPU and a "
            f"count ('h100:8'), from {sorted(TARGETS)}; got {target!r}."
        )
    tpu = HARDWARE[TARGETS[name]].kind == "tpu"
    if tpu != (len(dims) > 1):
        what = "a slice like 'v5p:4x4x4'" if tpu else "a count like 'h100:8'"
        raise ValueError(f"`target` {target!r}: {name} needs {what}.")
    return math.prod(int(d) for d in dims)


def target_device(target: str) -> str:
    """The device profile (a key of `HARDWARE`) of a valid `target`'s chips."""
    return TARGETS[target.partition(":")[0]]


def target_profile(target: str, device: str, devices: int) -> str:
    """The device profile of `target`, checked against `device` (its default or the
    same) and against the plan's `batch_devices * num_devices` (its chip count)."""
    chips = target_chips(target)
    profile = target_device(target)
    if device not in ("cpu", profile):
        raise ValueError(
            f"`device` must be {profile!r} (the profile of `target` {target!r}) or left "
            f"out; got {device!r}."
        )
    if devices != chips:
        raise ValueError(
            f"`batch_devices * num_devices` must be the {chips} chips of `target` "
            f"{target!r}; got {devices}."
        )
    return profile


def _budget(device: str, max_memory_usage: int | None) -> int:
    if device != "cpu" and device not in HARDWARE:
        raise ValueError(f"`device` must be 'cpu' or one of {sorted(HARDWARE)}; got {device!r}.")
    if max_memory_usage is not None:
        max_memory_usage = as_int(max_memory_usage)
        if not is_int(max_memory_usage) or max_memory_usage < 1:
            raise ValueError(
                f"`max_memory_usage` must be a positive int (bytes per device); got "
                f"{max_memory_usage!r}."
            )
        return max_memory_usage
    memory = HARDWARE[device].memory if device != "cpu" else None
    if memory is None:
        raise ValueError(
            f"The device profile {device!r} has no memory size: pass `max_memory_usage` "
            "(bytes per device)."
        )
    return int(memory)


def _float_name(dtype) -> str:
    float_itemsize("dtype", dtype)  # a floating dtype, or an error naming `dtype`
    return jnp.dtype(dtype).name


def _sizes(**given) -> dict[str, int]:
    """The problem's sizes, each an integer >= 1, with the divisibility they need."""
    sizes = {name: check_size(name, value) for name, value in given.items()}
    if sizes["heads"] % sizes["kv_heads"] != 0:
        raise ValueError(
            f"`heads` must be a multiple of `kv_heads`; got heads={sizes['heads']}, "
            f"kv_heads={sizes['kv_heads']}."
        )
    if sizes["seq_len"] < sizes["num_devices"]:
        # A shard of no tokens: it reached a ZeroDivisionError after compiling (issue 45).
        raise ValueError(
            f"`seq_len` must be at least `num_devices` (a token for every device on the "
            f"ring); got seq_len={sizes['seq_len']}, num_devices={sizes['num_devices']}."
        )
    if sizes["batch"] % sizes["batch_devices"] != 0:
        raise ValueError(
            f"`batch`={sizes['batch']} must be divisible by "
            f"`batch_devices`={sizes['batch_devices']}."
        )
    return sizes


def _lm_sizes(heads: int, dim, num_layers, vocab_size, hidden, head_dim) -> dict:
    """The kind of plan and the LM's sizes (all None for an attention plan)."""
    given = {"dim": dim, "num_layers": num_layers, "vocab_size": vocab_size}
    given = {k: None if v is None else check_size(k, v) for k, v in given.items()}
    head_dim = None if head_dim is None else check_size("head_dim", head_dim)
    hidden = None if hidden is None else check_size("hidden", hidden)
    if all(v is None for v in given.values()):
        if head_dim is None:
            raise ValueError("`head_dim` is required for an attention plan (no `dim`).")
        return {"kind": "attention", **given, "hidden": None, "head_dim": head_dim}
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"An LM plan needs `dim`, `num_layers` and `vocab_size`; missing {missing}."
        )
    dim = given["dim"]
    if head_dim is None and dim % heads != 0:
        raise ValueError(
            f"`dim`={dim} is not a multiple of `heads`={heads}: the LM splits its width "
            "over its heads (or pass `head_dim`)."
        )
    head_dim = dim // heads if head_dim is None else head_dim
    hidden = 4 * dim if hidden is None else hidden
    return {"kind": "lm", **given, "hidden": hidden, "head_dim": head_dim}


def check_precision(precision) -> Precision:
    """`precision` as a `ringeqx.nn.Precision`: one, a name of `PRECISIONS`, or None
    (float32); an error naming the argument for anything else."""
    if precision is None:
        return Precision()
    if isinstance(precision, Precision):
        return precision
    if isinstance(precision, str) and precision in PRECISIONS:
        return PRECISIONS[precision]()
    raise ValueError(
        "`precision` must be a ringeqx.nn.Precision or one of "
        f"{sorted(PRECISIONS)}; got {precision!r}."
    )


def _lm_options(mlp, norm_bias, precision, dim) -> dict:
    """The LM's block options, checked (an error names each; an attention plan takes
    none of them)."""
    if mlp is not None and mlp not in MLPS:
        raise ValueError(f"`mlp` must be one of {MLPS}; got {mlp!r}.")
    if norm_bias is not None and norm_bias not in (False, True):
        raise ValueError(f"`norm_bias` must be a bool; got {norm_bias!r}.")
    given = {"mlp": mlp, "norm_bias": norm_bias, "precision": precision}
    given = {name: value for name, value in given.items() if value is not None}
    if dim is None and given:
        said = ", ".join(f"`{name}`={value!r}" for name, value in given.items())
        raise ValueError(
            "`mlp`, `norm_bias` and `precision` are an LM plan's (`dim`, ... or a "
            f"`config`): attention alone has no MLP, norms or parameters; got {said}."
        )
    return {
        "mlp": "gelu" if mlp is None else mlp,
        "norm_bias": True if norm_bias is None else bool(norm_bias),
        "precision": check_precision(precision),
    }


def from_config(config, **given) -> dict:
    """`plan`'s LM arguments read from an `LMConfig` (its sizes, MLP, norms and
    `rope_theta`), or `given` as they are when `config` is None; a ValueError when both
    name a size, since one would silently override the other."""
    if config is None:
        return given | {"rope_theta": None}
    if not isinstance(config, LMConfig):
        hint = " (e.g. ringeqx.nn.LLAMA3_8B, not its name)" if isinstance(config, str) else ""
        raise TypeError(
            f"`config` must be a ringeqx.nn.LMConfig{hint} or None; got "
            f"{type(config).__name__} {config!r}."
        )
    clash = [name for name, value in given.items() if value is not None]
    if clash:
        raise ValueError(
            f"`config` gives the LM's sizes and block; pass it or "
            f"{', '.join(f'`{n}`' for n in clash)}, not both (to change a size, "
            "`dataclasses.replace(config, ...)`)."
        )
    return {
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": None,
        "dim": config.dim,
        "num_layers": config.num_layers,
        "vocab_size": config.vocab_size,
        "hidden": config.hidden,
        "mlp": config.mlp,
        "norm_bias": config.norm_bias,
        "rope_theta": config.rope_theta,
    }


def problem(
    seq_len: int,
    num_devices: int,
    *,
    heads: int | None = None,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    batch: int = 1,
    batch_devices: int = 1,
    dtype: DTypeLike = jnp.float32,
    mask: AbstractMask | None = None,
    dim: int | None = None,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    hidden: int | None = None,
    scan_layers: bool = False,
    device: str = "cpu",
    max_memory_usage: int | None = None,
    remat: Remat | None = None,
    target: str | None = None,
    mlp: str | None = None,
    norm_bias: bool | None = None,
    precision: Precision | str | None = None,
    config: LMConfig | None = None,
) -> tuple[Problem, tuple[Remat, ...]]:
    """`plan`'s arguments checked, as the problem and the remats to try (see
    `ringeqx.tools._planner._search.plan`)."""
    lm_args = from_config(
        config, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dim=dim,
        num_layers=num_layers, vocab_size=vocab_size, hidden=hidden, mlp=mlp,
        norm_bias=norm_bias,
    )  # fmt: skip
    rope_theta = lm_args.pop("rope_theta")
    heads, kv_heads, head_dim = lm_args["heads"], lm_args["kv_heads"], lm_args["head_dim"]
    dim, num_layers, vocab_size = lm_args["dim"], lm_args["num_layers"], lm_args["vocab_size"]
    hidden = lm_args["hidden"]
    if heads is None:
        raise ValueError("`heads` is required (or an LM's `config`).")
    options = _lm_options(lm_args["mlp"], lm_args["norm_bias"], precision, dim)
    sizes = _sizes(
        seq_len=seq_len,
        num_devices=num_devices,
        batch=batch,
        batch_devices=batch_devices,
        heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
    )
    lm = _lm_sizes(sizes["heads"], dim, num_layers, vocab_size, hidden, head_dim)
    if target is not None:
        device = target_profile(target, device, sizes["batch_devices"] * sizes["num_devices"])
    if scan_layers not in (False, True):
        raise ValueError(f"`scan_layers` must be a bool; got {scan_layers!r}.")
    if scan_layers and lm["kind"] == "attention":
        raise ValueError(
            "`scan_layers=True` needs an LM plan (`dim`, ...): attention alone has no layers."
        )
    cfg = Problem(
        **sizes,
        **lm,
        scan_layers=bool(scan_layers),
        # An LM's attention runs at its compute dtype (float32, or bfloat16 mixed).
        dtype=_float_name(options["precision"].compute_dtype if lm["kind"] == "lm" else dtype),
        mask=Causal() if mask is None else mask,
        device=device,
        max_memory_usage=_budget(device, max_memory_usage),
        **options,
        rope_theta=rope_theta,
    )
    _check_budget_and_remat(cfg, target, remat)
    return cfg, remats(cfg, remat)


def _check_budget_and_remat(cfg: Problem, target: str | None, remat: Remat | None) -> None:
    """A budget no larger than the target's chip, and a remat the problem has."""
    chip = HARDWARE[cfg.device].memory if target is not None else None
    if chip is not None and cfg.max_memory_usage > chip:
        # XLA:GPU only warns; a plan above the chip would be a promise it cannot keep.
        raise ValueError(
            f"`max_memory_usage`={cfg.max_memory_usage:,} bytes is more than a chip of "
            f"`target` {target!r} has ({chip:,} bytes, {HARDWARE[cfg.device].name}); pass "
            "at most that, or leave it out for the chip's memory."
        )
    if remat is not None and remat not in REMATS:
        raise ValueError(f"`remat` must be one of {REMATS} or None; got {remat!r}.")
    if cfg.kind == "attention" and remat not in (None, "none"):
        raise ValueError(
            f"`remat`={remat!r} needs an LM plan (`dim`, ...): attention alone has no "
            "layers to rematerialise (its custom VJP already recomputes the scores)."
        )


def remats(cfg: Problem, remat: Remat | None) -> tuple[Remat, ...]:
    """The remats to try, cheapest in compute first: the one asked for, or every one for
    an LM (attention alone has none)."""
    if remat is not None:
        return (remat,)
    return REMATS if cfg.kind == "lm" else ("none",)
