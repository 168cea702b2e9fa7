"""`ringeqx.tools.plan` and `ringeqx.tools.longest_context`: the plan of a problem from the memory
model, or from a target cluster's own compiler, and the longest context that fits."""

import time
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jax.typing import DTypeLike

from ..._masks._base import AbstractMask
from ..._util._numbers import check_size
from ...nn._config import LMConfig
from ...nn._precision import Precision
from ._analytic import analytic_plan
from ._compiled import NoFit, compiled_search
from ._plan import Plan
from ._problem import Remat, problem, target_chips


_GIB = 2**30


def plan(
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
    block_size: int | None = None,
    target: str | None = None,
    mlp: str | None = None,
    norm_bias: bool | None = None,
    precision: Precision | str | None = None,
    config: LMConfig | None = None,
) -> Plan:
    """Choose tiles, rematerialisation and a sharding strategy that fit a memory budget.

    Two problems: ring attention's forward and backward alone (give `head_dim`), or a
    [`ringeqx.nn.RingTransformerLM`][] training step with Adam (give `dim`, `num_layers`
    and `vocab_size`, or a `config`; the LM runs in float32 unless given a `precision`).
    The planner predicts each candidate's bytes per device with a model of the arrays
    the program holds, calibrated against XLA's `memory_analysis()` (see the [memory
    guide](../memory.md#planning-memory)), and returns the first candidate that fits,
    cheapest in compute first: no remat before `"attention"` before `"block"`, and for
    each the largest tile that fits.

    **Arguments:**

    - `seq_len`: tokens per example. `num_devices`: devices on the ring.
    - `heads`, `kv_heads` (default `heads`), `head_dim` (default `dim // heads`).
    - `batch`: examples per step; `batch_devices`: devices on the `"batch"` mesh axis
        (each holds `batch / batch_devices` examples).
    - `dtype`: of q/k/v (attention alone).
    - `mask`: the attention mask (default `Causal()`); the plan suggests its strategy
        (`Zigzag` for causal, `WorkBalanced` for packed documents, `Uniform` for windows
        and full attention).
    - `dim`, `num_layers`, `vocab_size`, `hidden` (default `4 * dim`): the LM.
    - `mlp` (`"gelu"`, the default, or `"swiglu"`), `norm_bias` (default True): the LM's
        blocks, as [`ringeqx.nn.RingTransformerLM`][] takes them.
    - `precision`: the LM's [`ringeqx.nn.Precision`][], or its name: `"float32"` (the
        default) or `"mixed"` (`Precision.mixed()`: float32 parameters and Adam state,
        bfloat16 compute, the recommended recipe). Its compute dtype is the attention's
        `dtype`. Without `target=` the memory model, fitted on float32 steps, scales its
        terms by each dtype's bytes (an estimate); with `target=` the compiler measures
        the model built with it.
    - `config`: an [`ringeqx.nn.LMConfig`][] (e.g. [`ringeqx.nn.LLAMA3_8B`][]) instead
        of `heads`, `kv_heads`, `dim`, `num_layers`, `vocab_size`, `hidden`, `mlp` and
        `norm_bias` (its `rope_theta` too); passing both is an error.
    - `scan_layers`: plan the LM with its layers stacked and scanned
        ([`ringeqx.nn.RingTransformerLM`][]`(scan_layers=True)`): on TPUs and GPUs it
        compiles in the time of one layer and keeps less memory.
    - `device`: `"cpu"` or a key of [`ringeqx.tools.HARDWARE`][] (its memory is the default
        budget). It also picks the compiler the prediction speaks for: a TPU or GPU
        profile predicts the program `target=` would compile there (the Pallas kernel,
        fully sharded LM state), with counts fitted to that compiler.
    - `max_memory_usage`: bytes per device (default: the device profile's memory;
        for TPU v5e and v6e what their runtime lets a program have, 15.75 and
        31.25 GiB, not the published 16 and 32).
    - `remat`, `block_size`: fix a knob instead of searching it.
    - `target`: a cluster to answer for with its own compiler, `"v5p:4x4x4"` (a TPU
        generation and slice) or `"h100:8"` (a GPU and a count), as
        [`ringeqx.tools.target_mesh`][] takes it; `batch_devices * num_devices` must be its
        chip count, `device` is its profile and its chip's memory the default budget.
        Each candidate (no remat, then `"attention"`, then `"block"`) is compiled for the
        target (its Pallas kernel; an LM's parameters and Adam state fully sharded over
        every chip and donated to the step, as a training loop does) until one fits:
        `plan.compiled` holds the compiler's bytes per chip, exact where the model is an
        estimate. Needs the target's compiler
        (`pip install "jax[tpu]"` or `"jax[cuda12]"` at JAX's version); seconds to
        minutes a compile.

    **Returns:** a [`ringeqx.tools.Plan`][].

    **Raises:** `ValueError` when nothing fits, saying what would: how many devices on
    the ring, or how large a budget; without `target=`, where the memory model was never
    fitted on such a program on the device's compiler (a regime it has no counts for,
    or an LM wider than its fit held), pointing at `target=`; on an accelerator, where
    the platform's Pallas kernel does not take the head_dim.

    **Example:**

    ```python
    p = ringeqx.tools.plan(65536, 8, heads=8, dim=512, num_layers=4, vocab_size=32000,
                     max_memory_usage=2**30)
    model = p.model(key=jax.random.key(0))
    # Llama-3-8B as it trains, on 8 v5p chips (needs libtpu):
    p = ringeqx.tools.plan(262144, 8, config=ringeqx.nn.LLAMA3_8B, precision="mixed",
                           scan_layers=True, remat="block", target="v5p:2x2x2")
    ```
    """
    cfg, remats = problem(
        seq_len,
        num_devices,
        heads=heads,
        head_dim=head_dim,
        kv_heads=kv_heads,
        batch=batch,
        batch_devices=batch_devices,
        dtype=dtype,
        mask=mask,
        dim=dim,
        num_layers=num_layers,
        vocab_size=vocab_size,
        hidden=hidden,
        scan_layers=scan_layers,
        device=device,
        max_memory_usage=max_memory_usage,
        remat=remat,
        target=target,
        mlp=mlp,
        norm_bias=norm_bias,
        precision=precision,
        config=config,
    )
    if target is not None:
        if block_size is not None:
            raise ValueError(
                "`block_size` fixes the memory model's tile; with `target=` the target's "
                "compiler is asked about its kernel's own tiles, so pass one or the "
                f"other; got block_size={block_size!r} and target={target!r}."
            )
        return compiled_search(cfg, target, remats)
    return analytic_plan(cfg, remat, block_size)


