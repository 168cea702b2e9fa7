"""Train `ringeqx.nn.RingTransformerLM` on ringeqx's own docs and source, byte by byte.

    python examples/train.py --model tiny --steps 30 --plot loss.png   # 8 fake CPU devices
    python examples/train.py --model 300m --seq-len 4096 --batch 8      # one TPU chip

The text is every `docs/**/*.md` and `src/ringeqx/**/*.py` of this checkout, read as bytes
(vocabulary 256); every tenth file, in path order, is held out. Each step draws `--batch`
windows of `--seq-len` tokens from the training files, shards them over the mesh axis
`"sequence"` (every device this JAX sees: 8 fake CPU devices, or the chips of a TPU
host), and takes one AdamW step. A one-line progress bar shows the step, the loss, tokens/s
and the model FLOP utilisation (MFU); the held-out loss is printed at the end, and
`--plot PATH` draws the loss curve. docs/training.md explains the recipe and the MFU.
"""

import os


# Fake CPU devices must be asked for before JAX starts. The flag only shapes the host
# (CPU) platform, so on a TPU or GPU, whose devices JAX picks first, it changes nothing.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = flags.strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import ringeqx  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256  # bytes

# The model shapes. "300m" and "1b" are the named Llama shapes with a byte vocabulary:
# their 32000-token embedding and head would be 65M parameters (of 301M) that bytes never
# use, and a 32000-way softmax per token that is not the model being measured.
MODELS = {
    "tiny": ringeqx.nn.LMConfig(
        vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden=192
    ),
    "300m": dataclasses.replace(ringeqx.nn.LLAMA_300M, vocab_size=VOCAB),
    "1b": dataclasses.replace(ringeqx.nn.TINYLLAMA_1B, vocab_size=VOCAB),
}
# Peak learning rates: the small model learns fast; the others use the field's rates for
# their sizes (TinyLlama trained at 4e-4).
LEARNING_RATES = {"tiny": 1e-2, "300m": 6e-4, "1b": 4e-4}
# Large models recompute each block in the backward pass (the activations of one block
# are kept, not of all), so a long sequence fits on one chip.
CHECKPOINT = {"tiny": "none", "300m": "block", "1b": "block"}

# Each chip's profile in ringeqx.tools' hardware table, by `jax.devices()[0].device_kind`
# as the chips name themselves; its peak dense bfloat16 FLOP/s is the MFU's denominator.
# Not listed: MFU "n/a", unless --peak-flops gives it.
_PROFILES = {
    "TPU v4": "tpu-v4",
    "TPU v5 lite": "tpu-v5e",
    "TPU v5": "tpu-v5p",
    "TPU v6 lite": "tpu-v6e",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA A100-SXM4-80GB": "a100-nvlink",
}
PEAK_FLOPS = {kind: ringeqx.tools.HARDWARE[p].flops for kind, p in _PROFILES.items()}


def read_corpus(root: Path = ROOT) -> tuple[np.ndarray, np.ndarray]:
    """The project's docs and source as bytes: `(train, held_out)`, int32 token arrays.

    Every tenth file (in path order) is held out whole, so the held-out loss is measured
    on files the model never saw, prose and code alike.
    """
    paths = sorted(root.glob("docs/**/*.md")) + sorted(root.glob("src/ringeqx/**/*.py"))
    if not paths:
        raise FileNotFoundError(f"no docs/**/*.md or src/ringeqx/**/*.py under {root}")
    train, held_out = [], []
    for i, path in enumerate(paths):
        (held_out if i % 10 == 9 else train).append(path.read_bytes())
    return tuple(np.frombuffer(b"".join(p), np.uint8).astype(np.int32) for p in (train, held_out))


def non_embedding_params(config: ringeqx.nn.LMConfig) -> int:
    """N of the MFU: every parameter but the input embedding, whose lookup does no
    arithmetic. The output head stays in: its product runs for every token."""
    return config.param_count() - config.vocab_size * config.dim


def step_flops(config: ringeqx.nn.LMConfig, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward and backward), as PaLM counts them.

    `6 N` per token for the weights (2 forward, 4 backward), plus causal attention's two
    matrix products, `2 * 2 T^2 H d` forward per layer and example, halved by the mask,
    times 3 for the backward: `6 B L H d T^2`. Recomputation (`checkpoint`) is not
    counted: MFU measures the model's FLOPs, not the hardware's.
    """
    tokens = batch * seq_len
    attention = 6 * batch * config.num_layers * config.num_heads * config.head_dim * seq_len**2
    return 6 * non_embedding_params(config) * tokens + attention


def make_optimiser(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW as the field trains: linear warmup then cosine decay to a tenth, betas
    (0.9, 0.95), weight decay 0.1 on matrices only (not norms), gradients clipped to
    norm 1."""
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)

    def matrices(params):
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=matrices)
    return optax.chain(optax.clip_by_global_norm(1.0), adamw)


