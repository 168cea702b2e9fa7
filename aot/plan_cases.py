"""The compile-backed planner's small cases, shared by test_tpu_plan and test_gpu_plan:
`ringeqx.tools.plan(..., target=...)` for attention and for an LM training step, and
`ringeqx.tools.longest_context`, each answered by the target's compiler."""

import jax.numpy as jnp
import pytest

import ringeqx as rx


_MIB = 2**20
ATTENTION = dict(heads=8, kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
LM = dict(heads=4, kv_heads=2, dim=256, num_layers=1, vocab_size=1024)


def check_plans(target: str, devices: int) -> None:
    """An attention plan and an LM plan for `target` fit their budgets by the compiler's
    count, which `measure_memory` reproduces; an impossible one says what it compiled."""
    p = rx.tools.plan(8192, devices, target=target, **ATTENTION)
    assert p.target == target and p.kernel() == "auto"
    assert 0 < p.compiled.total <= p.max_memory_usage
    assert rx.tools.measure_memory(p)["total"] == p.compiled.total
    # The overlap condition at the chip's published figures, and the schedule's answer.
    o = p.overlap
    cost = rx.tools.RingCost(8192, devices, 8, 2, 128, kv_bytes=2)
    assert o.shard == 8192 // devices and o.min_shard == cost.min_shard(rx.tools.HARDWARE[p.device])
    if devices > 2:  # 2 devices: their one hop is not in a loop, which ring_overlap reads
        assert o.permutes > 0 and o.scheduled, o
    else:
        assert o.permutes == 0 and not o.scheduled, o
    # The instant answer (the model fitted to this family's compiler) against the
    # compiler's, on a shard inside the model's calibrated domain (8K tokens a chip and
    # more): within 15%.
    long = rx.tools.plan(65536 * devices, devices, target=target, **ATTENTION)
    assert abs(long.memory.total / long.compiled.total - 1) <= 0.15, (long.memory, long.compiled)
    lm = rx.tools.plan(4096, devices, target=target, max_memory_usage=1024 * _MIB, **LM)
    assert lm.kind == "lm" and lm.remat == "none"
    assert 0 < lm.compiled.total <= 1024 * _MIB
    # A small budget said in MiB (it read "0.00 GiB"), and raising it is advised only
    # where the chip has more and did not refuse the program (issue 45).
    with pytest.raises(ValueError, match=rf"Nothing fits in max_memory_usage=1.00 MiB per chip "
                       rf"of {target}: seq_len=8192 compiles to remat='none': .*raise "
                       r"max_memory_usage \(up to the chip's"):
        rx.tools.plan(8192, devices, target=target, max_memory_usage=_MIB, **ATTENTION)
    # An LM whose parameters and Adam state alone exceed the budget: refused at once,
    # with nothing compiled, and so is every context of it.
    with pytest.raises(rx.tools.NoFit, match="the parameters and Adam state alone take") as e:
        rx.tools.plan(4096, devices, target=target, max_memory_usage=2**16, **LM)
    assert e.value.before_compile and e.value.seconds == 0.0 and e.value.total > 2**16
    with pytest.raises(rx.tools.NoFit, match="the parameters and Adam state alone take"):
        rx.tools.longest_context(target, max_memory_usage=2**16, log=None, **LM)


def check_longest_context(target: str) -> None:
    """The longest context under a small budget: the answer fits, every longer length
    tried does not, and the search stops within 1/8 of it (or one unit)."""
    budget = 192 * _MIB
    lines = []
    found = rx.tools.longest_context(target, max_memory_usage=budget, log=lines.append, **ATTENTION)
    p = found.plan
    assert p.compiled.total <= budget and len(lines) == len(found.probes)
    assert all(ok == (seq <= p.seq_len) for seq, _, ok in found.probes)
    unit = 2 * p.num_devices * 1024
    longer = [seq for seq, _, ok in found.probes if not ok]
    assert longer and min(longer) - p.seq_len <= max(unit, p.seq_len // 8)
