"""The `ringeqx` parser: one sub-command per command file, and the checks of flags that
are each fine alone but not together (before JAX is imported)."""

import argparse

from . import _bench, _demo, _generate, _plan, _report
from ._flags import indivisible, target_chips, target_device


def make_parser() -> argparse.ArgumentParser:
    """The `ringeqx` parser; each command file adds its flags (`arguments`) and the
    function that runs it (`args.run`)."""
    parser = argparse.ArgumentParser(
        prog="ringeqx",
        description="Exact ring attention for JAX. On CPU, the commands fake --devices "
        "devices through XLA_FLAGS (unless XLA_FLAGS already sets a device count).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _demo.arguments(
        commands.add_parser(
            "demo",
            help="causal GQA ring attention, forward + backward, checked against dense",
            description="Causal GQA ring attention, forward and backward, on a ring of "
            "(fake) devices: prints compile and run time, memory per device (and what "
            "it becomes on twice the devices), and the error against dense attention "
            "on a smaller copy of the problem.",
        )
    )
    _bench.arguments(
        commands.add_parser(
            "bench",
            help="time ringeqx forward and forward+backward at one size",
            description="Time ringeqx (full and causal masks) at one size. The "
            "comparison with the ringattention package and dense attention is "
            "benchmarks/ring_vs_dense.py.",
        )
    )
    _report.arguments(
        commands.add_parser(
            "report",
            help="what ring attention communicates: collectives from the compiled HLO, "
            "the analytic model and hardware profiles",
            description="Compile one ring attention call (no arrays are allocated) and "
            "list its collectives (count per call, dtype, bytes per device, mesh axis), "
            "the ring's bytes and FLOPs per step, and per hardware profile whether the "
            "transfer hides behind compute and the smallest shard that hides it.",
        )
    )
    _generate.arguments(
        commands.add_parser(
            "generate",
            help="ring prefill and exact KV-cache decoding on a small random LM",
            description="Generate tokens with a small language model of random weights "
            "(it shows the machinery; nothing is downloaded): the prompt runs through the "
            "ring into a sequence-sharded KV cache, each decode step merges the devices' "
            "partial attention by one max and one sum reduction, and the logits are "
            "checked against the whole sequence recomputed on one device.",
        )
    )
    _plan.arguments(
        commands.add_parser(
            "plan",
            help="the memory plan of ring attention or an LM training step: tiles, "
            "remat, strategy and predicted bytes per device",
            description="Plan ring attention (or, with --dim, a RingTransformerLM "
            "training step) within a memory budget per device: ringeqx.tools.plan, printed "
            "as a table or as JSON. Nothing is compiled.",
        )
    )
    return parser


def misuse(args: argparse.Namespace) -> str | None:
    """What is wrong with flags that are each fine alone (None if nothing), in their
    names; checked before JAX is imported."""
    if args.heads % args.kv_heads:
        return (
            f"argument --heads: must be a multiple of --kv-heads ({args.kv_heads}); got "
            f"{args.heads}"
        )
    match args.command:
        case "demo" | "bench":
            ring = args.devices
            if args.command == "demo" and args.num_processes and args.local_devices:
                ring = args.num_processes * args.local_devices  # the global ring
            elif args.command == "demo" and args.num_processes:
                ring = None  # known once the processes have joined (see `ring_mesh`)
            if ring and args.seq_len % ring:
                return indivisible(args.seq_len, ring)
            if args.command == "demo":
                return _demo.multiprocess_misuse(args)
        case "report":
            return _report.transfer_misuse(args)
        case "generate":
            if args.top_k is not None and args.top_k > args.vocab:
                return (
                    f"argument --top-k: must be at most --vocab ({args.vocab}); got "
                    f"{args.top_k}"
                )
        case "plan":
            if args.longest and args.target is None:
                return "argument --longest: needs --target (each probe is a compile for it)"
            if args.target is not None:
                chips = target_chips(args.target)
                if args.devices not in (None, chips):
                    return (
                        f"argument --devices: must be the {chips} chips of --target "
                        f"{args.target} (or left out); got {args.devices}"
                    )
                profile = target_device(args.target)
                if args.profile not in (None, profile):
                    # --target answered for its own chip whatever --profile said.
                    return (
                        f"argument --profile: must be {profile} (the chip of --target "
                        f"{args.target}) or left out; got {args.profile}"
                    )
            if args.profile == "cpu" and args.max_memory_mib is None:
                return (
                    "argument --profile: --profile cpu needs --max-memory-mib (the CPU "
                    "profile has no memory size)"
                )
            lm = args.dim is not None or args.config is not None
            if args.scan_layers and not lm:
                return (
                    "argument --scan-layers: needs --dim or --config (an LM plan; attention "
                    "has no layers)"
                )
            if args.config is not None and args.dim is not None:
                return (
                    "argument --config: gives the LM's sizes; pass it or --dim (and the "
                    f"other sizes), not both; got --config {args.config} --dim {args.dim}"
                )
            if args.dim is not None and args.dim % args.heads:
                return (
                    f"argument --dim: must be a multiple of --heads ({args.heads}), the "
                    f"LM's width split over its heads; got {args.dim}"
                )
    return None
