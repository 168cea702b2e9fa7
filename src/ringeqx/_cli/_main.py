"""The `ringeqx` command line: `ringeqx demo`, `bench`, `report`, `generate` and `plan`.

JAX reads `XLA_FLAGS` once, when its backends start, so `main` sets the fake CPU device
count first; the commands import JAX (and ringeqx) only inside the functions that run
them."""

from collections.abc import Sequence

from ._devices import force_host_devices, join_distributed
from ._parser import make_parser, misuse
from ._plan import plan_defaults


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ringeqx` script and of `python -m ringeqx`."""
    args = make_parser().parse_args(argv)
    problem = misuse(args)
    if problem is not None:
        args.parser.error(problem)
    if args.command == "plan":
        plan_defaults(args)
    # The demo also compiles for twice the devices, to show per-device memory halving;
    # in a multi-process run each process has `--local-devices` of its own.
    local = getattr(args, "local_devices", None)
    force_host_devices(local or (2 * args.devices if args.command == "demo" else args.devices))
    if args.command == "demo":
        join_distributed(args)
    return args.run(args)
