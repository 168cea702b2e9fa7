"""The CI slice of the differential fuzzer (`tests/fuzz.py`, `docs/fuzzing.md`).

The seed changes with the commit (`FUZZ_SEED`, else `GITHUB_SHA`, else
`git rev-parse HEAD`), so every commit checks new configurations; a failure prints the
seed, the index and a shrunk `python tests/fuzz.py --config '...'` reproducer.
"""

import dataclasses
import os

import fuzz
import jax


# 4 groups of 6: 4 compiles (see fuzz.GROUP), new ones on every commit. A compile is
# most of a group's time, so the slice is counted in groups; longer runs are
# `nox -s fuzz -- --configs N` (FUZZ_CONFIGS here).
CONFIGS = int(os.environ.get("FUZZ_CONFIGS", str(4 * fuzz.GROUP)))


def test_fuzz_slice():
    lines = []
    res = fuzz.run(fuzz.default_seed(), CONFIGS, shrink_budget=25, log=lines.append)
    print(fuzz.summary(res))
    assert res.configs == CONFIGS >= 4 * fuzz.GROUP
    assert not res.failures, fuzz.summary(res) + "\n" + "\n".join(lines)


def test_configs_are_reproducible_from_seed_and_index():
    a = [fuzz.draw_config(7, i) for i in range(3 * fuzz.GROUP)]
    assert a == [fuzz.draw_config(7, i) for i in range(3 * fuzz.GROUP)]
    assert all(fuzz.Config.from_json(c.to_json()) == c for c in a)
    # A group shares its static part (one compile) and differs in data.
    assert len({c.static_key() for c in a[: fuzz.GROUP]}) == 1
    assert len({c.data_seed for c in a[: fuzz.GROUP]}) == fuzz.GROUP
    assert len({c.static_key() for c in a}) == 3


def test_fuzzer_catches_and_shrinks_a_planted_bug(monkeypatch):
    # A dense reference with an off-by-one causal rule must be caught, and the shrunk
    # config must still fail and print a runnable reproducer.
    truth = fuzz.dense_allowed

    def off_by_one(expr, params, qp, kp, *rest):
        if expr[0] == "causal":
            return qp > kp
        return truth(expr, params, qp, kp, *rest)

    # The dense rule is read at trace time: drop compiled programs on every swap.
    jax.clear_caches()
    monkeypatch.setattr(fuzz, "dense_allowed", off_by_one)
    c = fuzz.Config(
        devices=2, seq=5, batch=0, batched_ids=False, heads=2, kv_heads=1, head_dim=3,
        dtype="float32", kernel="xla", block_q=3, block_kv=2, strategy="zigzag", stripe=1,
        mask=["causal"], score_mod="none", sinks=False,
        compression=False, data_seed=11,
    )
    assert "out: max error" in fuzz.check(c)
    small = fuzz.shrink(c, budget=6, log=lambda s: None)
    assert small != c and fuzz.check(small) is not None
    assert small.devices <= c.devices and small.seq <= c.seq
    assert fuzz.reproducer(small).startswith("python tests/fuzz.py --config '{")
    # The same config is fine with the true rule: the failure is the planted bug.
    monkeypatch.setattr(fuzz, "dense_allowed", truth)
    jax.clear_caches()
    assert fuzz.check(dataclasses.replace(c)) is None