def make_step(optimiser: optax.GradientTransformation, mesh):
    """One jitted training step, `(batch, model, opt_state) -> (model, opt_state, loss)`,
    with the model and optimiser state donated: their buffers are reused for the new
    ones, so a step needs no second copy of the parameters."""

    def mean_loss(model, tokens, labels):
        losses = jax.vmap(lambda t, y: model.loss(t, y, mesh=mesh))(tokens, labels)
        return jnp.mean(losses)

    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, opt_state):
        loss, grads = eqx.filter_value_and_grad(mean_loss)(model, *batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        # optax mixes Python floats with int32 step counts; strict promotion refuses that.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimiser.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    @eqx.filter_jit
    def evaluate(model, batch):
        return mean_loss(model, *batch)

    return step, evaluate


class Batches:
    """Windows of `seq_len + 1` tokens, split into `(tokens, labels)` shifted by one and
    sharded along the sequence over the mesh's `"sequence"` axis."""

    def __init__(self, data: np.ndarray, batch: int, seq_len: int, mesh):
        self.data, self.batch, self.seq_len = data, batch, seq_len
        self.sharding = NamedSharding(mesh, P(None, "sequence"))

    def _place(self, windows: np.ndarray):
        tokens, labels = windows[:, :-1], windows[:, 1:]
        return tuple(jax.device_put(x, self.sharding) for x in (tokens, labels))

    def random(self, rng: np.random.Generator):
        """A batch of windows at random offsets (training)."""
        starts = rng.integers(0, len(self.data) - self.seq_len - 1, self.batch)
        return self._place(np.stack([self.data[s : s + self.seq_len + 1] for s in starts]))

    def sequential(self, limit: int):
        """Up to `limit` batches of consecutive, non-overlapping windows (evaluation)."""
        width = self.seq_len + 1
        count = min(limit, len(self.data) // (width * self.batch))
        for i in range(count):
            chunk = self.data[i * width * self.batch : (i + 1) * width * self.batch]
            yield self._place(chunk.reshape(self.batch, width))


def bar(step: int, steps: int, loss: float, rate: float | None, mfu: float | None) -> str:
    """The progress bar: `step 12/30 [#####.....] loss 3.210 | 45,678 tokens/s | MFU 41.2%`."""
    width = 20
    done = width * step // steps
    rate_text = "-" if rate is None else f"{rate:,.0f}"
    mfu_text = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
    return (
        f"step {step:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (width - done)}] "
        f"loss {loss:.3f} | {rate_text} tokens/s | MFU {mfu_text}"
    )


def plot(path: Path, losses: list[float], held_out: float) -> None:
    """The loss curve (nats per byte) with the held-out loss, written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, label="train (each step's batch)")
    ax.axhline(held_out, color="C1", linestyle="--", label=f"held-out, at the end: {held_out:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("RingTransformerLM on ringeqx's docs and source")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="examples/train.py",
        description="Train a RingTransformerLM on ringeqx's own docs and source (bytes).",
    )
    parser.add_argument("--model", choices=tuple(MODELS), default="tiny")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per example")
    parser.add_argument("--batch", type=int, default=8, help="examples per step")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, help="peak learning rate (default: per model)")
    mixed = "mixed: float32 parameters, bfloat16 compute (the recipe)"
    parser.add_argument("--precision", choices=("float32", "mixed"), default="mixed", help=mixed)
    parser.add_argument("--plot", type=Path, metavar="PATH", help="write the loss curve (PNG)")
    every = "steps between progress updates (each waits for the device)"
    parser.add_argument("--log-every", type=int, default=10, help=every)
    peak = "peak FLOP/s of one device (default: from a table of chips)"
    parser.add_argument("--peak-flops", type=float, help=peak)
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    devices = jax.device_count()
    for flag in ("seq_len", "batch", "steps", "log_every", "eval_batches"):
        value = getattr(args, flag)
        if value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1; got {value}")
    if args.seq_len % devices:
        parser.error(
            f"--seq-len must be a multiple of the number of devices ({devices}), so that "
            f"each holds the same share of the sequence; got {args.seq_len}"
        )
    for flag in ("lr", "peak_flops"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{flag.replace('_', '-')} must be a positive number; got {value}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the example with command-line `argv` (default: `sys.argv[1:]`).

    **Returns:** a summary, `{"losses", "held_out_loss", "tokens_per_s", "mfu"}` (each
    step's training loss; tokens/s and MFU over the steps after the first, which
    compiles; MFU None without a peak).
    """
    args = parse_args(argv)
    config = MODELS[args.model]
    lr = LEARNING_RATES[args.model] if args.lr is None else args.lr
    devices = jax.devices()
    kind = devices[0].device_kind
    peak = args.peak_flops if args.peak_flops is not None else PEAK_FLOPS.get(kind)
    peak = None if peak is None else peak * len(devices)
    mesh = jax.make_mesh((len(devices),), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))

    train_data, held_out_data = read_corpus()
    train = Batches(train_data, args.batch, args.seq_len, mesh)
    held_out = Batches(held_out_data, args.batch, args.seq_len, mesh)
    if len(train_data) <= args.seq_len + 1 or len(held_out_data) < (args.seq_len + 1) * args.batch:
        sys.exit(
            f"the text is too short for --seq-len {args.seq_len} x --batch {args.batch}: "
            f"{len(train_data):,} training and {len(held_out_data):,} held-out bytes"
        )

    precision = ringeqx.nn.Precision.mixed() if args.precision == "mixed" else None
    optimiser = make_optimiser(lr, args.steps)

    @eqx.filter_jit
    def init(key):
        model = ringeqx.nn.RingTransformerLM.from_config(
            config,
            precision=precision,
            scan_layers=True,  # one layer to compile, however deep
            checkpoint=CHECKPOINT[args.model],
            key=key,
        )
        opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))
        # Replicated on every device, as the step returns them (so that the second step
        # does not compile again for other input shardings); the data is sharded.
        return eqx.filter_shard((model, opt_state), NamedSharding(mesh, P()))

    model, opt_state = init(jax.random.key(args.seed))
    step, evaluate = make_step(optimiser, mesh)

    flops = step_flops(config, args.batch, args.seq_len)
    tokens_per_step = args.batch * args.seq_len
    print(
        f"{args.model}: {config.param_count():,} parameters ({non_embedding_params(config):,} "
        f"non-embedding), {args.precision} precision, lr {lr:g}, on {len(devices)} x {kind}"
    )
    print(
        f"text: {len(train_data):,} training bytes, {len(held_out_data):,} held out; "
        f"{args.batch} x {args.seq_len} tokens a step, {flops:.3g} FLOPs a step"
    )

    rng = np.random.default_rng(args.seed)
    losses = []  # device arrays, read at the log points only: reading one waits for it
    loss = math.nan
    rate = mfu = None
    start = time.perf_counter()
    mark, mark_step = start, 0
    for i in range(1, args.steps + 1):
        model, opt_state, value = step(train.random(rng), model, opt_state)
        losses.append(value)
        if i == 1 or i % args.log_every == 0 or i == args.steps:
            loss = float(value)  # waits for step i
            now = time.perf_counter()
            if i == 1:
                compiled = now - start  # compiling and the first step; not in the rates
            else:
                seconds = now - mark
                rate = (i - mark_step) * tokens_per_step / seconds
                mfu = None if peak is None else (i - mark_step) * flops / seconds / peak
            mark, mark_step = now, i
        sys.stdout.write("\r" + bar(i, args.steps, loss, rate, mfu))
        sys.stdout.flush()
    end = time.perf_counter()
    print()

    losses = [float(x) for x in losses]
    if not all(math.isfinite(x) for x in losses):
        sys.exit(f"the loss is not finite: {losses}")
    timed, run = args.steps - 1, end - start - compiled
    tokens_per_s = timed * tokens_per_step / run if timed else None
    mean_mfu = timed * flops / run / peak if timed and peak is not None else None
    evaluated = [float(evaluate(model, batch)) for batch in held_out.sequential(args.eval_batches)]
    held_out_loss = float(np.mean(evaluated))

    print(f"first step (compiling) {compiled:.1f} s; then {timed} steps in {run:.1f} s")
    if tokens_per_s is not None:
        mfu_text = "n/a (no peak FLOP/s for this device: --peak-flops)"
        if mean_mfu is not None:
            mfu_text = f"{100 * mean_mfu:.1f}% of {peak:.3g} FLOP/s"
        print(f"throughput: {tokens_per_s:,.0f} tokens/s, MFU {mfu_text}")
    print(
        f"loss: {losses[0]:.3f} at step 1, {losses[-1]:.3f} at step {args.steps}; held-out "
        f"{held_out_loss:.3f} ({held_out_loss / math.log(2):.3f} bits per byte, "
        f"{len(evaluated)} x {args.batch} x {args.seq_len} tokens)"
    )
    if args.plot is not None:
        plot(args.plot, losses, held_out_loss)
        print(f"loss curve: {args.plot}")
    return {
        "losses": losses,
        "held_out_loss": held_out_loss,
        "tokens_per_s": tokens_per_s,
        "mfu": mean_mfu,
    }


if __name__ == "__main__":
    main()
