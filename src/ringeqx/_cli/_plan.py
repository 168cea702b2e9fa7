"""`ringeqx plan`: `ringeqx.tools.plan` (or `longest_context`) from the command line, as
a table or as JSON."""

import argparse
import os
import re

from ..tools._hardware import HARDWARE
from ._flags import (
    budget_mib,
    common,
    float_dtype,
    positive,
    target,
    target_chips,
    target_device,
)
from ._output import say


# `ringeqx.tools.plan`'s arguments, as `ringeqx plan` spells them.
_PLAN_FLAGS = (
    (r"max_memory_usage=([\d.,]+) MiB", r"--max-memory-mib \1"),
    (r"\bmax_memory_usage\b", "--max-memory-mib"),
    (r"\bseq_len=", "--seq-len "),
    (r"\bnum_devices=", "--devices "),
    (r"`batch_devices \* num_devices`", "--devices"),
    (r"`remat`", "--remat"),
    (r"`scan_layers=True`", "--scan-layers"),
    (r"`mlp`", "--mlp"),
    (r"`norm_bias`", "--no-norm-bias"),
    (r"`precision`", "--precision"),
    (r"`config`", "--config"),
)

# `ringeqx plan --config`: the named shapes of `ringeqx.nn`.
CONFIGS = {
    "llama3-8b": "LLAMA3_8B",
    "llama3-70b": "LLAMA3_70B",
    "tinyllama-1b": "TINYLLAMA_1B",
    "llama-300m": "LLAMA_300M",
}


def _in_flags(message: str) -> str:
    """A message of `ringeqx.tools.plan` with its argument names replaced by the flags."""
    for pattern, flag in _PLAN_FLAGS:
        message = re.sub(pattern, flag, message)
    return message


