"""Bytes per device (forward, and forward+backward) from comm_report: pure ring vs hybrid vs
allgather, N=8192, 8 devices, 32 heads / 8 kv heads, head_dim 128, float32, causal.

Run: `PYTHONPATH=src python benchmarks/comm_modes.py` (CPU: compiles only, reads the HLO;
float32 because XLA:CPU widens bfloat16 collectives to float32).
"""

from _devices import fake_cpu_devices


fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import ringeqx as rx  # noqa: E402


N, H, KV, D = 8192, 32, 8, 128


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _mib(x):
    return f"{x / 2**20:.2f} MiB"


def main():
    q = jax.ShapeDtypeStruct((1, N, H, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, N, KV, D), jnp.float32)
    ring8 = _mesh((8,), ("sequence",))
    cases = [("ring 8", ring8, rx.RingConfig())]
    for r, u in ((4, 2), (2, 4)):
        m = _mesh((r, u), ("sequence", "ulysses"))
        cases.append((f"hybrid ring {r} x ulysses {u}", m, rx.RingConfig(ulysses_axis="ulysses")))
    cases.append(("allgather 8", ring8, rx.AllGather()))
    print("| mode | fwd permute | fwd all-to-all | fwd all-gather | fwd total | fwd+bwd total |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m, c in cases:

        def f(q, k, v, m=m, c=c):
            return rx.ring_attention(q, k, v, mask=rx.Causal(), mesh=m, config=c)

        def g(q, k, v, f=f):
            out, vjp = jax.vjp(f, q, k, v)
            return vjp(out)

        r = rx.tools.comm_report(jax.jit(f), q, kv, kv, mesh=m)
        b = rx.tools.comm_report(jax.jit(g), q, kv, kv, mesh=m)
        kinds = ("collective-permute", "all-to-all", "all-gather")
        cells = " | ".join(_mib(r.bytes(k)) for k in kinds)
        print(f"| {name} | {cells} | {_mib(r.bytes())} | {_mib(b.bytes())} |")


if __name__ == "__main__":
    main()
