"""Check ringeqx's per-device kernels on a GPU or TPU: correctness at real sizes, then TFLOP/s.

On a GPU (the Triton kernel) or a TPU (the Mosaic kernel), compiled for it, this

1. runs the kernel contract at real sizes: every kernel's `out`, `lse` and gradients
   against a dense float32 answer, for several masks, GQA 4:1, head_dim 64 and 128,
   bfloat16 (4K tokens; the dense answer needs the full score matrix);
   on a TPU also shards of 256K and 384K tokens, past what one Mosaic call's SMEM tile
   tables hold, where the kernel runs as several calls: against the XLA kernel;
2. times each kernel's forward and forward+backward on one device, for 8K and 32K
   tokens, bfloat16, head_dim 64 and 128, causal and not, next to
   `jax.nn.dot_product_attention` (cuDNN where JAX has it), and prints TFLOP/s.

Without a GPU or TPU (or with `--tiny`) it runs the same code at a tiny size on the CPU, with
the Pallas kernels in the interpreter; CI runs that.

```
python benchmarks/gpu_check.py           # real sizes on a GPU or TPU, tiny elsewhere
python benchmarks/gpu_check.py --tiny    # tiny sizes, interpreter, any machine
python benchmarks/gpu_check.py --skip-checks --tiles 256x512 1024x1024   # other Pallas tiles
python benchmarks/gpu_check.py --skip-checks --lengths 32768 --only pallas_tpu "splash[1024 fused]"
```

FLOPs follow the Flash Attention convention: forward `4 * batch * heads * q_len *
kv_len * head_dim` (halved when causal), forward+backward 3.5 times that. The exit
status is 1 if a kernel failed a check or could not run, so CI notices.
"""

import argparse
import math
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from _splash import splash_kernel

import ringeqx as rx
from ringeqx._util._timing import median_seconds


def records(batch: int, length: int, doc: int) -> rx.TokenInfo:
    """Positions 0..length-1 (one run, as a contiguous layout says), documents of `doc`
    tokens, no spans."""
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    runs = rx.Runs((0,), length)
    return rx.TokenInfo(pos, pos // doc, jnp.full_like(pos, -1), pos >= 0, runs)


def problem(key, batch, heads, kv_heads, length, head_dim, dtype):
    """Heads-major q, k, v and an output cotangent."""
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, heads, length, head_dim), dtype)
    k = jax.random.normal(kk, (batch, kv_heads, length, head_dim), dtype)
    v = jax.random.normal(kv, (batch, kv_heads, length, head_dim), dtype)
    d_out = jax.random.normal(kd, q.shape, dtype)
    return q, k, v, d_out


def kernel_fns(kernel, info, mask, mod=None):
    """Jitted `forward` and `forward + backward` of one ring step with `kernel`."""

    def forward(q, k, v):
        scale = 1.0 / math.sqrt(q.shape[-1])
        return kernel.forward(q, k, v, info, info, rx.Scores(mask, mod, scale))

    def forward_backward(q, k, v, d_out):
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = rx.Scores(mask, mod, scale)
        out, lse = kernel.forward(q, k, v, info, info, scores)
        delta = jnp.sum(out * d_out.astype(jnp.float32), axis=-1)
        grads = kernel.backward(q, k, v, lse, delta, d_out, info, info, scores)
        return out, lse, grads

    return jax.jit(forward), jax.jit(forward_backward)


def dense(q, k, v, d_out, info, mask, mod=None):
    """Float32 dense `(out, lse, grads)`, heads-major (the reference)."""
    g = q.shape[1] // k.shape[1]
    qi = jax.tree.map(lambda x: x[:, None, :, None], info)
    ki = jax.tree.map(lambda x: x[:, None, None, :], info)
    ok = mask.allows(qi, ki) & qi.valid & ki.valid

    def attend(q, k, v):
        k, v = (jnp.repeat(x, g, axis=1) for x in (k, v))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        if mod is not None:
            s = mod(s, qi, ki)
        s = jnp.where(ok, s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        safe = jnp.where(jnp.isinf(lse), 0.0, lse)[..., None]
        p = jnp.where(ok, jnp.exp(s - safe), 0.0)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v), lse

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(attend, *f32)
    grads = vjp((d_out.astype(jnp.float32), jnp.zeros_like(lse)))
    return out, lse, grads


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite):
        return math.inf
    scale = max(float(np.abs(want[finite]).max(initial=0.0)), 1e-6)
    return float(np.abs(got[finite] - want[finite]).max(initial=0.0)) / scale