def plan(args: argparse.Namespace) -> int:
    """`ringeqx plan`: the memory plan of a problem, as a table or as JSON."""
    import json

    import ringeqx as rx

    masks = {
        "causal": rx.Causal(),
        "full": rx.Full(),
        "documents": rx.Causal() & rx.Document(),
        "window": rx.SlidingWindow(args.window),
    }
    lm: dict = {}
    block = dict(
        mlp=args.mlp, norm_bias=False if args.no_norm_bias else None, precision=args.precision,
    )  # fmt: skip
    if args.config is not None:
        # The config's sizes, heads included: the flags' defaults for them are not asked
        # (an --mlp or --no-norm-bias with it is refused by `plan`, naming both).
        lm = dict(config=getattr(rx.nn, CONFIGS[args.config]), scan_layers=args.scan_layers)
        sizes = dict(block)
    else:
        if args.dim is not None:
            lm = dict(
                dim=args.dim, num_layers=args.layers, vocab_size=args.vocab_size,
                hidden=args.hidden, scan_layers=args.scan_layers,
            )  # fmt: skip
        sizes = dict(heads=args.heads, kv_heads=args.kv_heads, **block)
        sizes["head_dim"] = None if lm else args.head_dim
    budget = None if args.max_memory_mib is None else int(args.max_memory_mib * 2**20)
    problem = dict(
        **sizes,
        batch=args.batch,
        dtype=args.dtype,
        mask=masks[args.mask],
        max_memory_usage=budget,
        remat=args.remat,
        **lm,
    )
    try:
        if args.longest:
            found = rx.tools.longest_context(args.target, **problem, log=say)
            result = found.plan
            say(f"longest --seq-len on {args.target}: {result.seq_len:,} tokens "
                 f"({len(found.probes)} compiles, {found.seconds:.0f} s)")
        else:
            device = {} if args.target is not None else {"device": args.profile}
            result = rx.tools.plan(
                args.seq_len, args.devices, **problem, target=args.target, **device
            )
    except (ValueError, ImportError) as error:
        say(f"ringeqx plan: {_in_flags(str(error))}")
        return 1
    say(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


# Device profiles of `ringeqx plan --profile`: the hardware table's keys, read from the
# table itself (importing ringeqx already imports JAX, so a copy saved nothing).
PROFILES = tuple(HARDWARE)


def plan_defaults(args: argparse.Namespace) -> None:
    """`ringeqx plan`'s defaults that depend on `--target`: its chips and its profile
    (a plan from the model alone: 8 devices, the h100 profile). A GPU target's compiler
    registers without a driver only when told before JAX starts."""
    if args.target is None:
        args.devices = 8 if args.devices is None else args.devices
        args.profile = "h100" if args.profile is None else args.profile
        return
    args.devices = target_chips(args.target)
    if HARDWARE[target_device(args.target)].kind == "gpu":
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def arguments(plan_parser: argparse.ArgumentParser) -> None:
    common(plan_parser, seq_len=65536, heads=8, kv_heads=2)
    plan_parser.add_argument(
        "--mask", choices=("causal", "full", "documents", "window"), default="causal"
    )
    plan_parser.add_argument("--window", type=positive, default=4096, help="for --mask window")
    plan_parser.add_argument(
        "--dtype", type=float_dtype, default="float32", help="q/k/v dtype (attention)"
    )
    plan_parser.add_argument("--batch", type=positive, default=1)
    plan_parser.add_argument(
        "--dim", type=positive, default=None, help="LM width (plans an LM training step)"
    )
    plan_parser.add_argument("--layers", type=positive, default=4, help="LM layers")
    plan_parser.add_argument("--vocab-size", type=positive, default=32000)
    plan_parser.add_argument(
        "--profile",
        choices=("cpu", *PROFILES),
        default=None,
        help="device profile: its memory is the default budget, its tiles the ones tried "
        "(default h100, or the --target's; cpu has no memory size: give --max-memory-mib)",
    )
    plan_parser.add_argument(
        "--max-memory-mib",
        type=budget_mib,
        default=None,
        help="budget per device in MiB (default: the profile's memory; TPU v5e/v6e: what "
        "their runtime allows, 15.75/31.25 GiB)",
    )
    plan_parser.add_argument("--hidden", type=positive, default=None, help="LM MLP width")
    plan_parser.add_argument(
        "--remat", choices=("none", "attention", "block"), default=None, help="fix the remat"
    )
    plan_parser.add_argument(
        "--scan-layers",
        action="store_true",
        help="the LM's layers stacked and scanned (RingTransformerLM(scan_layers=True))",
    )
    plan_parser.add_argument(
        "--mlp", choices=("gelu", "swiglu"), default=None, help="LM MLP (default gelu)"
    )
    plan_parser.add_argument(
        "--no-norm-bias", action="store_true", help="the LM's RMSNorms without a bias"
    )
    plan_parser.add_argument(
        "--precision",
        choices=("float32", "mixed"),
        default=None,
        help="LM precision (default float32; mixed: float32 parameters and Adam state, "
        "bfloat16 compute)",
    )
    plan_parser.add_argument(
        "--config",
        choices=tuple(CONFIGS),
        default=None,
        help="a named LM shape (ringeqx.nn.LLAMA3_8B, ...) instead of --dim, --layers, "
        "--heads, --kv-heads, --vocab-size, --hidden, --mlp, --no-norm-bias",
    )
    plan_parser.add_argument(
        "--target",
        type=target,
        default=None,
        help="answer with this cluster's compiler: a TPU slice (v5p:4x4x4) or GPUs "
        "(h100:8); --devices defaults to its chips, --profile to its chip",
    )
    plan_parser.add_argument(
        "--longest",
        action="store_true",
        help="with --target: search the longest --seq-len that fits (one compile a probe)",
    )
    plan_parser.add_argument("--json", action="store_true", help="print JSON")
    # None: the target's, or else 8 devices and the h100 profile (see `plan_defaults`).
    plan_parser.set_defaults(run=plan, parser=plan_parser, devices=None, profile=None)