class ContextSearch(NamedTuple):
    """The answer of [`ringeqx.tools.longest_context`][].

    **Fields:**

    - `plan`: the longest context that fits, as its [`ringeqx.tools.Plan`][] (with the
        compiler's bytes per chip in `plan.compiled`).
    - `probes`: every length compiled, in order, as `(seq_len, total bytes per chip or
        None where the compiler refused it, fits)`.
    - `seconds`: the search's wall time.
    """

    plan: Plan
    probes: tuple[tuple[int, int | None, bool], ...]
    seconds: float


def longest_context(
    target: str,
    *,
    heads: int | None = None,
    head_dim: int | None = None,
    kv_heads: int | None = None,
    dim: int | None = None,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    hidden: int | None = None,
    scan_layers: bool = False,
    batch: int = 1,
    batch_devices: int = 1,
    dtype: DTypeLike = jnp.bfloat16,
    mask: AbstractMask | None = None,
    max_memory_usage: int | None = None,
    remat: Remat | None = None,
    start: int | None = None,
    log: Callable[[str], None] | None = print,
    mlp: str | None = None,
    norm_bias: bool | None = None,
    precision: Precision | str | None = None,
    config: LMConfig | None = None,
) -> ContextSearch:
    """The longest sequence that ring attention, or a `RingTransformerLM` training step,
    fits in on `target`, answered by the target's compiler.

    A search over compiles of [`ringeqx.tools.plan`][]`(..., target=target)`: the length
    doubles from `start` until a program no longer fits, then the gap is halved until it
    is within 1/8 of the answer. Lengths are multiples of `2 * num_devices * 1024` (whole
    1024-token tiles, and zigzag's two chunks a device). Each probe is one compile
    (seconds for attention, minutes for a large LM's unrolled layers); `log` is told
    each one as it ends (pass None for silence).

    **Arguments:** as [`ringeqx.tools.plan`][], with `target` required and the ring its chips
    over `batch_devices`; `remat` defaults to `"block"` for an LM (the least memory, so
    the longest context). `start`: the first length tried (default 16 units).

    **Returns:** a [`ringeqx.tools.ContextSearch`][].

    **Raises:** `ValueError` when not even one unit fits (at once, with nothing
    compiled, when an LM's parameters and Adam state alone exceed the budget).
    """
    if log is not None and not callable(log):
        raise TypeError(
            f"`log` must be a function taking one line (e.g. print) or None; got {log!r}."
        )
    chips = target_chips(target)
    batch_devices = check_size("batch_devices", batch_devices)
    if chips % batch_devices:
        raise ValueError(
            f"`batch_devices` must divide the {chips} chips of `target` {target!r}; got "
            f"{batch_devices}."
        )
    num_devices = chips // batch_devices
    lm = dim is not None or config is not None
    remat = ("block" if lm else None) if remat is None else remat
    unit = 2 * num_devices * 1024
    probes: list[tuple[int, int | None, bool]] = []
    found: dict[int, Plan] = {}
    begin = time.perf_counter()
    problem = dict(
        heads=heads, head_dim=head_dim, kv_heads=kv_heads, batch=batch,
        batch_devices=batch_devices, dtype=dtype, mask=mask, dim=dim, vocab_size=vocab_size,
        hidden=hidden, scan_layers=scan_layers, remat=remat, mlp=mlp, norm_bias=norm_bias,
        precision=precision, config=config,
    )  # fmt: skip

    def fits(seq_len: int) -> bool:
        try:
            p = plan(seq_len, num_devices, num_layers=num_layers, target=target,
                     max_memory_usage=max_memory_usage, **problem)
        except NoFit as e:
            if e.before_compile:  # the LM's state alone does not fit: no length can
                raise
            probes.append((seq_len, e.total, False))
            _say(log, seq_len, e.total, e.budget, False, e.seconds, len(probes))
            return False
        found[seq_len] = p
        probes.append((seq_len, p.compiled.total, True))
        _say(log, seq_len, p.compiled.total, p.max_memory_usage, True, p.compiled.seconds,
             len(probes))
        return True

    start = unit * 16 if start is None else check_size("start", start)
    lo = _longest(fits, unit, max(unit, -(-start // unit) * unit), target)
    seconds = time.perf_counter() - begin
    return ContextSearch(found[lo], tuple(probes), seconds)


def _longest(fits: Callable[[int], bool], unit: int, seq: int, target: str) -> int:
    """The longest multiple of `unit` that `fits`, to within 1/8 (or one unit), from a
    first try at `seq`: doubling until one does not fit (or halving until one does),
    then bisecting."""
    if fits(seq):  # bracket the answer: grow until a length does not fit ...
        lo = seq
        while fits(seq := seq * 2):
            lo = seq
        hi = seq
    else:  # ... or shrink until one does
        hi = seq
        while True:
            if seq == unit:
                raise ValueError(
                    f"Nothing fits on {target}, not even seq_len={unit} (one unit of "
                    "2 * num_devices * 1024 tokens): raise max_memory_usage or add chips."
                )
            seq = max(unit, seq // 2 // unit * unit)
            if fits(seq):
                lo = seq
                break
            hi = seq
    while hi - lo > max(unit, lo // 8):
        mid = (lo + hi) // 2 // unit * unit
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _say(log, seq_len: int, total: int | None, budget: int, ok: bool, seconds: float, n: int):
    if log is None:
        return
    used = "refused by the compiler" if total is None else f"{total / _GIB:,.2f} GiB"
    verdict = "fits" if ok else "does not fit"
    log(
        f"[{n}] seq_len {seq_len:>12,}: {used} of {budget / _GIB:,.2f} GiB per chip, "
        f"{verdict} (compiled in {seconds:.1f} s)"
    )


