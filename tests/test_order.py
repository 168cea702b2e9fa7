"""On a CPU mesh every device runs the ring's collectives in one order (issue 42).

XLA:CPU runs independent operations concurrently and keys a collective's rendezvous by
a channel id that JAX sets to 1 for all of them, so two collectives that do not depend
on each other could meet each other's on other devices: swapped buffers, or the process
aborting. The ring chains its collectives by data (`ringeqx._ring._order`). These tests read
the compiled CPU program: in every computation, of any two collectives (or loops and
calls holding collectives) one must depend on the other, which gives every device the
same order whatever XLA:CPU runs concurrently. The old ring fails them (independent
K/V, V and record permutes in one hop; the backward's first hop beside the forward's
loop).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import mesh
from jax.sharding import AbstractDevice, AbstractMesh, PartitionSpec

import ringeqx as rx
from ringeqx._ring._mesh import on_cpu
from ringeqx.tools._hlo._parse import called_computations, module


_COLLECTIVE = re.compile(
    r"\s(collective-permute|all-reduce|all-gather|all-to-all|reduce-scatter)(-start)?\("
)
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OPERAND = re.compile(r"%([\w.\-]+)")


def _holds_collectives(comps) -> dict[str, bool]:
    """Per computation, whether it runs a collective (itself or in what it calls)."""
    memo: dict[str, bool] = {}

    def holds(name, seen=()):
        if name not in memo:
            lines = comps.get(name, [])
            memo[name] = any(_COLLECTIVE.search(line) for line in lines) or any(
                c in comps and c not in seen and holds(c, (*seen, name))
                for c, _ in called_computations(lines)
            )
        return memo[name]

    return {name: holds(name) for name in comps}


def unordered_collectives(hlo: str) -> list[tuple[str, str, str]]:
    """`(computation, a, b)` for every two collectives of one computation (a loop or a
    call holding collectives counts as one) of which neither depends on the other."""
    comps, _ = module(hlo)
    holds = _holds_collectives(comps)
    found = []
    for comp, lines in comps.items():
        deps, collectives = {}, []
        for line in lines:
            head = _DEF.match(line)
            if head is None:
                continue
            name = head.group(1)
            deps[name] = set(_OPERAND.findall(line[head.end() :]))
            calls = [c for c, _ in called_computations([line])]
            if _COLLECTIVE.search(line) or any(holds.get(c, False) for c in calls):
                collectives.append(name)

        @functools.cache
        def before(name):
            out = set()
            for d in deps.get(name, ()):
                if d in deps:
                    out |= {d} | before(d)
            return frozenset(out)

        for i, a in enumerate(collectives):
            for b in collectives[i + 1 :]:
                if a not in before(b) and b not in before(a):
                    found.append((comp, a, b))
    return found


def _grad_hlo(m, config, mask, kernel="auto", heads=(2, 2), head_dim=16):
    q = jnp.linspace(-1, 1, 32 * heads[0] * head_dim).reshape(1, 32, heads[0], head_dim)
    kv = jnp.linspace(-1, 1, 32 * heads[1] * head_dim).reshape(1, 32, heads[1], head_dim)

    def loss(q, k, v):
        out = rx.ring_attention(q, k, v, mask=mask, config=config, kernel=kernel)
        return jnp.sum(out * out)

    with jax.set_mesh(m):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, kv, 2 * kv).compile().as_text()


CASES = [
    ("default", rx.RingConfig(), rx.Causal(), "auto"),
    ("two_sided_window", rx.RingConfig(), rx.SlidingWindow(9, two_sided=True), "auto"),
    (
        "bidirectional_pieces_compressed",
        rx.RingConfig(
            bidirectional=True,
            communication_parallelism=4,
            compression_dtype=jnp.bfloat16,
            grad_compression_dtype=jnp.float16,
        ),
        rx.Causal(),
        "auto",
    ),
    ("zigzag", rx.RingConfig(balance="zigzag"), rx.Causal(), "auto"),
    ("allgather", rx.AllGather(), rx.Causal(), "auto"),
    # The interpreted Triton kernel checks its inputs at run time with a psum.
    (
        "runtime_check",
        rx.RingConfig(),
        rx.Causal(),
        rx.PallasGpuKernel(block_q=16, block_kv=16, interpret=True),
    ),
]


@pytest.mark.parametrize("name,config,mask,kernel", CASES, ids=[c[0] for c in CASES])
def test_ring_collectives_in_one_order(name, config, mask, kernel):
    hlo = _grad_hlo(mesh(4), config, mask, kernel)
    assert _COLLECTIVE.search(hlo), "expected a program with collectives"
    assert unordered_collectives(hlo) == []


def test_ulysses_collectives_in_one_order():
    m = mesh(2, 2, names=("sequence", "ulysses"))
    hlo = _grad_hlo(m, rx.RingConfig(ulysses_axis="ulysses"), rx.Causal())
    assert "all-to-all" in hlo
    assert unordered_collectives(hlo) == []


def test_reader_finds_independent_collectives():
    """The check can fail: two permutes of one `shard_map` that do not depend on each
    other (as the old ring's K and V hops were) are reported."""
    m = mesh(4)
    perm = [(i, (i + 1) % 4) for i in range(4)]

    def local(a, b):
        return jax.lax.ppermute(a, "sequence", perm), jax.lax.ppermute(b, "sequence", perm)

    spec = (PartitionSpec("sequence"),) * 2
    f = jax.shard_map(local, mesh=m, in_specs=spec, out_specs=spec)
    x = jnp.arange(8.0)
    hlo = jax.jit(f).lower(x, 2 * x).compile().as_text()
    assert len(unordered_collectives(hlo)) == 1


def test_only_cpu_meshes_are_ordered():
    """TPU and GPU programs keep their schedule (no token, no packing)."""
    assert on_cpu(mesh(4))
    for platform in ("tpu", "gpu"):
        device = AbstractDevice(device_kind=platform, num_cores=1, platform=platform)
        assert not on_cpu(AbstractMesh((8,), ("sequence",), abstract_device=device))


def test_ordered_ring_gradients_repeat():
    """The README's call with `jax.grad`, many times in one process: the same gradients
    every time (an exchange of buffers between collectives would change them, and an
    extra participant would abort the process)."""
    m = mesh(8)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 64, 4, 8))
    k, v = (jax.random.normal(key, (1, 64, 2, 8)) for key in keys[1:])

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v, mask=rx.Causal()) * q)

    with jax.set_mesh(m):
        grad = jax.jit(jax.grad(functools.partial(loss, rx.ring_attention), argnums=(0, 1, 2)))
        want = jax.grad(functools.partial(loss, rx.reference_attention), argnums=(0, 1, 2))(
            q, k, v
        )
        for _ in range(20):
            got = grad(q, k, v)
            for a, b in zip(got, want):
                assert jnp.allclose(a, b, atol=1e-5, rtol=1e-5)