def judged(errs: list[float], tol: float, label: str, failures: list[str]) -> str:
    """The table cells of relative errors `errs` and their verdict against `tol`; a
    failure named `label` is recorded where one is not below it."""
    ok = all(e < tol for e in errs)
    if not ok:
        failures.append(f"{label}: {errs}")
    return " | ".join(f"{e:.1e}" for e in errs) + f" | {'yes' if ok else 'NO'}"


def dpa_fns(causal: bool, implementation: str | None):
    """`jax.nn.dot_product_attention` (BTNH) forward and forward+backward."""

    def forward(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(forward, q, k, v)
        return out, vjp(d_out)

    return jax.jit(forward), jax.jit(forward_backward)


def splash_fns(causal: bool, heads: int, length: int, head_dim: int, blocks: int, fused: bool):
    """JAX's own Pallas TPU flash attention (splash attention, `jax.experimental`), a
    peer at its best configurations (issue 43's sweep on a v5e): every tile `blocks`,
    with the fused backward (`fused`, best where it fits in HBM: 1024) or the separate
    dQ kernel (512, where the fused one's float32 dQ partials run out of HBM);
    heads-major, grouped K/V heads as they are, q pre-scaled (splash does not scale).
    `benchmarks/tpu_vs_splash.py` times tokamax and the older `flash_attention` too."""
    kernel = splash_kernel(causal, length, heads, blocks, fused)
    scale = 1.0 / math.sqrt(head_dim)

    def forward(q, k, v):
        return jax.vmap(kernel)((q * scale).astype(q.dtype), k, v)

    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(forward, q, k, v)
        return out, vjp(d_out)

    return jax.jit(forward), jax.jit(forward_backward)


def seconds(fn, args, repeats: int) -> float:
    """Median wall time of `fn(*args)` after one compiling call."""
    return median_seconds(fn, *args, repeats=repeats)


def attention_flops(batch, heads, length, head_dim, causal: bool) -> float:
    flops = 4.0 * batch * heads * length * length * head_dim
    return flops / 2 if causal else flops


def pick_dpa_implementation(on_gpu: bool) -> tuple[str | None, str]:
    """cuDNN where JAX has it for this GPU; XLA otherwise (said so in the output)."""
    if not on_gpu:
        return "xla", "xla (no GPU)"
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    try:
        jax.block_until_ready(
            jax.jit(
                lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn")
            )(q)
        )
    except Exception as e:  # noqa: BLE001 - reported, and the baseline says it is XLA
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return "xla", f"xla (cuDNN unavailable: {first[:80]})"
    return "cudnn", "cudnn"


def run_checks(kernels, cfg, failures) -> None:
    print(
        f"\n## Kernel contract at {cfg['check_len']} tokens "
        f"(batch {cfg['batch']}, heads {cfg['heads']}:{cfg['kv_heads']}, "
        f"{jnp.dtype(cfg['dtype']).name}; relative max error vs dense float32)\n"
    )
    length = cfg["check_len"]
    info = records(cfg["batch"], length, doc=max(length // 3, 1) + 1)
    heads = cfg["heads"]
    slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1, dtype=jnp.float32) / heads)
    # (mask, score modifier): the modifiers' per-head parameters reach each program
    # through a block spec, a path only hardware compiles for real.
    block = max(length // 16, 1)
    blocks = -(-length // block)
    pattern = jax.random.bernoulli(jax.random.key(1), 0.5, (blocks, blocks))
    masks = {
        "full": (rx.Full(), None),
        "block_sparse_causal": (rx.BlockSparse(pattern, block) & rx.Causal(), None),
        "causal": (rx.Causal(), None),
        "causal_document": (rx.Causal() & rx.Document(), None),
        "sliding_window": (rx.SlidingWindow(max(length // 4, 1)), None),
        "causal_alibi": (rx.Causal(), rx.ALiBi(slopes)),
        "prefix_lm_softcap": (rx.PrefixLM(length // 5), rx.Softcap(20.0)),
    }
    print(
        f"| kernel | head_dim | mask | out | lse | dq | dk | dv | ok (< {cfg['tol']}) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for head_dim in cfg["head_dims"]:
        args = problem(
            jax.random.key(head_dim),
            cfg["batch"],
            cfg["heads"],
            cfg["kv_heads"],
            length,
            head_dim,
            cfg["dtype"],
        )
        for mask_name, (mask, mod) in masks.items():
            want = jax.jit(lambda *a, mask=mask, mod=mod: dense(*a, info, mask, mod))(
                *args
            )
            want = (want[0], want[1], *want[2])
            for name, kernel in kernels.items():
                try:
                    _, fwd_bwd = kernel_fns(kernel, info, mask, mod)
                    out, lse, grads = fwd_bwd(*args)
                    errs = [rel_error(g, w) for g, w in zip((out, lse, *grads), want)]
                except Exception as e:  # noqa: BLE001 - reported and counted as failed
                    failures.append(f"check {name} d{head_dim} {mask_name}: {e!r}")
                    traceback.print_exc(file=sys.stderr)
                    error = type(e).__name__
                    print(f"| {name} | {head_dim} | {mask_name} | error: {error} |")
                    continue
                cells = judged(
                    errs, cfg["tol"], f"check {name} d{head_dim} {mask_name}", failures
                )
                print(f"| {name} | {head_dim} | {mask_name} | {cells} |")


def run_ring(cfg, failures) -> None:
    """`ring_attention` with the default kernel (`"auto"`: this platform's) on a ring of
    every local device, fwd + grad, against `reference_attention`."""
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
    length = cfg["check_len"] // n * n
    kernel = rx.select_kernel("auto", mesh=mesh)
    print(f"\n## The ring on {n} {devices[0].platform} device(s): default kernel {kernel}\n")
    keys = jax.random.split(jax.random.key(7), 4)
    shape = (cfg["batch"], length)
    q = jax.random.normal(keys[0], (*shape, cfg["heads"], cfg["head_dims"][-1]), cfg["dtype"])
    k, v = (jax.random.normal(key, (*shape, cfg["kv_heads"], q.shape[-1]), cfg["dtype"])
            for key in keys[1:3])
    segments = jnp.arange(length, dtype=jnp.int32) // (length // 3 + 1)
    mask = rx.Causal() & rx.Document()

    def loss(attend, q, k, v):
        out = attend(q, k, v, mask=mask, segment_ids=segments)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))), out

    def ring(q, k, v, **kw):
        return rx.ring_attention(q, k, v, mesh=mesh, **kw)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    try:
        with jax.set_mesh(mesh):
            (_, out), grads = jax.jit(jax.value_and_grad(
                lambda *a: loss(ring, *a), argnums=(0, 1, 2), has_aux=True))(q, k, v)
        (_, want), want_grads = jax.jit(jax.value_and_grad(
            lambda *a: loss(rx.reference_attention, *a), argnums=(0, 1, 2), has_aux=True
        ))(*f32)
        errs = [rel_error(g, w) for g, w in zip((out, *grads), (want, *want_grads))]
    except Exception as e:  # noqa: BLE001 - reported and counted as failed
        failures.append(f"ring: {e!r}")
        traceback.print_exc(file=sys.stderr)
        print(f"error: {type(e).__name__}")
        return
    cells = judged(errs, cfg["tol"], "ring", failures)
    print("| tokens | mask | out | dq | dk | dv | ok |\n|---|---|---|---|---|---|---|")
    print(f"| {length} | causal & document | {cells} |")


def run_long_shard(kernels, cfg, failures) -> None:
    """A shard past what one Mosaic call's SMEM tile tables hold (libtpu refused 256K
    tokens a chip in one call): the TPU kernel runs as several calls over runs of query
    tiles, here against the XLA kernel (checked against the dense answer above) on the
    same inputs, with the calls counted, the chip's compiled temp, and the time."""
    pallas, xla = kernels["pallas_tpu"], kernels["xla"]
    print(
        f"\n## Long shards: the TPU kernel as several calls (batch {cfg['batch']}, heads "
        f"{cfg['long_heads'][0]}:{cfg['long_heads'][1]}, head_dim 128, causal & document; "
        "relative max error vs the XLA kernel)\n"
    )
    print(
        "| tokens | pallas_calls | out | lse | dq | dk | dv | ok | temp GiB "
        "| fwd+bwd ms | xla fwd+bwd ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in cfg["long_lengths"]:
        info = records(cfg["batch"], length, doc=length // 3 + 1)
        args = problem(jax.random.key(length), cfg["batch"], *cfg["long_heads"], length,
                       128, cfg["dtype"])  # fmt: skip
        mask = rx.Causal() & rx.Document()
        try:
            _, fwd_bwd = kernel_fns(pallas, info, mask)
            calls = str(jax.make_jaxpr(fwd_bwd)(*args)).count("pallas_call")
            compiled = fwd_bwd.lower(*args).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            got = compiled(*args)
            t_got = seconds(compiled, args, cfg["repeats"])
            _, ref_fwd_bwd = kernel_fns(xla, info, mask)
            want = ref_fwd_bwd(*args)
            t_want = seconds(ref_fwd_bwd, args, cfg["repeats"])
        except Exception as e:  # noqa: BLE001 - reported and counted as failed
            failures.append(f"long shard {length}: {e!r}")
            traceback.print_exc(file=sys.stderr)
            print(f"| {length} | error: {type(e).__name__} |")
            continue
        flat = lambda r: (r[0], r[1], *r[2])  # noqa: E731
        errs = [rel_error(g, w) for g, w in zip(flat(got), flat(want))]
        cells = judged(errs, cfg["tol"], f"long shard {length}", failures)
        print(
            f"| {length} | {calls} | {cells} | {temp / 2**30:.2f} | {1e3 * t_got:.1f} "
            f"| {1e3 * t_want:.1f} |"
        )


def run_bench(kernels, cfg, dpa_impl, dpa_label, failures) -> None:
    print(
        f"\n## Speed (one device, batch {cfg['batch']}, heads {cfg['heads']}:"
        f"{cfg['kv_heads']}, {jnp.dtype(cfg['dtype']).name}; "
        "fwd+bwd FLOPs = 3.5 x fwd)\n"
    )
    print(f"Baseline `jax.nn.dot_product_attention`: {dpa_label}.\n")
    print(
        "| tokens | head_dim | causal | kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms "
        "| fwd+bwd TFLOP/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for length in cfg["lengths"]:
        info = records(cfg["batch"], length, doc=length)
        for head_dim in cfg["head_dims"]:
            q, k, v, d_out = problem(
                jax.random.key(length + head_dim),
                cfg["batch"],
                cfg["heads"],
                cfg["kv_heads"],
                length,
                head_dim,
                cfg["dtype"],
            )
            btnh = [jnp.swapaxes(x, 1, 2) for x in (q, k, v, d_out)]
            for causal in (False, True):
                mask = rx.Causal() if causal else rx.Full()
                flops = attention_flops(
                    cfg["batch"], cfg["heads"], length, head_dim, causal
                )
                # name -> (a maker of the jitted fwd and fwd+bwd, their arguments),
                # made inside the try below, where a failure is reported.
                rows = {
                    name: (
                        lambda kn=kernel: kernel_fns(kn, info, mask), (q, k, v), (q, k, v, d_out)
                    )
                    for name, kernel in kernels.items()
                }
                # Peers: a failure of theirs (the dense baseline runs out of memory
                # at 32K) is printed, not counted.
                peers = {
                    f"dot_product_attention[{dpa_impl}]": (
                        lambda: dpa_fns(causal, dpa_impl), tuple(btnh[:3]), tuple(btnh)
                    )
                }  # fmt: skip
                if jax.default_backend() == "tpu":
                    for blocks, fused in ((1024, True), (512, False)):
                        name = f"splash[{blocks}{' fused' if fused else ''}]"
                        make = lambda b=blocks, f=fused: splash_fns(  # noqa: E731
                            causal, cfg["heads"], length, head_dim, b, f
                        )
                        peers[name] = (make, (q, k, v), (q, k, v, d_out))
                rows.update(peers)
                rows = {n: r for n, r in rows.items() if _wanted(n, cfg["only"])}
                for name, (make, fwd_args, bwd_args) in rows.items():
                    try:
                        fwd, fwd_bwd = make()
                        t_f = seconds(fwd, fwd_args, cfg["repeats"])
                        t_fb = seconds(fwd_bwd, bwd_args, cfg["repeats"])
                    except Exception as e:  # noqa: BLE001 - reported (counted if ours)
                        if name not in peers:
                            failures.append(f"bench {name} {length} d{head_dim}: {e!r}")
                        traceback.print_exc(file=sys.stderr)
                        print(
                            f"| {length} | {head_dim} | {causal} | {name} | "
                            f"error: {type(e).__name__} | | | |"
                        )
                        continue
                    print(
                        f"| {length} | {head_dim} | {causal} | {name} | "
                        f"{1e3 * t_f:.2f} | {flops / t_f / 1e12:.2f} | "
                        f"{1e3 * t_fb:.2f} | {3.5 * flops / t_fb / 1e12:.2f} |"
                    )


def _wanted(name: str, only: tuple[str, ...]) -> bool:
    """Whether the row `name` is timed under `--only` (names or their prefixes)."""
    return not only or any(name.startswith(prefix) for prefix in only)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="tiny sizes, Pallas kernels interpreted (the default without a GPU)",
    )
    parser.add_argument("--skip-checks", action="store_true", help="only time")
    parser.add_argument("--skip-bench", action="store_true", help="only check")
    parser.add_argument(
        "--tiles",
        nargs="+",
        default=(),
        metavar="BQxBK",
        help="also time the platform's Pallas kernel with these tiles (e.g. 256x512)",
    )
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=(), metavar="TOKENS",
        help="time these sequence lengths (default: 8192 32768; tiny: 256)",
    )  # fmt: skip
    parser.add_argument(
        "--head-dims", nargs="+", type=int, default=(), metavar="D",
        help="check and time these head dims (default: 64 128; tiny: 64)",
    )  # fmt: skip
    parser.add_argument(
        "--only", nargs="+", default=(), metavar="NAME",
        help="time only the rows whose name starts with one of these (e.g. pallas_tpu)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    platform = jax.default_backend()
    on_gpu = platform == "gpu"
    tiny = args.tiny or platform not in ("gpu", "tpu")
    device = jax.devices()[0]
    print(f"# ringeqx gpu_check on {device.platform} ({device.device_kind})")
    print(
        f"jax {jax.__version__}, ringeqx {rx.__version__}, mode: "
        f"{'tiny, Pallas interpreter' if tiny else 'real sizes, compiled'}"
    )
    if tiny:
        cfg = dict(
            batch=1,
            heads=4,
            kv_heads=1,
            dtype=jnp.bfloat16,
            head_dims=(64,),
            check_len=160,
            lengths=(256,),
            repeats=1,
            tol=3e-2,
        )
        kernels = {
            "xla": rx.XlaKernel(block_q=64, block_kv=64),
            "pallas_gpu": rx.PallasGpuKernel(block_q=64, block_kv=64, interpret=True),
            "pallas_tpu": rx.PallasTpuKernel(block_q=64, block_kv=128, interpret=True),
        }
    else:
        cfg = dict(
            batch=1,
            heads=16,
            kv_heads=4,
            dtype=jnp.bfloat16,
            head_dims=(64, 128),
            check_len=4096,
            lengths=(8192, 32768),
            repeats=5,
            tol=3e-2,
            # 256K tokens: two calls of each kernel; 384K: five (measured on a v5e).
            long_lengths=(262144, 393216),
            long_heads=(4, 2),
        )
        pallas = f"pallas_{platform}"
        kernels = {
            "xla": rx.select_kernel("xla", platform),
            pallas: rx.select_kernel(pallas, platform),
        }
    cfg["only"] = tuple(args.only)
    if args.lengths:
        cfg["lengths"] = tuple(args.lengths)
    if args.head_dims:
        cfg["head_dims"] = tuple(args.head_dims)
    for tiles in args.tiles:
        bq, _, bk = tiles.partition("x")
        pallas = "pallas_tpu" if platform == "tpu" or tiny else "pallas_gpu"
        kind = rx.PallasTpuKernel if pallas == "pallas_tpu" else rx.PallasGpuKernel
        kernels[f"{pallas}[{tiles}]"] = kind(block_q=int(bq), block_kv=int(bk), interpret=tiny)
    for name, kernel in kernels.items():
        print(f"- {name}: {kernel}")
    dpa_impl, dpa_label = pick_dpa_implementation(on_gpu and not tiny)

    failures: list[str] = []
    if not args.skip_checks:
        run_checks(kernels, cfg, failures)
        run_ring(cfg, failures)
        if platform == "tpu" and not tiny:
            run_long_shard(kernels, cfg, failures)
    if not args.skip_bench:
        run_bench(kernels, cfg, dpa_impl, dpa_label, failures)
    if failures:
        print(f"\n{len(failures)} failure(s):")
        for f in failures:
            print(f"- {f}")
        return 1
    print("\nAll checks passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
